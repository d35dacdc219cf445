"""Context parallelism inside the LLM's layers: the chunks of one CP rank, joined across ranks.

A CP rank's share of a pack (``mimo.data.pack.cp_share``; the order is ``PackLayout``'s) holds,
sample after sample, the sample's chunk ``r`` and chunk ``2cp-1-r`` of ``2cp`` equal chunks
(``c_s`` positions each), every chunk a segment of its own. Layers that mix along the sequence
join the chunks of a sample across ranks so that the result equals the unsplit sample:

* **attention** (``key_rows``): K and V are all-gathered over CP (their gradient reduce-scattered
  back, ``gather_seq``); each local chunk attends to its sample's prefix up to its own end,
  causally aligned at the bottom right (the chunk's last query sees the whole prefix);
* **convolutions** (``with_halo``): each chunk is preceded by the ``K-1`` positions before it
  in its sample, taken from the chunks' tails all-gathered over CP (zeros before the sample);
* **recurrences** (Mamba-2, GDN): each rank scans its chunks from a zero state, with virtual rows
  around them (``extend``) that read out each chunk's end state and, for GDN, its transfer
  matrix; ``states_in`` all-gathers (transfer, state) pairs and runs the exclusive scan over each
  sample's chunks in order, giving every chunk its true initial state, whose effect on the
  chunk's outputs is linear and added by the layer (``mimo.llm.mamba2`` / ``mimo.llm.gdn``).

Index tensors are computed once per pack on the host (``CPChunks`` lives in the pack's
``SeqContext``, shared by every layer) and moved to the device once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from mimo.core.batch import CPSlice
from mimo.parallel.collectives import gather_seq

__all__ = ["CPChunks", "Extended"]


def _segment_rows(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``cat(arange(s, s + n) for s, n in zip(starts, lens))`` without a Python loop."""
    total = int(lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    first = torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens, output_size=total)
    return first + torch.arange(total)


@dataclass(frozen=True)
class Extended:
    """Virtual rows around each local chunk: ``before`` rows, the chunk, ``after`` rows.
    ``real``: where the chunk rows sit in the extended sequence; ``before`` / ``after``: the
    virtual rows, chunk after chunk; ``cu_seqlens``: its segments (one per chunk)."""

    real: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    cu_seqlens: torch.Tensor
    length: int

    def place(self, x: torch.Tensor, before=None, after=None) -> torch.Tensor:
        """``x``'s rows at their places; ``before`` / ``after`` (rows for every chunk, or one
        chunk's rows repeated) at the virtual places; zeros elsewhere. Differentiable in ``x``."""
        out = x.new_zeros((self.length, *x.shape[1:])).index_copy(0, self.real, x)
        for rows, fill in ((self.before, before), (self.after, after)):
            if fill is not None and rows.numel():
                fill = fill.to(x.dtype)
                if fill.shape[0] != rows.numel():
                    fill = fill.repeat(rows.numel() // fill.shape[0], *([1] * (fill.dim() - 1)))
                out = out.index_copy(0, rows, fill)
        return out


class CPChunks:
    """One CP rank's chunks of a pack (see module doc), on ``group`` (the LLM's CP group)."""

    def __init__(self, info: CPSlice, group, device: torch.device | str):
        if info.rank is None:
            raise ValueError("a CP rank's layers need its share of the pack (mimo.data.pack.cp_share)")
        self.cp, self.rank, self.group, self.device = info.cp, info.rank, group, torch.device(device)
        self.lens = list(info.chunk_lens)  # per sample
        self.real_lens = list(info.real_lens)
        self.samples = len(self.lens)
        self.chunks = 2 * self.samples  # local chunks: sample s's are 2s (chunk rank) and 2s+1 (chunk 2cp-1-rank)
        self.own = (self.rank, 2 * self.cp - 1 - self.rank)
        self.local_len = 2 * sum(self.lens)
        self._offsets = [0]  # each sample's first local row
        for c in self.lens:
            self._offsets.append(self._offsets[-1] + 2 * c)

    # ---- where things live ----
    def owner(self, j: int) -> tuple[int, int]:
        """(CP rank, half) holding chunk ``j`` of a sample: half 0 or 1 of that sample's two."""
        return (j, 0) if j < self.cp else (2 * self.cp - 1 - j, 1)

    def _chunk_of(self, i: int) -> tuple[int, int, int, int]:
        """Local chunk ``i``: (sample, global chunk j, local start, length)."""
        s, h = divmod(i, 2)
        c = self.lens[s]
        return s, self.own[h], self._offsets[s] + h * c, c

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    @cached_property
    def chunk_lens_L(self) -> list[int]:
        return [self.lens[i // 2] for i in range(self.chunks)]

    @cached_property
    def ends_L(self) -> torch.Tensor:
        """int64 cumulative ends of the local chunks (``gemm.grouped_linear``'s offsets)."""
        return self._dev(torch.tensor(self.chunk_lens_L, dtype=torch.int64).cumsum(0))

    def ends_host(self) -> list[int]:
        """The local chunks' boundaries, ``[0, end_0, end_1, ...]`` (host ints)."""
        out = [0]
        for c in self.chunk_lens_L:
            out.append(out[-1] + c)
        return out

    @cached_property
    def chunk_T(self) -> torch.Tensor:
        """The local chunk of every local position."""
        lens = torch.tensor(self.chunk_lens_L, dtype=torch.int64)
        return self._dev(torch.repeat_interleave(torch.arange(self.chunks), lens, output_size=self.local_len))

    @cached_property
    def real_T(self) -> torch.Tensor:
        """``[T]`` bool: the local positions that are a sample's tokens, not its padding."""
        lens, starts, limit = [], [], []
        for i in range(self.chunks):
            s, j, _, c = self._chunk_of(i)
            lens.append(c)
            starts.append(j * c)
            limit.append(self.real_lens[s])
        lens_t = torch.tensor(lens, dtype=torch.int64)
        pos = _segment_rows(torch.tensor(starts, dtype=torch.int64), lens_t)
        return self._dev(pos < torch.repeat_interleave(torch.tensor(limit, dtype=torch.int64), lens_t, output_size=self.local_len))

    @property
    def real_tokens(self) -> int:
        """Real tokens of the whole pack (every CP rank's share)."""
        return sum(self.real_lens)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All CP ranks' ``x`` (rank after rank along dim 0); the gradient is summed back."""
        return gather_seq(x, self.group)

    # ---- attention ----
    @cached_property
    def key_rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(rows of the gathered K / V each local chunk attends to: its sample's chunks 0..j,
        chunk after chunk; int32 cu_seqlens of those key runs; the longest run)."""
        starts, lens, cu = [], [], [0]
        for i in range(self.chunks):
            s, j, _, c = self._chunk_of(i)
            for jj in range(j + 1):
                q, h = self.owner(jj)
                starts.append(q * self.local_len + self._offsets[s] + h * c)
                lens.append(c)
            cu.append(cu[-1] + (j + 1) * c)
        rows = _segment_rows(torch.tensor(starts, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64))
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        return self._dev(rows), self._dev(torch.tensor(cu, dtype=torch.int32)), longest

    # ---- convolutions ----
    def halo_layout(self, width: int) -> tuple[torch.Tensor, ...]:
        """For a causal convolution of ``width + 1`` taps: (the local rows of each chunk's tail,
        right-aligned, ``-1`` where a chunk is shorter; for each chunk's halo rows the row of
        the gathered tails, ``-1`` before the sample; the extended order; the extended rows'
        positions in their samples; their segment (local chunk); the extended rows that are the
        chunks'; the extended segments' int32 cu_seqlens). Cached per width."""
        key = ("halo", width)
        if key not in self.__dict__:
            tails, halo, offsets, seg = [], [], [], []
            for i in range(self.chunks):
                s, j, start, c = self._chunk_of(i)
                tails.extend(start + c - width + w if c - width + w >= 0 else -1 for w in range(width))
                for w in range(width):
                    p = j * c - width + w
                    if p < 0:
                        halo.append(-1)
                        continue
                    jj = p // c
                    q, h = self.owner(jj)
                    halo.append(((q * self.chunks) + 2 * s + h) * width + p - (jj + 1) * c + width)
                offsets.extend(range(j * c - width, j * c + c))
                seg.extend([i] * (width + c))
            n_halo = self.chunks * width
            # extended order: chunk i's halo rows (from the halo block), then its rows (from x)
            order = []
            for i in range(self.chunks):
                _, _, start, c = self._chunk_of(i)
                order.extend(range(i * width, (i + 1) * width))
                order.extend(range(n_halo + start, n_halo + start + c))
            keep = [k for k, o in enumerate(order) if o >= n_halo]
            cu = [0]
            for c in self.chunk_lens_L:
                cu.append(cu[-1] + width + c)
            as_t = lambda v, dt=torch.int64: self._dev(torch.tensor(v, dtype=dt))  # noqa: E731
            self.__dict__[key] = (as_t(tails), as_t(halo), as_t(order), as_t(offsets), as_t(seg), as_t(keep),
                                  as_t(cu, torch.int32))
        return self.__dict__[key]

    def with_halo(self, x_TC: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
        """``x`` with each chunk preceded by the ``width`` positions before it in its sample
        (zeros before the sample's start): (extended rows, their positions in the sample, their
        segment = local chunk, the extended rows that are ``x``'s, the segments' cu_seqlens)."""
        tails, halo, order, offsets, seg, keep, cu = self.halo_layout(width)
        zero = x_TC.new_zeros(1, *x_TC.shape[1:])
        tail_LWC = torch.cat([x_TC, zero]).index_select(0, torch.where(tails >= 0, tails, x_TC.shape[0]))
        got = self.gather(tail_LWC.view(self.chunks, width, *x_TC.shape[1:]))  # [cp * chunks, width, C]
        flat = torch.cat([got.reshape(-1, *x_TC.shape[1:]), zero])
        halo_rows = flat.index_select(0, torch.where(halo >= 0, halo, flat.shape[0] - 1))
        ext = torch.cat([halo_rows, x_TC]).index_select(0, order)
        return ext, offsets, seg, keep, cu

    # ---- recurrences ----
    def extend(self, before: int, after: int) -> Extended:
        key = ("extend", before, after)
        if key not in self.__dict__:
            real, pre, post, cu = [], [], [], [0]
            at = 0
            for i in range(self.chunks):
                c = self.chunk_lens_L[i]
                pre.extend(range(at, at + before))
                real.extend(range(at + before, at + before + c))
                post.extend(range(at + before + c, at + before + c + after))
                at += before + c + after
                cu.append(at)
            as_t = lambda v, dt=torch.int64: self._dev(torch.tensor(v, dtype=dt))  # noqa: E731
            self.__dict__[key] = Extended(as_t(real), as_t(pre), as_t(post), as_t(cu, torch.int32), at)
        return self.__dict__[key]

    def states_in(self, combine, transfer: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Each local chunk's true initial state: the exclusive scan, over each sample's chunks in
        order, of ``S <- combine(transfer_j, state_j, S)`` from ``S = 0``, where chunk ``j`` leaves
        ``combine(transfer_j, state_j, S_in)`` (``state_j``: what it leaves from a zero state).
        ``transfer`` / ``state``: ``[local chunks, ...]``, gathered over CP (gradients summed back)."""
        transfer_all, state_all = self.gather(transfer), self.gather(state)
        shape = state.shape[1:]
        s_idx = torch.arange(self.samples, device=state.device)
        S = state.new_zeros((self.samples, *shape))
        got = [None, None]
        for j in range(max(self.own) + 1):
            if j in self.own:
                got[self.own.index(j)] = S
            if j == max(self.own):
                break
            q, h = self.owner(j)
            rows = q * self.chunks + 2 * s_idx + h
            S = combine(transfer_all.index_select(0, rows), state_all.index_select(0, rows), S)
        return torch.stack(got, 1).reshape(self.chunks, *shape)  # sample s: chunk rank, then 2cp-1-rank

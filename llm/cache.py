"""Greedy generation's cache: what the sequence-mixing layers of one stage keep of their samples
between forwards, so that a decode step runs one new token per sample instead of the whole
sequence again (``mimo eval``).

A ``GenerationCache`` belongs to one rank's stage and one batch of samples; the stage hands it to
its layers in ``SeqContext.cache`` (``LLMStage.forward(batch, cache=...)``), and each layer keys
its entry by itself (``state(layer)``), so PP stages, TP ranks (local heads) and DP blocks each
hold their own. Row ``n`` of every entry is the batch's sample ``n``.

* The first forward is the *prefill*: the pack of the samples' prompts (its first ``N``
  segments; SP padding after them). Each layer computes what it computes without a cache and
  keeps, per sample: attention the keys and values of every position (local heads, after RoPE)
  in buffers ``[N, kv_heads, L, head_dim]`` with room for ``extra`` more tokens; Mamba-2 and
  Gated DeltaNet the recurrent state after the sample's last token and the last ``kernel - 1``
  inputs of each short convolution. MLP and MoE layers act on each token alone: nothing to keep.
* Every later forward is a *decode step* on ``decode_pack``: one token per row (the row's
  latest token at its position — under M-RoPE, the same on all three axes, its index plus the
  sample's offset, ``decode_pack``; SP padding after them). Attention writes the new key / value at
  the row's length and attends over the row's cache; the recurrent layers advance their state by
  one token. Padding rows come out as zeros.
* ``keep(rows)`` drops the samples that finished, between steps.

Not under context parallelism (a sample's positions are spread over the CP ranks): callers keep
the uncached path there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimo.core.batch import PackedBatch
from mimo.parallel.layout import PackLayout


class GenerationCache:
    """Per-layer, per-sample decoding state of one stage (module doc). ``extra``: tokens a sample
    may still grow by after the prefill (attention buffers are allocated with that room and grow
    when it runs out)."""

    def __init__(self, extra: int = 0):
        self.extra = extra
        self.lengths: list[int] | None = None  # tokens cached per row; None until the prefill ran
        self._states: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
        # of the forward under way (``begin``): prefill spans / decode write positions
        self.spans: list[tuple[int, int]] = []
        self.starts_N = self.ends_N = self.row_T = self.offset_T = self.at_N = None

    @property
    def decoding(self) -> bool:
        """True once the prefill ran: forwards are decode steps."""
        return self.lengths is not None

    @property
    def rows(self) -> int:
        return len(self.lengths) if self.lengths is not None else len(self.spans)

    def state(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``layer``'s entry: tensors whose dim 0 is the row."""
        return self._states.setdefault(layer, {})

    # ---------------------------------------------------------------- the stage's calls
    def begin(self, batch: PackedBatch) -> None:
        """Before a forward's layers: what they need to know of ``batch`` (on its device)."""
        device = batch.tokens.device
        if not self.decoding:
            n = batch.num_samples if batch.sample_ids is None else int(batch.sample_ids.numel())
            cu = [0, *torch.tensor(batch.seqlens[:n]).cumsum(0).tolist()]
            self.spans = list(zip(cu[:-1], cu[1:]))
            self.starts_N = torch.tensor(cu[:-1], dtype=torch.int64, device=device)
            self.ends_N = torch.tensor(cu[1:], dtype=torch.int64, device=device) - 1
            # each real token's row and offset in it (the padding after cu[-1] belongs to none)
            row_T = torch.repeat_interleave(torch.arange(n), torch.tensor(batch.seqlens[:n], dtype=torch.int64))
            self.row_T = row_T.to(device)  # built on the host: no device sync for its size
            self.offset_T = torch.arange(cu[-1], device=device) - self.starts_N[self.row_T]
            return
        real = batch.num_real_tokens
        if (batch.num_tokens if real is None else real) != self.rows:
            raise ValueError(f"a decode step takes one token for each of the cache's {self.rows} rows, "
                             f"got {batch.num_tokens if real is None else real}")
        self.at_N = torch.tensor(self.lengths, dtype=torch.int64, device=device)

    def end(self) -> None:
        """After a forward's layers: the rows are one token longer (the prefill: their prompts)."""
        if self.decoding:
            self.lengths = [n + 1 for n in self.lengths]
        else:
            self.lengths = [e - s for s, e in self.spans]

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order): the samples still generating."""
        if rows == list(range(self.rows)):
            return
        index = torch.tensor(rows, dtype=torch.int64)
        for entry in self._states.values():
            for key, x in entry.items():
                entry[key] = x.index_select(0, index.to(x.device))
        self.lengths = [self.lengths[r] for r in rows]

    # ---------------------------------------------------------------- per-position buffers (attention)
    def prefill_buffer(self, x_THD: torch.Tensor) -> torch.Tensor:
        """``[N, H, L, D]``: each sample's rows of ``x_THD`` at its positions, room for ``extra`` more."""
        longest = max((e - s for s, e in self.spans), default=0)
        buf_NHLD = x_THD.new_zeros(self.rows, x_THD.shape[1], longest + self.extra, x_THD.shape[2])
        buf_NHLD[self.row_T, :, self.offset_T] = x_THD[: self.row_T.numel()]
        return buf_NHLD

    def append(self, buf_NHLD: torch.Tensor, x_NHD: torch.Tensor) -> torch.Tensor:
        """``buf_NHLD`` with each row's new ``x_NHD`` at the row's length (grown when full)."""
        need = max(self.lengths, default=0) + 1
        if need > buf_NHLD.shape[2]:  # doubling: a long generation copies O(log L) times
            buf_NHLD = F.pad(buf_NHLD, (0, 0, 0, max(need, 2 * buf_NHLD.shape[2]) - buf_NHLD.shape[2]))
        rows_N = torch.arange(self.rows, device=buf_NHLD.device)
        buf_NHLD[rows_N, :, self.at_N] = x_NHD.to(buf_NHLD.dtype)
        return buf_NHLD

    def key_mask(self) -> tuple[int, torch.Tensor]:
        """A decode step's keys: (span, ``[N, 1, 1, span]`` True where key j <= the row's new
        position); span = the longest row's key count, so no step attends over unused room."""
        span = max(self.lengths, default=0) + 1
        mask_NL = torch.arange(span, device=self.at_N.device)[None, :] <= self.at_N[:, None]
        return span, mask_NL[:, None, None, :]


def pad_rows(y_N: torch.Tensor, t: int) -> torch.Tensor:
    """A decode step's per-row output ``[N, ...]`` as ``[t, ...]``: zeros for the padding rows."""
    return F.pad(y_N, (0,) * (2 * (y_N.dim() - 1)) + (0, t - y_N.shape[0]))


def decode_pack(tokens: list[int], positions: list[int], sample_ids: list[int], tp: int, sequence_parallel: bool,
                pad_id: int, mrope: bool = False) -> PackedBatch:
    """A decode step's pack: token ``tokens[n]`` of sample ``sample_ids[n]`` at ``positions[n]``,
    each its own segment, padded at its end as ``mimo.data.pack.pack`` pads (cp = 1).

    ``mrope``: for an M-RoPE LLM, ``positions_3d`` too: ``positions[n]`` on all three axes (a
    generated token is text). Its caller gives the M-RoPE position, as Hugging Face's Qwen3-VL
    does under a cache: the token's index in its sequence plus the sample's ``rope_deltas``
    (``max(prompt positions) + 1 - prompt length``; ``mimo.training.evaluation.rope_deltas``)."""
    n = len(tokens)
    total = PackLayout((1,) * n, tp, 1, sequence_parallel).total_len
    tail = total - n
    cu = list(range(n + 1)) + ([total] if tail else [])
    positions_T = torch.tensor(positions + list(range(tail)), dtype=torch.int64)
    return PackedBatch(
        tokens=torch.tensor(tokens + [pad_id] * tail, dtype=torch.int64),
        positions=positions_T,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        labels=torch.full((total,), pad_id, dtype=torch.int64),
        loss_mask=torch.zeros(total, dtype=torch.bool),
        sample_ids=torch.tensor(sample_ids, dtype=torch.int64),
        positions_3d=positions_T.expand(3, -1).clone() if mrope else None,
    )

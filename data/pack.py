"""One DP rank's block of samples -> one PackedBatch (THD), padded only as SP / CP need.

The padding rule is ``mimo.parallel.layout.PackLayout``'s, so the pack, the LLM and the bridges agree
on where every position lives: with cp = 1 the pack is padded at its end (its own trailing
segment) to a multiple of tp under sequence parallelism; with cp > 1 each sample is padded
to a multiple of 2*cp (times tp with SP), the padding inside the sample's segment after its
last token (causal layers never let real tokens see it). Padding never carries loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import itertools
from typing import Sequence

import numpy as np
import torch

from mimo.core.batch import CPSlice, PackedBatch
from mimo.core.errors import DataError
from mimo.data.positions import layout_positions_3d
from mimo.parallel.layout import PackLayout, expand


@dataclass
class PackItem:
    """A sample ready to pack: tokens, which tokens are targets, image starts; ``ok`` False
    for a sample that failed at read time (it keeps its slot, with no loss)."""

    id: int
    tokens: list[int]
    target: list[bool]
    image_starts: dict[str, list[int]]
    ok: bool = True
    # native placeholders: each image's rows and grid (t, h, w) (others: rows_per_image each)
    image_rows: dict[str, list[int]] = field(default_factory=dict)
    image_grids: dict[str, list] = field(default_factory=dict)


def pack(items: Sequence[PackItem], rows_per_image: dict[str, int], tp: int, cp: int, sequence_parallel: bool, pad_id: int,
         mrope_merge: dict[str, int] | None = None) -> PackedBatch:
    """``mrope_merge``: for an M-RoPE LLM, the native placeholders (-> their towers' merge size)
    whose images take 3-D positions (``PackedBatch.positions_3d``, ``mimo.data.positions``)."""
    # numpy, filled slice by slice: the data thread builds a pack each step while the training
    # thread launches kernels, and per-token Python lists would hold the interpreter lock for
    # milliseconds
    layout = PackLayout(tuple(len(it.tokens) for it in items), tp, cp, sequence_parallel)
    total = layout.total_len
    seg_N1 = np.fromiter(itertools.accumulate(layout.padded_lens, initial=0), dtype=np.int64, count=len(items) + 1)
    tail = total - int(seg_N1[-1])
    cu_S1 = np.append(seg_N1, total) if tail else seg_N1  # the SP padding at the end of a cp=1 pack: its own segment
    tokens_T = np.full(total, pad_id, dtype=np.int64)
    labels_T = np.full(total, pad_id, dtype=np.int64)  # next-token targets inside the sample; the last token has none
    mask_T = np.zeros(total, dtype=bool)
    slots: dict[str, list[np.ndarray]] = {p: [] for p in rows_per_image}
    for it, off in zip(items, seg_N1.tolist()):
        n = len(it.tokens)
        tokens_T[off : off + n] = it.tokens
        labels_T[off : off + n - 1] = tokens_T[off + 1 : off + n]
        if it.ok and n > 1:
            mask_T[off : off + n - 1] = np.asarray(it.target[1:], dtype=bool)
        for p, starts in it.image_starts.items():
            own = it.image_rows.get(p)
            if own is None:
                slots[p].append((off + np.asarray(starts, dtype=np.int64)[:, None] + np.arange(rows_per_image[p])).reshape(-1))
            elif len(own):
                run_R, at_R = expand(np.asarray(own, dtype=np.int64))
                slots[p].append(off + np.asarray(starts, dtype=np.int64)[run_R] + at_R)
    # positions restart at every segment (padding segments included)
    positions_T = np.arange(total, dtype=np.int64) - np.repeat(cu_S1[:-1], np.diff(cu_S1))
    positions_3d = None
    if mrope_merge:
        positions_3d = torch.from_numpy(_positions_3d(items, mrope_merge, cu_S1))
    return PackedBatch(
        tokens=torch.from_numpy(tokens_T),
        positions=torch.from_numpy(positions_T),
        cu_seqlens=torch.from_numpy(cu_S1.astype(np.int32)),
        labels=torch.from_numpy(labels_T),
        loss_mask=torch.from_numpy(mask_T),
        image_slots={p: torch.from_numpy(np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for p, v in slots.items()},
        sample_ids=torch.tensor([it.id for it in items], dtype=torch.int64),
        cp=CPSlice(cp, None, tuple(layout.chunk_lens()), tuple(len(it.tokens) for it in items)) if cp > 1 else None,
        positions_3d=positions_3d,
    )


def _positions_3d(items: Sequence[PackItem], mrope_merge: dict[str, int], cu_S1: np.ndarray) -> np.ndarray:
    """The pack's ``[3, T]`` M-RoPE positions from its layout (``layout_positions_3d``): the
    native placeholders' images, in position order within each sample."""
    merges = {mrope_merge[p] for p in mrope_merge}
    if len(merges) > 1:
        raise DataError(f"native towers with different merge sizes ({sorted(merges)}) cannot share one M-RoPE pack")
    sample_U, start_U, grid_U = [], [], []
    for n, it in enumerate(items):
        images = sorted((s, tuple(g)) for p in mrope_merge for s, g in zip(it.image_starts.get(p, ()), it.image_grids.get(p, ())))
        sample_U += [n] * len(images)
        start_U += [s for s, _ in images]
        grid_U += [g for _, g in images]
    return layout_positions_3d(cu_S1, np.array([len(it.tokens) for it in items], dtype=np.int64),
                               np.array(sample_U, dtype=np.int64), np.array(start_U, dtype=np.int64),
                               np.array(grid_U, dtype=np.int64).reshape(-1, 3), merges.pop() if merges else 1)


def cp_share(batch: PackedBatch, cp_rank: int) -> PackedBatch:
    """CP rank ``cp_rank``'s share of a whole pack (``pack`` with cp > 1): its two chunks of every
    sample, in ``PackLayout``'s local order, each chunk a segment of its own (positions stay the
    sample's, for RoPE; the layers join the chunks across CP ranks: ``mimo.llm.cp``); image slots
    become local positions; tokens, labels, loss mask (and M-RoPE ``positions_3d``, by column)
    are its positions'. A pack without CP comes back as it is."""
    info = batch.cp
    if info is None:
        return batch
    if info.rank is not None:
        raise ValueError(f"this pack is already CP rank {info.rank}'s share")
    cp = info.cp
    # the whole pack's samples are padded already: a layout of those lengths adds nothing
    index = PackLayout(tuple(2 * cp * c for c in info.chunk_lens), 1, cp, False).cp_local_index(cp_rank)
    cu = [0]
    for c in info.chunk_lens:
        cu.extend((cu[-1] + c, cu[-1] + 2 * c))
    idx = torch.tensor(index, dtype=torch.int64)
    local_of = torch.full((batch.num_tokens,), -1, dtype=torch.int64)
    local_of[idx] = torch.arange(idx.numel())
    slots = {}
    for key, full in batch.image_slots.items():
        local = local_of[full]
        slots[key] = local[local >= 0]
    return PackedBatch(
        tokens=batch.tokens[idx], positions=batch.positions[idx], cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        labels=batch.labels[idx], loss_mask=batch.loss_mask[idx], image_slots=slots, sample_ids=batch.sample_ids,
        cp=CPSlice(cp, cp_rank, info.chunk_lens, info.real_lens),
        positions_3d=None if batch.positions_3d is None else batch.positions_3d[:, idx],
    )


def padding_fraction(batch: PackedBatch, real_tokens: int) -> float:
    return 0.0 if batch.num_tokens == 0 else 1.0 - real_tokens / batch.num_tokens

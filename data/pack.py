"""One DP rank's block of samples -> one PackedBatch (THD), padded only as SP / CP need.

The padding rule is ``mimo.parallel.layout.PackLayout``'s, so the pack, the LLM and the bridges agree
on where every position lives: with cp = 1 the pack is padded at its end (its own trailing
segment) to a multiple of tp under sequence parallelism; with cp > 1 each sample is padded
to a multiple of 2*cp (times tp with SP), the padding inside the sample's segment after its
last token (causal layers never let real tokens see it). Padding never carries loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mimo.core.batch import CPSlice, PackedBatch
from mimo.parallel.layout import PackLayout


@dataclass
class PackItem:
    """A sample ready to pack: tokens, which tokens are targets, image starts; ``ok`` False
    for a sample that failed at read time (it keeps its slot, with no loss)."""

    id: int
    tokens: list[int]
    target: list[bool]
    image_starts: dict[str, list[int]]
    ok: bool = True


def pack(items: Sequence[PackItem], rows_per_image: dict[str, int], tp: int, cp: int, sequence_parallel: bool, pad_id: int) -> PackedBatch:
    layout = PackLayout(tuple(len(it.tokens) for it in items), tp, cp, sequence_parallel)
    tokens, positions, labels, mask, cu = [], [], [], [], [0]
    slots: dict[str, list[int]] = {p: [] for p in rows_per_image}
    for it, padded in zip(items, layout.padded_lens):
        n, off = len(it.tokens), len(tokens)
        for p, starts in it.image_starts.items():
            slots[p].extend(off + s + r for s in starts for r in range(rows_per_image[p]))
        tokens += it.tokens + [pad_id] * (padded - n)
        positions += list(range(padded))
        # next-token targets inside the sample; the last token has none
        labels += it.tokens[1:] + [pad_id] * (padded - n + 1)
        mask += ([t and it.ok for t in it.target[1:]] + [False]) + [False] * (padded - n)
        cu.append(len(tokens))
    tail = layout.total_len - len(tokens)
    if tail:  # the SP padding at the end of a cp=1 pack: its own segment
        tokens += [pad_id] * tail
        positions += list(range(tail))
        labels += [pad_id] * tail
        mask += [False] * tail
        cu.append(len(tokens))
    return PackedBatch(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        labels=torch.tensor(labels, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        image_slots={p: torch.tensor(v, dtype=torch.int64) for p, v in slots.items()},
        sample_ids=torch.tensor([it.id for it in items], dtype=torch.int64),
        cp=CPSlice(cp, None, tuple(layout.chunk_lens()), tuple(len(it.tokens) for it in items)) if cp > 1 else None,
    )


def cp_share(batch: PackedBatch, cp_rank: int) -> PackedBatch:
    """CP rank ``cp_rank``'s share of a whole pack (``pack`` with cp > 1): its two chunks of every
    sample, in ``PackLayout``'s local order, each chunk a segment of its own (positions stay the
    sample's, for RoPE; the layers join the chunks across CP ranks: ``mimo.llm.cp``); image slots
    become local positions; tokens, labels and loss mask are its positions'. A pack without CP
    comes back as it is."""
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
    )


def padding_fraction(batch: PackedBatch, real_tokens: int) -> float:
    return 0.0 if batch.num_tokens == 0 else 1.0 - real_tokens / batch.num_tokens

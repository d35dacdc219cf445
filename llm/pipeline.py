"""A minimal pipeline pass over the stages: one pack, forward then backward, blocking p2p.

Scope: verification and tests (``mimo verify-llm``, the one-process comparisons). The real
schedules (1F1B over several microbatches, encoder prefetch) belong to ``mimo.schedules`` and
replace this; it only has to move activations to the next stage and their gradients back.
Rank ``r`` of stage ``s`` talks to the rank with the same TP/CP/DP coordinates on stage
``s±1``; every stage knows the shape it receives from the pack (``[T_local, D]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from mimo.core.batch import PackedBatch
from mimo.parallel.grid import ParallelGrid
from mimo.llm.model import LLMStage


def pp_neighbour(grid: ParallelGrid, rank: int, delta: int) -> int | None:
    """The rank ``delta`` stages away with this rank's other coordinates (None past an end)."""
    coords = grid.coords(rank)
    stage = coords.get("pp", 0) + delta
    if not 0 <= stage < grid.shape.get("pp", 1):
        return None
    coords["pp"] = stage
    return grid.rank_at(**coords)


@dataclass
class PipelineResult:
    logits: torch.Tensor | None  # last stage: this rank's vocab-parallel logits
    loss: torch.Tensor | None  # last stage, when a normaliser was given


def run_pipeline(stage: LLMStage, grid: ParallelGrid, batch: PackedBatch, *,
                 image_rows: Mapping[str, torch.Tensor] | None = None,
                 num_loss_tokens: float | None = None, backward: bool = False,
                 rank: int | None = None) -> PipelineResult:
    """Run ``batch`` through every stage (this rank runs ``stage``), then, with ``backward``,
    back-propagate ``stage.loss`` to every stage's parameters (and to ``image_rows``)."""
    rank = dist.get_rank() if rank is None else rank
    prev, nxt = pp_neighbour(grid, rank, -1), pp_neighbour(grid, rank, +1)
    hidden = None
    if prev is not None:
        p = next(stage.parameters())
        hidden = torch.empty(stage.local_len(batch), stage.arch.hidden, device=p.device, dtype=p.dtype)
        dist.recv(hidden, src=prev)
        hidden.requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        out = stage(batch, hidden=hidden, image_rows=image_rows)
    if nxt is not None:
        dist.send(out.detach().contiguous(), dst=nxt)
        if backward:
            grad = torch.empty_like(out)
            dist.recv(grad, src=nxt)
            out.backward(grad)
        result = PipelineResult(None, None)
    else:
        loss = None
        if num_loss_tokens is not None:
            with torch.set_grad_enabled(backward):
                loss = stage.loss(out, batch, num_loss_tokens)
        if backward:
            if loss is None:
                raise ValueError("backward needs num_loss_tokens")
            loss.backward()
        result = PipelineResult(out.detach(), None if loss is None else loss.detach())
    if backward and prev is not None:
        dist.send(hidden.grad.contiguous(), dst=prev)
    return result

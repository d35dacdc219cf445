"""Cross entropy over vocab-sharded logits, without gathering the vocab.

Rank r holds logit columns ``[r*V_local, (r+1)*V_local)`` of the vocab padded to a multiple
of tp; columns at or beyond the real ``vocab_size`` are padding and take no part in the
softmax (their gradient is zero). Three small all-reduces per call: the row max (for
stability), then the target logit and the sum of exponentials together.

Backward needs no communication: the per-token loss is replicated over TP, so its gradient
is complete on every rank, and d loss / d logits = softmax - onehot is local.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from mimo.parallel.collectives import all_reduce, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


# rows per chunk: about 64 Mi logits (256 MiB of fp32) at a time, whatever the pack's length
CHUNK_LOGITS = 1 << 26


def _chunks(rows: int, cols: int, whole: bool = False):
    step = rows if whole else max(1, CHUNK_LOGITS // max(cols, 1))
    return [(s, min(rows, s + step)) for s in range(0, rows, max(step, 1))]


# The row math, in three functions run eagerly chunk by chunk, or compiled (``compiled=True``,
# under train.compile): then each is one fused kernel over all rows that reads the logits in
# their own dtype, and no fp32 copy of them exists even for a chunk.
def _row_max(x_CV: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    return x_CV.to(wide).amax(dim=-1)


# (in place where a value is not needed again: eager, a chunk holds at most two fp32 temporaries;
# compiled, the in-place ops are functionalized and change nothing)
def _picked_and_sum_exp(x_CV: torch.Tensor, max_C: torch.Tensor, idx_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z_CV = x_CV.to(max_C.dtype) - max_C.unsqueeze(-1)
    return z_CV.gather(-1, idx_C.unsqueeze(-1)).squeeze(-1), z_CV.exp_().sum(dim=-1)


def _softmax_grad(x_CV: torch.Tensor, lse_C: torch.Tensor, scale_C: torch.Tensor, idx_C: torch.Tensor,
                  minus_C: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot) * scale, in the logits' dtype (``minus_C``: -scale
    where the target is a local column, else 0)."""
    g_CV = (x_CV.to(lse_C.dtype) - lse_C.unsqueeze(-1)).exp_().mul_(scale_C.unsqueeze(-1))
    hit_CV = torch.arange(x_CV.shape[-1], device=x_CV.device) == idx_C.unsqueeze(-1)
    return g_CV.add_(torch.where(hit_CV, minus_C.unsqueeze(-1), 0.0)).to(x_CV.dtype)


_MATH = (_row_max, _picked_and_sum_exp, _softmax_grad)


@functools.cache
def _compiled_math() -> tuple:
    return tuple(torch.compile(f, dynamic=True) for f in _MATH)


def _math(compiled: bool) -> tuple:
    """(row max, picked and sum of exponentials, softmax gradient): eager, or compiled once per process."""
    return _compiled_math() if compiled else _MATH


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Eager, it works through the rows in chunks: fp32 copies of the logits exist one chunk at
    a time. Backward recomputes the softmax from the saved logits (in their own dtype) and the
    log-sum-exp, instead of keeping an fp32 softmax of the whole pack."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, weight_T, group, vocab_size, compiled):
        v_local = logits_TV.shape[-1]
        start = group_rank(group) * v_local
        n_real = max(0, min(v_local, vocab_size - start))  # real vocab columns held here
        chunks = _chunks(logits_TV.shape[0], n_real, whole=compiled)
        row_max, picked_and_sum_exp, _ = _math(compiled)

        wide = torch.promote_types(logits_TV.dtype, torch.float32)  # fp32 at least (fp64 references stay fp64)
        max_T = logits_TV.new_full(logits_TV.shape[:1], float("-inf"), dtype=wide)
        if n_real > 0:  # (a shard of padding only, tiny vocab at large tp, keeps -inf)
            for s, e in chunks:
                max_T[s:e] = row_max(logits_TV[s:e, :n_real], wide)
        max_T = all_reduce(max_T, group, op=dist.ReduceOp.MAX)

        target_T = labels_T - start
        is_local_T = (target_T >= 0) & (target_T < n_real)
        idx_T = target_T.masked_fill(~is_local_T, 0)
        picked_T, sum_exp_T = torch.zeros_like(max_T), torch.zeros_like(max_T)
        if n_real > 0:
            for s, e in chunks:
                picked_T[s:e], sum_exp_T[s:e] = picked_and_sum_exp(logits_TV[s:e, :n_real], max_T[s:e], idx_T[s:e])
            picked_T = picked_T.masked_fill(~is_local_T, 0.0)
        sums_2T = all_reduce(torch.stack([picked_T, sum_exp_T]), group)
        picked_T, log_sum_T = sums_2T[0], sums_2T[1].log()
        loss_T = (log_sum_T - picked_T) * weight_T

        ctx.save_for_backward(logits_TV, max_T + log_sum_T, idx_T, is_local_T, weight_T)
        ctx.n_real, ctx.compiled = n_real, compiled
        return loss_T

    @staticmethod
    def backward(ctx, grad_T):
        logits_TV, lse_T, idx_T, is_local_T, weight_T = ctx.saved_tensors
        n_real = ctx.n_real
        softmax_grad = _math(ctx.compiled)[2]
        scale_T = grad_T.to(lse_T.dtype) * weight_T
        minus_T = -(scale_T * is_local_T.to(scale_T.dtype))
        chunks = _chunks(logits_TV.shape[0], n_real, whole=ctx.compiled)
        if n_real == logits_TV.shape[-1] and len(chunks) == 1:  # one piece: the gradient as computed
            return softmax_grad(logits_TV, lse_T, scale_T, idx_T, minus_T), None, None, None, None, None
        grad_TV = torch.zeros_like(logits_TV)  # padding columns keep zero gradient
        if n_real > 0:
            for s, e in chunks:
                grad_TV[s:e, :n_real] = softmax_grad(logits_TV[s:e, :n_real], lse_T[s:e], scale_T[s:e], idx_T[s:e], minus_T[s:e])
        return grad_TV, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    group,
    vocab_size: int,
    loss_mask: torch.Tensor | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Per-token fp32 losses ``[...]`` from this rank's logits ``[..., V_local]``.

    ``labels`` are global vocab ids, the same on every TP rank. Tokens where ``loss_mask``
    is false, or whose label is negative (e.g. -100), get loss 0 and no gradient.
    ``compiled``: the row math as fused kernels (``torch.compile``), over all rows at once.
    """
    lead = labels.shape
    v_local = logits_local.shape[-1]
    if logits_local.shape[:-1] != lead:
        raise ValueError(f"logits {tuple(logits_local.shape)} do not match labels {tuple(lead)}")
    if v_local * group_size(group) < vocab_size:
        raise ValueError(f"{group_size(group)} shards of {v_local} logits cannot hold vocab {vocab_size}")
    labels_T = labels.reshape(-1)
    weight_T = (labels_T >= 0).float()
    if loss_mask is not None:
        weight_T = weight_T * loss_mask.reshape(-1).float()
    loss_T = _VocabParallelCrossEntropy.apply(
        logits_local.reshape(-1, v_local), labels_T, weight_T, group, vocab_size, compiled
    )
    return loss_T.reshape(lead)

"""Cross entropy over vocab-sharded logits, without gathering the vocab.

Rank r holds logit columns ``[r*V_local, (r+1)*V_local)`` of the vocab padded to a multiple
of tp; columns at or beyond the real ``vocab_size`` are padding and take no part in the
softmax (their gradient is zero). Three small all-reduces per call: the row max (for
stability), then the target logit and the sum of exponentials together.

Backward needs no communication: the per-token loss is replicated over TP, so its gradient
is complete on every rank, and d loss / d logits = softmax - onehot is local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo.parallel.collectives import all_reduce, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


# rows per chunk: about 64 Mi logits (256 MiB of fp32) at a time, whatever the pack's length
CHUNK_LOGITS = 1 << 26


def _chunks(rows: int, cols: int):
    step = max(1, CHUNK_LOGITS // max(cols, 1))
    return [(s, min(rows, s + step)) for s in range(0, rows, step)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Works through the rows in chunks: fp32 copies of the logits exist one chunk at a time,
    and backward recomputes the softmax from the saved logits (in their own dtype) and the
    log-sum-exp, instead of keeping an fp32 softmax of the whole pack."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, weight_T, group, vocab_size):
        v_local = logits_TV.shape[-1]
        start = group_rank(group) * v_local
        n_real = max(0, min(v_local, vocab_size - start))  # real vocab columns held here
        chunks = _chunks(logits_TV.shape[0], n_real)

        wide = torch.promote_types(logits_TV.dtype, torch.float32)  # fp32 at least (fp64 references stay fp64)
        max_T = logits_TV.new_full(logits_TV.shape[:1], float("-inf"), dtype=wide)
        if n_real > 0:  # (a shard of padding only, tiny vocab at large tp, keeps -inf)
            for s, e in chunks:
                max_T[s:e] = logits_TV[s:e, :n_real].to(wide).max(dim=-1).values
        max_T = all_reduce(max_T, group, op=dist.ReduceOp.MAX)

        target_T = labels_T - start
        is_local_T = (target_T >= 0) & (target_T < n_real)
        idx_T = target_T.masked_fill(~is_local_T, 0)
        picked_T, sum_exp_T = torch.zeros_like(max_T), torch.zeros_like(max_T)
        if n_real > 0:
            for s, e in chunks:
                x_CV = logits_TV[s:e, :n_real].to(wide) - max_T[s:e].unsqueeze(-1)
                picked_T[s:e] = x_CV.gather(-1, idx_T[s:e].unsqueeze(-1)).squeeze(-1)
                sum_exp_T[s:e] = x_CV.exp_().sum(dim=-1)
            picked_T = picked_T.masked_fill(~is_local_T, 0.0)
        sums_2T = all_reduce(torch.stack([picked_T, sum_exp_T]), group)
        picked_T, log_sum_T = sums_2T[0], sums_2T[1].log()
        loss_T = (log_sum_T - picked_T) * weight_T

        ctx.save_for_backward(logits_TV, max_T + log_sum_T, idx_T, is_local_T, weight_T)
        ctx.n_real = n_real
        return loss_T

    @staticmethod
    def backward(ctx, grad_T):
        logits_TV, lse_T, idx_T, is_local_T, weight_T = ctx.saved_tensors
        n_real = ctx.n_real
        scale_T = grad_T.to(lse_T.dtype) * weight_T
        minus_T = -(scale_T * is_local_T.to(scale_T.dtype))
        grad_TV = torch.zeros_like(logits_TV)  # padding columns keep zero gradient
        if n_real > 0:
            for s, e in _chunks(logits_TV.shape[0], n_real):
                # d loss / d logits = (softmax - onehot) * scale
                g_CV = (logits_TV[s:e, :n_real].to(lse_T.dtype) - lse_T[s:e].unsqueeze(-1)).exp_().mul_(scale_T[s:e].unsqueeze(-1))
                g_CV.scatter_add_(-1, idx_T[s:e].unsqueeze(-1), minus_T[s:e].unsqueeze(-1))
                grad_TV[s:e, :n_real] = g_CV
        return grad_TV, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    group,
    vocab_size: int,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token fp32 losses ``[...]`` from this rank's logits ``[..., V_local]``.

    ``labels`` are global vocab ids, the same on every TP rank. Tokens where ``loss_mask``
    is false, or whose label is negative (e.g. -100), get loss 0 and no gradient.
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
        logits_local.reshape(-1, v_local), labels_T, weight_T, group, vocab_size
    )
    return loss_T.reshape(lead)

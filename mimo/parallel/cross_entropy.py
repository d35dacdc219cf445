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
import torch.nn.functional as F

from mimo.parallel.collectives import all_reduce, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, labels_T, weight_T, group, vocab_size):
        v_local = logits_TV.shape[-1]
        start = group_rank(group) * v_local
        n_real = max(0, min(v_local, vocab_size - start))  # real vocab columns held here
        x_TV = logits_TV[:, :n_real].float()

        if n_real > 0:
            max_T = x_TV.max(dim=-1).values
        else:  # a shard of padding only (tiny vocab at large tp)
            max_T = x_TV.new_full(x_TV.shape[:1], float("-inf"))
        max_T = all_reduce(max_T, group, op=dist.ReduceOp.MAX)
        x_TV = x_TV - max_T.unsqueeze(-1)

        target_T = labels_T - start
        is_local_T = (target_T >= 0) & (target_T < n_real)
        idx_T = target_T.masked_fill(~is_local_T, 0)
        if n_real > 0:
            picked_T = x_TV.gather(-1, idx_T.unsqueeze(-1)).squeeze(-1).masked_fill(~is_local_T, 0.0)
        else:
            picked_T = torch.zeros_like(max_T)

        exp_TV = x_TV.exp_()
        sums_2T = all_reduce(torch.stack([picked_T, exp_TV.sum(dim=-1)]), group)
        picked_T, sum_exp_T = sums_2T[0], sums_2T[1]
        loss_T = (sum_exp_T.log() - picked_T) * weight_T

        softmax_TV = exp_TV.div_(sum_exp_T.unsqueeze(-1))
        ctx.save_for_backward(softmax_TV, idx_T, is_local_T, weight_T)
        ctx.pad_cols, ctx.dtype = v_local - n_real, logits_TV.dtype
        return loss_T

    @staticmethod
    def backward(ctx, grad_T):
        softmax_TV, idx_T, is_local_T, weight_T = ctx.saved_tensors
        scale_T = grad_T.float() * weight_T
        grad_TV = softmax_TV * scale_T.unsqueeze(-1)
        if grad_TV.shape[-1] > 0:
            minus_T = -(scale_T * is_local_T.to(scale_T.dtype))
            grad_TV.scatter_add_(-1, idx_T.unsqueeze(-1), minus_T.unsqueeze(-1))
        if ctx.pad_cols:
            grad_TV = F.pad(grad_TV, (0, ctx.pad_cols))
        return grad_TV.to(ctx.dtype), None, None, None, None


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

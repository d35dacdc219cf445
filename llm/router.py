"""The MoE router: fp32 scores, deterministic top-k, balancing state and aux losses.

``Router.logits`` is the one GEMM (fp32 weight and fp32 logits whatever the precision policy:
the weight is kept fp32 through the module's dtype changes; a bf16 input on CUDA multiplies on
bf16 tensor cores the weight's exact three-part bf16 split, ``mimo.parallel.split_gemm``). ``route`` turns the logits of
the *whole* local pack (under sequence parallelism the MoE layer gathers them over TP first,
so every TP rank routes every token of the pack identically) into each token's ``topk``
experts and gate values:

* ``score``: ``softmax`` or ``sigmoid`` of the logits (fp32, fp64 in fp64 references).
* selection scores: the scores plus ``expert_bias`` (aux-loss-free balancing; DeepSeek-V3's
  ``e_score_correction_bias``), or minus the quantile-balancing bias ``qb_beta``; gate values
  always come from the unbiased scores.
* ``groups > 1``: group-limited routing (DeepSeek-V3, Nemotron-H): a group's score is the sum
  of its two best selection scores, a token chooses among the experts of its ``group_topk``
  best groups.
* top-k by a stable descending sort: among equal scores the lowest expert index wins, the
  same on every layout (``torch.topk`` promises no order among ties).
* gates: the chosen scores, renormalised to sum 1 (``norm_topk``; ``+ norm_eps`` in the
  denominator, Hugging Face's epsilon of the family), times ``scale``.

Pack padding routes nowhere: its gates are 0 and it counts nowhere.

**Balancing state** (fp32 buffers outside autograd, docs/design.md §9): ``expert_bias`` and ``qb_beta``
are persistent (checkpointed); the step accumulators (``step_counts``: assignments per expert;
``qb_sum`` / ``qb_n``: quantile-balancing column quantiles; ``aux_*``) are not. Accumulators
change only in a training forward (``self.training`` and grad enabled: never in eval, nor in
a forward under ``torch.no_grad``, as a recompute's is). ``mimo.llm.balance`` sums them over
the ranks that saw tokens and applies the updates once per optimizer step.

**Aux losses** (``aux_loss.kind``), normalised like the LM loss: divided by the step's global
loss-token count (``SeqContext.loss_norm``), so gradients do not depend on packing or layout.
With ``P_ti`` the token's probabilities (softmax; sigmoid scores normalised per token) and
``f_i`` the fraction of assignments to expert i:

* ``global``: ``coeff * E * sum_i f_i * sum_t P_ti / N``, ``f`` over the step's tokens so
  far — every DP rank's, microbatches 1..k of the step for microbatch k (summed over DP
  in the forward, so each microbatch sees the same ``f`` at every layout); the last
  microbatch sees the whole step's. (A step-final ``f`` would have to be known before the
  first backward of a 1F1B schedule.)
* ``per_sample``: the same within each packed sample (``cu_seqlens``), each sample its own
  sequence: ``coeff * E * sum_s sum_i f_si * sum_{t in s} P_ti / N`` — equal for the same
  samples however they are packed.
* ``z_loss_coeff``: ``coeff * sum_t logsumexp(logits_t)^2 / N``.

They join the objective through ``attach_loss`` (an identity on the hidden states whose
backward feeds the loss's gradient in), so no stage has to carry them to the last one.
Every TP rank computes them on the whole pack; each attaches ``1/tp`` of them, since the
router's input and weight gradients are summed over TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.distributed as dist

from mimo.llm.config import MoEArch
from mimo.parallel import gemm, split_gemm
from mimo.parallel.context import ParallelContext
from mimo.parallel.placement import ParamPlacement, replicated
from mimo.parallel.recompute import replaying, stash


@dataclass
class Routing:
    """Each token's experts and gates: ``idx_TK`` (int64; ``E`` for padding), ``gate_TK``
    (the scores' dtype; 0 for padding)."""

    idx_TK: torch.Tensor
    gate_TK: torch.Tensor


def topk_lowest_index(x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest per row; ties go to the lowest index."""
    values, indices = torch.sort(x_TE, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def group_limited(sel_TE: torch.Tensor, groups: int, group_topk: int) -> torch.Tensor:
    """``sel_TE`` with every expert outside each token's ``group_topk`` best groups at -inf
    (a group scores the sum of its two best experts)."""
    t, e = sel_TE.shape
    group_scores_TG = sel_TE.view(t, groups, e // groups).topk(2, dim=-1).values.sum(-1)
    _, best_TG = topk_lowest_index(group_scores_TG, group_topk)
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_TG, True)
    keep_TE = keep_TG.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
    return sel_TE.masked_fill(~keep_TE, float("-inf"))


def aux_probs(scores_TE: torch.Tensor, score: str) -> torch.Tensor:
    """The per-token probabilities of the aux losses: softmax scores, or sigmoid scores
    normalised per token."""
    return scores_TE if score == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)


def assignment_counts(idx_TK: torch.Tensor, experts: int) -> torch.Tensor:
    """``[E]`` assignments per expert (the padding sentinel ``E`` dropped); no host sync."""
    counts = torch.zeros(experts + 1, dtype=torch.float32, device=idx_TK.device)
    counts.scatter_add_(0, idx_TK.reshape(-1), torch.ones(idx_TK.numel(), dtype=torch.float32, device=idx_TK.device))
    return counts[:experts]


class _AttachLoss(torch.autograd.Function):
    """Identity on ``h``; backward also gives ``loss`` the gradient 1 (it joins the objective)."""

    @staticmethod
    def forward(ctx, h, loss):
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


def attach_loss(h: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``h``, through which backward also differentiates ``loss`` (a scalar of the objective)."""
    return _AttachLoss.apply(h, loss)


class Router(nn.Module):
    """Router weight ``[E, D]`` (fp32, replicated over TP: its gradient is a partial sum there)
    and the balancing buffers (see module doc)."""

    def __init__(self, hidden: int, cfg: MoEArch, ctx: ParallelContext | None = None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.cfg, self.hidden = cfg, hidden
        e = cfg.experts
        self.weight = nn.Parameter(torch.empty(e, hidden, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32)) if cfg.router_bias else None
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        if cfg.quantile_balancing:
            self.register_buffer("qb_beta", torch.zeros(e, dtype=torch.float32))
        for name, shape in (("step_counts", (e,)), ("qb_sum", (e,)), ("qb_n", ()),
                            ("aux_counts", (e,)), ("aux_tokens", ()), ("aux_value", ())):
            self.register_buffer(name, torch.zeros(shape, dtype=torch.float32), persistent=False)

    # the step accumulators (non-persistent), zeroed once per optimizer step by mimo.llm.balance
    ACCUMULATORS = ("step_counts", "qb_sum", "qb_n", "aux_counts", "aux_tokens", "aux_value")

    @torch.no_grad()
    def reset_accumulators(self) -> None:
        for name in self.ACCUMULATORS:
            getattr(self, name).zero_()

    def placements(self) -> dict[str, ParamPlacement]:
        partial = ("tp",) if self.ctx.tp_size > 1 else ()
        out = {"weight": replicated(tuple(self.weight.shape), partial=partial)}
        if self.bias is not None:
            out["bias"] = replicated(tuple(self.bias.shape), partial=partial)
        return out

    def _apply(self, fn, recurse=True):
        # the router and its state stay at least fp32 whatever dtype the model is cast to
        super()._apply(fn, recurse)
        for holder in (self._parameters, self._buffers):
            for name, t in holder.items():
                if t is not None and t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
                    t.data = t.data.float()
        return self

    @property
    def accumulating(self) -> bool:
        """Whether this forward updates the step accumulators (a training forward, not the
        recompute of one: ``mimo.parallel.recompute``)."""
        return self.training and torch.is_grad_enabled() and not replaying()

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """fp32 (at least) router logits ``[T, E]`` of ``x_TD``."""
        if self.bias is None and getattr(self.weight, "gtp", None) is None and split_gemm.takes(x_TD, self.weight):
            return split_gemm.fp32_linear_of_bf16(x_TD, self.weight)  # on bf16 tensor cores, fp32 exact terms
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        w = self.weight.to(dtype)
        return gemm.linear(x_TD.to(dtype), w, None if self.bias is None else self.bias.to(dtype))

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return logits_TE.softmax(-1) if self.cfg.score == "softmax" else logits_TE.sigmoid()

    def route(self, logits_TE: torch.Tensor, valid_T: torch.Tensor | None, num_valid: int | None = None,
              cp=None) -> Routing:
        """Experts and gates of every token of the pack (see module doc); updates the step
        accumulators in a training forward. ``valid_T``: real tokens (None: all);
        ``num_valid``: their count, known on the host (quantile balancing needs it); ``cp``:
        under context parallelism this rank's chunks (``mimo.llm.cp.CPChunks``), the pack's
        quantile being taken over every CP rank's tokens."""
        cfg = self.cfg
        k, e = cfg.topk, cfg.experts
        scores_TE = self.scores(logits_TE)
        with torch.no_grad():
            sel_TE = scores_TE.detach()
            if cfg.expert_bias:
                sel_TE = sel_TE + self.expert_bias.to(sel_TE.dtype)
            if cfg.quantile_balancing:
                sel_TE = sel_TE - self.qb_beta.to(sel_TE.dtype)
            if cfg.groups > 1:
                sel_TE = group_limited(sel_TE, cfg.groups, cfg.group_topk)
            sel_vals_TK1, idx_TK1 = topk_lowest_index(sel_TE, k + 1 if cfg.quantile_balancing else k)
            idx_TK = idx_TK1[:, :k]
        gate_TK = scores_TE.gather(1, idx_TK)
        if cfg.norm_topk:
            gate_TK = gate_TK / (gate_TK.sum(-1, keepdim=True) + cfg.norm_eps)
        if cfg.scale != 1.0:
            gate_TK = gate_TK * cfg.scale
        if valid_T is not None:
            idx_TK = torch.where(valid_T[:, None], idx_TK, e)
            gate_TK = gate_TK * valid_T[:, None].to(gate_TK.dtype)
        if self.accumulating:
            with torch.no_grad():
                self.step_counts += assignment_counts(idx_TK, e)
                if cfg.quantile_balancing:
                    self._accumulate_quantiles(scores_TE.detach(), sel_vals_TK1[:, k:], valid_T, num_valid, cp)
        return Routing(idx_TK, gate_TK)

    def _accumulate_quantiles(self, scores_TE, alpha_T1, valid_T, num_valid, cp=None) -> None:
        """Megatron-Core 0.19's per-microbatch column quantile: each expert's
        ``(m*k // n + 1)``-th largest ``score - alpha`` over the m real tokens (alpha: the
        token's (k+1)-th selection score). Megatron requires m*k divisible by n; here the
        target is ``floor(m*k/n)`` tokens per expert otherwise. A pack without real tokens
        adds nothing. Under context parallelism the pack's tokens are every CP rank's: their
        values are all-gathered (padding at -inf) and m is the whole pack's."""
        if cp is not None:
            m = cp.real_tokens
            vals_TE = scores_TE - alpha_T1
            if valid_T is not None:
                vals_TE = vals_TE.masked_fill(~valid_T[:, None], float("-inf"))
            got = torch.empty((cp.cp * vals_TE.shape[0], vals_TE.shape[1]), dtype=vals_TE.dtype, device=vals_TE.device)
            dist.all_gather_into_tensor(got, vals_TE.contiguous(), group=cp.group)
            vals_TE = got
        else:
            m = scores_TE.shape[0] if num_valid is None else int(num_valid)
            if valid_T is not None:
                scores_TE, alpha_T1 = scores_TE[valid_T], alpha_T1[valid_T]
            vals_TE = scores_TE - alpha_T1
        if m == 0:
            return
        target = m * self.cfg.topk // self.cfg.experts
        beta_E = vals_TE.topk(target + 1, dim=0).values[-1]
        self.qb_sum += beta_E.float()
        self.qb_n += 1

    @property
    def has_aux_loss(self) -> bool:
        return self.cfg.aux_loss.kind != "none" or self.cfg.z_loss_coeff != 0

    def aux_loss(self, logits_TE: torch.Tensor, routing: Routing, valid_T: torch.Tensor | None,
                 segment_T: torch.Tensor | None, num_segments: int, loss_norm: float, dp_group=None,
                 cp_group=None) -> torch.Tensor | None:
        """This rank's share of the aux losses of one pack (a scalar to ``attach_loss``), or
        None when there are none. ``segment_T``: each token's sample (``per_sample``);
        ``dp_group``: the group the ``global`` counts are summed over (the LLM's gradient group,
        cp x dp); ``cp_group``: under context parallelism, the ranks holding the other chunks
        of the pack's samples (``per_sample`` counts are summed over it)."""
        cfg = self.cfg
        kind, e, k = cfg.aux_loss.kind, cfg.experts, cfg.topk
        if not self.has_aux_loss:
            return None
        accumulating = self.accumulating  # (read outside the no_grad blocks below: it asks for grad mode)
        mask_T1 = None if valid_T is None else valid_T[:, None].to(logits_TE.dtype)
        total = logits_TE.new_zeros(())
        if kind != "none":
            p_TE = aux_probs(self.scores(logits_TE), cfg.score)
            if mask_T1 is not None:
                p_TE = p_TE * mask_T1
            with torch.no_grad():
                counts_E = assignment_counts(routing.idx_TK, e).to(logits_TE.dtype)
            if kind == "global":
                @torch.no_grad()
                def running_fractions():  # a recompute reads them back: the running counts move on
                    stats = torch.cat([counts_E, (counts_E.sum() / k).reshape(1)])  # + tokens routed
                    if dp_group is not None:
                        dist.all_reduce(stats, group=dp_group)
                    if accumulating:
                        self.aux_counts += stats[:e].float()
                        self.aux_tokens += stats[e].float()
                        running_E, tokens = self.aux_counts.to(stats.dtype), self.aux_tokens.to(stats.dtype)
                    else:
                        running_E, tokens = stats[:e], stats[e]
                    return running_E / (k * tokens.clamp_min(1))

                f_E = stash(running_fractions)
                total = total + cfg.aux_loss.coeff * e * (f_E * p_TE.sum(0)).sum()
            else:  # per_sample
                seg = segment_T if segment_T is not None else torch.zeros(logits_TE.shape[0], dtype=torch.long,
                                                                          device=logits_TE.device)
                n_seg = max(1, num_segments)

                @torch.no_grad()
                def sample_fractions():
                    tok = routing.idx_TK.shape[0]
                    rows = seg[:, None].expand(tok, k).reshape(-1)
                    flat = rows * (e + 1) + routing.idx_TK.reshape(-1)
                    counts_SE = torch.zeros(n_seg * (e + 1), dtype=logits_TE.dtype, device=logits_TE.device)
                    counts_SE.scatter_add_(0, flat, torch.ones_like(flat, dtype=logits_TE.dtype))
                    if cp_group is not None:  # a sample's tokens are spread over the CP ranks
                        dist.all_reduce(counts_SE, group=cp_group)
                    counts_SE = counts_SE.view(n_seg, e + 1)[:, :e]
                    return counts_SE / counts_SE.sum(-1, keepdim=True).clamp_min(1)  # of the sample's k * n_s

                f_SE = stash(sample_fractions)
                p_SE = torch.zeros(n_seg, e, dtype=p_TE.dtype, device=p_TE.device).index_add(0, seg, p_TE)
                total = total + cfg.aux_loss.coeff * e * (f_SE * p_SE).sum()
        if cfg.z_loss_coeff:
            z_T = torch.logsumexp(logits_TE, dim=-1).square()
            if valid_T is not None:
                z_T = z_T * valid_T.to(z_T.dtype)
            total = total + cfg.z_loss_coeff * z_T.sum()
        total = total / loss_norm
        if self.accumulating:
            self.aux_value += total.detach().float()
        return total / self.ctx.tp_size

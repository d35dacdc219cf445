"""MoE load balancing, once per optimizer step, outside the model (``mimo.llm.router``'s state).

``balance_step(model, group)`` finds every ``Router`` of an LLM stage and, after the optimizer
step:

1. sums the step accumulators of all its routers (``step_counts``, ``qb_sum``, ``qb_n``,
   ``aux_value``) over ``group`` in ONE all-reduce of one flat tensor. ``group`` is the LLM's
   gradient group (cp × dp, ``ParallelContext.grad_group``): those ranks see different tokens.
   TP is *not* summed over: every TP rank routes the whole local pack (under sequence
   parallelism the MoE layer gathers the logits over TP before ``route``), so its counts are
   already those of the pack, identical on every TP rank — summing them would count each token
   tp times. (``aux_counts`` / ``aux_tokens`` are DP sums already, made in the forward.)
2. expert bias (``arch.moe.expert_bias``): ``bias += rate * sign(mean(counts) - counts)``,
   ``rate = bias_update_rate``; a step without tokens leaves it unchanged (sign 0).
3. quantile balancing (Megatron-Core 0.19's ``_update_router_qb_beta``): the step's column
   quantile ``qb_sum / qb_n`` pooled over every microbatch with real tokens on every rank,
   blended ``ema * beta + (1 - ema) * new`` (``quantile_ema``; 0 takes the new value) and
   re-centred (mean subtracted). Megatron averages each rank's own mean over its ranks
   instead; the two agree when every rank has as many non-empty microbatches, and the pooled
   mean is the one that does not depend on how the microbatches are spread over ranks. A step
   in which no microbatch had tokens leaves beta unchanged.
4. zeroes every accumulator (the global aux loss must not see the last step's counts).

It returns the step's per-layer stats (``BalanceStats``: ``max_load`` = max count / mean count,
0 without tokens; ``dead_experts`` = experts without an assignment; ``aux_loss`` = the layer's
aux + z loss summed over the step, as it joined the objective) as one ``[L, 3]`` tensor on the
routers' device (no host sync), or None for a model without routers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from mimo.llm.router import Router

STATS = ("max_load", "dead_experts", "aux_loss")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class BalanceStats:
    """``layers``: the global layer index of each row of ``table_L3`` (columns: ``STATS``)."""

    layers: list[int]
    table_L3: torch.Tensor


def find_routers(model: nn.Module) -> dict[int, Router]:
    """Every router of ``model`` by its global layer index (``layers.<i>.``; else the order found)."""
    out: dict[int, Router] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Router):
            m = _LAYER.search(name + ".")
            out[int(m.group(1)) if m else len(out)] = mod
    return out


def reset_accumulators(model: nn.Module) -> None:
    for router in find_routers(model).values():
        router.reset_accumulators()


def _packed(router: Router) -> list[torch.Tensor]:
    # the order _unpack reads: [E] counts, [E] quantile sums, quantile count, aux value
    return [router.step_counts, router.qb_sum, router.qb_n.reshape(1), router.aux_value.reshape(1)]


@torch.no_grad()
def balance_step(model: nn.Module, group=None) -> BalanceStats | None:
    """The once-per-step update of every router of ``model`` (see module doc). Collective over
    ``group`` (the LLM's gradient group; None: this rank alone)."""
    routers = find_routers(model)
    if not routers:
        return None
    layers = sorted(routers)
    flat = torch.cat([t.reshape(-1) for i in layers for t in _packed(routers[i])])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    rows, at = [], 0
    for i in layers:
        router = routers[i]
        e = router.cfg.experts
        counts_E, qb_sum_E = flat[at:at + e], flat[at + e:at + 2 * e]
        qb_n, aux = flat[at + 2 * e], flat[at + 2 * e + 1]
        at += 2 * e + 2
        rows.append(_update(router, counts_E, qb_sum_E, qb_n, aux))
        router.reset_accumulators()
    return BalanceStats(layers, torch.stack(rows))


class Balancer:
    """``balance_step`` of one LLM stage as a once-per-step finaliser (``mimo.compose.model.
    ModulePart``): ``reset()`` before the step's forwards (nothing but them counts), then called
    after the optimizer's update; ``stats``: that update's."""

    def __init__(self, stage: nn.Module, group=None):
        self.stage, self.group = stage, group
        self.stats: BalanceStats | None = None

    def reset(self) -> None:
        reset_accumulators(self.stage)

    def __call__(self) -> None:
        self.stats = balance_step(self.stage, self.group)


def _update(router: Router, counts_E: torch.Tensor, qb_sum_E: torch.Tensor, qb_n: torch.Tensor,
            aux: torch.Tensor) -> torch.Tensor:
    """Apply one router's step update from its summed accumulators; its stats row."""
    cfg = router.cfg
    mean = counts_E.mean()
    if cfg.expert_bias:
        step_E = cfg.bias_update_rate * torch.sign(mean - counts_E)
        router.expert_bias += step_E.to(router.expert_bias.dtype)
    if cfg.quantile_balancing:
        # without any microbatch of tokens (qb_n == 0) beta stays as it is; no host sync
        new_E = qb_sum_E / qb_n.clamp_min(1)
        ema = cfg.quantile_ema
        blended_E = ema * router.qb_beta + (1.0 - ema) * new_E.to(router.qb_beta.dtype)
        blended_E = blended_E - blended_E.mean()
        router.qb_beta.copy_(torch.where(qb_n > 0, blended_E, router.qb_beta))
    max_load = torch.where(mean > 0, counts_E.max() / mean.clamp_min(1e-30), torch.zeros_like(mean))
    dead = (counts_E == 0).sum().to(counts_E.dtype)
    return torch.stack([max_load, dead, aux])


def stats_metrics(layers: list[int], table_L3: torch.Tensor) -> dict[str, float]:
    """metrics.jsonl keys of the per-layer stats: ``moe/max_load`` (max over layers),
    ``moe/dead_experts`` (sum), ``moe/aux_loss`` (sum), and ``moe/layer<i>/<stat>`` each."""
    if not layers:
        return {}
    rows = table_L3.double().cpu().tolist()
    out = {"moe/max_load": max(r[0] for r in rows), "moe/dead_experts": int(sum(r[1] for r in rows)),
           "moe/aux_loss": sum(r[2] for r in rows)}
    for i, r in zip(layers, rows):
        out[f"moe/layer{i}/max_load"] = r[0]
        out[f"moe/layer{i}/dead_experts"] = int(r[1])
        out[f"moe/layer{i}/aux_loss"] = r[2]
    return out

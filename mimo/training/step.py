"""One training step: the microbatches on a tick table of ``mimo.schedules`` (``train.schedule``:
``1f1b``, the default, or ``simple`` — every microbatch forward, then every one backward), run
by ``mimo.training.schedule_run`` on every rank (the helpers named below live there); then the
optimizer part, the same for both.

Per microbatch and rank, in a fixed order (every collective is entered by all its ranks at the
same point): the data pipeline delivers this rank's pack (LLM ranks) and pixels (encoder
ranks); each encoder runs forward, then its bridge to the LLM's first stage (declared
placement) — ``encode_and_bridge``; the LLM stages run, the last one's loss being its
token-loss sum over the step's global loss-token count. Backward: the LLM stages, then each
bridge's backward (the bridge's output is detached at the LLM boundary, so this is an explicit
phase on every rank — ``bridge_backward``), which continues into the encoder. Microbatch
gradients accumulate in the run's persistent fp32 main gradients (``GradSync``, built once:
``grad_sync_for``). Then the TP sums of partial gradients and the DP sums (launched bucket by
bucket during each module's last backward), the tied-embedding sum, the global norm (one
world-wide all-reduce), clipping, and each module's optimizer step; then each module part's
finalisers (``mimo.compose.model.ModulePart``, decided when the model is built): the MoE
balancing update of this rank's LLM stage (``mimo.llm.balance``: expert bias / quantile
balancing from the step's counts, summed over the LLM's gradient group), whose per-layer stats
are gathered to every rank in the step's one loss all-reduce (each stage knows only its own
layers), and the FP8 amax histories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mimo.compose.model import MimoModel
from mimo.data.pipeline import DataPipeline
from mimo.llm.balance import STATS, Balancer, stats_metrics
from mimo.llm.dsa import dsa_layers, step_kl
from mimo.llm.mtp import mtp_metrics
from mimo.training.optim import clip_, grad_norm, grad_sync_for, lr_for
from mimo.training.precision import PrecisionPolicy
from mimo.training.schedule_run import run_schedule
from mimo.training.trace import Trace


@dataclass
class StepResult:
    """``loss`` (the step's per-token loss, global) and ``grad_norm`` (before clipping) may be
    handed over as device tensors: they are read (a device sync) on first access, so a caller
    that does not look at them every step lets the host queue the next step meanwhile."""

    loss: float
    grad_norm: float
    loss_tokens: int
    lr: dict[str, float] = field(default_factory=dict)
    read_failures: dict = field(default_factory=dict)
    trace: list | None = None  # this rank's events, when asked for (train_step(trace=True))
    # MoE stats for metrics.jsonl (``mimo.llm.balance.stats_metrics`` keys; {} without MoE);
    # handed over as (layers, [L, 3] tensor) and read on first access, like the loss
    moe: dict | tuple = field(default_factory=dict)
    skipped: bool = False
    # MTP losses for metrics.jsonl (``mimo.llm.mtp.mtp_metrics`` keys; {} without arch.mtp);
    # handed over as (each depth's loss [depth],) and read on first access
    mtp: dict | tuple = field(default_factory=dict)  # train.on_nonfinite skip_step: the gradient norm was not finite, no update
    # the DSA indexers' KL for metrics.jsonl (``dsa/indexer_kl``: the D layers' mean per loss
    # token; {} without D layers)
    dsa: dict = field(default_factory=dict)

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if name in ("loss", "grad_norm") and isinstance(value, torch.Tensor):
            value = float(value)
            object.__setattr__(self, name, value)
        elif name == "moe" and isinstance(value, tuple):
            value = stats_metrics(*value)
            object.__setattr__(self, name, value)
        elif name == "mtp" and isinstance(value, tuple):
            value = mtp_metrics(*value)
            object.__setattr__(self, name, value)
        return value


def _sum_over(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.item()


def moe_layers(model: MimoModel) -> list[int]:
    """The global indices of the LLM's MoE layers (the same list on every rank)."""
    arch = model.config.llm.arch
    if getattr(arch, "moe", None) is None:
        return []
    return [s.index for s in arch.all_layers() if s.kind == "moe"]


def _moe_table(model: MimoModel, layers: list[int], stats) -> torch.Tensor:
    """``[len(layers), len(STATS)]``: this rank's stage's rows where it holds them and is the
    stage's reporting rank (tp = cp = dp = 0), zeros elsewhere, so that a sum over the world
    gives every layer's stats once."""
    table = torch.zeros(len(layers), len(STATS), dtype=torch.float64)
    coords = model.llm.grid.coords(model.rank) if model.llm.module is not None else {}
    if stats is not None and all(coords.get(a, 0) == 0 for a in ("tp", "cp", "dp")):
        at = torch.tensor([layers.index(i) for i in stats.layers])
        table[at] = stats.table_L3.to("cpu", torch.float64)
    return table


def _balancer(model: MimoModel) -> Balancer | None:
    """This rank's MoE balancing (a finaliser of its LLM stage), None where it holds no router."""
    return next((f for f in model.llm.finalisers if isinstance(f, Balancer)), None)


def train_step(model: MimoModel, pipeline: DataPipeline, step: int, optimizers: dict, policy: PrecisionPolicy | None = None,
               on_grads=None, trace: bool = False) -> StepResult:
    """One step; ``on_grads(model, grad_norm)`` (optional) sees the gradients before clipping.
    ``trace``: record this rank's events (``mimo.training.trace``)."""
    cfg = model.config
    model.graph_step()
    model.refresh_fp8()
    plan = pipeline.step(step)  # planned on the data thread: microbatches and ticks
    # the global loss-token count: each LLM DP rank's packs, summed over DP (docs/design.md §2)
    llm = model.llm
    local = sum(mb.loss_tokens for mb in plan) if llm.module is not None else 0  # counted on the CPU
    num_loss_tokens = _sum_over(local, llm.dp_group) if llm.module is not None else 0.0
    events: Trace | None = [] if trace else None
    # one tick loop runs both schedules; microbatches accumulate into the run's main gradients,
    # and each module's DP sums start bucket by bucket during its last backward on this rank
    # (the tied-embedding sum below commutes with them)
    layers = moe_layers(model)
    balancer = _balancer(model)
    if balancer is not None:
        balancer.reset()
    mtp = getattr(llm.module, "mtp", None)
    if mtp is not None:
        mtp.reset()
    n_dsa = _dsa_count(cfg.llm.arch)
    dsa = dsa_layers(llm.module) if n_dsa else []  # (no walk over the modules without DSA layers)
    step_kl(dsa, reset=True)
    grad_sync = grad_sync_for(model, policy)
    grad_sync.zero_grad()
    loss_local = run_schedule(model, plan, max(num_loss_tokens, 1.0), events, grad_sync)
    grad_sync.finish()
    for _, chain in model.gtp_chains():  # no weight gather may outlive the weights it read
        chain.drop()
    for part in model.parts:  # (a tied embedding's two copies summed)
        for finalise in part.grad_finalisers:
            finalise(grad_sync)
    # from the gradients the optimizers step on (a sharded one's: its shards), on the rank's
    # device, also where no parameter trains (one backend for the all-reduce); read below, after
    # the optimizer's launches
    norm_t = grad_norm(optimizers.values(), model.device)
    if on_grads is not None:
        on_grads(model, float(norm_t))
    # skip_step reads the norm here (a device sync the default stop does without: it looks at the
    # step's result after the update, and no checkpoint of that update is written); the norm is
    # world-wide, so every rank skips the same steps
    if cfg.train.on_nonfinite == "skip_step" and not math.isfinite(float(norm_t)):
        return StepResult(_world_loss(model, loss_local)[0], norm_t, int(num_loss_tokens), {}, _read_failures(plan), events,
                          skipped=True)
    clip_(optimizers.values(), cfg.train.grad_clip, norm_t)
    lrs = {}
    for module, opt in optimizers.items():
        # each module's own base lr (AdamW keeps it in defaults), on the shared schedule
        lr = lr_for(cfg.train, step, opt.defaults["lr"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()  # the main gradients are zeroed at the next step's start
        lrs[module] = lr
    for part in model.parts:  # MoE balancing, FP8 amax histories: each part's, as it was built
        for finalise in part.finalisers:
            finalise()
    stats = balancer.stats if balancer is not None else None
    # the step's loss: the last stage's DP ranks hold the parts; read only after the optimizer's
    # kernels are queued (at world 1 only when the caller asks), so that reading it does not
    # idle the device
    depth = cfg.llm.arch.mtp.depth if cfg.llm.arch.mtp is not None else 0
    # riding along: the MoE stats, the MTP losses and the loss-token count (which ranks outside
    # the LLM's grid do not know), each held so that its sum over the world counts it once
    extras = ([_moe_table(model, layers, stats).reshape(-1)] if layers else []) + [
        _dsa_kl(model, dsa, n_dsa, num_loss_tokens), _mtp_losses(model, depth, num_loss_tokens),
        _held_by_first_llm_rank(model, num_loss_tokens)]
    loss, extra_sum = _world_loss(model, loss_local, torch.cat(extras))
    moe = (layers, stats.table_L3) if stats is not None else {}
    kl, mtp_K = extras[-3], extras[-2]
    if extra_sum is not None:
        moe_sum, kl, mtp_K, count = extra_sum.split([len(layers) * len(STATS), 1, depth, 1])
        moe = (layers, moe_sum.view(len(layers), len(STATS))) if layers else {}
        num_loss_tokens = float(count)
    mtp_result = (mtp_K,) if depth else {}
    dsa_result = {"dsa/indexer_kl": float(kl)} if n_dsa else {}
    return StepResult(loss, norm_t, int(num_loss_tokens), lrs, _read_failures(plan), events, moe, mtp=mtp_result,
                      dsa=dsa_result)


def _dsa_count(arch) -> int:
    """The LLM's DSA layers (the pattern's and the MTP blocks'), the same on every rank."""
    return sum(s.kind == "dsa" for s in arch.all_layers())


def _dsa_kl(model: MimoModel, layers: list, count: int, num_loss_tokens: float) -> torch.Tensor:
    """``[1]``: this rank's DSA layers' step KL over the loss-token count and the layer count where
    it is of TP coordinate 0 (every TP rank computes the whole indexer), zeros elsewhere: the
    world's sum counts each stage's, each DP rank's and each CP rank's share once."""
    if not count or not layers or model.llm.grid.coords(model.rank)["tp"] != 0:
        return torch.zeros(1, dtype=torch.float64)
    return (step_kl(layers) / max(num_loss_tokens, 1.0) / count).reshape(1)


def _mtp_losses(model: MimoModel, depth: int, num_loss_tokens: float) -> torch.Tensor:
    """``[depth]``: this rank's summed MTP token losses over the step's loss-token count where it
    is a last-stage rank of TP coordinate 0 (one per DP rank), zeros elsewhere: their sum over the
    world is each depth's loss."""
    mtp = getattr(model.llm.module, "mtp", None)
    holds = mtp is not None and mtp.sums_K is not None and model.llm.grid.coords(model.rank)["tp"] == 0
    if not holds:
        return torch.zeros(depth, dtype=torch.float64)
    return mtp.sums_K.to("cpu", torch.float64) / max(num_loss_tokens, 1.0)


def _held_by_first_llm_rank(model: MimoModel, value: float) -> torch.Tensor:
    """``[1]``: ``value`` on the LLM grid's first rank, 0 elsewhere."""
    first = model.llm.module is not None and not any(model.llm.grid.coords(model.rank).values())
    return torch.tensor([value if first else 0.0], dtype=torch.float64)


def _world_loss(model: MimoModel, loss_local, extra: torch.Tensor | None = None):
    """(the step's loss, ``extra`` summed) on every rank: the last stage's DP ranks hold the loss's
    parts; ``extra`` (e.g. the MoE stats) rides along in the one all-reduce. At world 1: as they are."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return loss_local, None
    stage = model.llm.module
    holds = stage is not None and stage.is_last and model.llm.grid.coords(model.rank)["tp"] == 0
    t = torch.tensor([float(loss_local) if holds else 0.0], dtype=torch.float64)
    if extra is not None:  # every rank enters with the same size
        t = torch.cat([t, extra])
    dist.all_reduce(t)
    return t[0].item(), (t[1:] if extra is not None else None)


def _read_failures(mbs) -> dict:
    failures: dict = {}
    for mb in mbs:
        for k, v in mb.read_failures.items():
            failures[k] = failures.get(k, 0) + v
    return failures

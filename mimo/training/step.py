"""One training step: the microbatches on a tick table of ``mimo.schedules`` (``train.schedule``:
``1f1b``, the default, or ``simple`` — every microbatch forward, then every one backward), run
by ``mimo.training.schedule_run`` on every rank; then the optimizer part, the same for both.

Per microbatch and rank, in a fixed order (every collective is entered by all its ranks at the
same point): the data pipeline delivers this rank's pack (LLM ranks) and pixels (encoder
ranks); each encoder runs forward, then its bridge to the LLM's first stage (declared
placement) — ``encode_and_bridge`` here; the LLM stages run, the last one's loss being its
token-loss sum over the step's global loss-token count. Backward: the LLM stages, then each
bridge's backward (the bridge's output is detached at the LLM boundary, so this is an explicit
phase on every rank — ``bridge_backward`` here), which continues into the encoder. Then
tied-embedding and DP gradient sums, the global norm (one world-wide all-reduce), clipping, and
each module's optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mimo.bridges.executor import Bridge
from mimo.data.pipeline import DataPipeline, Microbatch
from mimo.parallel.layout import dp_placement, packed_placement
from mimo.llm.model import sync_tied_grads
from mimo.compose.model import MimoModel
from mimo.training.optim import GradSync, PrecisionPolicy, bucket_numel, clip_grads_, global_grad_norm, lr_at


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

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if name in ("loss", "grad_norm") and isinstance(value, torch.Tensor):
            value = float(value)
            object.__setattr__(self, name, value)
        return value


def _sum_over(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.item()


def encode_and_bridge(model: MimoModel, mb: Microbatch, trace: "Trace | None" = None, tick: int | None = None,
                      index: int | None = None, defer_sends: bool = False) -> tuple[dict, dict]:
    """Each encoder's forward and its bridge to the LLM's first stage (a collective over the
    bridge's ranks). Returns (encoder -> (bridge, y, y_leaf), placeholder -> rows for stage 0).
    ``defer_sends``: a non-colocated encoder rank returns once its sends are posted (the
    caller waits for them with ``Bridge.wait_sends``). An encoder that trains nothing runs
    without autograd state."""
    rank, llm_grid, hidden = model.rank, model.llm_grid, model.config.llm.arch.hidden
    bridges, image_rows = {}, {}
    sequence_parallel = model.config.llm.parallel.sequence_parallel and model.config.llm.parallel.tp > 1
    for name, part in model.encoders.items():
        feed_rows = model.config.encoders[name].rows_per_image
        placeholder = model.config.encoders[name].placeholder
        rows = [s.images_for(placeholder) * feed_rows for s in mb.samples]
        src = dp_placement(part.grid, rows, mb.encoder_blocks[name], hidden)
        samples = [(s.tokens, s.positions(placeholder, feed_rows)) for s in mb.samples]
        # the LLM first stage's declared placement (LLMStage.image_placement); ranks without a
        # stage compute the same pure function
        dst, _ = packed_placement(llm_grid, samples, mb.llm_blocks, hidden, sequence_parallel)
        if rank not in src.local_rows and rank not in dst.local_rows:
            continue
        trains = model.encoder_trains[name]
        bridge = Bridge(src, dst, part.bridge_group,
                        src_replica_group=part.tp_group if rank in part.grid else None,
                        dst_replica_group=model.llm_tp if rank in llm_grid and not sequence_parallel else None,
                        needs_grad=trains, rank=rank, defer_sends=defer_sends)
        x = None
        if part.module is not None:
            start = time.perf_counter()
            with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
                x = part.module(mb.pixels[name])
            _note(trace, tick, "encoder_fwd", index, name, start=start)
        start = time.perf_counter()
        y = bridge(x) if x is not None else bridge(None, *_receive_as(model))
        _note(trace, tick, "bridge_fwd", index, name, start=start)
        y_leaf = None
        if bridge.is_dst:
            y_leaf = y.detach().requires_grad_(trains)
            image_rows[placeholder] = y_leaf
        bridges[name] = (bridge, y, y_leaf)
    return bridges, image_rows


def _receive_as(model: MimoModel) -> tuple[torch.dtype, torch.device]:
    """What a rank without the encoder receives: its LLM stage's dtype and device (the gradient
    it sends back must match what the encoder ranks expect)."""
    p = next(model.stage.parameters())
    return p.dtype, p.device


def bridge_backward(model: MimoModel, bridges: dict, trace: "Trace | None" = None, tick: int | None = None,
                    index: int | None = None) -> None:
    """Each trained bridge's backward (the LLM side hands the gradient of the rows it
    received), continuing into the encoder; on every rank of the bridge."""
    for name, (bridge, y, y_leaf) in bridges.items():
        if not model.encoder_trains[name]:
            continue
        start = time.perf_counter()
        if bridge.is_dst:
            g = y_leaf.grad if y_leaf.grad is not None else torch.zeros_like(y_leaf)
            y.backward(g)
        else:  # a non-colocated source: receive the gradient of what it sent
            Bridge.backward_source(y)
        # the bridge's backward continues into the encoder: one span for both
        _note(trace, tick, "bridge_bwd", index, name, start=start)
        if model.encoders[name].module is not None:
            _note(trace, tick, "encoder_bwd", index, name, start=start)


# A rank's events, in order: dicts with tick, kind, microbatch (None for buckets), module, time
# (when it ended) and, for spans, start. Kinds: forward / backward (this rank's LLM stage; with
# stage, and alive: microbatches whose activations it holds), send / recv (stage to stage, with
# peer), encoder_fwd, bridge_fwd, bridge_bwd, encoder_bwd, send_wait (waiting for a
# microbatch's bridge sends posted earlier), bucket_reduce_start / bucket_reduce_end (bucket, numel).
Trace = list


def _note(trace: Trace | None, tick: int | None, kind: str, microbatch: int | None, module: str, **extra) -> None:
    """``time``: when the event ended (``start``: when it began, for spans), in
    ``time.perf_counter()`` seconds: the host's monotonic clock, comparable between the
    processes of one machine."""
    if trace is not None:
        trace.append({"tick": tick, "kind": kind, "microbatch": microbatch, "module": module, "time": time.perf_counter(), **extra})


def chrome_trace(events: Trace, rank: int) -> list[dict]:
    """A rank's events in the Chrome trace event format (Perfetto, chrome://tracing): spans as
    complete events, the rest as instants, times in microseconds of the host clock; one process
    per rank (traces of several ranks concatenate), one thread per module."""
    modules = list(dict.fromkeys(e["module"] for e in events))
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}]
    out += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": m}} for i, m in enumerate(modules)]
    for e in events:
        name = e["kind"] if e["microbatch"] is None else f"{e['kind']} {e['microbatch']}"
        args = {k: v for k, v in e.items() if k not in ("kind", "module", "time", "start")}
        base = {"name": name, "pid": rank, "tid": modules.index(e["module"]), "args": args}
        if "start" in e:
            out.append({**base, "ph": "X", "ts": e["start"] * 1e6, "dur": (e["time"] - e["start"]) * 1e6})
        else:
            out.append({**base, "ph": "i", "s": "t", "ts": e["time"] * 1e6})
    return out


def write_trace(events: Trace, rank: int, path: str) -> None:
    """``chrome_trace`` of ``events`` as a JSON file (directories created)."""
    import json
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": chrome_trace(events, rank), "displayTimeUnit": "ms"}, f)


def train_step(model: MimoModel, pipeline: DataPipeline, step: int, optimizers: dict, policy: PrecisionPolicy | None = None,
               on_grads=None, trace: bool = False) -> StepResult:
    """One step; ``on_grads(model, grad_norm)`` (optional) sees the gradients before clipping.
    ``trace``: record this rank's events (see mimo.training.schedule_run)."""
    cfg = model.config
    mbs = pipeline.step(step)
    # the global loss-token count: each LLM DP rank's packs, summed over DP (DESIGN §2)
    local = sum(mb.loss_tokens for mb in mbs) if model.stage is not None else 0  # counted on the CPU
    num_loss_tokens = _sum_over(local, model.llm_dp) if model.stage is not None else 0.0
    events: Trace | None = [] if trace else None
    from mimo.training.schedule_run import run_schedule  # imports this module's helpers

    # one tick loop runs both schedules; each module's DP sums start bucket by bucket during
    # its last backward on this rank (the tied-embedding sum below commutes with them)
    params = model.train_params()
    grad_sync = GradSync(params, policy, bucket_numel(cfg.train.grad_bucket_mb, policy.grad_reduce if policy else torch.float32))
    try:
        loss_local = run_schedule(model, mbs, max(num_loss_tokens, 1.0), cfg.train.schedule, cfg.train.encoder_prefetch, events,
                                  grad_sync)
        grad_sync.finish()
    finally:
        grad_sync.close()
    if model.stage is not None:
        sync_tied_grads(model.stage, model.llm_embedding_group)
    norm_t = global_grad_norm(params)  # on the device: read below, after the optimizer's launches
    if on_grads is not None:
        on_grads(model, float(norm_t))
    clip_grads_(params, cfg.train.grad_clip, norm_t)
    lrs = {}
    for module, opt in optimizers.items():
        # each module's own base lr (AdamW keeps it in defaults), on the shared schedule
        lr = lr_at(step, opt.defaults["lr"], cfg.train.warmup_steps, cfg.train.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        lrs[module] = lr
    # the step's loss: the last stage's DP ranks hold the parts; read only after the optimizer's
    # kernels are queued (at world 1 only when the caller asks), so that reading it does not
    # idle the device
    loss = loss_local
    if dist.is_initialized() and dist.get_world_size() > 1:
        holds = model.stage is not None and model.stage.is_last and model.llm_grid.coords(model.rank)["tp"] == 0
        t = torch.tensor([float(loss_local) if holds else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        loss = t.item()
    failures: dict = {}
    for mb in mbs:
        for k, v in mb.read_failures.items():
            failures[k] = failures.get(k, 0) + v
    return StepResult(loss, norm_t, int(num_loss_tokens), lrs, failures, events)

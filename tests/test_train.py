"""Training steps on every layout of the assembly issue equal the one-process reference
(loss, every gathered gradient before clipping, grad norm, parameters after the steps), under
the yardstick (mimo.core.testing: the reference in fp32 and fp64, tol 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch

from mimo.compose.config import load_config
from mimo.commands.verify_train import compare, references, train_case

STEPS = 2
TOL = 1e-5


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory, write_demo_config):
    def edit(cfg):
        cfg["train"]["grad_bucket_mb"] = 0.05  # small buckets: several per module, launched during backward
        # sizes that tp=3 divides too (6 attention and KV heads, 6 Mamba heads)
        cfg["modules"]["language"]["arch"].update({"hidden": 48, "heads": 6, "kv_heads": 6, "mamba_head_dim": 16})

    return write_demo_config(tmp_path_factory.mktemp("train"), 2, edit)


LAYOUTS = {
    "colocated enc tp1 dp4, llm tp2 dp2 sp": (4, []),
    "colocated enc tp2 dp2, llm tp1 dp4": (4, ["modules.vision.parallel.tp=2", "modules.vision.parallel.dp=2",
                                               "modules.language.parallel.tp=1", "modules.language.parallel.dp=4"]),
    "colocated 6 ranks enc tp2 dp3, llm tp3 dp2": (6, ["world_size=6", "modules.vision.parallel.tp=2", "modules.vision.parallel.dp=3",
                                                       "modules.vision.parallel.ranks=0:6", "modules.language.parallel.tp=3",
                                                       "modules.language.parallel.ranks=0:6"]),
    "non-colocated enc tp1 dp2 (2), llm tp2 dp2 (4)": (6, ["world_size=6", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
                                                           "modules.language.parallel.ranks=2:6"]),
    "llm pp2, 3 microbatches": (4, ["modules.language.parallel.tp=1", "modules.language.parallel.pp=2", "train.micro_batches=3"]),
    "tower frozen, projector trained": (4, ["modules.vision.freeze=[tower]"]),
    "llm frozen, projector trained (stage 1)": (4, ["modules.vision.freeze=[tower]", "modules.language.freeze=true"]),
    "ranks without samples or images": (4, ["modules.language.parallel.tp=1", "modules.language.parallel.dp=4",
                                            "data.tokens_per_microbatch=200", "data.max_sample_tokens=150", "train.micro_batches=3"]),
}


def _reference(pools, config, overrides, cache={}):
    """The one-process run on the simple schedule (the schedule must not change the numbers),
    in fp32 and fp64."""
    overrides = [o for o in overrides if not o.startswith(("train.schedule", "train.encoder_prefetch"))] + ["train.schedule=simple"]
    key = (config, tuple(o for o in overrides if "parallel" not in o and not o.startswith("world_size")))
    if key not in cache:
        cache[key] = references(pools(1), config, overrides, STEPS)
    return cache[key]


# layouts that only the ticked schedules run (1F1B needs pp > 1 and several microbatches)
SCHEDULED_LAYOUTS = {
    "non-colocated enc tp1 dp2 (2), llm tp2 pp2 (4), 4 microbatches": (6, [
        "world_size=6", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
        "modules.language.parallel.ranks=2:6", "modules.language.parallel.dp=1", "modules.language.parallel.pp=2",
        "train.micro_batches=4"]),
    "llm pp2 colocated, 4 microbatches": (4, ["modules.language.parallel.tp=1", "modules.language.parallel.pp=2",
                                              "train.micro_batches=4"]),
    "llm pp2 colocated, 4 microbatches, prefetch 2": (4, ["modules.language.parallel.tp=1", "modules.language.parallel.pp=2",
                                                          "train.micro_batches=4", "train.encoder_prefetch=2"]),
    # a frozen tower keeps no autograd state while prefetched (only the projector's)
    "tower frozen, llm pp2, prefetch 3": (4, ["modules.vision.freeze=[tower]", "modules.language.parallel.tp=1",
                                              "modules.language.parallel.pp=2", "train.micro_batches=4",
                                              "train.encoder_prefetch=3"]),
    "non-colocated, encoder frozen, llm pp2, prefetch 2": (6, [
        "world_size=6", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2", "modules.vision.freeze=[tower,projector]",
        "modules.language.parallel.ranks=2:6", "modules.language.parallel.dp=1", "modules.language.parallel.pp=2",
        "train.micro_batches=4", "train.encoder_prefetch=2"]),
}


CASES = [(name, schedule) for name in LAYOUTS for schedule in ("simple", "1f1b")]
CASES += [(name, "1f1b") for name in SCHEDULED_LAYOUTS]


@pytest.mark.parametrize("name,schedule", CASES)
def test_layout_equals_one_process_reference(pools, demo_config, name, schedule):
    world, overrides = {**LAYOUTS, **SCHEDULED_LAYOUTS}[name]
    overrides = overrides + [f"train.schedule={schedule}"]
    layout = pools(world).run(train_case, demo_config, overrides, STEPS, False)
    ref32, ref64 = _reference(pools, demo_config, overrides)
    report = compare(layout, ref32, TOL, fp64=ref64)
    assert report["ok"], report
    assert report["losses"][0] > 0
    # every rank's bridge plans of every microbatch, as training made them, equal the reference builders'
    assert report["bridge_plans"]["checked"] >= STEPS * min(world, 4) and report["bridge_plans"]["problems"] == 0


def _misreferenced_train_case(config, overrides, steps, reference):
    """The real step, its plans checked against a reference with one deliberate error: every
    image one position later in its sample."""
    import mimo.bridges.verify as verify

    right = verify.reference_bridge

    def shifted(tokens_N, images_N, image_start_I, *rest):
        return right(tokens_N, images_N, image_start_I + 1, *rest)

    verify.reference_bridge = shifted
    try:
        return train_case(config, overrides, steps, reference)
    finally:
        verify.reference_bridge = right


def test_verify_train_fails_on_bridge_plans_unlike_the_reference(pools, demo_config):
    world, overrides = LAYOUTS["colocated enc tp1 dp4, llm tp2 dp2 sp"]
    layout = pools(world).run(_misreferenced_train_case, demo_config, overrides, STEPS, False)
    ref32, ref64 = _reference(pools, demo_config, overrides)
    report = compare(layout, ref32, TOL, fp64=ref64)
    assert report["bridge_plans"]["problems"] > 0 and not report["ok"], report["bridge_plans"]
    assert report["max_loss_rel_err"] <= TOL  # the training itself is right: only the plans' check fails


def _averaging_train_case(config, overrides, steps, reference):
    """The real step with one deliberate bug: DP gradients averaged instead of summed (the loss
    is already normalised over every DP rank, so this is a missing factor of dp). Every DP sum
    (the simple schedule's and the overlapped one's) finishes in GradSync.finish."""
    import torch.distributed as dist

    from mimo.training.optim import GradSync

    summed = GradSync.finish

    def averaged(self):
        buckets = [b for module in self.buckets.values() for b in module]
        summed(self)
        for b in buckets:
            for p in b.params:
                p.grad.div_(dist.get_world_size(b.group))

    GradSync.finish = averaged
    try:
        return train_case(config, overrides, steps, reference)
    finally:  # the pool's processes run later cases too
        GradSync.finish = summed


@pytest.mark.parametrize("schedule", ["simple", "1f1b"])
def test_a_wrong_gradient_scale_fails_verification(pools, demo_config, schedule):
    overrides = LAYOUTS["colocated enc tp2 dp2, llm tp1 dp4"][1] + [f"train.schedule={schedule}"]
    layout = pools(4).run(_averaging_train_case, demo_config, overrides, STEPS, False)
    ref32, ref64 = _reference(pools, demo_config, overrides)
    report = compare(layout, ref32, TOL, fp64=ref64)
    assert not report["ok"]
    assert report["max_grads_rel_err"] > 0.5  # a factor of 4 on every DP-summed gradient


def test_per_module_learning_rates_and_schedule(demo_config):
    from mimo.training.optim import lr_at, optimizer_settings

    config = load_config(demo_config, ["modules.vision.lr=0.01", "modules.language.weight_decay=0.1"])
    lr, wd = optimizer_settings(config)
    assert lr == {"vision": 0.01, "language": config.train.lr}
    assert wd == {"vision": config.train.weight_decay, "language": 0.1}
    # linear warmup to the base, then cosine down to 10% of it
    assert lr_at(5, 0.01, 10, 100) == pytest.approx(0.005)
    assert lr_at(10, 0.01, 10, 100) == pytest.approx(0.01)
    assert lr_at(100, 0.01, 10, 100) == pytest.approx(0.001)
    assert lr_at(55, 0.01, 10, 100) == pytest.approx(0.0055)


def _trace_case(config_path, overrides):
    """One traced training step; returns this rank's LLM stage (or None) and its events."""
    import torch.distributed as dist

    from mimo.training.precision import PrecisionPolicy
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config = load_config(config_path, overrides)
    run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
    result = train_step(run.model, run.pipeline, 1, run.optimizers, trace=True)
    run.close()
    stage = run.model.llm.grid.coords(dist.get_rank())["pp"] if run.model.llm.module is not None else None
    return stage, result.trace


def _ticks(events, kind, **match):
    """microbatch -> tick of the first event of ``kind`` matching ``match``."""
    out = {}
    for e in events:
        if e["kind"] == kind and all(e.get(k) == v for k, v in match.items()):
            out.setdefault(e["microbatch"], e["tick"])
    return out


# non-colocated encoder tp1 dp2 on ranks 0-1, LLM dp2 pp2 on ranks 2-5 (both modules have DP
# gradient sums, so both show bucket events)
NONCOLOCATED_DP_PP = ["world_size=6", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
                      "modules.language.parallel.ranks=2:6", "modules.language.parallel.tp=1",
                      "modules.language.parallel.dp=2", "modules.language.parallel.pp=2", "train.micro_batches=4"]
TRACED = {
    "non-colocated, prefetch 1": (6, NONCOLOCATED_DP_PP, 1),
    "non-colocated, prefetch 2": (6, NONCOLOCATED_DP_PP + ["train.encoder_prefetch=2"], 2),
    "colocated pp2, prefetch 2": (4, SCHEDULED_LAYOUTS["llm pp2 colocated, 4 microbatches, prefetch 2"][1], 2),
}


def _span(events, kind, mb, module=None):
    """(start, end) of the event of ``kind`` for microbatch ``mb`` (and ``module``)."""
    found = [e for e in events if e["kind"] == kind and e["microbatch"] == mb and module in (None, e["module"])]
    assert len(found) == 1, (kind, mb, module, found)
    return found[0]["start"], found[0]["time"]


def _check_buckets_overlap_last_backward(events, mbs):
    """Every module with DP gradient sums on this rank starts reducing a bucket *during* its
    last backward here (by the run's own clock), with several buckets, each waited for."""
    starts = [e for e in events if e["kind"] == "bucket_reduce_start"]
    ends = [e for e in events if e["kind"] == "bucket_reduce_end"]
    modules = {e["module"] for e in starts}
    for module in modules:
        kind = "backward" if any(e["kind"] == "backward" and e["module"] == module for e in events) else "encoder_bwd"
        bwd_start, bwd_end = _span(events, kind, mbs - 1, module)
        first = min(e["time"] for e in starts if e["module"] == module)
        assert bwd_start < first < bwd_end, (module, bwd_start, first, bwd_end)
        ids = sorted(e["bucket"] for e in starts if e["module"] == module)
        assert ids == list(range(len(ids))) and len(ids) > 1  # launched in order, several
        assert sorted(e["bucket"] for e in ends if e["module"] == module) == ids
    return modules


@pytest.mark.parametrize("name", list(TRACED))
def test_1f1b_trace_shows_the_schedule(pools, demo_config, name):
    from mimo.schedules.ticks import one_f_one_b_order
    from mimo.training.trace import chrome_trace

    world, overrides, depth = TRACED[name]
    per_rank = pools(world).run(_trace_case, demo_config, overrides + ["train.schedule=1f1b"])
    stages, mbs = 2, 4
    stage0_f, stage0_b = {}, {}
    encoder_f, bridge_b = {}, {}
    reducing = set()  # modules whose buckets were seen reducing
    enc_f_start, stage0_b_end = {}, {}  # by the clock: encoder-only ranks' forward starts, stage 0's backward ends
    for rank, (stage, events) in enumerate(per_rank):
        reducing |= _check_buckets_overlap_last_backward(events, mbs)
        # what `mimo train` writes for train.trace_steps: every span and instant, as JSON
        chrome = json.loads(json.dumps(chrome_trace(events, rank)))
        spans = [c for c in chrome if c["ph"] == "X"]
        assert len(spans) == sum("start" in e for e in events) > 0
        assert len([c for c in chrome if c["ph"] == "i"]) == sum("start" not in e for e in events)
        assert all(c["dur"] >= 0 and c["pid"] == rank for c in spans)
        for k in range(mbs):
            if stage is None and any(e["kind"] == "encoder_fwd" for e in events):
                enc_f_start[k] = min(enc_f_start.get(k, float("inf")), _span(events, "encoder_fwd", k)[0])
            if stage == 0:
                stage0_b_end[k] = max(stage0_b_end.get(k, 0.0), _span(events, "backward", k)[1])
        assert [e["tick"] for e in events] == sorted(e["tick"] for e in events)  # in tick order
        if stage is not None:
            ops = [(e["kind"][0].upper(), e["microbatch"]) for e in events if e["kind"] in ("forward", "backward")]
            # warm-up forwards, then one forward and one backward alternately, then backwards
            assert ops == [(op.kind, op.mb) for op in one_f_one_b_order(stages, mbs, stage)]
            alive = peak = 0
            for kind, _ in ops:
                alive += 1 if kind == "F" else -1
                peak = max(peak, alive)
            assert peak <= stages - stage  # at most pp - stage microbatches' activations alive
            # and what the stage really held (its stored activations, counted when each forward ends)
            held = [e["alive"] for e in events if e["kind"] == "forward"]
            assert max(held) == peak == min(stages - stage, mbs)
            if stage == 0:
                stage0_f, stage0_b = _ticks(events, "forward"), _ticks(events, "backward")
            else:  # the activation arrives from stage 0
                assert set(_ticks(events, "recv")) == set(range(mbs))
        for k, t in _ticks(events, "encoder_fwd").items():
            encoder_f[k] = max(encoder_f.get(k, t), t)
        for k, t in _ticks(events, "bridge_bwd").items():
            bridge_b[k] = min(bridge_b.get(k, t), t)
        # on a rank that runs both, the encoder's forward of k comes before stage 0's F(k)
        order = [(e["kind"], e["microbatch"]) for e in events]
        for k in range(mbs):
            if ("encoder_fwd", k) in order and ("forward", k) in order and stage == 0:
                assert order.index(("encoder_fwd", k)) < order.index(("forward", k))
    assert sorted(encoder_f) == sorted(bridge_b) == list(range(mbs))
    for k in range(mbs):
        assert encoder_f[k] <= stage0_f[k]
        assert bridge_b[k] >= stage0_b[k]  # the bridge's backward of k follows stage 0's B(k)
        if k + depth < mbs:  # bounded prefetch: k..k+d-1 by F(0, k), and no more
            assert encoder_f[k + depth - 1] <= stage0_f[k] < encoder_f[k + depth]
    if depth > 1:  # the encoder's forward of microbatch 1 starts before the LLM's backward of 0
        assert encoder_f[1] < stage0_b[0]
    if enc_f_start:  # non-colocated, by the real clocks: encoder forward of i+1 starts before the LLM's backward of i ends
        for k in range(mbs - 1):
            assert enc_f_start[k + 1] < stage0_b_end[k]
    assert reducing == {"language", "vision"}


def _slow_llm_trace_case(config_path, overrides, delay_s):
    """``_trace_case`` with every LLM stage forward made ``delay_s`` slower, so that an encoder
    rank that waited for the LLM would visibly lag behind it."""
    import time

    from mimo.llm.stage_runner import StageRunner

    forward = StageRunner.forward

    def slow(self, *args, **kwargs):
        time.sleep(delay_s)
        return forward(self, *args, **kwargs)

    StageRunner.forward = slow
    try:
        return _trace_case(config_path, overrides)
    finally:  # the pool's processes run later cases too
        StageRunner.forward = forward


def test_frozen_encoder_prefetch_runs_ahead_of_a_slow_llm(pools, demo_config):
    """Non-colocated frozen encoder, prefetch 2: the encoder ranks only post their sends, so they
    compute microbatch 3 while stage 0 still runs its first forward (it needs the LLM to have
    received microbatch 1 only); a rank that waited for each send to be received would start
    microbatch 3 only after stage 0 received microbatch 2, i.e. after that forward. And the
    run-ahead is bounded: before microbatch k an encoder rank waits for the sends of k - 2."""
    depth, mbs = 2, 4
    overrides = NONCOLOCATED_DP_PP + ["modules.vision.freeze=[tower,projector]", f"train.encoder_prefetch={depth}",
                                      "train.schedule=1f1b"]
    per_rank = pools(6).run(_slow_llm_trace_case, demo_config, overrides, 0.3)
    stage0_forward_end = min(_span(events, "forward", 0)[1] for stage, events in per_rank if stage == 0)
    encoder_ranks = [events for stage, events in per_rank if stage is None]
    assert len(encoder_ranks) == 2
    for events in encoder_ranks:
        assert not [e for e in events if e["kind"] in ("bridge_bwd", "encoder_bwd", "bucket_reduce_start")]  # frozen
        assert _span(events, "encoder_fwd", depth + 1)[0] < stage0_forward_end
        order = [(e["kind"], e["microbatch"]) for e in events]
        for k in range(depth, mbs):
            assert order.index(("send_wait", k - depth)) < order.index(("encoder_fwd", k))
        assert {k for kind, k in order if kind == "send_wait"} == set(range(mbs))  # every send waited for


def test_schedule_setting_is_validated(demo_config):
    from mimo.core.errors import ConfigError

    assert load_config(demo_config).train.schedule == "1f1b"
    assert load_config(demo_config, ["train.schedule=1f1b"]).train.schedule == "1f1b"
    with pytest.raises(ConfigError):
        load_config(demo_config, ["train.schedule=zigzag"])
    with pytest.raises(ConfigError):
        load_config(demo_config, ["train.encoder_prefetch=0"])


def _grad_sync_case():
    """GradSync alone on 2 ranks: buckets launch during backward, in index order, each shared
    parameter reduced once, an unused one as zeros."""
    import torch
    import torch.distributed as dist

    from mimo.training.optim import GradSync, TrainParam

    rank, world = dist.get_rank(), dist.group.WORLD
    a, b, unused = (torch.nn.Parameter(torch.zeros(n)) for n in (6, 3, 2))
    params = [TrainParam("m", "unused", unused, world, True), TrainParam("m", "a", a, world, True),
              TrainParam("m", "b", b, world, True), TrainParam("m", "a.again", a, world, True)]
    sync = GradSync(params, bucket_numel=4)  # reversed order: [b], [a] (6 > 4), [unused]
    events = []
    sync.note = lambda kind, module, **extra: events.append((kind, extra["bucket"]))
    sync.arm("m")
    ((a * (rank + 1)).sum() + (b * 2 * (rank + 1)).sum()).backward()
    during = list(events)  # what launched before backward returned
    sync.flush("m")
    sync.finish()
    sync.close()
    return during, events, a.grad.tolist(), b.grad.tolist(), unused.grad.tolist()


def test_grad_sync_buckets_launch_during_backward_in_order(pools):
    for during, events, a, b, unused in pools(2).run(_grad_sync_case):
        assert during == [("bucket_reduce_start", 0), ("bucket_reduce_start", 1)]  # unused's bucket waits for flush
        assert events == during + [("bucket_reduce_start", 2)] + [("bucket_reduce_end", i) for i in range(3)]
        assert a == [3.0] * 6 and b == [6.0] * 3 and unused == [0.0] * 2  # summed once over the 2 ranks


def test_step_result_reads_device_values_on_first_access():
    """train_step hands the loss and the gradient norm over as tensors (no device wait in the
    step); they read as floats, once."""
    from mimo.training.step import StepResult

    r = StepResult(torch.tensor(2.5, dtype=torch.float64), torch.tensor(0.5), 7)
    assert torch.is_tensor(object.__getattribute__(r, "loss"))
    assert r.loss == 2.5 and type(r.loss) is float and r.grad_norm == 0.5 and type(r.grad_norm) is float
    assert type(object.__getattribute__(r, "loss")) is float  # read once, kept


def test_grad_norm_term_lives_on_the_given_device_even_without_parameters(monkeypatch):
    """The old hang: a rank where nothing trains (a frozen module on its own ranks) built its
    norm term on the CPU, so under ``cpu:gloo,cuda:nccl`` its all-reduce went to gloo while
    every other rank's went to NCCL. The term handed to the all-reduce must be on the device
    the caller names, parameters or not ("meta" stands in for a GPU on this CPU machine)."""
    import torch.distributed as dist

    from mimo.training.optim import TrainParam, global_grad_norm

    reduced = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: reduced.append(t))
    norm = global_grad_norm([], torch.device("meta"))
    assert [t.device.type for t in reduced] == ["meta"] and norm.device.type == "meta"
    # with gradients: their norm (counted ones only), against a plain computation
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (5, 3, 4))
    for p in (a, b, c):
        p.grad = torch.randn(p.shape, dtype=torch.float32)
    norm = global_grad_norm([TrainParam("m", "a", a, None, True), TrainParam("m", "b", b, None, True),
                             TrainParam("m", "c", c, None, False)], "cpu")
    assert reduced[-1] is not reduced[0] and reduced[-1].device.type == "cpu"
    assert float(norm) == pytest.approx(float(torch.cat([a.grad, b.grad]).double().norm()), rel=1e-6)


# the vision encoder frozen, alone on rank 0 (no trainable parameter there); the LLM on rank 1
FROZEN_ENCODER_ALONE = ["world_size=2", "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1",
                        "modules.vision.freeze=[tower,projector]", "modules.language.parallel.tp=1",
                        "modules.language.parallel.dp=1", "modules.language.parallel.ranks=1:2",
                        "modules.language.parallel.sequence_parallel=false"]


def _frozen_rank_step_case(config_path, overrides):
    """One training step; records what train_step hands the global norm (the device it names
    and how many parameters) and this rank's sum of squared gradients, computed plainly."""
    import torch.distributed as dist

    import mimo.training.step as step_module
    from mimo.training.run import build_run

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    seen, norm = {}, step_module.grad_norm

    def spy(optimizers, device):
        optimizers = list(optimizers)
        out = norm(optimizers, device)
        seen.update(params=sum(len(s.pieces) for opt in optimizers for s in opt.states), device=str(device),
                    reduced_on=str(out.device))
        return out

    def own(model, grad_norm):
        seen["own_sq"] = sum(float(p.param.grad.double().pow(2).sum()) for p in model.train_params()
                             if p.counts_in_norm and p.param.grad is not None)

    step_module.grad_norm = spy
    try:
        result = step_module.train_step(run.model, run.pipeline, 1, run.optimizers, run.policy, on_grads=own)
    finally:  # the pool's processes run later cases too
        step_module.grad_norm = norm
        run.close()
    return {**seen, "model_device": str(run.model.device), "grad_norm": result.grad_norm, "loss": result.loss}


def test_a_rank_where_nothing_trains_joins_the_norm_on_its_device(pools, demo_config):
    frozen, llm = pools(2).run(_frozen_rank_step_case, demo_config, FROZEN_ENCODER_ALONE)
    assert frozen["params"] == 0 and llm["params"] > 0  # the old hang's condition
    for r in (frozen, llm):
        assert r["device"] == r["model_device"] == r["reduced_on"]  # named by the step, not taken from parameters
    assert frozen["own_sq"] == 0.0 and llm["own_sq"] > 0 and llm["loss"] > 0
    assert frozen["grad_norm"] == llm["grad_norm"] == pytest.approx(llm["own_sq"] ** 0.5, rel=1e-6)


def _tables_per_step_case(config_path, overrides):
    """Two training steps; counts the parameter tables (``param_table``, ``train_params``) the
    second one builds (the run's table is built once, with its gradient buffers), and the new
    steps of CUDA graphs it marks with the model's ``cuda_graphs`` set."""
    import torch.distributed as dist

    import mimo.compose.model as model_module
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    model = run.model
    train_step(model, run.pipeline, 1, run.optimizers, run.policy)
    count, marks = [0], [0]
    real_table, real_params = model_module.ModulePart.param_table, type(model).train_params
    real_mark = torch.compiler.cudagraph_mark_step_begin
    model.cuda_graphs = True  # as train.cuda_graphs sets it (the blocks themselves run as built)
    torch.compiler.cudagraph_mark_step_begin = lambda: marks.__setitem__(0, marks[0] + 1)
    stage_cls = type(model.llm.module) if model.llm.module is not None else None
    real_stage_table = stage_cls.param_table if stage_cls is not None else None

    def counting(fn):
        def wrapped(*args, **kwargs):
            count[0] += 1
            return fn(*args, **kwargs)
        return wrapped

    model_module.ModulePart.param_table = counting(real_table)
    type(model).train_params = counting(real_params)
    if stage_cls is not None:
        stage_cls.param_table = counting(real_stage_table)
    try:
        result = train_step(model, run.pipeline, 2, run.optimizers, run.policy)
    finally:  # the pool's processes run later cases too
        model_module.ModulePart.param_table, type(model).train_params = real_table, real_params
        torch.compiler.cudagraph_mark_step_begin = real_mark
        if stage_cls is not None:
            stage_cls.param_table = real_stage_table
        run.close()
    return {"tables": count[0], "graph_steps": marks[0], "loss": result.loss}


def test_a_step_builds_no_parameter_table(pools, demo_config):
    """The step boundary's host time: the norm and clipping read the table the gradient buffers
    were built from, not one rebuilt every step (about 20 ms a step at llava-1.3b's 56 layers
    on this machine). Mutation: ``model.train_params()`` per step counts here. Under
    ``train.cuda_graphs`` the step marks exactly one new step of the graphs, on every rank."""
    for r in pools(4).run(_tables_per_step_case, demo_config, []):
        assert r["tables"] == 0 and r["loss"] > 0
        assert r["graph_steps"] == 1


@pytest.mark.parametrize("change", [{}, {"sent": 11}, {"gathered": 1}, {"problems": ["rank 0: its forward plan differs"]}])
def test_verify_train_counts_bridge_elements_against_the_minimum(change):
    """``compare`` passes training's bridge plans only at the reference's minimum: one element
    sent or all-gathered beyond it, or one plan unlike the reference's, fails the verification."""
    step = {"loss": 1.0, "grad_norm": 1.0, "grads": {}, "mtp": {}, "dsa": {}}
    ref = [{"steps": [step], "params": {}}]
    plans = {"checked": 2, "problems": [], "sent": 10, "minimum": 10, "gathered": 0, "gather_minimum": 0, **change}
    report = compare([{"steps": [step], "params": {}, "bridge_plans": plans}], ref, TOL, fp64=ref)
    assert report["ok"] == (not change), report["bridge_plans"]

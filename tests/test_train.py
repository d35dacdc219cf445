"""Training steps on every layout of the assembly issue equal the one-process reference
(loss, every gathered gradient before clipping, grad norm, parameters after the steps)."""

from __future__ import annotations

import os

import pytest
import yaml

from mimo.data.demo import make_demo_data
from mimo.inputs import ensure_index
from mimo.config import load_config
from mimo.verify_train import compare, train_case

STEPS = 2
TOL = 1e-5


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    data = root / "data"
    make_demo_data(str(data), train_samples=400, heldout_samples=20, shard_size=200, seed=2)
    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["data"]["shards"] = str(data / "train-{000000..000001}.tar")
    cfg["data"]["tokenizer"] = str(data / "tokenizer")
    cfg["data"]["tokens_per_microbatch"] = 1024
    cfg["train"]["checkpoint"]["dir"] = str(root / "ckpt")
    # sizes that tp=3 divides too (6 attention and KV heads, 6 Mamba heads)
    cfg["modules"]["language"]["arch"].update({"hidden": 48, "heads": 6, "kv_heads": 6, "mamba_head_dim": 16})
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ensure_index(load_config(str(path)))
    return str(path)


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
    """The one-process run on the simple schedule (the schedule must not change the numbers)."""
    overrides = [o for o in overrides if not o.startswith(("train.schedule", "train.encoder_prefetch"))] + ["train.schedule=simple"]
    key = (config, tuple(o for o in overrides if "parallel" not in o and not o.startswith("world_size")))
    if key not in cache:
        cache[key] = pools(1).run(train_case, config, overrides, STEPS, True)
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
    report = compare(layout, _reference(pools, demo_config, overrides), TOL)
    assert report["ok"], report
    assert report["losses"][0] > 0


def _averaging_train_case(config, overrides, steps, reference):
    """The real step with one deliberate bug: DP gradients averaged instead of summed (the loss
    is already normalised over every DP rank, so this is a missing factor of dp). Every DP sum
    (the simple schedule's and the overlapped one's) finishes in GradSync.finish."""
    import torch.distributed as dist

    from mimo.optim import GradSync

    summed = GradSync.finish

    def averaged(self):
        buckets = [(bucket, group) for _, _, bucket, group in self._pending]
        summed(self)
        for bucket, group in buckets:
            for g in bucket:
                g.div_(dist.get_world_size(group))

    GradSync.finish = averaged
    try:
        return train_case(config, overrides, steps, reference)
    finally:  # the pool's processes run later cases too
        GradSync.finish = summed


@pytest.mark.parametrize("schedule", ["simple", "1f1b"])
def test_a_wrong_gradient_scale_fails_verification(pools, demo_config, schedule):
    overrides = LAYOUTS["colocated enc tp2 dp2, llm tp1 dp4"][1] + [f"train.schedule={schedule}"]
    layout = pools(4).run(_averaging_train_case, demo_config, overrides, STEPS, False)
    report = compare(layout, _reference(pools, demo_config, overrides), TOL)
    assert not report["ok"]
    assert report["max_grads_rel_err"] > 0.5  # a factor of 4 on every DP-summed gradient


def test_per_module_learning_rates_and_schedule(demo_config):
    from mimo.optim import lr_at

    config = load_config(demo_config, ["modules.vision.lr=0.01", "modules.language.weight_decay=0.1"])
    lr, wd = config.optimizer_settings()
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

    from mimo.optim import PrecisionPolicy
    from mimo.run import build_run
    from mimo.step import train_step

    config = load_config(config_path, overrides)
    run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
    result = train_step(run.model, run.pipeline, 1, run.optimizers, trace=True)
    run.close()
    stage = run.model.llm_grid.coords(dist.get_rank())["pp"] if run.model.stage is not None else None
    return stage, result.trace


def _ticks(events, kind, **match):
    """microbatch -> tick of the first event of ``kind`` matching ``match``."""
    out = {}
    for e in events:
        if e["kind"] == kind and all(e.get(k) == v for k, v in match.items()):
            out.setdefault(e["microbatch"], e["tick"])
    return out


TRACED = {
    "non-colocated, prefetch 1": (6, SCHEDULED_LAYOUTS["non-colocated enc tp1 dp2 (2), llm tp2 pp2 (4), 4 microbatches"][1], 1),
    "colocated pp2, prefetch 2": (4, SCHEDULED_LAYOUTS["llm pp2 colocated, 4 microbatches, prefetch 2"][1], 2),
}


@pytest.mark.parametrize("name", list(TRACED))
def test_1f1b_trace_shows_the_schedule(pools, demo_config, name):
    from mimo.schedules.pipeline import one_f_one_b_order

    world, overrides, depth = TRACED[name]
    per_rank = pools(world).run(_trace_case, demo_config, overrides + ["train.schedule=1f1b"])
    stages, mbs = 2, 4
    stage0_f, stage0_b = {}, {}
    encoder_f, bridge_b = {}, {}
    reduce_starts = []  # (tick, module, stage)
    for stage, events in per_rank:
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
            if stage == 0:
                stage0_f, stage0_b = _ticks(events, "forward"), _ticks(events, "backward")
            else:  # the activation arrives from stage 0
                assert set(_ticks(events, "recv")) == set(range(mbs))
        reduce_starts += [(e["tick"], e["module"], stage) for e in events if e["kind"] == "bucket_reduce"]
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
    # overlap: the last stage's DP gradient sums start while stage 0 (and the encoder) still run backward
    assert {m for _, m, _ in reduce_starts} == {"language", "vision"}
    assert min(t for t, m, st in reduce_starts if st == stages - 1) < stage0_b[mbs - 1]


def test_schedule_setting_is_validated(demo_config):
    from mimo.errors import ConfigError

    assert load_config(demo_config).train.schedule == "1f1b"
    assert load_config(demo_config, ["train.schedule=1f1b"]).train.schedule == "1f1b"
    with pytest.raises(ConfigError):
        load_config(demo_config, ["train.schedule=zigzag"])
    with pytest.raises(ConfigError):
        load_config(demo_config, ["train.encoder_prefetch=0"])

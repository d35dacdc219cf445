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
    key = (config, tuple(o for o in overrides if "parallel" not in o and not o.startswith("world_size")))
    if key not in cache:
        cache[key] = pools(1).run(train_case, config, overrides, STEPS, True)
    return cache[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process_reference(pools, demo_config, name):
    world, overrides = LAYOUTS[name]
    layout = pools(world).run(train_case, demo_config, overrides, STEPS, False)
    report = compare(layout, _reference(pools, demo_config, overrides), TOL)
    assert report["ok"], report
    assert report["losses"][0] > 0


def _averaging_train_case(config, overrides, steps, reference):
    """The real step with one deliberate bug: DP gradients averaged instead of summed (the loss
    is already normalised over every DP rank, so this is a missing factor of dp)."""
    import torch.distributed as dist

    import mimo.step
    from mimo.optim import sync_grads

    def averaged(params, policy=None):
        sync_grads(params, policy)
        for p in params:
            if p.dp_group is not None and p.param.grad is not None:
                p.param.grad.div_(dist.get_world_size(p.dp_group))

    mimo.step.sync_grads = averaged
    try:
        return train_case(config, overrides, steps, reference)
    finally:  # the pool's processes run later cases too
        mimo.step.sync_grads = sync_grads


def test_a_wrong_gradient_scale_fails_verification(pools, demo_config):
    overrides = LAYOUTS["colocated enc tp2 dp2, llm tp1 dp4"][1]
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

"""One communicator per distinct rank set and purpose: the run's GroupRegistry is the only
maker of groups.

Each case builds a whole run (model, data pipeline, optimizers) on a gloo pool and trains
one step with ``torch.distributed.new_group`` wrapped to record every creation; the
creations must all come from the registry, and no rank set may get two communicators for one
purpose (the data pipeline's step thread has its own, purpose "data").
"""

from __future__ import annotations

import pytest

from mimo.compose.config import load_config


def count_groups_case(config_path: str, overrides: list[str]):
    import torch.distributed as dist

    from mimo.training.precision import PrecisionPolicy
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    made = []
    real = dist.new_group

    def recording(ranks=None, *args, **kwargs):
        made.append(tuple(sorted(ranks)))
        return real(ranks, *args, **kwargs)

    dist.new_group = recording
    try:
        config = load_config(config_path, overrides)
        run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
        train_step(run.model, run.pipeline, 1, run.optimizers, run.policy)
        run.close()
    finally:
        dist.new_group = real
    registry = run.model.registry
    return {"made": made, "registry": list(registry.created), "purposes": list(registry.purposes)}


def check_one_per_rank_set(results) -> set:
    first = results[0]
    for r in results:
        assert r == first, "ranks disagree on the groups they created"
    made, registry = first["made"], first["registry"]
    assert made == registry, "a group was created outside the run's registry"
    keys = list(zip(first.get("purposes", [""] * len(made)), made))
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    assert not duplicates, f"rank sets with more than one communicator: {duplicates}"
    return set(made)


def _colocated(cfg):  # configs/examples/colocated.yaml's layout on the demo model
    cfg["modules"]["language"]["parallel"] = {"tp": 2, "dp": 2, "ranks": "0:4"}


def _noncolocated(cfg):  # configs/examples/noncolocated.yaml's layout on the demo model
    cfg["world_size"] = 6
    cfg["modules"]["vision"]["parallel"] = {"tp": 1, "dp": 2, "ranks": "0:2"}
    cfg["modules"]["language"]["parallel"] = {"tp": 2, "pp": 2, "dp": 1, "ranks": "2:6"}


@pytest.mark.parametrize("layout,world", [(None, 4), (_colocated, 4), (_noncolocated, 6)],
                         ids=["demo", "colocated", "noncolocated"])
def test_one_communicator_per_rank_set(pools, tmp_path, write_demo_config, layout, world):
    path = write_demo_config(tmp_path, seed=3, edit=layout)
    results = pools(world).run(count_groups_case, path, ["train.micro_batches=2"])
    groups = check_one_per_rank_set(results)
    assert "data" in results[0]["purposes"]  # the data pipeline's step thread: groups of its own
    cfg = load_config(path)
    llm = cfg.llm.parallel
    # the LLM's TP groups are among them (a sanity check that the recording saw the run)
    if llm.tp > 1:
        start = llm.rank_range(cfg.world_size).start
        assert tuple(range(start, start + llm.tp)) in groups


def test_two_encoders_one_communicator_per_rank_set(pools, tmp_path):
    """tests/configs/two_encoders.yaml: a colocated tower (tp2 dp2) and a non-colocated one."""
    import os

    import yaml

    from mimo.compose.inputs import ensure_index
    from mimo.data.two_towers import make_two_tower_data

    shards = make_two_tower_data(str(tmp_path / "data"), samples=60, shard_size=60, seed=3)
    with open(os.path.join(os.path.dirname(__file__), "configs", "two_encoders.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["data"].update(shards=shards, tokenizer=str(tmp_path / "data" / "tokenizer"))
    cfg["train"]["checkpoint"]["dir"] = str(tmp_path / "ckpt")
    path = tmp_path / "two_encoders.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ensure_index(load_config(str(path)))
    groups = check_one_per_rank_set(pools(6).run(count_groups_case, str(path), ["train.micro_batches=2"]))
    assert (4, 5) in groups  # the sketch tower's DP group


def test_the_check_catches_a_duplicate():
    with pytest.raises(AssertionError, match="more than one"):
        check_one_per_rank_set([{"made": [(0, 1), (0, 1)], "registry": [(0, 1), (0, 1)]}])
    with pytest.raises(AssertionError, match="outside"):
        check_one_per_rank_set([{"made": [(0, 1), (2, 3)], "registry": [(0, 1)]}])

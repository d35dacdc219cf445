"""Shared fixtures: ``pools(N)`` gives an N-rank gloo worker pool, started once per test module;
``write_demo_config`` writes the demo config over fresh demo shards, ``write_moe_configs``
tests/configs/moe_{tp,pp}.yaml over them."""

from __future__ import annotations

import os

import pytest
import yaml

from mimo.training.launch import WorkerPool


@pytest.fixture(scope="module")
def pools():
    started: dict[int, WorkerPool] = {}

    def get(world_size: int, timeout_s: float = 120.0) -> WorkerPool:
        pool = started.get(world_size)
        if pool is None:
            pool = started[world_size] = WorkerPool(world_size, timeout_s=timeout_s)
        return pool

    yield get
    for pool in started.values():
        pool.close()


@pytest.fixture(scope="session")
def write_demo_config():
    """``write(root, seed, edit=None)``: configs/demo.yaml over 400 fresh demo samples in two
    shards under ``root``, 1024-token microbatches, its index prepared; ``edit(cfg)`` may change
    the config dict first. Returns the config's path."""
    from mimo.compose.config import load_config
    from mimo.data.demo import make_demo_data
    from mimo.compose.inputs import ensure_index

    def write(root, seed: int, edit=None) -> str:
        data = root / "data"
        make_demo_data(str(data), train_samples=400, heldout_samples=20, shard_size=200, seed=seed)
        with open(os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")) as f:
            cfg = yaml.safe_load(f)
        cfg["data"].update(shards=str(data / "train-{000000..000001}.tar"), tokenizer=str(data / "tokenizer"), tokens_per_microbatch=1024)
        cfg["train"]["checkpoint"]["dir"] = str(root / "ckpt")
        if "eval" in cfg:  # the held-out split written beside the train shards
            cfg["eval"]["shards"] = str(data / "heldout-{000000..000000}.tar")
        if edit is not None:
            edit(cfg)
        path = root / "demo.yaml"
        path.write_text(yaml.safe_dump(cfg))
        ensure_index(load_config(str(path)))
        return str(path)

    return write


@pytest.fixture(scope="session")
def write_moe_configs():
    """``write(root, train_samples, seed, names=("moe_tp", "moe_pp"))``: those tests/configs/*.yaml
    over fresh demo shards (two) under ``root``, their index prepared: {name: path}."""
    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index
    from mimo.data.demo import make_demo_data

    def write(root, train_samples: int, seed: int, names=("moe_tp", "moe_pp")) -> dict[str, str]:
        data = root / "data"
        make_demo_data(str(data), train_samples=train_samples, heldout_samples=4, shard_size=train_samples // 2, seed=seed)
        out = {}
        for name in names:
            with open(os.path.join(os.path.dirname(__file__), "configs", f"{name}.yaml")) as f:
                cfg = yaml.safe_load(f)
            cfg["data"].update(shards=str(data / "train-{000000..000001}.tar"), tokenizer=str(data / "tokenizer"))
            cfg["train"]["checkpoint"]["dir"] = str(root / name / "ckpt")
            path = root / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            ensure_index(load_config(str(path)))
            out[name] = str(path)
        return out

    return write

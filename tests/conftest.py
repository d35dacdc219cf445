"""Shared fixtures: ``pools(N)`` gives an N-rank gloo worker pool, started once per test module."""

from __future__ import annotations

import pytest

from mimo.launch import WorkerPool


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

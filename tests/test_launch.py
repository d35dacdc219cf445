"""The worker-pool harness: results per rank, and fast, clear failures."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mimo.core.errors import DistributedError


def _allreduce_rank():
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return {"rank": dist.get_rank(), "sum": x.item(), "threads": torch.get_num_threads()}


def _fail_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the healthy ranks wait for the failed one: they must not hang the test
    return dist.get_rank()


def _hang_on_rank(silent_rank):
    if dist.get_rank() != silent_rank:
        dist.all_reduce(torch.ones(1))  # never completes: one rank does not join
    return dist.get_rank()


def _kwargs_echo(a, *, b):
    return (dist.get_rank(), a + b)


def test_results_in_rank_order(pools):
    results = pools(3).run(_allreduce_rank)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 6.0 for r in results)
    assert all(r["threads"] == 1 for r in results)
    assert pools(3).run(_kwargs_echo, 2, b=5) == [(0, 7), (1, 7), (2, 7)]


def test_failing_rank_ends_fast_with_its_message(pools):
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 2 failed(.|\n)*deliberate failure on rank 2"):
        pools(3).run(_fail_on_rank, 2, timeout_s=60)
    assert time.monotonic() - t0 < 15
    # the pool restarts cleanly for the next case
    assert pools(3).run(_allreduce_rank)[0]["sum"] == 6.0


def test_hung_collective_times_out_fast(pools):
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"timed out; ranks \[0, 2\] did not finish"):
        pools(3).run(_hang_on_rank, 1, timeout_s=3)
    assert time.monotonic() - t0 < 15
    assert pools(3).run(_allreduce_rank)[2]["sum"] == 6.0


def test_local_functions_are_refused(pools):
    def local():
        return 1

    with pytest.raises(ValueError, match="module-level"):
        pools(3).run(local)

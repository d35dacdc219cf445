"""Bridges and training over NCCL, one process per GPU, against the one-process reference.

The CPU-runnable part checks the device and dtype options (clear errors, exact bf16 moves over
gloo). The GPU part needs two GPUs and skips with its reason otherwise; it runs the world-2
layouts of the bridge, assembly and schedules issues in fp32 (TF32 off, exact attention, the
CPU tolerance) and bf16 (fast paths, the stated bf16 tolerance), the reference being one
process on one GPU in fp32. It prints one ``RESULT`` JSON line per case (``pytest -s``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mimo.bridges.verify import bridge_case, summarise
from mimo.commands.cli import VERIFY_TRAIN_TOL
from mimo.core.errors import DistributedError
from mimo.training.launch import WorkerPool, check_device, resolve_device

GPUS = torch.cuda.device_count()
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"NCCL runs one rank per GPU: needs 2 GPUs, {GPUS} visible")

ROOT = Path(__file__).resolve().parents[1]

BRIDGES = [  # (src, dst, colocated) on 2 ranks
    ("tp=1,dp=2", "tp=2,dp=1", True),
    ("tp=2,dp=1", "tp=1,dp=2", True),
    ("tp=1,dp=2", "tp=2,dp=1,shard=seq", True),
    ("tp=2,dp=1", "tp=1,dp=2,shard=seq", True),
    ("tp=1", "tp=1", False),
]


# ---- CPU-runnable ------------------------------------------------------------------------------
def test_device_errors_come_before_any_process():
    with pytest.raises(DistributedError, match=f"{GPUS + 1} ranks need {GPUS + 1} GPUs, {GPUS} visible"):
        check_device("cuda", GPUS + 1)
    with pytest.raises(DistributedError, match="use one of cpu, cuda"):
        WorkerPool(1, device="tpu")
    proc = subprocess.run([sys.executable, "-m", "mimo", "verify-bridge", "--world", str(max(2, GPUS + 1)), "--src", "tp=1",
                           "--dst", "tp=1", "--non-colocated", "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "one rank per GPU" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_train_device_auto_takes_a_gpu_per_rank_or_the_cpu():
    assert resolve_device("auto", GPUS + 1) == "cpu"  # one GPU short: the CPU, not an error
    assert resolve_device("cpu", 4) == "cpu"
    if GPUS:
        assert resolve_device("auto", GPUS) == "cuda"
    with pytest.raises(DistributedError, match=f"{GPUS + 1} ranks need {GPUS + 1} GPUs"):
        resolve_device("cuda", GPUS + 1)
    # mimo train says so before starting anything (no data, no run directory needed for that)
    proc = subprocess.run([sys.executable, "-m", "mimo", "train", "configs/examples/single.yaml", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "one rank per GPU" in proc.stderr + proc.stdout and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("src,dst,colocated", BRIDGES[:2] + BRIDGES[4:])
def test_bf16_moves_exactly_and_counts_two_bytes(pools, src, dst, colocated):
    fp32 = summarise(pools(2).run(bridge_case, src, dst, colocated, 12, 2, True, 5, "cpu", "fp32"))
    bf16 = summarise(pools(2).run(bridge_case, src, dst, colocated, 12, 2, True, 5, "cpu", "bf16"), itemsize=2)
    assert fp32["ok"] and bf16["ok"], (fp32, bf16)
    assert bf16["bytes_sent"] * 2 == fp32["bytes_sent"] > 0


# ---- two GPUs, NCCL ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_pools():
    started: dict[int, WorkerPool] = {}

    def get(world: int) -> WorkerPool:
        if world not in started:
            started[world] = WorkerPool(world, timeout_s=300, device="cuda")
        return started[world]

    yield get
    for pool in started.values():
        pool.close()


def _result(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


@needs_two_gpus
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("src,dst,colocated", BRIDGES)
def test_bridge_over_nccl(gpu_pools, src, dst, colocated, dtype):
    report = summarise(gpu_pools(2).run(bridge_case, src, dst, colocated, 64, 3, True, 11, "cuda", dtype),
                       itemsize=2 if dtype == "bf16" else 4)
    _result(check="verify-bridge", src=src, dst=dst, colocated=colocated, dtype=dtype, **report)
    assert report["ok"], report


WORLD2 = ["world_size=2", "modules.vision.parallel.ranks=0:2", "modules.language.parallel.ranks=0:2"]
TRAIN_LAYOUTS = {  # demo model, 2 ranks
    "colocated enc tp1 dp2, llm tp2 sp": WORLD2 + ["modules.vision.parallel.dp=2", "modules.language.parallel.dp=1"],
    "colocated enc tp1 dp2, llm tp2": WORLD2 + ["modules.vision.parallel.dp=2", "modules.language.parallel.dp=1",
                                                "modules.language.parallel.sequence_parallel=false"],
    "colocated enc tp2 dp1, llm tp1 dp2": WORLD2 + ["modules.vision.parallel.tp=2", "modules.vision.parallel.dp=1",
                                                    "modules.language.parallel.tp=1", "modules.language.parallel.dp=2",
                                                    "modules.language.parallel.sequence_parallel=false"],
    "colocated enc dp2, llm pp2, 1f1b, 4 microbatches": WORLD2 + [
        "modules.vision.parallel.dp=2", "modules.language.parallel.tp=1", "modules.language.parallel.dp=1",
        "modules.language.parallel.pp=2", "modules.language.parallel.sequence_parallel=false", "train.micro_batches=4"],
    "non-colocated enc 1 rank, llm 1 rank": ["world_size=2", "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1",
                                             "modules.language.parallel.tp=1", "modules.language.parallel.dp=1",
                                             "modules.language.parallel.ranks=1:2", "modules.language.parallel.sequence_parallel=false"],
}
STEPS = 2


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory, write_demo_config):
    return write_demo_config(tmp_path_factory.mktemp("gpu"), 3)


@needs_two_gpus
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_train_over_nccl(gpu_pools, demo_config, name, precision, references={}):
    from mimo.commands.verify_train import compare, train_case
    from mimo.commands.verify_train import references as one_process

    overrides = TRAIN_LAYOUTS[name]
    # the reference sees only the model/data overrides (one process, fp32 and fp64, one GPU)
    key = tuple(o for o in overrides if o.startswith("train."))
    if key not in references:
        references[key] = one_process(gpu_pools(1), demo_config, list(key), STEPS, "cuda")
    layout = gpu_pools(2).run(train_case, demo_config, overrides, STEPS, False, "cuda", precision)
    tol = VERIFY_TRAIN_TOL[precision]
    ref32, ref64 = references[key]
    report = compare(layout, ref32, tol, per_module=precision == "bf16", fp64=ref64)
    _result(check="verify-train", layout=name, precision=precision, tol=tol,
            **{k: v for k, v in report.items() if k.startswith("max_") or k in ("ok", "worst", "losses", "reference_losses")})
    assert report["ok"], report


# ---- DeepEP (issue 22): the deepep dispatcher against alltoall, two GPUs over NCCL -------------
needs_deep_ep = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                                   reason="the deepep dispatcher needs the deep_ep package (DeepEP), not installed here")


def deepep_gpu_case(seed: int) -> dict:
    """Each rank routes its own ragged tokens (bf16 rows, top-2 of 8 experts, some padding)
    through ``deepep`` and ``alltoall`` over the world's ranks; outputs, the tokens', gates' and
    expert weights' gradients, and bytes (audited) per dispatcher."""
    import torch.distributed as dist

    from mimo.llm.dispatch import AllToAllDispatcher, DeepEPDispatcher
    from mimo.llm.router import Routing
    from mimo.parallel import gemm

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    experts, k, d, t = 8, 2, 512, 700 + 173 * rank
    gen = torch.Generator().manual_seed(seed + rank)
    idx = torch.rand(t, experts, generator=gen).topk(k, dim=-1).indices
    idx[-5:] = experts  # padding routes nowhere
    gate = torch.rand(t, k, generator=gen) + 0.1
    x0, g0 = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    w0 = torch.randn(experts // world, d, d, generator=gen) / d ** 0.5
    out = {}
    for kind, disp in (("deepep", DeepEPDispatcher(experts, dist.group.WORLD)), ("alltoall", AllToAllDispatcher(experts, dist.group.WORLD))):
        disp.audit = True
        x = x0.to(dev, torch.bfloat16).requires_grad_()
        gt = gate.to(dev).requires_grad_()
        w = w0.to(dev, torch.bfloat16).requires_grad_()
        dispatched = disp.dispatch(x, Routing(idx.to(dev), gt))
        y = disp.combine(torch.tanh(gemm.grouped_linear(dispatched.x_RD, w, dispatched.ends_L)), dispatched)
        (y.float() * g0.to(dev)).sum().backward()
        out[kind] = {"out": y.float().cpu(), "x": x.grad.float().cpu(), "gate": (gt.grad * (idx.to(dev) < experts)).cpu(),
                     "w": w.grad.float().cpu(), "fwd": disp.stats.forward_bytes, "bwd": disp.stats.backward_bytes,
                     "min": disp.stats.min_forward_bytes}
    return out


@needs_two_gpus
@needs_deep_ep
def test_deepep_equals_alltoall_over_nccl(gpu_pools):
    from mimo.core.testing import rel_err

    for rank, r in enumerate(gpu_pools(2).run(deepep_gpu_case, 7)):
        errs = {key: rel_err(r["deepep"][key], r["alltoall"][key]) for key in ("out", "x", "gate", "w")}
        _result(check="deepep vs alltoall", rank=rank, **errs, bytes=r["deepep"]["fwd"], min_bytes=r["deepep"]["min"])
        assert max(errs.values()) <= 1e-2, errs  # bf16 rows; the same sums in another order
        assert (r["deepep"]["fwd"], r["deepep"]["bwd"]) == (r["alltoall"]["fwd"], r["alltoall"]["bwd"])

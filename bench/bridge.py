"""Bridge throughput against a raw ``all_to_all_single`` moving the same bytes on the same ranks.

For each case the bridge runs forward + backward on a realistic microbatch (LLaVA-like: 576
image rows per image, ragged text), and the anchor is one ``all_to_all_single`` per direction
whose per-peer split sizes equal the bytes the bridge sends between each pair of ranks (so
only the execution differs: packing, plan, point-to-point and the finishing all-gather).

Each iteration is timed alone (device synchronised before and after, on every rank of the
bridge) and the report keeps the median; a case's time is its slowest rank's. Two bridge
times: ``bridge`` builds the plans inside the timed step, as training does (one Bridge per
microbatch), ``executor`` reuses a built Bridge (the transfer alone). Prints one JSON line:
per case the times, ``ratio`` = raw / bridge and ``ratio_executor`` = raw / executor
(1.0 = as fast as the raw collective), and GB/s of the bytes crossing between ranks.

    python bench/bridge.py [--backend gloo|nccl] [--hidden H] [--samples N] [--dtype fp32|bf16] [--iters 20]

``--backend nccl`` runs one process per GPU (``cpu:gloo,cuda:nccl``); cases needing more
ranks than there are GPUs are listed under ``not_run``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch
import torch.distributed as dist

from mimo.bridges.executor import Bridge
from mimo.bridges.verify import DTYPES, Sample, local_view, parse_layout, placements, resolve
from mimo.parallel.grid import ParallelGrid
from mimo.training.launch import WorkerPool
from mimo.core.testing import rank_device

CASES = [  # (world, src, dst, colocated)
    (2, "tp=1,dp=2", "tp=2,dp=1", True),
    (2, "tp=2,dp=1", "tp=1,dp=2,shard=seq", True),
    (2, "tp=1", "tp=1", False),
    (4, "tp=1,dp=4", "tp=2,dp=2", True),
    (4, "tp=2,dp=2", "tp=1,dp=4,shard=seq", True),
    (6, "tp=1,dp=2", "tp=2,dp=2", False),
    (8, "tp=1,dp=4", "tp=2,dp=2", False),
]


def _samples(seed: int, n: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        before, after = rng.randint(8, 64), rng.randint(32, 1024)
        out.append(Sample(before + 576 + after, tuple(range(before, before + 576))))
    return out


def _timed(fn, iters: int, device: torch.device, group) -> float:
    """Median seconds of ``iters`` calls, each between a device sync and a barrier."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bench_case(src_text, dst_text, colocated, hidden, samples, dtype, iters, device_kind):
    rank = dist.get_rank()
    device, dt = rank_device(device_kind), DTYPES[dtype]
    src, dst = parse_layout(src_text), parse_layout(dst_text)
    sg, dg = resolve(src, dst, dist.get_world_size(), colocated)
    s_tp, d_tp = sg.group("tp"), dg.group("tp")
    members = sorted(set(sg.ranks) | set(dg.ranks))
    group = ParallelGrid({"b": len(members)}, members[0]).group("b")
    src_pl, dst_pl = placements(src, dst, sg, dg, _samples(0, samples), hidden)
    if rank not in members:
        return None
    X = torch.randn(src_pl.rows, hidden, generator=torch.Generator().manual_seed(0)).to(dt)
    G = torch.randn(src_pl.rows, hidden, generator=torch.Generator().manual_seed(1)).to(dt)
    x_local = local_view(X, src_pl, rank).to(device) if rank in src_pl.local_rows else None
    g_local = local_view(G, dst_pl, rank).to(device) if rank in dst_pl.local_rows else None

    def make_bridge():
        return Bridge(src_pl, dst_pl, group, s_tp if rank in sg else None, d_tp if rank in dg else None)

    def run(bridge):
        x = x_local.clone().requires_grad_() if x_local is not None else None
        y = bridge(x, dtype=dt, device=device)
        if bridge.is_dst:
            y.backward(g_local)
        else:
            Bridge.backward_source(y)

    built = make_bridge()
    # the anchor: the same per-pair element counts, in one all_to_all_single per direction
    def splits(plan):
        out = [sum(m.numel for m in plan.moves if m.src == rank and m.dst == peer != rank) for peer in members]
        inn = [sum(m.numel for m in plan.moves if m.dst == rank and m.src == peer != rank) for peer in members]
        return out, inn

    bufs = []
    for plan in (built.fwd.plan, built.bwd.plan):
        o, i = splits(plan)
        bufs.append((torch.randn(sum(o), device=device).to(dt), torch.empty(sum(i), device=device, dtype=dt), o, i))

    def raw():
        for send, recv, o, i in bufs:
            dist.all_to_all_single(recv, send, i, o, group=group)

    steps = {"bridge": lambda: run(make_bridge()), "executor": lambda: run(built), "raw": raw, "plan": make_bridge}
    for fn in steps.values():  # warm-up (NCCL channels, allocator)
        fn()
        fn()
    times = {name: _timed(fn, iters, device, group) for name, fn in steps.items()}
    itemsize = torch.tensor([], dtype=dt).element_size()
    return {**{f"{k}_s": v for k, v in times.items()},
            "bytes_sent": (built.fwd.sent_numel + built.bwd.sent_numel) * itemsize,
            "allgather_bytes": sum(g.received_numel for g in (built.fwd.gather, built.bwd.gather) if g) * itemsize}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo: CPU processes; nccl: one process per GPU")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=8, help="samples per microbatch (576 image rows each)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-world", type=int, help="run only cases of at most this many ranks")
    args = ap.parse_args()
    device = "cuda" if args.backend == "nccl" else "cpu"
    limit = args.max_world or (torch.cuda.device_count() if device == "cuda" else max(w for w, *_ in CASES))
    results, not_run = [], []
    for world, src, dst, colocated in CASES:
        name = {"world": world, "src": src, "dst": dst, "colocated": colocated}
        if world > limit:
            not_run.append(name)
            continue
        with WorkerPool(world, timeout_s=600, device=device) as pool:
            per_rank = [r for r in pool.run(_bench_case, src, dst, colocated, args.hidden, args.samples, args.dtype, args.iters, device) if r]
        t = {k: max(r[f"{k}_s"] for r in per_rank) for k in ("bridge", "executor", "raw", "plan")}
        sent = sum(r["bytes_sent"] for r in per_rank)
        results.append({
            **name,
            "bridge_ms": round(t["bridge"] * 1e3, 3), "executor_ms": round(t["executor"] * 1e3, 3),
            "raw_all_to_all_ms": round(t["raw"] * 1e3, 3), "plan_ms": round(t["plan"] * 1e3, 3),
            "ratio": round(t["raw"] / t["bridge"], 3), "ratio_executor": round(t["raw"] / t["executor"], 3),
            "bytes_sent": sent, "allgather_bytes": sum(r["allgather_bytes"] for r in per_rank),
            "bridge_GBps": round(sent / t["bridge"] / 1e9, 2), "executor_GBps": round(sent / t["executor"] / 1e9, 2),
            "raw_GBps": round(sent / t["raw"] / 1e9, 2),
        })
    if not results:
        raise SystemExit(f"no case fits {limit} ranks")
    print(json.dumps({
        "bench": "bridge", "backend": args.backend, "hidden": args.hidden, "samples": args.samples, "dtype": args.dtype,
        "iters": args.iters, "torch": torch.__version__, "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "cases": results, "not_run": not_run,
        "min_ratio": min(r["ratio"] for r in results), "min_ratio_executor": min(r["ratio_executor"] for r in results),
    }))


if __name__ == "__main__":
    main()

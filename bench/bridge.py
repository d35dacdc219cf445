"""Bridge throughput against a raw ``all_to_all_single`` moving the same bytes on the same ranks.

For each case the bridge runs forward + backward on a realistic microbatch (LLaVA-like: 576
image rows per image, ragged text), and the anchor is one ``all_to_all_single`` per direction
whose per-peer split sizes equal the bytes the bridge sends between each pair of ranks (so
only the execution differs: packing, plan, point-to-point and the finishing all-gather).
Prints one JSON line: per case the bridge and raw times and ``ratio`` = raw time / bridge time
(1.0 = as fast as the raw collective).

    python bench/bridge.py [--backend gloo|nccl] [--hidden 1024] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch
import torch.distributed as dist

from mimo.bridges.executor import Bridge
from mimo.bridges.verify import local_view, parse_layout, placements, resolve
from mimo.grid import ParallelGrid
from mimo.launch import WorkerPool

CASES = [  # (world, src, dst, colocated)
    (4, "tp=1,dp=4", "tp=2,dp=2", True),
    (4, "tp=2,dp=2", "tp=1,dp=4,shard=seq", True),
    (6, "tp=1,dp=2", "tp=2,dp=2", False),
]


def _samples(seed: int, n: int):
    from mimo.bridges.verify import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        before, after = rng.randint(8, 64), rng.randint(32, 1024)
        out.append(Sample(before + 576 + after, tuple(range(before, before + 576))))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_case(src_text, dst_text, colocated, hidden, iters, backend_device):
    rank = dist.get_rank()
    device = torch.device(backend_device if backend_device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    src, dst = parse_layout(src_text), parse_layout(dst_text)
    sg, dg = resolve(src, dst, dist.get_world_size(), colocated)
    s_tp, d_tp = sg.group("tp"), dg.group("tp")
    members = sorted(set(sg.ranks) | set(dg.ranks))
    group = ParallelGrid({"b": len(members)}, members[0]).group("b")
    samples = _samples(0, 8)
    src_pl, dst_pl = placements(src, dst, sg, dg, samples, hidden)
    if rank not in members:
        return None
    dist.barrier(group=group)
    X = torch.randn(src_pl.rows, hidden, generator=torch.Generator().manual_seed(0))
    G = torch.randn(src_pl.rows, hidden, generator=torch.Generator().manual_seed(1))
    x_local = local_view(X, src_pl, rank).to(device) if rank in src_pl.local_rows else None
    g_local = local_view(G, dst_pl, rank).to(device) if rank in dst_pl.local_rows else None

    def bridge_step():
        bridge = Bridge(src_pl, dst_pl, group, s_tp if rank in sg else None, d_tp if rank in dg else None)
        x = x_local.clone().requires_grad_() if x_local is not None else None
        y = bridge(x, device=device)
        if bridge.is_dst:
            y.backward(g_local)
        else:
            Bridge.backward_source(y)
        return bridge

    # the anchor: the same per-pair element counts, in one all_to_all_single per direction
    b = bridge_step()
    g_ranks = members
    def splits(plan, me):
        out = [sum(m.numel for m in plan.moves if m.src == me and m.dst == peer and peer != me) for peer in g_ranks]
        inn = [sum(m.numel for m in plan.moves if m.dst == me and m.src == peer and peer != me) for peer in g_ranks]
        return out, inn

    f_out, f_in = splits(b.fwd.plan, rank)
    b_out, b_in = splits(b.bwd.plan, rank)
    bufs = [(torch.randn(sum(o), device=device), torch.empty(sum(i), device=device), o, i) for o, i in ((f_out, f_in), (b_out, b_in))]

    def raw_step():
        for send, recv, o, i in bufs:
            dist.all_to_all_single(recv, send, i, o, group=group)

    for fn in (bridge_step, raw_step):  # warm-up
        fn()
    times = {}
    for name, fn in (("bridge", bridge_step), ("raw", raw_step)):
        _sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        times[name] = (time.perf_counter() - t0) / iters
    sent = (b.stats.fwd_sent + b.stats.bwd_sent) * 4
    return {"bridge_s": times["bridge"], "raw_s": times["raw"], "bytes_sent": sent, "allgather_bytes": (b.stats.fwd_allgather + b.stats.bwd_allgather) * 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", choices=("gloo",), default="gloo", help="gloo on CPU (NCCL needs several GPUs)")
    args = ap.parse_args()
    results = []
    for world, src, dst, colocated in CASES:
        with WorkerPool(world, timeout_s=600) as pool:
            per_rank = [r for r in pool.run(_bench_case, src, dst, colocated, args.hidden, args.iters, "cpu") if r]
        bridge_s = max(r["bridge_s"] for r in per_rank)
        raw_s = max(r["raw_s"] for r in per_rank)
        results.append({
            "world": world, "src": src, "dst": dst, "colocated": colocated,
            "bridge_ms": round(bridge_s * 1e3, 3), "raw_all_to_all_ms": round(raw_s * 1e3, 3),
            "ratio": round(raw_s / bridge_s, 3),
            "bytes_sent": sum(r["bytes_sent"] for r in per_rank),
            "allgather_bytes": sum(r["allgather_bytes"] for r in per_rank),
        })
    print(json.dumps({
        "bench": "bridge", "backend": args.backend, "hidden": args.hidden, "iters": args.iters,
        "torch": torch.__version__, "host": platform.node(), "cases": results,
        "min_ratio": min(r["ratio"] for r in results),
    }))


if __name__ == "__main__":
    main()

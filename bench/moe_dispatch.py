"""MoE all-to-all dispatch + combine against a raw ``all_to_all_single`` of the same bytes.

Every EP rank routes its own (ragged) tokens to ``--topk`` of ``--experts`` experts with a
skewed router (expert ``e`` favoured by ``skew * e / E``), runs ``AllToAllDispatcher.dispatch``
and ``combine`` around identity experts, forward (``dispatch_combine``) and forward + backward
(``fwd_bwd``). The anchor (``raw``) is two ``all_to_all_single`` calls (there and back) whose
per-peer split sizes equal the dispatcher's rows, so only the counts exchange, the host copy,
the metadata and the permutation differ. Each iteration is timed alone (barrier before) and
the median kept; a time is its slowest rank's.

Bytes: ``bytes_sent`` is what the forward's row all-to-alls sent to other ranks over all
ranks, ``bytes_min`` the independently computed minimum (distinct (token, remote rank) pairs x
D x element size, there and back), ``bytes_ratio`` their quotient (1.0: every token reaches
each destination rank once); ``meta_bytes``: the expert ids and gates beside the rows. Token
load: rows each rank's experts process (max and mean over ranks) and tokens sent per rank.

    python bench/moe_dispatch.py [--world 4] [--tokens 2048] [--hidden 512] [--experts 16] [--topk 4] [--iters 10]
                                 [--dispatcher alltoall|deepep] [--device cpu|cuda]

Prints one JSON line. gloo on the CPU; ``--device cuda``: one rank per GPU over NCCL, bf16
rows (``--dispatcher deepep`` needs it, and the deep_ep package).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.distributed as dist

from mimo.llm.dispatch import AllToAllDispatcher, DeepEPDispatcher, min_forward_bytes
from mimo.llm.router import Routing, topk_lowest_index
from mimo.training.launch import WorkerPool


def _timed(fn, iters: int, sync) -> float:
    times = []
    for _ in range(iters):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _splits(idx_TK: torch.Tensor, experts: int, world: int) -> tuple[list[int], list[int]]:
    """Rows to and from each peer when each (token, rank) pair travels once (host arithmetic)."""
    loc = experts // world
    send = [0] * world
    for row in idx_TK.tolist():
        for p in {e // loc for e in row if e < experts}:
            send[p] += 1
    got = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(got, torch.tensor(send, dtype=torch.int64))
    return send, got.tolist()


def _routing(t: int, experts: int, topk: int, skew: float, gen: torch.Generator) -> Routing:
    logits = torch.randn(t, experts, generator=gen) + skew * torch.arange(experts) / experts
    gate, idx = topk_lowest_index(torch.softmax(logits, -1), topk)
    return Routing(idx, gate / gate.sum(-1, keepdim=True))


def _bench_rank(tokens: int, hidden: int, experts: int, topk: int, skew: float, iters: int, kind: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    dev, dtype = (torch.device("cuda", torch.cuda.current_device()), torch.bfloat16) if cuda else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(rank)
    t = tokens * (4 + rank % 3) // 5  # ragged: 0.8, 1.0, 1.2 x tokens
    cpu_routing = _routing(t, experts, topk, skew, gen)
    routing = Routing(cpu_routing.idx_TK.to(dev), cpu_routing.gate_TK.to(dev))
    x_TD = torch.randn(t, hidden, generator=gen).to(dev, dtype)
    g_TD = torch.randn(t, hidden, generator=gen).to(dev, dtype)
    disp = (DeepEPDispatcher if kind == "deepep" else AllToAllDispatcher)(experts, dist.group.WORLD)
    disp.audit = True  # bytes and their minimum (reads the routing on the host: outside the timed calls)

    def forward(x):
        d = disp.dispatch(x, routing)
        return disp.combine(d.x_RD, d), d

    def fwd_bwd():
        x = x_TD.clone().requires_grad_()
        y, _ = forward(x)
        (y * g_TD).sum().backward()

    disp.stats.reset()
    _, d = forward(x_TD)
    sent, meta, minimum = disp.stats.payload_bytes, disp.stats.meta_bytes, disp.stats.min_forward_bytes
    disp.audit = False
    send, recv = _splits(cpu_routing.idx_TK, experts, world)
    bufs = (torch.randn(sum(send), hidden).to(dev, dtype), torch.empty(sum(recv), hidden, device=dev, dtype=dtype))

    def raw():
        dist.all_to_all_single(bufs[1], bufs[0], recv, send)  # there ...
        dist.all_to_all_single(bufs[0], bufs[1], send, recv)  # ... and back

    steps = {"dispatch_combine": lambda: forward(x_TD), "fwd_bwd": fwd_bwd, "raw": raw}
    for fn in steps.values():  # warm-up
        fn()
    times = {k: _timed(fn, iters, sync) for k, fn in steps.items()}
    assert minimum == min_forward_bytes(cpu_routing.idx_TK, experts, world, rank, 1, hidden * x_TD.element_size())
    return {**times, "bytes_sent": sent, "meta_bytes": meta, "tokens": t, "expert_rows": d.x_RD.shape[0],
            "rows_sent": sum(n for p, n in enumerate(send) if p != rank), "bytes_min": minimum}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="mean tokens per rank (ragged 0.8x .. 1.2x)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--skew", type=float, default=2.0, help="router bias towards high expert ids")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dispatcher", choices=("alltoall", "deepep"), default="alltoall")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one rank per GPU, NCCL, bf16 rows")
    args = ap.parse_args()
    with WorkerPool(args.world, timeout_s=600, device=args.device) as pool:
        per_rank = pool.run(_bench_rank, args.tokens, args.hidden, args.experts, args.topk, args.skew, args.iters,
                            args.dispatcher)
    t = {k: max(r[k] for r in per_rank) for k in ("dispatch_combine", "fwd_bwd", "raw")}
    sent, minimum = sum(r["bytes_sent"] for r in per_rank), sum(r["bytes_min"] for r in per_rank)
    rows = [r["expert_rows"] for r in per_rank]
    print(json.dumps({
        "bench": "moe_dispatch", "dispatcher": args.dispatcher, "backend": "nccl" if args.device == "cuda" else "gloo",
        "world": args.world, "hidden": args.hidden, "experts": args.experts,
        "topk": args.topk, "skew": args.skew, "iters": args.iters, "torch": torch.__version__, "host": platform.node(),
        "tokens_per_rank": [r["tokens"] for r in per_rank],
        "dispatch_combine_ms": round(t["dispatch_combine"] * 1e3, 3), "fwd_bwd_ms": round(t["fwd_bwd"] * 1e3, 3),
        "raw_all_to_all_ms": round(t["raw"] * 1e3, 3), "ratio": round(t["raw"] / t["dispatch_combine"], 3),
        "bytes_sent": sent, "bytes_min": minimum, "bytes_ratio": sent / minimum if minimum else 1.0,
        "meta_bytes": sum(r["meta_bytes"] for r in per_rank),
        "expert_rows_max": max(rows), "expert_rows_mean": statistics.mean(rows),
        "expert_rows_max_over_mean": round(max(rows) / statistics.mean(rows), 3),
        "rows_sent_max": max(r["rows_sent"] for r in per_rank),
        "rows_sent_mean": statistics.mean(r["rows_sent"] for r in per_rank),
        "dispatch_combine_GBps": round(sent / t["dispatch_combine"] / 1e9, 3), "raw_GBps": round(sent / t["raw"] / 1e9, 3),
    }))


if __name__ == "__main__":
    main()

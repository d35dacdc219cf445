"""Activation memory per rank under context parallelism: one long sample through an LLM stage.

One sample of ``--tokens`` tokens (default 32768) runs forward and backward through a hybrid
LLM stage with every sequence-mixing kind (``--pattern``, default ``M*G-E*``: Mamba-2,
attention, Gated DeltaNet, MLP, MoE, attention) at each ``--cp`` (default 1, 2, 4), one gloo
process per CP rank, fp32 on the CPU. Per rank it reports:

* ``saved_mib``: the bytes the forward keeps for backward (every tensor autograd saves, each
  storage counted once: what activation memory is);
* ``alloc_peak_mib``: the peak of live tensor bytes during forward + backward above what was
  live before, from the CPU allocator's statistics (``torch.profiler`` memory events, summed
  allocations minus frees in order);
* ``step_s``: forward + backward time of the slowest rank.

The anchor is cp 1 (the same sample on one process); ``ratio`` = cp-1 bytes / cp-n bytes.

    python bench/cp_memory.py [--tokens 32768] [--cp 1 2 4] [--hidden 128] [--pattern M*G-E*]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.distributed as dist

from mimo.data.pack import PackItem, cp_share, pack
from mimo.llm.config import HybridArch, MoEArch
from mimo.llm.model import LLMStage
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import GroupRegistry, ParallelGrid
from mimo.training.launch import WorkerPool


def _arch(hidden: int, pattern: str) -> HybridArch:
    return HybridArch(pattern=pattern, hidden=hidden, heads=4, kv_heads=2, vocab=256, ffn=2 * hidden,
                      max_seq_len=1 << 20, mamba_heads=4, mamba_head_dim=hidden // 4, mamba_state=16,
                      mamba_chunk=128, gdn_heads=2, gdn_v_heads=4, gdn_head_dim=hidden // 8,
                      gdn_v_head_dim=hidden // 8, gdn_chunk=64,
                      moe=MoEArch(experts=4, topk=2, ffn=hidden, shared_ffn=hidden) if "E" in pattern else None)


def _saved_bytes():
    """A saved-tensors hook pair counting each saved storage once, and the counter."""
    seen: dict[int, int] = {}

    def pack_hook(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    return pack_hook, seen


def _alloc_peak(prof) -> int:
    """Peak of live CPU bytes over the profiled region, from its allocator events."""
    # an op's memory counts its children's too: each event's own share (its allocations and
    # frees outside any child op), in time order
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _rank(tokens: int, hidden: int, pattern: str) -> dict:
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    registry = GroupRegistry()
    ctx = ParallelContext(ParallelGrid({"tp": 1, "cp": cp, "dp": 1, "pp": 1}, registry=registry), rank, registry)
    stage = LLMStage(_arch(hidden, pattern), ctx)
    stage.init_weights(1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (tokens,), generator=g).tolist()
    whole = pack([PackItem(0, ids, [True] * tokens, {})], {}, 1, cp, False, 0)
    batch = cp_share(whole, rank) if cp > 1 else whole
    hook, seen = _saved_bytes()
    dist.barrier()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
            logits = stage(batch, loss_norm=float(tokens))
        loss = stage.loss(logits, batch, float(tokens))
        saved = sum(seen.values())
        loss.backward()
    step = time.perf_counter() - t0
    return {"saved": saved, "peak": _alloc_peak(prof), "step_s": step, "local_tokens": batch.num_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--pattern", default="M*G-E*")
    args = ap.parse_args()
    rows = {}
    for cp in args.cp:
        with WorkerPool(cp, timeout_s=3600) as pool:
            per_rank = pool.run(_rank, args.tokens, args.hidden, args.pattern)
        rows[cp] = {"saved_mib": [round(r["saved"] / 2**20, 1) for r in per_rank],
                    "alloc_peak_mib": [round(r["peak"] / 2**20, 1) for r in per_rank],
                    "local_tokens": [r["local_tokens"] for r in per_rank],
                    "step_s": round(max(r["step_s"] for r in per_rank), 2)}
    base = rows.get(1)
    for cp, row in rows.items():
        if base is not None:
            row["saved_ratio"] = round(base["saved_mib"][0] / max(row["saved_mib"]), 3)
            row["peak_ratio"] = round(base["alloc_peak_mib"][0] / max(row["alloc_peak_mib"]), 3)
    print(json.dumps({"bench": "cp_memory", "tokens": args.tokens, "pattern": args.pattern, "hidden": args.hidden,
                      "torch": torch.__version__, "host": platform.node(), "by_cp": rows}))


if __name__ == "__main__":
    main()

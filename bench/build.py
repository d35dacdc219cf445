"""Building an LLM at tensor parallel 1, 2, 4, 8 on local gloo processes: time and memory per rank.

Each rank builds its shard of the config's LLM (default: configs/llava-1.3b.yaml's, 1.3 B
parameters) and initialises it layout-independently (drawing only its shards), the way
``mimo train`` does. Reported per tp: the slowest rank's build seconds, its peak resident
memory, its parameter bytes, and the bound ``1.5 x parameter bytes + 1 GiB``. The resident
memory of the process before the build (torch imported) is reported beside it. Prints one
JSON line.

    python bench/build.py [--config configs/llava-1.3b.yaml] [--tps 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

GiB = 1 << 30


def _rss_bytes(kind: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    return 0


def build_case(config_path: str, tp: int) -> dict:
    import torch
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.llm.model import build_stage
    from mimo.parallel import param_seed
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import GroupRegistry, ParallelGrid

    config = load_config(config_path)
    registry = GroupRegistry()
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": 1, "pp": 1}, registry=registry)
    ctx = ParallelContext(grid, dist.get_rank(), registry, sequence_parallel=tp > 1)
    before = _rss_bytes("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    stage = build_stage(config.llm.arch, ctx)
    stage.init_weights(param_seed(config.train.seed, config.llm_name))
    seconds = time.perf_counter() - start
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    return {"seconds": seconds, "peak_rss": _rss_bytes("VmHWM"), "rss_before": before, "param_bytes": param_bytes,
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    from mimo.training.launch import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "llava-1.3b.yaml"))
    ap.add_argument("--tps", default="1,2,4,8")
    args = ap.parse_args()
    out = {"bench": "build", "config": os.path.basename(args.config), "tp": {}}
    for tp in [int(x) for x in args.tps.split(",")]:
        with WorkerPool(tp, timeout_s=1800.0) as pool:
            ranks = pool.run(build_case, args.config, tp)
        worst = max(ranks, key=lambda r: r["peak_rss"])
        bound = 1.5 * worst["param_bytes"] + GiB
        out["tp"][str(tp)] = {
            "build_s": round(max(r["seconds"] for r in ranks), 2),
            "peak_rss_gib": round(worst["peak_rss"] / GiB, 3),
            "rss_before_gib": round(worst["rss_before"] / GiB, 3),
            "param_gib": round(worst["param_bytes"] / GiB, 3),
            "bound_gib": round(bound / GiB, 3),
            "within_bound": worst["peak_rss"] <= bound,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

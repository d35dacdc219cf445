"""Per-rank host time per microbatch to plan one encoder bridge, by world size: the sample
arrays, the DP blocks and the bridge's placements and plans, as every rank computes them.

LLaVA-like microbatches: 16 samples per LLM DP rank, each one image of 576 rows and 400 text
tokens (the image at a random offset in the text); the LLM at tp 8 x dp world/8, the vision
encoder at dp = world (colocated), so a global microbatch holds 2 x world samples (2048 at world
1024). The samples come from a ``DataPlan`` over an index of such entries. One rank's work is
computed without processes, as the data pipeline (``mimo.data.pipeline.DataPipeline._prepare``)
and ``mimo.training.schedule_run.encode_and_bridge`` do it per microbatch:

* ``arrays_ms``: ``DataPlan.microbatch_arrays`` (the microbatch's end in the stream, its
  entries' tokens and image starts gathered from the index's columns); median over
  ``--repeats`` successive microbatches.
* ``blocks_ms``: the pipeline's two ``dp_blocks`` (the LLM's, by tokens; the encoder's, by image
  rows) from those arrays; median of ``--repeats``.
* ``new_ms``: ``image_bridge_plans`` (runs of rows, ``dp_runs``, ``packed_runs``, ``rank_plans``
  for this rank, both directions) and the ``Bridge`` built from them; median of ``--repeats``,
  the slowest of ranks 0, world/2+3 and world-1.
* ``total_ms`` = arrays + blocks + new: the whole per-microbatch planning of one rank;
  ``flat_ratio``: total at the largest world / total at the smallest (1 = flat).
* ``old_ms`` (the anchor, the code path before issue 27): ``dp_placement`` and ``packed_placement``
  over every row, ``make_plan`` both ways over the whole world, the rank's moves filtered out
  (what the executor did); rank 0, once (it takes seconds at large worlds). ``ratio`` = old / new;
  ``same_moves`` and ``same_blocks`` check the new path against the old one and the blocks
  against ``dp_blocks_reference``.

Every timing runs with the garbage collector off (as ``timeit`` does).

``--ragged``: text lengths drawn from 200..600 tokens (mean 400) instead of 400 each, so that
the DP blocks by tokens are uneven (the general block search, not the even split).

    python bench/plan_scale.py [--worlds 8,64,512,1024] [--old-max-world 1024] [--repeats 21] [--ragged]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time

import numpy as np
import torch

from mimo.bridges.executor import Bridge
from mimo.bridges.plan_reference import make_plan
from mimo.data.index import Entry, Index
from mimo.data.plan import DataPlan
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import dp_blocks
from mimo.parallel.layout_reference import dp_blocks_reference, dp_placement, packed_placement
from mimo.data.pipeline import microbatch_bridge_plans as image_bridge_plans

ROWS, TEXT, PER_DP, LLM_TP, HIDDEN, PLACEHOLDER = 576, 400, 16, 8, 2048, "<image>"


def data_plan(samples: int, microbatches: int, seed: int = 0, ragged: bool = False) -> DataPlan:
    """A plan whose microbatches hold ``samples`` samples (on average, ``ragged``), over an
    index of ``microbatches`` of them (one epoch: its shuffle, once per epoch, is not
    per-microbatch work)."""
    rng = random.Random(seed)
    text = [rng.randint(TEXT // 2, 3 * TEXT // 2) if ragged else TEXT for _ in range(microbatches * samples)]
    entries = [Entry(0, str(i), {}, ROWS + t, 1, {PLACEHOLDER: [rng.randint(0, t)]}) for i, t in enumerate(text)]
    return DataPlan(Index([], entries, ""), samples * (ROWS + TEXT), ROWS + max(text), seed)


def blocks(arrays, llm: ParallelGrid, vision: ParallelGrid):
    """The pipeline's DP blocks of a microbatch (``llm_blocks``, ``encoder_blocks``)."""
    return dp_blocks(arrays.tokens_N, llm.shape["dp"]), dp_blocks(arrays.images_for(PLACEHOLDER) * ROWS, vision.shape["dp"])


def microbatch(world: int, repeats: int, ragged: bool):
    """((arrays, LLM grid, vision grid, LLM blocks, vision blocks), planned samples, arrays
    seconds, blocks seconds)."""
    llm = ParallelGrid({"tp": LLM_TP, "cp": 1, "dp": world // LLM_TP, "pp": 1})
    vision = ParallelGrid({"tp": 1, "dp": world})
    plan = data_plan(PER_DP * llm.shape["dp"], repeats + 4, ragged=ragged)  # its windows stay in one epoch
    arrays = plan.microbatch_arrays(0)
    later = iter(range(1, repeats + 1))  # each call plans a microbatch not planned before
    arrays_s = timed(lambda: plan.microbatch_arrays(next(later)), repeats)
    blocks_s = timed(lambda: blocks(arrays, llm, vision), repeats)
    return (arrays, llm, vision, *blocks(arrays, llm, vision)), plan.microbatch(0), arrays_s, blocks_s


def new_path(arrays, llm, vision, llm_blocks, vision_blocks, rank: int) -> Bridge:
    src, dst, plans = image_bridge_plans(arrays, PLACEHOLDER, ROWS, HIDDEN, vision, vision_blocks, llm,
                                         llm_blocks, False, rank)
    return Bridge(src, dst, None, needs_grad=True, rank=rank, plans=plans)


def old_path(samples, llm, vision, llm_blocks, vision_blocks, rank: int):
    rows = [s.images_for(PLACEHOLDER) * ROWS for s in samples]
    src = dp_placement(vision, rows, vision_blocks, HIDDEN)
    dst, _ = packed_placement(llm, [(s.tokens, s.positions(PLACEHOLDER, ROWS)) for s in samples], llm_blocks, HIDDEN)
    plans = make_plan(src, dst), make_plan(dst, src)
    return [[m for m in p.moves if rank in (m.src, m.dst)] for p in plans]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls, the garbage collector off (as ``timeit`` does)."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times)


def case(world: int, repeats: int, old: bool, ragged: bool) -> dict:
    mb, samples, arrays_s, blocks_s = microbatch(world, repeats, ragged)
    ranks = sorted({0, min(world // 2 + 3, world - 1), world - 1})
    new_s = {r: timed(lambda: new_path(*mb, r), repeats) for r in ranks}
    bridge = new_path(*mb, 0)
    total_s = arrays_s + blocks_s + max(new_s.values())
    out = {"world": world, "llm": f"tp={LLM_TP},dp={world // LLM_TP}", "vision": f"dp={world}",
           "samples": len(samples), "rows": len(samples) * ROWS, "arrays_ms": round(arrays_s * 1e3, 3),
           "blocks_ms": round(blocks_s * 1e3, 3), "new_ms": round(max(new_s.values()) * 1e3, 3),
           "total_ms": round(total_s * 1e3, 3), "new_ms_by_rank": {r: round(t * 1e3, 3) for r, t in new_s.items()},
           "rank0_moves": len(bridge.fwd.plan.moves) + len(bridge.bwd.plan.moves)}
    if old:
        start = time.perf_counter()
        moves = old_path(samples, *mb[1:], 0)
        out["old_ms"] = round((time.perf_counter() - start) * 1e3, 1)
        out["ratio"] = round(out["old_ms"] / out["new_ms"], 1)
        out["same_moves"] = moves == [list(bridge.fwd.plan.moves), list(bridge.bwd.plan.moves)]
        out["same_blocks"] = (mb[3] == dp_blocks_reference([s.tokens for s in samples], mb[1].shape["dp"])
                              and mb[4] == dp_blocks_reference([s.images_for(PLACEHOLDER) * ROWS for s in samples], world))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="8,64,512,1024")
    ap.add_argument("--old-max-world", type=int, default=1024, help="skip the old path above this world")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--ragged", action="store_true", help="text lengths 200..600 (uneven token blocks)")
    args = ap.parse_args()
    cases = [case(w, args.repeats, w <= args.old_max_world, args.ragged) for w in map(int, args.worlds.split(","))]
    flat_ratio = round(cases[-1]["total_ms"] / cases[0]["total_ms"], 2)
    print(json.dumps({"bench": "plan_scale", "host": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__,
                      "numpy": np.__version__, "python": platform.python_version(), "rows_per_image": ROWS,
                      "text_tokens": f"{TEXT // 2}..{3 * TEXT // 2}" if args.ragged else TEXT, "samples_per_llm_dp": PER_DP, "llm_tp": LLM_TP, "hidden": HIDDEN,
                      "flat_ratio": flat_ratio, "cases": cases}))


if __name__ == "__main__":
    main()

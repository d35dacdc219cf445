"""Data pipeline throughput against reading the tars and decoding the images alone.

Ours: plan from the index, read each sample by seeking, parse, tokenize with the template,
decode its images (resized and cropped, as bytes), pack each LLM DP block (the reader ranks' work), with
``data.workers`` threads. Anchor: stream the same shards with the webdataset library and
decode the images, nothing else. Also the padding fraction of our packs against padded
batching of the same samples (batches of ``--batch`` samples padded to their longest).

    python bench/data.py CONFIG [--batches 32] [--batch 8]

Prints one JSON line; ``ratio`` = our samples/s / anchor samples/s.

``--route STEPS``: instead, the real data pipeline at the config's layout on ``world_size``
local gloo processes for STEPS training steps (reading, packing, pixel routing), reporting the
pixel bytes the ranks send each other per step (transfer plans and the encoders' TP
all-gathers, summed over ranks) and the pipeline's mean wait per step. Bytes are counted
around each pixel ``Bridge`` call, so the script measures older code the same way (run it with
an older checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import time

import torch


def anchor(pattern: str, limit: int) -> tuple[int, float]:
    import webdataset as wds

    from mimo.data.config import shard_paths

    t0, n = time.perf_counter(), 0
    ds = wds.WebDataset(shard_paths(pattern), shardshuffle=False).decode("pil")
    for sample in ds:
        for key in ("png", "jpg", "jpeg", "webp", "0.png", "1.png"):
            if key in sample:
                sample[key].convert("RGB")
        n += 1
        if n >= limit:
            break
    return n, time.perf_counter() - t0


def ours(config, batches: int):
    from mimo.data.pipeline import SampleReader
    from mimo.compose.inputs import data_plan, encoder_feeds, ensure_index, read_packs, text_spec

    index, _ = ensure_index(config)
    plan = data_plan(config, index)
    spec = text_spec(config)
    reader = SampleReader(index, spec, encoder_feeds(config))
    microbatches = [plan.microbatch(k) for k in range(batches)]  # planning is not timed
    samples = tokens = computed = 0
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(config.data.workers) as pool:
        for mb in microbatches:
            for got, batch in read_packs(reader, mb, config.llm.parallel, dict(spec.rows_per_image), pool.map):
                computed += batch.num_tokens
                tokens += sum(len(r.item.tokens) for r in got)
                samples += len(got)
    return samples, tokens, computed, time.perf_counter() - t0, microbatches


def padded_fraction(microbatches, batch: int) -> float:
    lens = [s.tokens for mb in microbatches for s in mb]
    real = padded = 0
    for i in range(0, len(lens), batch):
        chunk = lens[i : i + batch]
        real += sum(chunk)
        padded += max(chunk) * len(chunk)
    return 1 - real / padded


def route_rank(config_path: str, overrides: list[str], steps: int) -> dict:
    """One rank: the config's data pipeline over ``steps`` steps; pixel bytes it sent."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.inputs import data_plan, encoder_feeds, ensure_index, sample_reader, text_spec
    from mimo.data import pipeline as data_pipeline
    from mimo.parallel.grid import GroupRegistry

    sent = [0]

    class CountingBridge(data_pipeline.Bridge):
        def __call__(self, *args, **kwargs):
            y = super().__call__(*args, **kwargs)
            sent[0] += (self.stats.fwd_sent + self.stats.fwd_allgather) * y.element_size()
            return y

    data_pipeline.Bridge = CountingBridge
    config = load_config(config_path, overrides)
    index, _ = ensure_index(config)
    plan = data_plan(config, index)
    registry, par = GroupRegistry(), config.llm.parallel
    grids = {name: enc.parallel.grid(config.world_size, registry) for name, enc in config.encoders.items()}
    pipe = data_pipeline.DataPipeline(plan, text_spec(config), par.grid(config.world_size, registry), par.sequence_parallel and par.tp > 1,
                                      encoder_feeds(config, grids), config.train.micro_batches, config.data.workers,
                                      config.data.prefetch, dist.get_rank(), make_reader=lambda: sample_reader(config, plan))
    pipe.last_step = steps  # nothing prepared past the end (older code ignores it)
    waits, images = [], 0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        mbs = pipe.step(step)
        waits.append(time.perf_counter() - t0)
        images += sum(len(x) for mb in mbs for x in mb.pixels.values())
    pipe.close()
    return {"sent": sent[0], "wait_s": sum(waits[1:]) / max(len(waits) - 1, 1), "images": images}


def route(config_path: str, overrides: list[str], steps: int) -> dict:
    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index
    from mimo.training.launch import WorkerPool

    config = load_config(config_path, overrides)
    ensure_index(config)  # once, before the ranks read it
    with WorkerPool(config.world_size, timeout_s=1800) as pool:
        ranks = pool.run(route_rank, config_path, overrides, steps)
    sent = sum(r["sent"] for r in ranks)
    return {"bench": "data-route", "config": config_path, "world": config.world_size, "steps": steps,
            "pixel_bytes_per_step": round(sent / steps), "images_per_step": sum(r["images"] for r in ranks) / steps,
            "mean_wait_s_per_step": round(max(r["wait_s"] for r in ranks), 5), "host": platform.node()}


def main() -> None:
    from mimo.compose.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="samples per padded batch (anchor padding)")
    ap.add_argument("--route", type=int, metavar="STEPS", help="pixel bytes per step of the pipeline at the config's layout")
    args = ap.parse_args()
    if args.route:
        print(json.dumps(route(args.config, args.overrides, args.route)))
        return
    config = load_config(args.config, args.overrides)
    torch.set_num_threads(1)
    n, tok, computed, t_ours, mbs = ours(config, args.batches)
    n_anchor, t_anchor = anchor(config.data.shards, n)
    print(json.dumps({
        "bench": "data", "config": args.config, "workers": config.data.workers, "host": platform.node(),
        "samples": n, "samples_per_s": round(n / t_ours, 1), "tokens_per_s": round(tok / t_ours, 1),
        "anchor_samples_per_s": round(n_anchor / t_anchor, 1), "ratio": round((n / t_ours) / (n_anchor / t_anchor), 3),
        "padding_fraction": round(1 - tok / computed, 5), "padded_batching_fraction": round(padded_fraction(mbs, args.batch), 4),
    }))


if __name__ == "__main__":
    main()

"""Data pipeline throughput against reading the tars and decoding the images alone.

Ours: plan from the index, read each sample by seeking, parse, tokenize with the template,
decode and preprocess its images, pack each LLM DP block (the reader ranks' work), with
``data.workers`` threads. Anchor: stream the same shards with the webdataset library and
decode the images, nothing else. Also the padding fraction of our packs against padded
batching of the same samples (batches of ``--batch`` samples padded to their longest).

    python bench/data.py CONFIG [--batches 32] [--batch 8]

Prints one JSON line; ``ratio`` = our samples/s / anchor samples/s.
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


def main() -> None:
    from mimo.compose.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="samples per padded batch (anchor padding)")
    args = ap.parse_args()
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

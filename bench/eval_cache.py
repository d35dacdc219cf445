"""``mimo eval``'s greedy generation with the cache (``eval.cache``) against without it, in one run.

A config's model (default configs/llava-1.3b.yaml: CLIP ViT-L/14 and a 16-layer, 2048-wide
Llama-like LLM; ``--tiny``: configs/demo.yaml's hybrid Mamba-2 / attention model, a CPU smoke
run) at world 1 with random weights, on held-out demo samples (``mimo make-demo-data``'s shapes
at the tower's image size, written to a temporary folder). The evaluator's microbatches are read
once; then greedy generation of ``--max-new-tokens`` per sample (an untrained model seldom stops
early) runs on them without the cache (every step: encoders and the whole LLM on prompt +
generated tokens) and with it (one prefill, then one token per sample and step through the LLM
only), alternately, ``--repeats`` times each after a warm-up; the fastest run of each counts.
Only generation is timed (not the held-out loss forward, the same either way).

Reports generated tokens/s of each, ``speedup`` = cached / uncached tokens/s, and whether the
greedy tokens are equal (``tokens_equal``; ``samples_equal`` of ``samples_generated``). In fp32
(TF32 off) they must be; in bf16 the two paths round differently (flash attention over the whole
sequence against attention over the cache, a scan against steps), so a sample's greedy tokens may
part at a near-tie of an untrained model's logits. Prints one JSON line.

    python bench/eval_cache.py [--device cuda|cpu] [--config configs/llava-1.3b.yaml] [--samples 64]
        [--max-new-tokens 32] [--precision bf16|fp32] [--repeats 2] [--tiny] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_config(args, folder: Path) -> str:
    """The config at world 1 on demo shards and their tokenizer, evaluating ``args.samples``."""
    from mimo.data.demo import make_demo_data

    cfg = yaml.safe_load(Path(args.config).read_text())
    size = next(m["arch"]["image_size"] for m in cfg["modules"].values() if m["kind"] == "vit")
    make_demo_data(str(folder / "data"), train_samples=8, heldout_samples=args.samples, shard_size=max(args.samples, 8),
                   image_size=size, seed=0)
    cfg["world_size"] = 1
    for module in cfg["modules"].values():
        module.pop("parallel", None)  # one process: every module on rank 0
    data = cfg["data"]
    data.pop("synthetic", None)
    data.update(source="webdataset", shards=str(folder / "data" / "train-{000000..000000}.tar"),
                tokenizer=str(folder / "data" / "tokenizer"), template="chatml")
    cfg["train"].update(precision=args.precision, compile=False, checkpoint={"dir": str(folder / "ckpt")})
    cfg["eval"] = {"shards": str(folder / "data" / "heldout-{000000..000000}.tar"), "samples": args.samples,
                   "max_new_tokens": args.max_new_tokens}
    path = folder / "eval_cache.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def _bench_rank(config_path: str, overrides: list[str], req, device: str, repeats: int) -> dict:
    """The one rank: build, read the microbatches, generate without and with the cache."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.training.evaluation import Evaluator, _Scorer
    from mimo.training.launch import rank_compute_device

    config = load_config(config_path, overrides)
    if config.train.precision == "fp32":  # an fp32 comparison on the GPU: no TF32 (docs/design.md §3)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = rank_compute_device(device)
    model = MimoModel(config, dist.get_rank(), device=dev)
    evaluator = Evaluator(config, model, req)
    try:
        mbs = [evaluator.pipeline.microbatch(k) for k in range(len(evaluator.batches))]
        prompt_tokens = sum(mb.pack.num_tokens for mb in mbs)  # whole samples, answers included

        def generate(cached: bool, batches) -> tuple[float, _Scorer]:
            scorer = _Scorer(model, evaluator.pipeline, evaluator.runner, req, cached)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                for mb in batches:
                    scorer.generate(mb)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start, scorer

        for cached in (False, True):  # warm-up: kernels, allocator, the varlen / SDPA paths
            generate(cached, mbs[:1])
        best: dict[bool, tuple[float, _Scorer]] = {}
        for _ in range(repeats):
            for cached in (False, True):
                t, scorer = generate(cached, mbs)
                if cached not in best or t < best[cached][0]:
                    best[cached] = (t, scorer)
        return {"microbatches": len(mbs), "pack_tokens": prompt_tokens,
                **{cached: {"seconds": t, "generated": s.generated, "generated_tokens": s.counts["generated_tokens"]}
                   for cached, (t, s) in best.items()},
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}
    finally:
        evaluator.close()


def main() -> None:
    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index
    from mimo.training.evaluation import request_for
    from mimo.training.launch import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", default=str(ROOT / "configs" / "llava-1.3b.yaml"))
    ap.add_argument("--tiny", action="store_true", help="configs/demo.yaml, 8 samples, 4 new tokens (a CPU smoke run)")
    ap.add_argument("--samples", type=int, default=64, help="held-out samples (questions are generated, captions not)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--precision", choices=("bf16", "fp32"), help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="config key=value overrides (e.g. modules.language.arch.pattern=...)")
    args = ap.parse_args()
    if args.tiny:
        args.config, args.samples, args.max_new_tokens = str(ROOT / "configs" / "demo.yaml"), 8, 4
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    with tempfile.TemporaryDirectory(prefix="mimo-eval-cache-") as tmp:
        config_path = write_config(args, Path(tmp))
        config = load_config(config_path, args.overrides)
        req = request_for(config, None, None)
        ensure_index(config, shards=req.shards)
        with WorkerPool(1, timeout_s=3600, device=args.device) as pool:
            (r,) = pool.run(_bench_rank, config_path, args.overrides, req, args.device, args.repeats)
    plain, cached = r[False], r[True]
    same = [k for k in plain["generated"] if cached["generated"].get(k) == plain["generated"][k]]
    rate = {name: run["generated_tokens"] / run["seconds"] for name, run in (("uncached", plain), ("cached", cached))}
    print(json.dumps({
        "bench": "eval_cache", "config": Path(args.config).name, "overrides": args.overrides, "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "precision": args.precision,
        "torch": torch.__version__, "host": platform.node(), "samples": args.samples,
        "max_new_tokens": args.max_new_tokens, "microbatches": r["microbatches"], "pack_tokens": r["pack_tokens"],
        "samples_generated": len(plain["generated"]), "generated_tokens": plain["generated_tokens"],
        "uncached_s": round(plain["seconds"], 4), "cached_s": round(cached["seconds"], 4),
        "uncached_tokens_per_s": round(rate["uncached"], 2), "cached_tokens_per_s": round(rate["cached"], 2),
        "speedup": round(rate["cached"] / rate["uncached"], 3),
        "tokens_equal": len(same) == len(plain["generated"]) and cached["generated_tokens"] == plain["generated_tokens"],
        "samples_equal": len(same), "peak_gib": None if r["peak_gib"] is None else round(r["peak_gib"], 2),
    }))


if __name__ == "__main__":
    main()

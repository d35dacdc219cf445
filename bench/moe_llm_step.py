"""The LLM training step alone: mimo against torchtitan's Qwen3-MoE (or dense Qwen3) on the same
documents (issue 55, item 1).

Trains ``configs/llava-moe-llm.yaml`` (llava-moe's text model: 16 layers, 64 experts top 8,
1.04B active of 5.27B parameters; bf16 parameters, gradients and AdamW state) through
``bench/llava_step.py``'s machinery, and in the same invocation, first, runs the anchor
``torchtitan_moe_baseline.py`` (``../shared/bench/`` or ``.whl/``: torchtitan's own model,
compiled per block, FlexAttention with document masks, grouped_mm experts, fused AdamW) as a
subprocess on the same documents: it replays mimo's synthetic generator (seed 1), and both time
microbatches ``warmup .. steps-1`` after ``--warmup`` untimed steps. Workloads:

* ``uniform``: 8 documents of 2,048 tokens a step;
* ``ragged``: 12 documents of 32..2,048 tokens, a new total every step.

``--model dense`` trains ``configs/llava-1.3b-llm.yaml`` instead (llava-1.3b's text model with
Qwen3's QK-norm: 16 layers, hidden 2048, 16 heads, ffn 5632) against ``torchtitan_dense_anchor.py``
beside this file: torchtitan's dense Qwen3 at those shapes, timed by the MoE anchor's harness.

Prints one JSON line: each side's median / min / max step, real tokens/s, MFU against the GPU's
rated dense peak (torchtitan's at mimo's FLOPs per real token, ``mfu``, and at its own count,
``mfu_own_flop_count``), peak memory, warm-up
(compile) seconds, graphs compiled inside the timed steps, and ``ratio`` = mimo's real tokens/s
over torchtitan's (> 1: mimo faster; the two count the same tokens: ``same_tokens``) beside the
median-step ratio. torchtitan needs its wheel and four small ones on the GPU machine (see the
anchor's docstring).

    python bench/moe_llm_step.py [--model moe|dense] [--workload uniform|ragged] [--steps 13 --warmup 3] [key=value ...]
    python bench/moe_llm_step.py --tiny --device cpu --steps 3 --warmup 1 --anchor-arg=--no-compile ...  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llava_step  # noqa: E402

ROOT = llava_step.ROOT
ANCHORS = (ROOT.parent / "shared/bench/torchtitan_moe_baseline.py", ROOT / ".whl/torchtitan_moe_baseline.py")
WORKLOADS = {"uniform": (8, 2048, 2048), "ragged": (12, 32, 2048)}  # documents a step, shortest, longest
# the anchor's --tiny model (2 layers, hidden 64, 4 / 2 heads of 16, 8 experts top 2 of ffn 32, vocab 512)
TINY = ["modules.language.arch.pattern='*E*E'", "modules.language.arch.hidden=64", "modules.language.arch.heads=4",
        "modules.language.arch.kv_heads=2", "modules.language.arch.head_dim=16", "modules.language.arch.vocab=512",
        "modules.language.arch.moe={experts: 8, topk: 2, ffn: 32}", "modules.language.arch.max_seq_len=256"]
TINY_DOCS = (4, 64, 128)
# --model: mimo's config (the dense anchor wraps the MoE one, passed as its --base)
MODELS = {"moe": "configs/llava-moe-llm.yaml", "dense": "configs/llava-1.3b-llm.yaml"}
DENSE_ANCHOR = Path(__file__).resolve().parent / "torchtitan_dense_anchor.py"
TINY_DENSE = [o for o in TINY if ".moe=" not in o and ".pattern=" not in o] + [
    "modules.language.arch.pattern='*-*-'", "modules.language.arch.ffn=32"]


def run_anchor(path: Path, docs: tuple[int, int, int], steps: int, warmup: int, device: str, tiny: bool,
               extra: list[str]) -> dict:
    """The anchor's JSON line (``{"error": ...}`` when it did not produce one)."""
    n, lo, hi = docs
    cmd = [sys.executable, str(path), "--docs", str(n), "--lo", str(lo), "--hi", str(hi), "--steps", str(steps),
           "--warmup", str(warmup), "--device", device] + (["--tiny"] if tiny else []) + extra
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = out.stderr.strip().splitlines()[-1][-400:] if out.stderr.strip() else ""
        return {"error": f"exit {out.returncode}, no JSON line: {tail}"}
    return json.loads(lines[0])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="mimo config key=value overrides")
    parser.add_argument("--model", choices=sorted(MODELS), default="moe", help="moe: llava-moe's text model; dense: llava-1.3b's")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="uniform")
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default="compile", help="mimo's (bench/llava_step.py --variants)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--tiny", action="store_true", help="both sides' tiny models (CPU smoke run)")
    parser.add_argument("--anchor", help="path of torchtitan_moe_baseline.py (default: ../shared/bench or .whl/)")
    parser.add_argument("--anchor-arg", action="append", default=[], help="one more argument of the anchor's, repeatable")
    parser.add_argument("--no-anchor", action="store_true", help="mimo only")
    parser.add_argument("--profile", metavar="PREFIX", help="both sides: two more steps profiled, kernel tables to PREFIX.*")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    docs = TINY_DOCS if args.tiny else WORKLOADS[args.workload]
    n, lo, hi = docs
    anchor = None
    if not args.no_anchor:  # first: a clean GPU for each side
        path = Path(args.anchor) if args.anchor else next((p for p in ANCHORS if p.is_file()), None)
        if path is None or not path.is_file():
            parser.error(f"no anchor script at {args.anchor or [str(p) for p in ANCHORS]}; use --anchor or --no-anchor")
        extra = args.anchor_arg + (["--profile", f"{args.profile}.torchtitan.txt"] if args.profile else [])
        if args.model == "dense":  # torchtitan's dense Qwen3 in the MoE anchor's harness
            path, extra = DENSE_ANCHOR, ["--base", str(path)] + extra
        anchor = run_anchor(path, docs, args.steps, args.warmup, device, args.tiny, extra)
    tiny = TINY_DENSE if args.model == "dense" else TINY
    overrides = (tiny if args.tiny else []) + [
        f"data.synthetic.samples_per_microbatch={n}", f"data.synthetic.text_tokens=[{lo},{hi}]",
        f"data.tokens_per_microbatch={n * hi}", f"data.max_sample_tokens={hi}"] + args.overrides
    mimo = llava_step.main(["--config", str(ROOT / MODELS[args.model]), "--no-baseline", "--device", device,
                            "--steps", str(args.steps), "--warmup", str(args.warmup), "--variants", args.variants]
                           + (["--profile", f"{args.profile}.mimo"] if args.profile else []) + overrides,
                           bench="moe_llm_step", quiet=True)
    res = {"bench": "moe_llm_step", "model": args.model, "workload": "tiny" if args.tiny else args.workload, "docs_per_step": n,
           "doc_tokens": [lo, hi], "mimo": mimo, "torchtitan": anchor}
    if anchor is not None and "error" not in anchor:
        for name in args.variants.split(","):
            v = mimo.get(name, {})
            if "real_tokens_per_s" in v:
                v["ratio_tokens_per_s"] = v["real_tokens_per_s"] / anchor["real_tokens_per_s"]
                v["ratio_median_step"] = anchor["step_s_median"] / v["step_s_median"]
        rated = mimo.get("peak_tflops_rated")  # the GPU's rated dense peak (TFLOP/s): MFU on both sides
        timed = next((mimo[k] for k in args.variants.split(",") if "model_tflops_per_s" in mimo.get(k, {})), None)
        if rated and timed is not None and timed["real_tokens_per_s"]:
            anchor["mfu"] = anchor["real_tokens_per_s"] * timed["model_tflops_per_s"] / timed["real_tokens_per_s"] / rated
            anchor["mfu_own_flop_count"] = anchor.get("model_tflops_per_s", 0.0) / rated
        res["same_tokens"] = mimo["real_tokens_per_step"] == anchor["real_tokens_per_step"]
        res["same_active_params"] = mimo.get("params_llm") == anchor.get("params_active")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()

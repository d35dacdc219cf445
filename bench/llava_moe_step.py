"""Single-GPU training step of "llava-moe" through mimo, beside the Hugging Face MoE anchor.

Trains configs/llava-moe.yaml (the model of ``../shared/bench/hf_llava_moe_baseline.py``:
CLIP ViT-L/14-224 + a 16-layer Qwen3-MoE of 64 experts, top 8; the same parameter counts
and the same seeded samples) with ``bench/llava_step.py``'s machinery, 8 samples per step
(the anchor runs 4: 8 do not fit it). Prints one JSON line: real tokens/s, model TFLOP/s on
active parameters (``mimo.training.flops``), MFU against the GPU's rated dense peak (and against
a measured bf16 matmul rate beside it), peak
memory, with ``--profile`` the step's kernel-time shares (grouped GEMMs, dense GEMMs,
attention, router, permutation, optimizer, FP8 quantization), and the anchor's JSON line (its
best: grouped_mm experts, B=4) run in the same invocation, with the ratio of real tokens/s.

    python bench/llava_moe_step.py [--steps 13] [--warmup 3] [--variants eager,compile] [key=value ...]
    python bench/llava_moe_step.py train.fp8={recipe: rowwise}     # FP8 GEMMs
    python bench/llava_moe_step.py --tiny --no-baseline --device cpu   # a CPU smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llava_step  # noqa: E402

ROOT = llava_step.ROOT
BASELINES = (ROOT.parent / "shared/bench/hf_llava_moe_baseline.py", ROOT / ".whl/hf_llava_moe_baseline.py")
# llava_step's tiny model with MoE layers (8 experts, top 2) in place of the MLPs
TINY = [o for o in llava_step.TINY if not o.startswith(("modules.language.arch.pattern", "modules.language.arch.ffn"))] + [
    "modules.language.arch.pattern='*E*E'", "modules.language.arch.moe={experts: 8, topk: 2, ffn: 32}"]
# the padded anchor's attention implementations with grouped_mm experts, then padding-free packing
# (bench/hf_llava_packed.py) with SDPA and FlexAttention, each also with its decoder layers compiled
BASELINE_CONFIGS = ",".join([f"grouped_mm+ATTN={a}" for a in ("eager", "sdpa", "flex_attention")] + [
    f"packed:{a}:grouped_mm{c}" for a in ("sdpa", "flex_attention") for c in ("", "+COMPILE=1")])


def main(argv=None) -> dict:
    return llava_step.main(argv, bench="llava_moe_step", config_path=ROOT / "configs/llava-moe.yaml", tiny=TINY,
                           baselines=BASELINES, baseline_configs=BASELINE_CONFIGS, baseline_env=("B=4",), packed_model="moe")


if __name__ == "__main__":
    main()

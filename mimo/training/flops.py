"""Model FLOPs of a step and the peak of a device: ``tflops`` and ``mfu`` in ``metrics.jsonl``
and in the benches (``bench/llava_step.py``), counted one way.

Model FLOPs are the usual dense estimate (as Hugging Face's baseline counts them): 6 x
parameters x tokens, i.e. forward + backward of every weight, for the LLM (with the
projectors) over the real text and image-row tokens and for each encoder's whole tower over
its image tokens (patches and [CLS]); attention's quadratic term, padding and frozen parts
are not discounted. MFU is that rate over the devices' peak: a table of datasheet dense
tensor-core peaks by GPU name, or ``train.log.peak_tflops`` (e.g. a measured matmul rate).
An MoE layer counts its active parameters only (router, the ``topk`` of its routed experts a
token runs through, shared expert, latent projections): what a token's FLOPs follow.
"""

from __future__ import annotations

import torch

# dense (no sparsity) peak FLOP/s by GPU name: (bf16 tensor cores, fp32 without TF32); the
# first name contained in torch.cuda.get_device_name wins
PEAK_FLOPS = (
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H200", 989e12, 67e12),  # also GH200
    ("H100", 989e12, 67e12),  # SXM
    ("H800", 989e12, 67e12),
    ("B200", 2250e12, 80e12),
    ("A100", 312e12, 19.5e12),
    ("A800", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
    ("A10G", 70e12, 31.2e12),
)


def inactive_expert_params(llm) -> int:
    """Routed-expert parameters a token does not use: of each MoE layer's ``E`` experts, all but
    its ``topk``."""
    from mimo.llm.moe import MoE

    return sum(sum(p.numel() for p in m.experts.parameters()) // m.cfg.experts * (m.cfg.experts - m.cfg.topk)
               for m in llm.modules() if isinstance(m, MoE))


def param_counts(config) -> dict[str, int]:
    """Parameters per module as the model-FLOP count takes them: the LLM with every projector
    (MoE layers: active parameters only), each encoder's whole tower (every block and its final
    norm, although mimo builds only what ``feature_layer`` needs). A native tower (``qwen3_vl``):
    what runs per patch under the encoder's name, its mergers (which run per merged row) under
    ``"<name>.mergers"``. Built on the meta device: no memory, no weights."""
    from mimo.encoders.projector import build_projector
    from mimo.encoders.qwen3_vl import Qwen3VisionTower
    from mimo.encoders.vit import VisionTransformer
    from mimo.llm.model import LLMStage

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        llm = LLMStage(config.llm.arch)
        out = {config.llm_name: count(llm) - inactive_expert_params(llm)}
        for name, enc in config.encoders.items():
            if enc.native:
                tower = Qwen3VisionTower(enc.arch)
                mergers = count(tower.merger) + count(tower.deepstack_mergers)
                out[name], out[f"{name}.mergers"] = count(tower) - tower.pos_embed.numel() - mergers, mergers
                continue
            out[config.llm_name] += count(build_projector(enc.projector.kind, enc.arch.hidden, config.llm.arch.hidden))
            out[name] = count(VisionTransformer(enc.arch, "post_norm"))
    return out


def tokens_per_image(encoder) -> int:
    """Tokens the tower runs per image: its patches and the class token."""
    return encoder.arch.patches_per_image + (1 if encoder.arch.class_token else 0)


def model_flops(config, samples, counts: dict[str, int]) -> float:
    """Model FLOPs of training on ``samples`` (planned samples: ``tokens``, ``images_for``)."""
    flops = 6.0 * counts[config.llm_name] * sum(s.tokens for s in samples)
    for name, enc in config.encoders.items():
        if enc.native:  # per patch (a merged row is merge^2 patches), the mergers per merged row
            rows = sum(sum(s.image_rows.get(enc.placeholder, ())) for s in samples)
            flops += 6.0 * rows * (counts[name] * enc.arch.spatial_merge**2 + counts[f"{name}.mergers"])
            continue
        images = sum(s.images_for(enc.placeholder) for s in samples)
        flops += 6.0 * counts[name] * images * tokens_per_image(enc)
    return flops


def device_peak_flops(device: torch.device | str, precision: str) -> float | None:
    """The table's dense peak of ``device`` for the run's ``precision`` (bf16 compute: the bf16
    peak; fp32: the fp32 one), or None (the CPU, a GPU not in the table)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf16, fp32 in PEAK_FLOPS:
        if key in name:
            return fp32 if precision == "fp32" else bf16
    return None


def throughput(flops: float, seconds: float, devices: int, peak_flops: float | None) -> tuple[float | None, float | None]:
    """(TFLOP/s achieved by the whole world, MFU: that over ``devices`` x ``peak_flops``, None without a peak)."""
    if not seconds:
        return None, None
    rate = flops / seconds
    return rate / 1e12, (rate / (devices * peak_flops) if peak_flops else None)

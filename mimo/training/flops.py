"""Model FLOPs of a step and the peak of a device: ``tflops`` and ``mfu`` in ``metrics.jsonl``
and in the benches (``bench/llava_step.py``), counted one way.

Model FLOPs are the usual dense estimate: 2 x parameters x tokens for the forward, as much
again for the activations' gradients where backward runs through a module, and as much again
for its weights' gradients where it trains (``module_factors``): 6 for a module that trains, 4
for a frozen one that gradients cross (a frozen LLM under a training projector), 2 for a frozen
one that nothing before it trains (a frozen tower). Counted for the LLM over the real text and
image-row tokens, each projector over its image rows, each encoder's whole tower over its image
tokens (patches and [CLS]); attention's quadratic term and padding are not counted. MFU is that
rate over the devices' rated dense peak: a table of datasheet tensor-core peaks by GPU name (bf16,
fp32, FP8: a run with ``train.fp8`` is measured against the FP8 peak), or
``train.log.peak_tflops``. An MoE layer counts its active parameters only (router, the ``topk``
of its routed experts a token runs through, shared expert, latent projections): what a token's
FLOPs follow.
"""

from __future__ import annotations

import torch

# rated dense (no sparsity) peak FLOP/s by GPU name: (bf16 tensor cores, fp32 without TF32, FP8
# tensor cores; None: no FP8); the first name contained in torch.cuda.get_device_name wins
PEAK_FLOPS = (
    ("H100 PCIe", 756e12, 51e12, 1513e12),
    ("H100 NVL", 835e12, 60e12, 1671e12),
    ("H200", 989e12, 67e12, 1979e12),  # also GH200
    ("H100", 989e12, 67e12, 1979e12),  # SXM
    ("H800", 989e12, 67e12, 1979e12),
    ("B200", 2250e12, 80e12, 4500e12),
    ("A100", 312e12, 19.5e12, None),
    ("A800", 312e12, 19.5e12, None),
    ("L40S", 362e12, 91.6e12, 733e12),
    ("L4", 121e12, 30.3e12, 242.5e12),
    ("A10G", 70e12, 31.2e12, None),
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
    from mimo.encoders.config import NATIVE_TOWERS
    from mimo.encoders.vit import VisionTransformer
    from mimo.llm.model import LLMStage

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        llm = LLMStage(config.llm.arch)
        out = {config.llm_name: count(llm) - inactive_expert_params(llm)}
        for name, enc in config.encoders.items():
            if enc.native:
                tower = NATIVE_TOWERS[enc.kind].tower_class()(enc.arch)
                mergers = count(tower.merger) + count(tower.deepstack_mergers)
                out[name], out[f"{name}.mergers"] = count(tower) - tower.pos_embed.numel() - mergers, mergers
                continue
            out[f"{name}.projector"] = count(build_projector(enc.projector.kind, enc.arch.hidden, config.llm.arch.hidden))
            out[name] = count(VisionTransformer(enc.arch, "post_norm"))
    return out


def module_factors(config) -> dict[str, int]:
    """FLOPs per parameter and token of each ``param_counts`` entry (module doc): 6 where it
    trains, 4 where it is frozen but a module before it trains, 2 where nothing before it does.
    A module with low-rank adapters (``lora``) counts 4 (gradients cross its frozen weights to
    the adapters of every layer; the adapters' own products, rank r, are left out)."""
    def factor(trains: bool, upstream_trains: bool) -> int:
        return 6 if trains else (4 if upstream_trains else 2)

    out, feeding = {}, False  # feeding: some encoder part before the LLM trains
    for name, enc in config.encoders.items():
        tower = "tower" not in enc.freeze and enc.lora is None
        out[name] = 4 if enc.lora is not None else factor(tower, False)
        if enc.native:
            out[f"{name}.mergers"] = out[name]
            feeding |= tower or enc.lora is not None
        else:
            projector = "projector" not in enc.freeze
            out[f"{name}.projector"] = factor(projector, tower or enc.lora is not None)
            feeding |= tower or projector or enc.lora is not None
    out[config.llm_name] = 4 if config.llm.lora is not None else factor(not config.llm.freeze, feeding)
    return out


def tokens_per_image(encoder) -> int:
    """Tokens the tower runs per image: its patches and the class token."""
    return encoder.arch.patches_per_image + (1 if encoder.arch.class_token else 0)


def model_flops(config, samples, counts: dict[str, int]) -> float:
    """Model FLOPs of training on ``samples`` (planned samples: ``tokens``, ``images_for``)."""
    f = module_factors(config)
    flops = f[config.llm_name] * counts[config.llm_name] * sum(s.tokens for s in samples)
    for name, enc in config.encoders.items():
        if enc.native:  # per patch (a merged row is merge^2 patches), the mergers per merged row
            rows = sum(sum(s.image_rows.get(enc.placeholder, ())) for s in samples)
            flops += f[name] * rows * (counts[name] * enc.arch.spatial_merge**2 + counts[f"{name}.mergers"])
            continue
        images = sum(s.images_for(enc.placeholder) for s in samples)
        flops += f[name] * counts[name] * images * tokens_per_image(enc)
        flops += f[f"{name}.projector"] * counts[f"{name}.projector"] * images * enc.rows_per_image
    return float(flops)


def device_peak_flops(device: torch.device | str, precision: str, fp8: bool = False) -> float | None:
    """The table's rated dense peak of ``device`` for the run's ``precision`` (bf16 compute: the
    bf16 peak; fp32: the fp32 one; ``fp8``: FP8 products, the FP8 peak), or None (the CPU, a GPU
    not in the table or without FP8)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf16, fp32, fp8_peak in PEAK_FLOPS:
        if key in name:
            return fp8_peak if fp8 else (fp32 if precision == "fp32" else bf16)
    return None


def throughput(flops: float, seconds: float, devices: int, peak_flops: float | None) -> tuple[float | None, float | None]:
    """(TFLOP/s achieved by the whole world, MFU: that over ``devices`` x ``peak_flops``, None without a peak)."""
    if not seconds:
        return None, None
    rate = flops / seconds
    return rate / 1e12, (rate / (devices * peak_flops) if peak_flops else None)

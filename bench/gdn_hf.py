"""Gated DeltaNet at Qwen3.5 sizes: mimo's layer against transformers' torch fallback (issue 48).

One layer (pre-norm + mixer + residual), forward + backward on one pack of ragged samples
(seeded lengths, as bench/llm_recurrent.py), bf16 on CUDA, fp32 on the CPU:

* ``qwen3_5``: mimo's ``G`` layer in its Qwen3.5 form (``norm_zero_centred``), as the model builds
  it (``build_layer``), with transformers' weights loaded by ``mimo.llm.hf.gdn_layer_from_hf``;
  ``mimo_rule`` / ``mimo_conv`` say which gated delta rule and conv it took (fla / causal-conv1d
  when installed and working on CUDA in bf16, else the torch chunked form). When it took a kernel,
  ``qwen3_5_chunked`` is the same layer on the torch chunked form.
* ``plain``: the same layer with the Qwen3.5 flags off (today's GDN), the same weights (its
  pre-norm's as ``1 +`` the zero-centred offset); ``qwen3_5_over_plain`` is the CPU acceptance
  ratio (within 2x).
* the anchor, transformers' ``Qwen3_5GatedDeltaNet`` + its ``input_layernorm`` + residual on its
  torch fallback (``torch_chunk_gated_delta_rule``, ``F.conv1d``: fla / causal-conv1d forced off),
  same weights, same samples. The fallback ignores packed boundaries, so ``hf_per_sample`` runs
  each sample as a batch of one, in turn (the exact computation); ``hf_padded`` runs them as one
  right-padded batch ``[B, Lmax]`` with ``attention_mask`` (the way a user batches transformers).
  ``ratio_*`` = anchor median / ``qwen3_5`` median (above 1: mimo is faster).

``rel_err`` (outputs less the residual), ``rel_err_dx`` (input gradients) and ``rel_err_grad``
(the worst weight gradient, transformers' mapped by the same rules) compare ``qwen3_5`` with
``hf_per_sample``; ``rel_err_padded`` the padded run's outputs. Times are the median of
``--iters`` steps after ``--warmup``, the variants taken in turn within each iteration (a drifting
load weighs on all alike); ``peak_gib`` (CUDA) is the peak one step adds to what was allocated
before it. Prints one JSON line.

    python bench/gdn_hf.py [--small] [--tokens N] [--iters 10] [--device cuda|cpu] [--impl auto|chunked|kernel]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import platform
import random
import statistics
import time

import torch
import torch.nn as nn

import transformers

from mimo.core.testing import rel_err
from mimo.llm import hf
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.pattern import LayerSpec
from mimo.llm.ssm import find_kernel
from mimo.parallel.params import load_full_, param_table

# hidden, key heads, value heads, head dim (keys and values), conv kernel, tokens
PRESETS = {
    "qwen3.5": dict(hidden=2048, heads=16, v_heads=32, head_dim=128, conv=4, tokens=8192),
    "small": dict(hidden=256, heads=4, v_heads=8, head_dim=32, conv=4, tokens=1024),
}
EPS = 1e-6  # Qwen3.5's rms_norm_eps (the pre-norm and the gated norm)
# transformers' module globals that pick fla / causal-conv1d when they import
HF_KERNEL_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update")


# ---------------------------------------------------------------- the samples and the clock
def seqlens(tokens: int, seed: int = 0) -> list[int]:
    """Ragged sample lengths summing to ``tokens``: bench/llm_recurrent.py's draw (the same at
    8192 tokens), its lengths scaled to ``tokens`` so that small packs hold several samples too."""
    choices = [max(1, round(n * tokens / 8192)) for n in (1, 7, 100, 300, 700, 1500, 2500)]
    rng, out = random.Random(seed), []
    while sum(out) < tokens:
        out.append(min(rng.choice(choices), tokens - sum(out)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(steps: dict, iters: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Median ms of each step, the steps taken in turn within each iteration: a load that
    drifts (a shared CPU, GPU clocks) weighs on all of them alike, so their ratios hold."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: round(statistics.median(t), 3) for name, t in times.items()}


def peak_gib(step, module: nn.Module, device: torch.device) -> dict:
    """(CUDA) The peak one step adds over what is allocated before it; {} on the CPU."""
    if device.type != "cuda":
        return {}
    module.zero_grad(set_to_none=True)  # no stale gradients in the baseline
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    out = {"peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)}
    module.zero_grad(set_to_none=True)
    return out


# ---------------------------------------------------------------- transformers' layer, on its torch fallback
def hf_module(name: str):
    """A module of transformers' Qwen3.5 (5.17 and later have ``Qwen3_5GatedDeltaNet``)."""
    try:
        return importlib.import_module(f"transformers.models.qwen3_5.{name}")
    except ImportError as e:
        raise SystemExit(f"gdn_hf: transformers {transformers.__version__} has no Qwen3.5 ({e})")


def hf_modeling():
    return hf_module("modeling_qwen3_5")


@contextlib.contextmanager
def torch_fallback(modeling):
    """transformers' GDN on its reference torch functions while inside. Each of
    ``HF_KERNEL_FUNCS`` is decorated at import to call fla's / causal-conv1d's kernel when that
    package imports (and, from 5.2x, runs on the input's device); the torch function is what the
    decorators wrap (``__wrapped__``), so it is put back in the module for the run."""
    saved = {name: getattr(modeling, name) for name in HF_KERNEL_FUNCS if hasattr(modeling, name)}
    for name, fn in saved.items():
        plain = inspect.unwrap(fn)
        if plain.__module__ != modeling.__name__:  # a decorator we do not know: refuse rather than mis-measure
            raise RuntimeError(f"gdn_hf: cannot find transformers' torch {name} under {fn!r}")
        setattr(modeling, name, plain)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(modeling, name, fn)


class HFBlock(nn.Module):
    """``h + linear_attn(input_layernorm(h))``: a Qwen3.5 decoder layer's GDN half, with its
    parameter names (``gdn_layer_from_hf``'s input)."""

    def __init__(self, modeling, sizes: dict):
        super().__init__()
        cfg = hf_module("configuration_qwen3_5").Qwen3_5TextConfig(
            hidden_size=sizes["hidden"], rms_norm_eps=EPS, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, hidden_act="silu", linear_num_key_heads=sizes["heads"],
            linear_num_value_heads=sizes["v_heads"], linear_key_head_dim=sizes["head_dim"],
            linear_value_head_dim=sizes["head_dim"], linear_conv_kernel_dim=sizes["conv"],
            layer_types=["linear_attention"])
        self.input_layernorm = modeling.Qwen3_5RMSNorm(sizes["hidden"], eps=EPS)
        self.linear_attn = modeling.Qwen3_5GatedDeltaNet(cfg, 0)

    def forward(self, h_BLD: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return h_BLD + self.linear_attn(self.input_layernorm(h_BLD), attention_mask=attention_mask)


def hf_block(modeling, sizes: dict, seed: int) -> HFBlock:
    """transformers' own init (seeded), with the norms moved off their identity so that the
    zero-centred pre-norm and the gated norm's weight take part in the check."""
    torch.manual_seed(seed)
    block = HFBlock(modeling, sizes)
    with torch.no_grad():
        block.input_layernorm.weight.normal_(0.0, 0.1)
        block.linear_attn.norm.weight.normal_(1.0, 0.1)
    return block


# ---------------------------------------------------------------- mimo's layers
def mimo_arch(sizes: dict, zero_centred: bool) -> HybridArch:
    heads = max(1, sizes["hidden"] // sizes["head_dim"])  # attention heads: unused by a G layer, but validated
    return HybridArch(pattern="G", hidden=sizes["hidden"], heads=heads, vocab=16, norm_eps=EPS,
                      norm_zero_centred=zero_centred, gdn_heads=sizes["heads"], gdn_v_heads=sizes["v_heads"],
                      gdn_head_dim=sizes["head_dim"], gdn_v_head_dim=sizes["head_dim"], conv_kernel=sizes["conv"],
                      gdn_chunk=64)


def mimo_layer(arch: HybridArch, impl: str) -> nn.Module:
    layer = build_layer(arch, LayerSpec(0, "gdn"))
    layer.mixer.impl = impl
    return layer


# ---------------------------------------------------------------- one forward + backward each
def mimo_step(layer, impl: str | None, x_TD, dy_TD, seq):
    """One forward + backward of mimo's layer on the pack; ``impl``: its mixer's (None: as it is)."""
    def step():
        if impl is not None:
            layer.mixer.impl = impl  # one layer serves its impl and the torch chunked form
        layer.zero_grad(set_to_none=True)
        h_TD = x_TD.detach().requires_grad_(True)  # a leaf of its own: no gradient left on x
        y_TD = layer(h_TD, seq)
        y_TD.backward(dy_TD)
        return h_TD, y_TD
    return step


def hf_per_sample_step(block, x_TD, dy_TD, cu: list[int], positions: bool = False):
    """transformers' block on each sample as a batch of one; ``positions``: the block also takes
    the sample's position ids (``[1, L]``)."""
    def step():
        block.zero_grad(set_to_none=True)
        out = []
        for s, e in zip(cu[:-1], cu[1:]):  # a batch of one per sample: the fallback has no boundaries
            h_1LD = x_TD[s:e].detach()[None].requires_grad_(True)
            y_1LD = block(h_1LD, torch.arange(e - s, device=x_TD.device)[None]) if positions else block(h_1LD)
            y_1LD.backward(dy_TD[s:e][None])
            out.append((h_1LD, y_1LD))
        return out
    return step


def padded(x_TD: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pack as a right-padded batch ``[B, Lmax, D]`` (zeros past each sample) and its mask ``[B, Lmax]``."""
    mask_BL = torch.arange(max(lens), device=x_TD.device)[None] < torch.tensor(lens, device=x_TD.device)[:, None]
    x_BLD = x_TD.new_zeros(len(lens), max(lens), x_TD.shape[-1])
    x_BLD[mask_BL] = x_TD
    return x_BLD, mask_BL.long()


def hf_padded_step(block, x_BLD, dy_BLD, mask_BL):
    def step():
        block.zero_grad(set_to_none=True)
        h_BLD = x_BLD.detach().requires_grad_(True)
        y_BLD = block(h_BLD, attention_mask=mask_BL)
        y_BLD.backward(dy_BLD)
        return h_BLD, y_BLD
    return step


# ---------------------------------------------------------------- the check
def check(mimo_run, per_sample_run, padded_run, mask_BL, layer, block, arch) -> dict:
    """mimo's Qwen3.5 layer against transformers per sample: outputs less the residual, input
    gradients, every weight gradient (transformers' mapped to mimo's names by the import rules)."""
    h_TD, y_TD = mimo_run
    hf_y_TD = torch.cat([(y - h)[0] for h, y in per_sample_run]).detach()
    hf_dx_TD = torch.cat([h.grad[0] for h, _ in per_sample_run])
    theirs = {n: p.grad for n, p in block.named_parameters()}  # per_sample_run left its gradients
    theirs = hf.gdn_layer_from_hf(theirs, arch, "qwen3_5")
    ours = {n: p.grad for n, p in layer.named_parameters()}
    worst = max((rel_err(ours[n], g), n) for n, g in theirs.items())
    pad_h_BLD, pad_y_BLD = padded_run
    mask = mask_BL.bool()
    return {"rel_err": rel_err((y_TD - h_TD).detach(), hf_y_TD), "rel_err_dx": rel_err(h_TD.grad, hf_dx_TD),
            "rel_err_grad": worst[0], "rel_err_grad_worst": worst[1],
            "rel_err_padded": rel_err((pad_y_BLD - pad_h_BLD).detach()[mask], hf_y_TD)}


# ---------------------------------------------------------------- the bench
def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a CPU-sized layer: " + str(PRESETS["small"]))
    for key in PRESETS["qwen3.5"]:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--impl", choices=["auto", "chunked", "kernel"], default="auto", help="mimo's GDN impl")
    return ap.parse_args(argv)


def sizes_of(args) -> dict:
    preset = PRESETS["small" if args.small else "qwen3.5"]
    return {k: v if getattr(args, k) is None else getattr(args, k) for k, v in preset.items()}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):  # the CPU's model, where Linux tells it
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on CUDA stays fp32 (both sides alike)
    sizes = sizes_of(args)
    lens = seqlens(sizes["tokens"], args.seed)
    seq = SeqContext.from_seqlens(lens, device=device)
    cu = seq.cu_seqlens.tolist()

    modeling = hf_modeling()
    block = hf_block(modeling, sizes, args.seed)
    arch = mimo_arch(sizes, zero_centred=True)
    qwen = mimo_layer(arch, args.impl)
    state = hf.gdn_layer_from_hf(block.state_dict(), arch, "qwen3_5")
    load_full_(param_table(qwen), state)
    # today's form, the same function: the same weights, the pre-norm's as 1 + offset
    plain = mimo_layer(mimo_arch(sizes, zero_centred=False), args.impl)
    load_full_(param_table(plain), {**state, "norm.weight": 1.0 + state["norm.weight"]})
    block, qwen, plain = (m.to(device=device, dtype=dtype) for m in (block, qwen, plain))

    g = torch.Generator().manual_seed(args.seed + 1)
    x_TD, dy_TD = (torch.randn(sizes["tokens"], sizes["hidden"], generator=g).to(device, dtype) for _ in range(2))
    x_BLD, mask_BL = padded(x_TD, lens)
    dy_BLD, _ = padded(dy_TD, lens)

    result = {"bench": "gdn_hf", "device": device_name(device), "torch": torch.__version__,
              "transformers": transformers.__version__, "dtype": dtype_name, **sizes, "samples": len(lens),
              "max_len": max(lens), "iters": args.iters, "impl": args.impl,
              "mimo_rule": "fla" if find_kernel("gated_delta", args.impl, x_TD) else "torch_chunked",
              "mimo_conv": "causal_conv1d" if find_kernel("conv", args.impl, x_TD) else "torch",
              "hf_rule": "torch_chunk_gated_delta_rule (forced)",
              # what transformers would have picked up without the forcing
              "hf_kernel_packages": {p: importlib.util.find_spec(p) is not None for p in ("fla", "causal_conv1d")}}
    if device.type == "cpu":
        result["threads"] = torch.get_num_threads()

    steps = {"qwen3_5": (mimo_step(qwen, args.impl, x_TD, dy_TD, seq), qwen),
             "plain": (mimo_step(plain, args.impl, x_TD, dy_TD, seq), plain),
             "hf_per_sample": (hf_per_sample_step(block, x_TD, dy_TD, cu), block),
             "hf_padded": (hf_padded_step(block, x_BLD, dy_BLD, mask_BL), block)}
    if result["mimo_rule"] != "torch_chunked" or result["mimo_conv"] != "torch":  # also our own chunked form
        steps["qwen3_5_chunked"] = (mimo_step(qwen, "chunked", x_TD, dy_TD, seq), qwen)
    with torch_fallback(modeling):
        times = median_ms({name: step for name, (step, _) in steps.items()}, args.iters, args.warmup, device)
        for name, (step, module) in steps.items():
            result[name] = {"ms": times[name], **peak_gib(step, module, device)}
        result["hf_padded"]["tokens"] = x_BLD.shape[0] * x_BLD.shape[1]
        result["qwen3_5_over_plain"] = round(times["qwen3_5"] / times["plain"], 3)
        result["ratio_per_sample"] = round(times["hf_per_sample"] / times["qwen3_5"], 3)
        result["ratio_padded"] = round(times["hf_padded"] / times["qwen3_5"], 3)
        padded_run = steps["hf_padded"][0]()  # before the per-sample run: that one's weight gradients are checked
        result.update(check(steps["qwen3_5"][0](), steps["hf_per_sample"][0](), padded_run, mask_BL, qwen, block, arch))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

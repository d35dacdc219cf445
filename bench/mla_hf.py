"""Multi-head latent attention at DeepSeek-V3's head sizes: mimo's ``+`` layer against
transformers' ``DeepseekV3Attention`` (issue 56).

One layer (pre-norm + attention + residual), forward + backward on one THD pack of ragged samples
(bench/gdn_hf.py's seeded lengths), bf16 on CUDA, fp32 on the CPU, the same weights and samples:

* ``mimo``: our MLA layer as the model builds it (``build_layer``), on its fastest path
  (``attention``: the varlen flash kernel of ``torch.nn.attention.varlen`` on CUDA in bf16, v
  zero-padded to q / k's head size; else the per-sample SDPA of the exact path);
  ``mimo_exact`` the exact path.
* the anchor, transformers' ``DeepseekV3RMSNorm`` + ``DeepseekV3Attention`` + residual, in each
  configuration that runs here: ``hf_<impl>_per_sample`` runs each sample as a batch of one
  (causal, no mask: SDPA takes its causal kernels), ``hf_<impl>_padded`` one right-padded batch
  ``[B, Lmax]`` with a causal + padding mask, for ``impl`` in eager, sdpa, flex_attention and
  flash_attention_2 (where its package is installed; packed with position ids, transformers'
  padding-free path). ``best`` names the fastest; ``ratio`` = its median / mimo's (above 1: mimo
  is faster); ``ratios`` every configuration's.

``rel_err`` / ``rel_err_dx`` / ``rel_err_grad`` compare ``mimo`` with the sdpa per-sample run
(outputs less the residual, input gradients, the worst weight gradient); in bf16,
``mimo_vs_fp32_*`` and ``hf_vs_fp32_*`` compare each with that run in fp32 (the weights and
inputs rounded to bf16 alike), so that bf16's own error is seen beside the difference. Times: median of
``--iters`` steps after ``--warmup``, the variants in turn within each iteration; ``peak_gib``
(CUDA): what one step adds to memory. One JSON line.

    python bench/mla_hf.py [--small] [--tokens N] [--iters 10] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdn_hf import device_name, hf_per_sample_step, median_ms, mimo_step, padded, peak_gib, seqlens  # noqa: E402

from mimo.core.testing import rel_err  # noqa: E402
from mimo.llm.blocks import build_layer  # noqa: E402
from mimo.llm.config import HybridArch  # noqa: E402
from mimo.llm.context import SeqContext  # noqa: E402
from mimo.llm.pattern import LayerSpec  # noqa: E402
from mimo.parallel.params import load_full_, param_table  # noqa: E402

# DeepSeek-V3's head sizes (q_lora 1536, kv_lora 512, rope 64, nope 128, v 128) at 16 heads
PRESETS = {
    "deepseek": dict(hidden=2048, heads=16, q_lora_rank=1536, kv_lora_rank=512, rope=64, nope=128, v=128, tokens=8192),
    "small": dict(hidden=128, heads=4, q_lora_rank=48, kv_lora_rank=32, rope=8, nope=16, v=12, tokens=256),
}
EPS = 1e-6
IMPLS = ("eager", "sdpa", "flex_attention", "flash_attention_2")


class HFBlock(nn.Module):
    """transformers' pre-norm + MLA + residual on ``[B, L, D]`` (positions restart per row)."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        self.norm = m.DeepseekV3RMSNorm(cfg.hidden_size, eps=EPS)
        self.attn = m.DeepseekV3Attention(cfg, 0)
        self.rotary = m.DeepseekV3RotaryEmbedding(cfg)

    def forward(self, h_BLD, position_ids, attention_mask=None, **kw):
        y, _ = self.attn(self.norm(h_BLD), self.rotary(h_BLD, position_ids), attention_mask=attention_mask,
                         position_ids=position_ids, **kw)
        return h_BLD + y


def hf_config(sizes: dict, impl: str):
    cfg = transformers.DeepseekV3Config(
        hidden_size=sizes["hidden"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["heads"],
        q_lora_rank=sizes["q_lora_rank"], kv_lora_rank=sizes["kv_lora_rank"], qk_rope_head_dim=sizes["rope"],
        qk_nope_head_dim=sizes["nope"], v_head_dim=sizes["v"], rms_norm_eps=EPS, rope_interleave=True,
        max_position_embeddings=max(4096, sizes["tokens"]), vocab_size=32, num_hidden_layers=1)
    cfg._attn_implementation = impl
    return cfg


def mimo_arch(sizes: dict) -> HybridArch:
    return HybridArch(pattern="+", hidden=sizes["hidden"], heads=sizes["heads"], vocab=32, norm_eps=EPS,
                      mla_q_lora_rank=sizes["q_lora_rank"], mla_kv_lora_rank=sizes["kv_lora_rank"],
                      mla_qk_rope_head_dim=sizes["rope"], mla_qk_nope_head_dim=sizes["nope"], mla_v_head_dim=sizes["v"])


def hf_state_to_ours(block: HFBlock) -> dict:
    state = {k[len("attn."):]: v for k, v in block.state_dict().items() if k.startswith("attn.")}
    return {**state, "norm.weight": block.norm.weight.detach()}


def available(impl: str) -> str | None:
    """Why ``impl`` cannot run here (None: it can)."""
    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed"
    return None


# ---------------------------------------------------------------- steps
def hf_padded_step(block, x_BLD, dy_BLD, mask_BL):
    b, n = mask_BL.shape
    causal = torch.ones(n, n, dtype=torch.bool, device=x_BLD.device).tril()
    mask_B1LL = (causal[None] & mask_BL.bool()[:, None, :])[:, None]  # True: attend
    pos_BL = torch.arange(n, device=x_BLD.device)[None].expand(b, n)

    def step():
        block.zero_grad(set_to_none=True)
        h_BLD = x_BLD.detach().requires_grad_(True)
        y_BLD = block(h_BLD, pos_BL, attention_mask=mask_B1LL)
        y_BLD.backward(dy_BLD)
        return h_BLD, y_BLD
    return step


def hf_packed_step(block, x_TD, dy_TD, lens: list[int]):
    """transformers' padding-free path (flash_attention_2): one row, positions restarting per sample."""
    pos_1T = torch.cat([torch.arange(n, device=x_TD.device) for n in lens])[None]

    def step():
        block.zero_grad(set_to_none=True)
        h_1TD = x_TD.detach()[None].requires_grad_(True)
        y_1TD = block(h_1TD, pos_1T)
        y_1TD.backward(dy_TD[None])
        return h_1TD, y_1TD
    return step


def per_sample_result(run, block) -> dict:
    """(outputs less the residual, input gradients, weight gradients by our names) of a per-sample run."""
    grads = {k[len("attn."):] if k.startswith("attn.") else "norm.weight": p.grad for k, p in block.named_parameters()}
    return {"y": torch.cat([(y - h)[0] for h, y in run]).detach(), "dx": torch.cat([h.grad[0] for h, _ in run]),
            "grads": grads}


def mimo_result(run, layer) -> dict:
    h_TD, y_TD = run
    return {"y": (y_TD - h_TD).detach(), "dx": h_TD.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}}


def errors(got: dict, want: dict, prefix: str = "") -> dict:
    """Relative errors of outputs, input gradients and the worst weight gradient."""
    worst = max((rel_err(got["grads"][n], g.to(got["grads"][n].dtype)), n) for n, g in want["grads"].items())
    return {f"{prefix}rel_err": rel_err(got["y"], want["y"].to(got["y"].dtype)),
            f"{prefix}rel_err_dx": rel_err(got["dx"], want["dx"].to(got["dx"].dtype)),
            f"{prefix}rel_err_grad": worst[0], f"{prefix}rel_err_grad_worst": worst[1]}


def check(mimo_run, per_sample_run, layer, block, fp32_run=None, fp32_block=None) -> dict:
    """mimo against transformers' sdpa per-sample run; in bf16 also each of them against the same
    per-sample run in fp32 (``mimo_vs_fp32_*``, ``hf_vs_fp32_*``): the errors bf16 itself makes."""
    ours, theirs = mimo_result(mimo_run, layer), per_sample_result(per_sample_run, block)
    out = errors(ours, theirs)
    if fp32_run is not None:
        ref = per_sample_result(fp32_run, fp32_block)
        ref = {"y": ref["y"], "dx": ref["dx"], "grads": ref["grads"]}
        out.update(errors({k: (v.float() if k != "grads" else {n: g.float() for n, g in v.items()})
                           for k, v in ours.items()}, ref, "mimo_vs_fp32_"))
        out.update(errors({k: (v.float() if k != "grads" else {n: g.float() for n, g in v.items()})
                           for k, v in theirs.items()}, ref, "hf_vs_fp32_"))
    return out


# ---------------------------------------------------------------- the bench
def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a CPU-sized layer: " + str(PRESETS["small"]))
    for key in PRESETS["deepseek"]:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    torch.backends.cuda.matmul.allow_tf32 = False
    preset = PRESETS["small" if args.small else "deepseek"]
    sizes = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in preset.items()}
    lens = seqlens(sizes["tokens"], args.seed)
    seq = SeqContext.from_seqlens(lens, device=device)
    cu = seq.cu_seqlens.tolist()

    torch.manual_seed(args.seed)
    blocks = {}
    for impl in IMPLS:
        if available(impl) is None:
            blocks[impl] = HFBlock(hf_config(sizes, impl))
    weights = hf_state_to_ours(blocks["sdpa"])
    for block in blocks.values():
        block.load_state_dict(blocks["sdpa"].state_dict())
    layer = build_layer(mimo_arch(sizes), LayerSpec(0, "mla"))
    load_full_(param_table(layer), weights)
    exact = build_layer(mimo_arch(sizes), LayerSpec(0, "mla"))
    load_full_(param_table(exact), weights)
    exact.impl = "exact"
    layer, exact = layer.to(device=device, dtype=dtype), exact.to(device=device, dtype=dtype)
    blocks = {k: b.to(device=device, dtype=dtype) for k, b in blocks.items()}

    g = torch.Generator().manual_seed(args.seed + 1)
    x_TD, dy_TD = (torch.randn(sizes["tokens"], sizes["hidden"], generator=g).to(device, dtype) for _ in range(2))
    x_BLD, mask_BL = padded(x_TD, lens)
    dy_BLD, _ = padded(dy_TD, lens)
    fast = device.type == "cuda" and dtype == torch.bfloat16
    from mimo.llm.attention import _varlen_attn

    result = {"bench": "mla_hf", "device": device_name(device), "torch": torch.__version__,
              "transformers": transformers.__version__, "dtype": dtype_name, **sizes, "samples": len(lens),
              "max_len": max(lens), "iters": args.iters,
              "mimo_kernel": "varlen flash (torch.nn.attention.varlen)" if fast and _varlen_attn() is not None
              else "per-sample SDPA (exact path)",
              "hf_unavailable": {impl: why for impl in IMPLS if (why := available(impl)) is not None}}
    steps = {"mimo": (mimo_step(layer, None, x_TD, dy_TD, seq), layer),
             "mimo_exact": (mimo_step(exact, None, x_TD, dy_TD, seq), exact)}
    for impl, block in blocks.items():
        if impl == "flash_attention_2":
            steps["hf_flash_attention_2_packed"] = (hf_packed_step(block, x_TD, dy_TD, lens), block)
            continue
        steps[f"hf_{impl}_per_sample"] = (hf_per_sample_step(block, x_TD, dy_TD, cu, positions=True), block)
        steps[f"hf_{impl}_padded"] = (hf_padded_step(block, x_BLD, dy_BLD, mask_BL), block)
    failed = {}
    for name in list(steps):
        try:
            steps[name][0]()
        except Exception as e:  # a configuration that does not run here is reported, not fatal
            failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
            del steps[name]
    result["hf_failed"] = failed
    times = median_ms({name: step for name, (step, _) in steps.items()}, args.iters, args.warmup, device)
    for name, (step, module) in steps.items():
        result[name] = {"ms": times[name], **peak_gib(step, module, device)}
    anchors = {n: t for n, t in times.items() if n.startswith("hf_")}
    result["ratios"] = {n: round(t / times["mimo"], 3) for n, t in anchors.items()}
    result["best"] = min(anchors, key=anchors.get)
    result["ratio"] = result["ratios"][result["best"]]
    fp32_run = fp32_block = None
    if dtype != torch.float32:  # the same per-sample run in fp32: what bf16 costs each side
        fp32_block = HFBlock(hf_config(sizes, "sdpa")).to(device)
        fp32_block.load_state_dict({k: v.float() for k, v in blocks["sdpa"].state_dict().items()})
        fp32_run = hf_per_sample_step(fp32_block, x_TD.float(), dy_TD.float(), cu, positions=True)()
    result.update(check(steps["mimo"][0](), steps["hf_sdpa_per_sample"][0](), layer, blocks["sdpa"], fp32_run, fp32_block))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Mamba-2 and Gated DeltaNet layers: the torch (chunked) path against the GPU kernels.

One layer each, at a realistic size (Nemotron-H-like Mamba-2, Qwen3-Next-like GDN), forward
+ backward on one pack of ragged samples. The anchor is the same layer on the optional kernel
packages (mamba_ssm's SSD scan, flash-linear-attention's chunked gated delta rule), when they
are installed; ``ratio`` = kernel time / torch time (1.0 = the torch path is as fast), and
``rel_err`` compares the two outputs. Prints one JSON line.

    python bench/llm_recurrent.py [--tokens 8192] [--iters 10] [--dtype bf16] [--no-anchor]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch

from mimo.llm.context import SeqContext
from mimo.llm.gdn import GatedDeltaNet, GDNConfig
from mimo.llm.mamba2 import Mamba2, Mamba2Config


def _seqlens(tokens: int, seed: int = 0) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < tokens:
        out.append(min(rng.choice([1, 7, 100, 300, 700, 1500, 2500]), tokens - sum(out)))
    return out


def _time(fn, iters: int, device) -> float:
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def bench_layer(name: str, layer: torch.nn.Module, hidden: int, args, device, dtype) -> dict:
    layer.init_weights(seed=0, std=0.02)
    layer = layer.to(device=device, dtype=dtype)
    seqlens = _seqlens(args.tokens)
    ctx = SeqContext.from_seqlens(seqlens, device=device)
    x = torch.randn(args.tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x, ctx).backward(dy)

    @torch.no_grad()
    def forward():
        return layer(x, ctx) - x

    out = {"tokens": args.tokens, "samples": len(seqlens)}
    layer.mixer.impl = "chunked"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["torch_ms"] = round(_time(step, args.iters, device), 3)  # forward + backward
    out["torch_fwd_ms"] = round(_time(forward, args.iters, device), 3)
    if device.type == "cuda":
        out["torch_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    y_torch = forward()
    if not args.no_anchor:
        layer.mixer.impl = "kernel"
        try:  # forward first: some kernels run forward but refuse backward on some GPUs
            out["kernel_fwd_ms"] = round(_time(forward, args.iters, device), 3)
            y_kernel = forward()
            out["rel_err"] = float((y_kernel.double() - y_torch.double()).norm() / y_torch.double().norm())
            out["fwd_ratio"] = round(out["kernel_fwd_ms"] / out["torch_fwd_ms"], 3)
            out["kernel_ms"] = round(_time(step, args.iters, device), 3)
            out["ratio"] = round(out["kernel_ms"] / out["torch_ms"], 3)
        except Exception as e:  # package missing or kernel failure: report, keep the torch numbers
            out["kernel_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--no-anchor", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    mamba = Mamba2(Mamba2Config(hidden=2048, heads=64, head_dim=64, state=128, groups=8, chunk=128))
    gdn = GatedDeltaNet(GDNConfig(hidden=2048, heads=16, v_heads=32, head_dim=128, v_head_dim=128, chunk=64))
    result = {
        "bench": "llm_recurrent",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "mamba2": bench_layer("mamba2", mamba, 2048, args, device, dtype),
        "gdn": bench_layer("gdn", gdn, 2048, args, device, dtype),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

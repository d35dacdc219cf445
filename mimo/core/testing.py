"""Comparison helpers for the reference discipline (DESIGN §3): error = ||a-b|| / ||b||."""

from __future__ import annotations

from typing import Mapping

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; 0 when both are zero, inf when only ``b`` is."""
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    num = torch.linalg.vector_norm(a64 - b64).item()
    den = torch.linalg.vector_norm(b64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def max_rel_err(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> tuple[float, str]:
    """Largest rel_err over the tensors of two dicts with the same keys, and its key."""
    if set(got) != set(want):
        raise ValueError(f"key mismatch: {sorted(set(got) ^ set(want))}")
    worst, worst_key = 0.0, ""
    for k in want:
        e = rel_err(got[k], want[k])
        if e > worst or not worst_key:
            worst, worst_key = e, k
    return worst, worst_key


def assert_close(got, want, tol: float = 1e-5, what: str = "") -> None:
    """Assert rel_err <= tol for a tensor or a dict of tensors (reports the worst key)."""
    if isinstance(want, Mapping):
        err, key = max_rel_err(got, want)
        label = f"{what}[{key}]" if what else key
    else:
        err, label = rel_err(got, want), what or "tensor"
    assert err <= tol, f"{label}: rel err {err:.3e} > {tol:.1e}"


def rank_device(kind: str = "cpu") -> torch.device:
    """The device this rank computes on in a verification: the CPU, or the GPU the launcher
    bound this rank to (``torch.cuda.current_device()``). On a GPU, fp32 matrix products and
    convolutions are made true fp32 (TF32 off), so that fp32 checks keep the CPU's tolerance."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"unknown device kind {kind!r} (cpu or cuda)")
    # the legacy flags: what the project sets elsewhere (mixing them with ``fp32_precision`` raises)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", torch.cuda.current_device())

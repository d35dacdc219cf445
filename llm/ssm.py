"""Pieces shared by the recurrent layers (Mamba-2, Gated DeltaNet) over packed sequences.

- ``segments``: per-token segment id and offset inside its segment, from ``cu_seqlens``;
- ``causal_conv1d``: the short depthwise causal convolution, reset at every sample boundary;
- ``segsum``: stable segment sums of log-decays, the core of the chunked (matrix) forms;
- initialisers (full shape, TP-invariant through ``mimo.parallel.params``) for dt bias, A_log, conv;
- ``find_kernel``: feature detection of optional GPU kernel packages (mamba_ssm, causal_conv1d,
  fla). They are imported lazily, only when installed and asked for, never at module load.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math

import torch
import torch.nn.functional as F

from mimo.llm.cache import pad_rows
from mimo.llm.context import segment_index
from mimo.llm.norm import RMSNorm
from mimo.llm.recurrence import conv1d_naive
from mimo.parallel.context import ParallelContext
from mimo.parallel.params import init_params_, param_table

__all__ = [
    "PreNormResidual", "segments", "causal_conv1d", "conv_over_chunks", "silu_conv", "short_conv", "conv_step", "segsum", "kernel", "find_kernel", "KERNELS", "IMPLS",
    "init_dt_bias", "init_conv", "init_uniform_log", "init_constant",
]


def segments(cu_seqlens: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seg_T, offset_T)``: segment index of each of ``t`` tokens and its offset in it.

    Tokens past ``cu_seqlens[-1]`` (there should be none) form one more trailing segment.
    """
    cu = cu_seqlens.to(torch.int64)
    seg_T = segment_index(cu, t)
    offset_T = torch.arange(t, device=cu.device) - cu[seg_T.clamp(max=cu.numel() - 1)]
    return seg_T, offset_T


def causal_conv1d(x_TC: torch.Tensor, w_CK: torch.Tensor, bias_C: torch.Tensor | None, offset_T: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv: ``y_t = sum_s w[:, K-1-s] * x_{t-s}`` over ``s < K`` within t's sample.

    Same weight convention as ``nn.Conv1d(C, C, K, groups=C, padding=K-1)`` truncated to T
    (Mamba-2's and causal-conv1d's). ``offset_T`` (position inside the sample) masks the taps
    that would read the previous sample, so the convolution restarts at each boundary.
    K is small (4): a loop over taps, no [T, K, C] unfold.
    """
    k = w_CK.shape[1]
    y_TC = x_TC * w_CK[:, k - 1]
    for s in range(1, k):
        shifted_TC = F.pad(x_TC, (0, 0, s, 0))[: x_TC.shape[0]]  # x_{t-s}, zeros for t < s
        keep_T1 = (offset_T >= s).unsqueeze(-1)
        y_TC = y_TC + torch.where(keep_T1, shifted_TC, 0.0) * w_CK[:, k - 1 - s]
    return y_TC if bias_C is None else y_TC + bias_C


def conv_over_chunks(conv, x_TC: torch.Tensor, kernel: int, seq) -> torch.Tensor:
    """``conv(x_TC, seg_T, offset_T, cu_seqlens)``, a causal convolution of ``kernel`` taps
    that restarts at each segment, over the pack of ``seq``. Under context parallelism a segment
    is a chunk of a sample: each chunk first gets the ``kernel - 1`` positions before it in its
    sample from the CP ranks holding them (``mimo.llm.cp.CPChunks.with_halo``), and the
    offsets are positions in the sample, so the taps stop only at the sample's start."""
    if seq.cp is None or kernel == 1:
        seg_T, offset_T = segments(seq.cu_seqlens, x_TC.shape[0])
        return conv(x_TC, seg_T, offset_T, seq.cu_seqlens)
    ext_TC, offset_T, seg_T, keep, cu = seq.cp.with_halo(x_TC, kernel - 1)
    return conv(ext_TC, seg_T, offset_T, cu).index_select(0, keep)


def conv_step(state_NKC: torch.Tensor, x_NC: torch.Tensor, w_CK: torch.Tensor, bias_C: torch.Tensor | None):
    """``causal_conv1d`` at one new token per row: ``state_NKC`` holds the row's previous
    ``K - 1`` inputs, oldest first (zeros before its sample's start). Returns (the output, the
    state after the token). The taps are summed in ``causal_conv1d``'s order, so a decode step
    rounds as the whole-sequence convolution does."""
    k = w_CK.shape[1]
    y_NC = x_NC * w_CK[:, k - 1]
    for s in range(1, k):
        y_NC = y_NC + state_NKC[:, k - 1 - s] * w_CK[:, k - 1 - s]
    state_NKC = torch.cat([state_NKC[:, 1:], x_NC[:, None]], 1)
    return (y_NC if bias_C is None else y_NC + bias_C), state_NKC


def silu_conv(impl: str, x_TC, w_CK, bias_C, seg_T, offset_T, cu_seqlens) -> torch.Tensor:
    """SiLU(the short causal convolution, restarting at each segment) by ``impl`` (``IMPLS``):
    causal-conv1d's kernel where ``find_kernel`` allows it, ``conv1d_naive`` for "naive", else
    ``causal_conv1d``."""
    if impl == "naive":
        return F.silu(conv1d_naive(x_TC, w_CK, bias_C, cu_seqlens))
    fn = find_kernel("conv", impl, x_TC)
    if fn is not None:  # channel-last [1, C, T] view; seq_idx restarts the conv per sample
        y = fn(x_TC.unsqueeze(0).transpose(1, 2), w_CK, bias_C, seq_idx=seg_T.to(torch.int32).unsqueeze(0), activation="silu")
        return y.transpose(1, 2).squeeze(0)
    return F.silu(causal_conv1d(x_TC, w_CK, bias_C, offset_T))


def short_conv(impl: str, x_TC: torch.Tensor, w_CK: torch.Tensor, bias_C: torch.Tensor | None, seq, state: dict | None,
               key: str) -> torch.Tensor:
    """A recurrent layer's short convolution (``silu_conv`` by ``impl``) over ``seq``'s pack
    (``conv_over_chunks``). Under a generation cache (``mimo.llm.cache``; ``state``: the layer's
    entry) the prefill also keeps each sample's last ``K - 1`` inputs under ``key``, and a
    decode step convolves each row's new input with them (``conv_step``)."""
    cache, k = seq.cache, w_CK.shape[1]
    if cache is not None and cache.decoding:
        y_NC, state[key] = conv_step(state[key], x_TC[: cache.rows], w_CK, bias_C)
        return pad_rows(F.silu(y_NC), x_TC.shape[0])
    if cache is not None:
        at_NK = cache.ends_N[:, None] + torch.arange(2 - k, 1, device=x_TC.device)  # the last K-1 positions
        inside_NK1 = (at_NK >= cache.starts_N[:, None])[..., None]
        state[key] = torch.where(inside_NK1, x_TC[at_NK.clamp_min(0)], 0.0)
    return conv_over_chunks(lambda x, *s: silu_conv(impl, x, w_CK, bias_C, *s), x_TC, k, seq)


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``i >= j`` (0 on the diagonal).

    Entries above the diagonal are 0 (mask them yourself). Built by a masked cumsum instead of
    ``cumsum[i] - cumsum[j]``: no cancellation between two large partial sums.
    """
    n = a.shape[-1]
    strict = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)
    a_ij = a.unsqueeze(-1).expand(*a.shape, n).masked_fill(~strict, 0.0)  # [..., i, j] = a_i if i > j
    return a_ij.cumsum(-2)


# ---- initialisers (full shape; each rank keeps its slice: mimo.parallel.init.init_local) ----
def init_dt_bias(dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4):
    """Mamba-2's dt bias: softplus(bias) log-uniform in [dt_min, dt_max]."""

    def fill(t: torch.Tensor, gen: torch.Generator) -> None:
        u = torch.rand(t.shape, generator=gen)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
        t.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    return fill


def init_conv(kernel_size: int):
    """``nn.Conv1d``'s default for a depthwise conv: U(-1/sqrt(K), 1/sqrt(K)) (fan_in = K)."""
    bound = 1.0 / math.sqrt(kernel_size)

    def fill(t: torch.Tensor, gen: torch.Generator) -> None:
        t.uniform_(-bound, bound, generator=gen)

    return fill


def init_uniform_log(low: float, high: float):
    """log(U(low, high)): A_log of Mamba-2 (1, 16) and Gated DeltaNet (0, 16)."""

    def fill(t: torch.Tensor, gen: torch.Generator) -> None:
        t.uniform_(low, high, generator=gen).clamp_(min=1e-4).log_()  # no log(0)

    return fill


def init_constant(value: float):
    def fill(t: torch.Tensor, gen: torch.Generator) -> None:
        t.fill_(value)

    return fill


# ---- optional GPU kernels ----
IMPLS = ("auto", "kernel", "chunked", "naive")
_log = logging.getLogger(__name__)


def _probe_ssd(fn, device) -> None:
    bf = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(1, 32, 2, 16, **bf, requires_grad=True)
    dt = torch.rand(1, 32, 2, device=device, requires_grad=True)
    B, C = (torch.randn(1, 32, 1, 16, **bf, requires_grad=True) for _ in range(2))
    seq_idx = (torch.arange(32, device=device) >= 11).to(torch.int32).unsqueeze(0)
    fn(x, dt, -torch.rand(2, device=device), B, C, chunk_size=16, seq_idx=seq_idx).float().sum().backward()


def _probe_conv(fn, device) -> None:
    x = torch.randn(1, 32, 16, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    w = torch.randn(16, 4, device=device, dtype=torch.bfloat16, requires_grad=True)
    seq_idx = (torch.arange(32, device=device) >= 11).to(torch.int32).unsqueeze(0)
    fn(x, w, None, seq_idx=seq_idx, activation="silu").float().sum().backward()


def _probe_gated_delta(fn, device) -> None:
    bf = dict(device=device, dtype=torch.bfloat16)
    q, k = (F.normalize(torch.randn(1, 32, 2, 16, **bf), dim=-1).requires_grad_(True) for _ in range(2))
    v = torch.randn(1, 32, 2, 16, **bf, requires_grad=True)
    g = (-torch.rand(1, 32, 2, device=device)).requires_grad_(True)
    beta = torch.rand(1, 32, 2, **bf, requires_grad=True)
    cu = torch.tensor([0, 11, 32], device=device, dtype=torch.long)
    o, _ = fn(q, k, v, g, beta, scale=1.0, cu_seqlens=cu)
    o.float().sum().backward()


# name -> (module, function, probe): mamba_ssm's SSD scan, Dao's causal-conv1d, fla's gated delta rule
KERNELS = {
    "ssd": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", _probe_ssd),
    "conv": ("causal_conv1d", "causal_conv1d_fn", _probe_conv),
    "gated_delta": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", _probe_gated_delta),
}
_IMPORTED: dict[str, object] = {}
_PROBED: dict[tuple[str, str], bool] = {}


def kernel(name: str):
    """The kernel function ``name`` of ``KERNELS`` if its package is installed (imported on first use), else None."""
    if name not in _IMPORTED:
        module, attr, _ = KERNELS[name]
        fn = None
        try:
            if importlib.util.find_spec(module.split(".")[0]) is not None:
                fn = getattr(importlib.import_module(module), attr, None)
        except Exception as e:  # a broken install (ABI mismatch, no triton) means "not available"
            _log.warning("optional kernel %s.%s could not be imported (%s); using the torch path", module, attr, e)
        _IMPORTED[name] = fn
    return _IMPORTED[name]


def find_kernel(name: str, impl: str, x: torch.Tensor):
    """The kernel a layer with ``impl`` (one of ``IMPLS``) should call for input ``x``, or None.

    "kernel": the kernel whenever installed (the caller decides what a missing one means).
    "auto": only on CUDA in bf16/fp16 (docs/design.md §3: fast paths are half precision; fp32 runs the
    exact torch path), and only if a tiny forward + backward with sample boundaries ran on this
    device (probed once per process and device: a package can import yet refuse to run, e.g.
    fla on Hopper with Triton < 3.7.1 raises in backward). "chunked" / "naive": None.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; one of {IMPLS}")
    if impl == "kernel":
        return kernel(name)
    if impl != "auto" or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    fn = kernel(name)
    if fn is None:
        return None
    key = (name, str(x.device))
    if key not in _PROBED:
        try:
            with torch.enable_grad():
                KERNELS[name][2](fn, x.device)
            _PROBED[key] = True
        except Exception as e:
            _log.warning("optional kernel %r does not run on %s (%s: %s); using the torch path",
                         name, x.device, type(e).__name__, str(e)[:200])
            _PROBED[key] = False
    return fn if _PROBED[key] else None


class PreNormResidual(torch.nn.Module):
    """A recurrent layer: ``forward(h_TD, seq) -> h + mixer(norm(h))`` (``[T/tp, D]`` blocks
    under sequence parallelism). Mamba-2 and Gated DeltaNet differ only in their mixer, which
    is built on the same context ``ctx``."""

    def __init__(self, hidden: int, eps: float, mixer: torch.nn.Module, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        # under SP each rank normalises its own tokens: the norm weight's gradient is partial
        self.norm = RMSNorm(hidden, eps, ctx, partial=ctx.sequence_parallel)
        self.mixer = mixer

    def init_weights(self, seed: int, std: float, out_std: float | None = None) -> None:
        """TP-invariant: each parameter from ``param_seed(seed, its name in this layer)``;
        projections N(0, std) (``out_proj``: ``out_std``), the rest by the mixer's ``param_init``."""
        init_params_(param_table(self), seed, std, {"mixer.out_proj.weight": std if out_std is None else out_std})

    def forward(self, h_TD: torch.Tensor, seq) -> torch.Tensor:
        return h_TD + self.mixer(self.norm(h_TD), seq)

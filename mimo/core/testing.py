"""Comparison helpers for the reference discipline (docs/design.md §3): error = ||a-b|| / ||b||.

``Yardstick`` is the tolerance of every check of a parallel layout against its one-process
reference (docs/design.md §9): the reference runs in fp64 as well as fp32, and a tensor of the layout
passes when its error against the fp64 run is at most ``max(tol, k * e1)``, ``e1`` being the
one-process fp32 run's own error against fp64. A fixed ``tol`` alone sits at the noise floor of
reduction-heavy and near-zero tensors; ``k * e1`` is that floor, measured per tensor. A layout
bug (a missing reduction, a wrong slice, a factor 2) is orders of magnitude above both.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

# how far above the one-process fp32 run's own rounding error a layout may be: summation in
# another order (TP shards, DP buckets) is a rounding of the same size, not a multiple of it
YARDSTICK_K = 4.0


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


def _norm64(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.detach().double().cpu()).item()


def _as_tensor(x) -> torch.Tensor:
    return x if torch.is_tensor(x) else torch.tensor(float(x), dtype=torch.float64)


@dataclass(frozen=True)
class Measure:
    """One tensor (or scalar) under the yardstick. ``err``: the layout against the fp64
    reference; ``e1``: the one-process fp32 run against fp64; both ||a - ref64|| / ||ref64||,
    or absolute norms (``absolute``) where the fp64 reference is exactly zero."""

    name: str
    err: float
    e1: float
    bound: float
    absolute: bool = False

    @property
    def ok(self) -> bool:
        return self.err <= self.bound  # NaN fails

    @property
    def ratio(self) -> float:
        """err / bound: above 1 fails; how close to failing a passing tensor is."""
        return math.inf if math.isnan(self.err) else self.err / self.bound if self.bound > 0 else math.inf

    def as_dict(self) -> dict:
        out = {"name": self.name, "err_vs_fp64": self.err, "one_process_fp32_vs_fp64": self.e1, "bound": self.bound,
               "ok": self.ok}
        return {**out, "absolute": True} if self.absolute else out

    def __str__(self) -> str:
        kind = "abs err" if self.absolute else "rel err"
        return (f"{self.name}: {kind} {self.err:.3e} vs fp64 (one-process fp32 {self.e1:.3e}; bound "
                f"{self.bound:.3e}) {'ok' if self.ok else 'FAIL'}")


@dataclass
class Yardstick:
    """Measures of a layout against a one-process reference computed in fp32 and in fp64
    (module doc). ``check`` one tensor, ``check_all`` dicts (nested dicts of tensors and
    floats: losses, grad norms, grads, params); ``ok``, ``worst``, ``summary``, ``assert_ok``."""

    tol: float
    k: float = YARDSTICK_K
    measures: list[Measure] = field(default_factory=list)

    def check(self, name: str, got, ref32, ref64) -> Measure:
        got, ref32, ref64 = _as_tensor(got), _as_tensor(ref32), _as_tensor(ref64)
        if not got.shape == ref32.shape == ref64.shape:
            raise ValueError(f"{name}: shape mismatch: {tuple(got.shape)}, fp32 reference {tuple(ref32.shape)}, "
                             f"fp64 reference {tuple(ref64.shape)}")
        ref = ref64.detach().double().cpu()
        den = _norm64(ref)
        scale = den if den > 0 else 1.0  # an exactly-zero truth: absolute errors
        err = _norm64(got.detach().double().cpu() - ref) / scale
        e1 = _norm64(ref32.detach().double().cpu() - ref) / scale
        return self.record(name, err, e1, absolute=den == 0)

    def record(self, name: str, err: float, e1: float, absolute: bool = False) -> Measure:
        """A measure taken elsewhere (another rank's ``check``), bounded by this yardstick."""
        m = Measure(name, float(err), float(e1), max(self.tol, self.k * float(e1)), absolute)
        self.measures.append(m)
        return m

    def extend(self, measures, prefix: str = "") -> None:
        """Measures (``Measure`` or ``as_dict()`` dicts, e.g. returned by workers), re-bounded here."""
        for m in measures:
            if isinstance(m, Measure):
                m = m.as_dict()
            self.record(prefix + m["name"], m["err_vs_fp64"], m["one_process_fp32_vs_fp64"], m.get("absolute", False))

    def check_all(self, got: Mapping, ref32: Mapping, ref64: Mapping, prefix: str = "") -> None:
        """Every key of ``ref64`` (recursively); the three must have the same keys."""
        if not set(got) == set(ref32) == set(ref64):
            odd = (set(got) | set(ref32) | set(ref64)) - (set(got) & set(ref32) & set(ref64))
            raise ValueError(f"{prefix or 'dicts'}: key mismatch: {sorted(map(str, odd))[:10]}")
        for key, want in ref64.items():
            name = f"{prefix}{key}"
            if isinstance(want, Mapping):
                self.check_all(got[key], ref32[key], want, f"{name}.")
            else:
                self.check(name, got[key], ref32[key], want)

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.measures)

    def worst(self, n: int = 5, startswith: str = "") -> list[Measure]:
        """The ``n`` measures closest to (or furthest past) their bound."""
        ms = [m for m in self.measures if m.name.startswith(startswith)]
        return sorted(ms, key=lambda m: m.ratio, reverse=True)[:n]

    def summary(self, n: int = 5) -> dict:
        return {"k": self.k, "tol": self.tol, "checked": len(self.measures), "failed": sum(not m.ok for m in self.measures),
                "ok": self.ok, "worst": [m.as_dict() for m in self.worst(n)]}

    def message(self, n: int = 5) -> str:
        failed = sum(not m.ok for m in self.measures)
        head = f"yardstick max(tol={self.tol:.1e}, {self.k:g} x one-process fp32 err): {failed} of {len(self.measures)} failed"
        return "\n  ".join([head, *map(str, self.worst(n))])

    def assert_ok(self, what: str = "") -> None:
        assert self.measures, f"{what}: nothing was checked"
        assert self.ok, (f"{what}: " if what else "") + self.message()


def yardstick_check(got: Mapping, ref32: Mapping, ref64: Mapping, tol: float = 1e-5, k: float = YARDSTICK_K) -> Yardstick:
    """``Yardstick(tol, k)`` over three dicts with the same keys (see ``Yardstick.check_all``)."""
    ys = Yardstick(tol, k)
    ys.check_all(got, ref32, ref64)
    return ys


@contextlib.contextmanager
def fp64_kept():
    """While it is open, a cast of an fp64 tensor to fp32 (``.to``, ``.float()``, softmax's
    ``dtype``, and ``new_zeros(..., dtype=float32)`` of one: Kimi-K2.5's ``temporal_merge``) keeps
    it fp64: an fp64 reference run of Hugging Face code whose norms, rotary and router softmax
    upcast "to fp32" stays fp64 throughout (else those casts put fp32 rounding into the yardstick's
    fp64 run)."""
    import torch.nn.functional as F

    to, flt, softmax, new_zeros = torch.Tensor.to, torch.Tensor.float, F.softmax, torch.Tensor.new_zeros

    def keep(dtype, t):
        return torch.float64 if dtype is torch.float32 and t.dtype is torch.float64 else dtype

    def to_(self, *args, **kw):
        args = tuple(keep(a, self) if isinstance(a, torch.dtype) else a for a in args)
        if isinstance(kw.get("dtype"), torch.dtype):
            kw["dtype"] = keep(kw["dtype"], self)
        return to(self, *args, **kw)

    def float_(self, *args, **kw):
        return self if self.dtype is torch.float64 else flt(self, *args, **kw)

    def softmax_(x, *args, dtype=None, **kw):
        return softmax(x, *args, dtype=keep(dtype, x), **kw)

    def new_zeros_(self, *args, **kw):
        if isinstance(kw.get("dtype"), torch.dtype):
            kw["dtype"] = keep(kw["dtype"], self)
        return new_zeros(self, *args, **kw)

    torch.Tensor.to, torch.Tensor.float, F.softmax, torch.Tensor.new_zeros = to_, float_, softmax_, new_zeros_
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, F.softmax, torch.Tensor.new_zeros = to, flt, softmax, new_zeros

"""The run's precision policy: which dtype the weights, activations, gradient sums, optimizer
state and master weights use (``train.precision``, ``train.grad_reduce``; docs/design.md §8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each thing uses (docs/design.md §8). ``master_params``: the dtype of the copy of the
    weights that the optimizer updates (None: it updates the model's weights themselves)."""

    params: torch.dtype
    compute: torch.dtype
    grad_reduce: torch.dtype
    optimizer_state: torch.dtype
    master_params: torch.dtype | None = None

    @classmethod
    def named(cls, name: str, grad_reduce: str = "fp32") -> "PrecisionPolicy":
        """``train.precision`` and ``train.grad_reduce``: the dtype gradients accumulate over
        microbatches and are summed in (fp32: main gradients beside bf16 weights; bf16: the
        gradients are the weights' own ``.grad``, no main-gradient buffer)."""
        f32, b16 = torch.float32, torch.bfloat16
        grads = {"fp32": f32, "bf16": b16}[grad_reduce]
        if name == "fp32":
            return cls(f32, f32, f32, f32)
        if name == "bf16":  # bf16 weights and activations; AdamW on fp32 master weights and fp32 state
            return cls(b16, b16, grads, f32, master_params=f32)
        if name == "bf16-pure":  # bf16 weights, activations and Adam state (no master copy)
            return cls(b16, b16, grads, b16)
        raise ValueError(f"unknown precision {name!r}")

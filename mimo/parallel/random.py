"""Dropout RNG streams.

Inside TP-sharded regions (attention heads, FFN columns) each rank holds different elements,
so its dropout mask must come from its own stream (``sharded``); in replicated regions
(residual stream without sequence parallel) every TP rank must draw the same mask
(``replicated``). With sequence parallel the residual stream is sharded by tokens, so it
uses the ``sharded`` stream too. Callers fold further coordinates (pp stage, dp rank, module
name) into ``seed`` when those should differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimo.parallel.init import param_seed

__all__ = ["DropoutStreams", "dropout_streams", "dropout"]


@dataclass
class DropoutStreams:
    sharded: torch.Generator  # differs per TP rank
    replicated: torch.Generator  # identical on every TP rank

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"sharded": self.sharded.get_state(), "replicated": self.replicated.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.sharded.set_state(state["sharded"])
        self.replicated.set_state(state["replicated"])


def dropout_streams(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> DropoutStreams:
    def gen(name: str) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(param_seed(seed, name))

    return DropoutStreams(sharded=gen(f"dropout/tp{tp_rank}"), replicated=gen("dropout/replicated"))


def dropout(x: torch.Tensor, p: float, generator: torch.Generator, training: bool = True) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``generator`` (which must live on x's device)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))

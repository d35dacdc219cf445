"""A module's ``lora`` section and the adapter settings it gives (``mimo.parallel.lora``), free of
torch so that configs load without it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mimo.core.errors import ConfigError
from mimo.core.schema import join_path

__all__ = ["LoraConfig", "LoraSpec"]


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    dora: bool = False

    def __post_init__(self):
        if self.rank < 1:
            raise ConfigError(f"lora.rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class LoraConfig:
    """A module's ``lora`` section: adapters on the projections ``targets`` names (each module
    kind's names: ``LoraTarget`` tables beside its layers), every base weight of the module frozen
    (an encoder's projector still trains unless ``freeze`` lists it)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    dora: bool = False  # weight-decomposed LoRA
    targets: list[str] = field(default_factory=list)
    init: str | None = None  # a PEFT adapter directory the adapters start from (mimo.compose.peft)

    def validate(self, path: str) -> list[str]:
        problems = []
        if self.rank < 1:
            problems.append(f"{join_path(path, 'rank')}: must be at least 1, got {self.rank}")
        if self.alpha <= 0:
            problems.append(f"{join_path(path, 'alpha')}: must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"{join_path(path, 'dropout')}: must be in [0, 1), got {self.dropout}")
        if not self.targets:
            problems.append(f"{join_path(path, 'targets')}: name at least one projection")
        if self.init is not None and not os.path.isfile(os.path.join(self.init, "adapter_config.json")):
            problems.append(f"{join_path(path, 'init')}: {self.init} is not a PEFT adapter directory (no adapter_config.json)")
        repeated = sorted({t for t in self.targets if self.targets.count(t) > 1})
        if repeated:
            problems.append(f"{join_path(path, 'targets')}: {', '.join(repeated)} listed more than once")
        return problems

    def spec(self) -> "LoraSpec":
        return LoraSpec(self.rank, self.alpha, self.dropout, self.dora)

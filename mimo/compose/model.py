"""Model assembly: every module of the config on its own grid, and the bridges between them.

``MimoModel(config, rank)`` is built on every rank of the world at the same point: it creates
all process groups in one fixed order (grids' TP / DP / PP groups, the tied-embedding groups,
one group per encoder→LLM bridge over the union of their ranks), then the parts this rank
runs: the encoders it belongs to (tower + projector) and its LLM pipeline stage. Weights are
initialised from ``train.seed`` by layout-independent names, so any layout starts from the
one-process model's weights; ``init`` sections then load timm / Hugging Face checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from mimo.compose.config import MimoConfig
from mimo.encoders.model import VisionEncoder
from mimo.parallel.grid import ParallelGrid, new_group
from mimo.llm.model import LLMStage, build_stage, embedding_group
from mimo.parallel.params import param_table
from mimo.parallel.params import TrainParam
from mimo.parallel import group_rank, param_seed


@dataclass
class EncoderPart:
    name: str
    grid: ParallelGrid
    tp_group: object
    dp_group: object
    bridge_group: object  # over encoder ∪ LLM ranks
    module: VisionEncoder | None  # None on ranks outside the encoder's grid

    @property
    def trains(self) -> bool:
        """Whether anything of the encoder takes gradients (config-wide, the same on every rank)."""
        return self.module is not None and any(p.requires_grad for p in self.module.parameters())


class MimoModel:
    def __init__(self, config: MimoConfig, rank: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.config, self.rank = config, rank
        llm_cfg = config.llm
        self.llm_name = config.llm_name
        self.llm_grid = llm_cfg.parallel.grid(config.world_size)
        # ---- process groups: the same calls in the same order on every rank ----
        self.llm_tp = self.llm_grid.group("tp")
        self.llm_dp = self.llm_grid.group(("cp", "dp"))
        self.llm_pp = self.llm_grid.group("pp")
        self.llm_embedding_group = embedding_group(self.llm_grid, rank)
        self.encoders: dict[str, EncoderPart] = {}
        for name, enc in config.encoders.items():
            grid = enc.parallel.grid(config.world_size)
            tp, dp = grid.group("tp"), grid.group("dp")
            bridge = new_group(set(grid.ranks) | set(self.llm_grid.ranks))
            module = None
            if rank in grid:
                module = VisionEncoder(enc, llm_cfg.arch.hidden, tp).to(device=device, dtype=dtype)
                module.init_weights(param_seed(config.train.seed, name))
            self.encoders[name] = EncoderPart(name, grid, tp, dp, bridge, module)
        # the encoders' "trains" must be known on every rank (bridges run backward or not)
        self.encoder_trains = {name: "tower" not in enc.freeze or "projector" not in enc.freeze for name, enc in config.encoders.items()}
        self.stage: LLMStage | None = build_stage(llm_cfg.arch, self.llm_grid, rank, llm_cfg.parallel.sequence_parallel)
        if self.stage is not None:
            self.stage.to(device=device, dtype=dtype)
            self.stage.init_weights(param_seed(config.train.seed, self.llm_name))
            if llm_cfg.init.hf:
                from mimo.llm.hf import load_hf_checkpoint

                load_hf_checkpoint(self.stage, llm_cfg.init.hf)
            if llm_cfg.freeze:
                self.stage.requires_grad_(False)

    # ---- views ----
    @property
    def sequence_parallel(self) -> bool:
        return self.stage.sequence_parallel if self.stage is not None else False

    def coords(self, grid: ParallelGrid) -> dict[str, int]:
        return grid.coords(self.rank)

    def train_params(self) -> list[TrainParam]:
        """Every local trainable parameter with its DP group and whether it counts in the norm."""
        out: list[TrainParam] = []
        for name, part in self.encoders.items():
            if part.module is None:
                continue
            c = part.grid.coords(self.rank)
            out += _describe(name, part.module, param_table(part.module), part.dp_group, c["dp"] == 0, group_rank(part.tp_group))
        if self.stage is not None:
            c = self.llm_grid.coords(self.rank)
            first_of_dp = c["dp"] == 0 and c["cp"] == 0
            table = self.stage.param_table()
            tied = self.stage.tied_weight()
            infos = _describe(self.llm_name, self.stage, table, self.llm_dp, first_of_dp, group_rank(self.llm_tp))
            for info in infos:  # a tied embedding's last-stage copy is the same parameter: count it once
                if tied is not None and info.param is tied and not self.stage.is_first:
                    info.counts_in_norm = False
            out += infos
        return out

    def full_grads(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full gradients by module and canonical name (collective over each TP group)."""
        return self._full(grads=True)

    def full_params(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._full(grads=False)

    def _full(self, grads: bool) -> dict[str, dict[str, torch.Tensor]]:
        from mimo.parallel.params import full_tensors

        out = {}
        for name, part in self.encoders.items():
            if part.module is not None:
                out[name] = full_tensors(param_table(part.module), grads=grads)
        if self.stage is not None:
            out[self.llm_name] = full_tensors(self.stage.param_table(), grads=grads)
        return out


def _describe(module_name: str, module: nn.Module, table, dp_group, first_of_dp: bool, tp_rank: int) -> list[TrainParam]:
    out = []
    for name, info in table.items():
        if not info.param.requires_grad:
            continue
        replicated_over_tp = info.spec.dim is None
        counts = first_of_dp and (not replicated_over_tp or tp_rank == 0)
        # no weight decay on biases, norms and other vectors (the usual AdamW practice)
        decay = info.param.dim() >= 2
        out.append(TrainParam(module_name, name, info.param, dp_group, counts, decay))
    return out

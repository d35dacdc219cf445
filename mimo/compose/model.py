"""Model assembly: every module of the config on its own grid, and the bridges between them.

``MimoModel(config, rank)`` is built on every rank of the world at the same point. It owns
the run's ``GroupRegistry`` (one communicator per distinct rank set) and builds, in one fixed
order, each module's ``ParallelContext`` (the LLM's first, then each encoder's), the
tied-embedding groups and one group per encoder→LLM bridge over the union of their ranks;
then the parts this rank runs: the encoders it belongs to (tower + projector; a ``kind:
qwen3_vl`` encoder: the Qwen3-VL tower, ``mimo.encoders.model.NativeVisionEncoder``) and its LLM
pipeline stage, each handed its context. Weights are initialised from ``train.seed`` by
layout-independent names (each rank drawing only its shards), so any layout starts from the
one-process model's weights; ``init`` sections then load timm / Hugging Face checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mimo.compose.config import Fp8Config, MimoConfig
from mimo.core.errors import MimoError
from mimo.encoders.model import NativeVisionEncoder, VisionEncoder, build_encoder
from mimo.llm.model import LLMStage, build_stage, embedding_group
from mimo.llm.moe import set_dispatchers
from mimo.parallel import gemm, param_seed
from mimo.parallel.fp8 import apply_fp8, clear_fp8
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import GroupRegistry, ParallelGrid
from mimo.parallel.params import TrainParam, param_table

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")  # an LLM layer's modules, by global index


@dataclass
class EncoderPart:
    name: str
    ctx: ParallelContext
    bridge_group: object  # over encoder ∪ LLM ranks
    module: VisionEncoder | NativeVisionEncoder | None  # None on ranks outside the encoder's grid

    @property
    def grid(self) -> ParallelGrid:
        return self.ctx.grid

    @property
    def tp_group(self):
        return self.ctx.tp

    @property
    def dp_group(self):
        return self.ctx.grad_group


class MimoModel:
    def __init__(self, config: MimoConfig, rank: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.config, self.rank = config, rank
        self.device = torch.device(device)  # this rank's compute device (also where nothing of it trains)
        llm_cfg = config.llm
        self.llm_name = config.llm_name
        # ---- process groups: the same requests in the same order on every rank ----
        self.registry = registry = GroupRegistry()
        par = llm_cfg.parallel
        # the experts' own view (parallel folding) where they are laid out unlike the dense layers
        self.llm_ctx = ParallelContext(par.grid(config.world_size, registry), rank, registry,
                                       sequence_parallel=par.sequence_parallel, expert=llm_cfg.expert_layout(), gtp=par.gtp,
                                       egtp=par.egtp if llm_cfg.expert_layout() is not None else 1)
        self.llm_grid = self.llm_ctx.grid
        self.llm_embedding_group = embedding_group(self.llm_ctx)
        self.encoders: dict[str, EncoderPart] = {}
        for name, enc in config.encoders.items():
            ctx = ParallelContext(enc.parallel.grid(config.world_size, registry), rank, registry,
                                  sequence_parallel=enc.parallel.sequence_parallel, gtp=enc.parallel.gtp)
            bridge = registry.group(set(ctx.grid.ranks) | set(self.llm_grid.ranks), rank)
            module = None
            if ctx.member:
                module = build_encoder(enc, llm_cfg.arch.hidden, ctx).to(device=device, dtype=dtype)
                module.init_weights(param_seed(config.train.seed, name))
                module.tower.set_recompute(*config.recompute_for(name))
            self.encoders[name] = EncoderPart(name, ctx, bridge, module)
        # the encoders' "trains" must be known on every rank (bridges run backward or not)
        self.encoder_trains = {name: enc.trains for name, enc in config.encoders.items()}
        self.stage: LLMStage | None = build_stage(llm_cfg.arch, self.llm_ctx)
        if self.stage is not None:
            self.stage.to(device=device, dtype=dtype)
            self.stage.init_weights(param_seed(config.train.seed, self.llm_name))
            if llm_cfg.init.hf:
                from mimo.llm.hf import load_hf_checkpoint

                load_hf_checkpoint(self.stage, llm_cfg.init.hf)
            if llm_cfg.freeze:
                self.stage.requires_grad_(False)
            if config.train.moe_dispatcher == "deepep" and self.llm_ctx.expert is not None and self.device.type != "cuda":
                raise MimoError("train.moe_dispatcher: deepep runs DeepEP's GPU kernels; this run is on the CPU "
                                "(--device cuda with a GPU per rank, or alltoall)")
            set_dispatchers(self.stage, config.train.moe_dispatcher)
            self.stage.set_recompute(*config.recompute_for(self.llm_name))
        self.fp8: Fp8Config | None = None  # train.fp8 as set on the modules (set_fp8)
        if config.train.fp8 is not None:
            self.set_fp8(config.train.fp8)
        # the run's gradient buffers (``mimo.training.optim.GradSync``), built once by the
        # training side on its first step and kept
        self.grad_sync = None
        self.cuda_graphs = False  # the vision blocks replay as CUDA graphs (mimo.training.run.compile_blocks)

    def graph_step(self) -> None:
        """A new step of the CUDA-graphed blocks: outputs of the last one may be overwritten
        (torch.compile's cudagraph trees); called where a step or a forward-only pass begins."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def set_fp8(self, f8: Fp8Config | None) -> None:
        """FP8 GEMMs (``train.fp8``) on every LLM layer but ``bf16_layers`` and every vision
        block (not patch embeddings, projectors, embeddings or the LM head); None: back to the
        run's precision everywhere."""
        self.fp8 = f8
        parts = [(p.module.tower, p.ctx, lambda n: n.startswith("blocks.")) for p in self.encoders.values() if p.module is not None]
        if self.stage is not None:
            kept = f8.kept_layers(len(self.config.llm.arch.layer_pattern().layers)) if f8 is not None else set()
            parts.append((self.stage, self.llm_ctx,
                          lambda n: (m := _LAYER_NAME.match(n)) is not None and int(m.group(1)) not in kept))
        for root, ctx, keep in parts:
            if f8 is None:
                clear_fp8(root, gemm.default_recipe)
            else:
                apply_fp8(root, f8.recipe, ctx, f8.amax_history, keep)

    # the LLM's groups, as its context holds them
    @property
    def llm_tp(self):
        return self.llm_ctx.tp

    @property
    def llm_dp(self):
        return self.llm_ctx.grad_group

    @property
    def llm_pp(self):
        return self.llm_ctx.pp

    def encoder_grids(self) -> dict[str, ParallelGrid]:
        return {name: part.grid for name, part in self.encoders.items()}

    def gtp_chains(self) -> list[tuple[str, object]]:
        """(module name, a GTP chain of it on this rank: ``mimo.parallel.gtp``) for each one."""
        contexts = [(name, part.ctx) for name, part in self.encoders.items() if part.module is not None]
        if self.stage is not None:
            contexts.append((self.llm_name, self.llm_ctx))
        return [(name, chain) for name, ctx in contexts for chain in (ctx.gtp_chain, ctx.egtp_chain) if chain is not None]

    def wait_roots(self, module: str) -> list[torch.nn.Module]:
        """The submodules of ``module`` on this rank whose forwards first use its weights, outer
        before inner: the LLM stage and its layers; an encoder and its tower's blocks (a sharded
        optimizer's weight gathers are waited for there)."""
        if module == self.llm_name:
            return [] if self.stage is None else [self.stage, *self.stage.layers.values()]
        part = self.encoders[module].module
        return [] if part is None else [part, *part.tower.blocks]

    # ---- views ----
    @property
    def sequence_parallel(self) -> bool:
        return self.stage.sequence_parallel if self.stage is not None else False

    def coords(self, grid: ParallelGrid) -> dict[str, int]:
        return grid.coords(self.rank)

    def train_params(self) -> list[TrainParam]:
        """Every local trainable parameter with its gradient group and whether this rank's copy
        counts in the norm (read from its placement: one copy of every element in the world)."""
        out: list[TrainParam] = []
        for name, part in self.encoders.items():
            if part.module is not None:
                out += _describe(name, param_table(part.module, ctx=part.ctx), part.ctx)
        if self.stage is not None:
            tied = self.stage.embedding_copy()
            infos = _describe(self.llm_name, self.stage.param_table(), self.llm_ctx)
            for info in infos:  # a tied embedding's last-stage copy is the same parameter: count it once
                if tied is not None and info.param is tied and not self.stage.is_first:
                    info.counts_in_norm = info.counts_in_shard_norm = False
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
                out[name] = full_tensors(param_table(part.module, ctx=part.ctx), grads=grads)
        if self.stage is not None:
            out[self.llm_name] = full_tensors(self.stage.param_table(), grads=grads)
        return out


def _describe(module_name: str, table, ctx: ParallelContext) -> list[TrainParam]:
    out = []
    for name, info in table.items():
        if not info.param.requires_grad:
            continue
        group = info.view.group("grad")
        # no weight decay on biases, norms and other vectors (the usual AdamW practice)
        out.append(TrainParam(module_name, name, info.param, group, info.is_owner, info.param.dim() >= 2,
                              partial_groups=info.partial_groups, counts_in_shard_norm=info.is_owner_but_data_parallel))
    return out

"""Model assembly: every module of the config on its own grid, and the bridges between them.

``MimoModel(config, rank)`` is built on every rank of the world at the same point. It owns
the run's ``GroupRegistry`` (one communicator per distinct rank set) and builds, in one fixed
order, each module's ``ParallelContext`` (the LLM's first, then each encoder's with its bridge
group over the union of its ranks and the LLM's) and the tied-embedding groups;
then the modules this rank runs: the encoders it belongs to (tower + projector; a ``kind:
qwen3_vl`` / ``kimi_k25`` encoder: its native tower, ``mimo.encoders.model.NativeVisionEncoder``) and its LLM
pipeline stage, each handed its context. Each module is a ``ModulePart`` of ``model.parts``
(the LLM first, then the encoders in config order) on every rank, holding its module only
where this rank is on its grid, and what it runs once per step (its finalisers), decided here.
Weights are initialised from ``train.seed`` by layout-independent names (each rank drawing
only its shards), so any layout starts from the one-process model's weights; ``init``
sections then load timm / Hugging Face checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Literal

import torch

from mimo.compose.adapters import adapt_module, adapter_layout
from mimo.compose.config import Fp8Config, MimoConfig, one_process_module
from mimo.core.errors import MimoError
from mimo.encoders.model import build_encoder
from mimo.llm.balance import Balancer, find_routers
from mimo.llm.dsa import set_dsa_training
from mimo.llm.model import LLMStage, build_stage, embedding_group, sync_tied_grads
from mimo.llm.moe import set_dispatchers
from mimo.parallel import gemm, param_seed
from mimo.parallel.fp8 import apply_fp8, clear_fp8, history_step, invalidate_weights, refresh_weights, torchao_problem
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import GroupRegistry, ParallelGrid
from mimo.parallel.lora import AdapterSite
from mimo.parallel.params import ParamInfo, TrainParam

_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")  # an LLM layer's modules, by global index


@dataclass
class ModulePart:
    """One module of the model (the LLM or an encoder) as this rank sees it."""

    name: str
    role: Literal["llm", "encoder"]
    ctx: ParallelContext
    module: torch.nn.Module | None  # None on ranks outside the module's grid
    trains: bool  # from the config, so known on every rank (a bridge runs backward or not)
    # once per step on the summed gradients, before the norm: f(grad_sync) (a tied embedding's sum)
    grad_finalisers: list[Callable] = field(default_factory=list)
    # once per step after the optimizer's update, in order: MoE balancing, FP8 amax histories
    finalisers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def grid(self) -> ParallelGrid:
        return self.ctx.grid

    @property
    def bridge_group(self):
        """An encoder's bridge to the LLM: over encoder ∪ LLM ranks (None for the LLM)."""
        return self.ctx.bridge

    @property
    def tp_group(self):
        return self.ctx.tp

    @property
    def dp_group(self):
        return self.ctx.grad_group

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The module's repeated blocks on this rank: the LLM stage's layers, a tower's blocks."""
        if self.module is None:
            return []
        return list(self.module.layers.values()) if self.role == "llm" else list(self.module.tower.blocks)

    @property
    def first_stage_copy(self) -> torch.nn.Parameter | None:
        """The parameter here that mirrors the first pipeline stage's (a later LLM stage's copy of
        a tied embedding): counted in the norm and written by the first stage only."""
        if self.role != "llm" or self.module is None or self.module.is_first:
            return None
        return self.module.embedding_copy()

    def param_table(self) -> dict[str, ParamInfo]:
        """This rank's parameters of the module by layout-independent name."""
        return self.module.param_table()


def refuse_compiled_fp8(device: torch.device) -> None:
    """FP8 products compiled on a GPU are refused until their zero gradients are explained: on an
    H100 with torch 2.11 (2026-12-08) a compiled row-wise or block-wise FP8 product in bf16 gave
    the right output but exactly zero input and weight gradients, with any backend, where the same
    product eager, or with its float8 operands multiplied dequantized, or in fp32, gave the right
    ones (docs/performance.md). A run would train those layers on nothing, silently."""
    if device.type == "cuda":
        raise MimoError("train.fp8 with train.compile on a GPU: compiled FP8 products have given zero input and "
                        "weight gradients there (torch 2.11, not yet explained: issue 50); train with one or the "
                        "other (train.compile: false, or no train.fp8)")


def init_module_(module: torch.nn.Module, config: MimoConfig, name: str) -> None:
    """Module ``name``'s base weights: the run's seeded init (an encoder's also reads its
    ``init`` there), then the LLM's ``init.hf`` if set (any layout: each rank its shard of the
    one-process tensors)."""
    module.init_weights(param_seed(config.train.seed, name))
    if name == config.llm_name and config.llm.init.hf:
        from mimo.llm.hf import load_hf_checkpoint

        load_hf_checkpoint(module, config.llm.init.hf)


def adapted_base(config: MimoConfig, name: str) -> tuple[dict[str, torch.Tensor], list[AdapterSite]]:
    """The base of module ``name`` of a run with ``lora``, which its checkpoints do not hold: the
    full tensors (parameters and persistent buffers) of the module built on one process and
    initialised as the run does (seed, ``init.hf``), before its adapters; and where the
    adapters sit in it."""
    from mimo.parallel.params import full_tensors, persistent_buffers

    cfg, llm = config.modules[name], name == config.llm_name
    if llm:
        module = LLMStage(cfg.arch)
    else:
        module = build_encoder(one_process_module(cfg), config.llm.arch.hidden)
    init_module_(module, config, name)
    state = full_tensors(module.param_table())
    state.update({n: t.detach().clone() for n, t in persistent_buffers(module).items() if n not in state})
    return state, adapter_layout(cfg, name, llm)


class MimoModel:
    def __init__(self, config: MimoConfig, rank: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.config, self.rank = config, rank
        self.device = torch.device(device)  # this rank's compute device (also where nothing of it trains)
        llm_cfg = config.llm
        # ---- process groups: the same requests in the same order on every rank ----
        self.registry = registry = GroupRegistry()
        recompute = {name: config.recompute_for(name) for name in config.modules}
        # the experts' own view (parallel folding) where they are laid out unlike the dense layers
        expert, contexts = llm_cfg.expert_layout(), {}
        for name in [config.llm_name, *config.encoders]:  # (an encoder's context holds its bridge group)
            par, llm = config.modules[name].parallel, name == config.llm_name
            contexts[name] = ParallelContext(par.grid(config.world_size, registry), rank, registry,
                                             sequence_parallel=par.sequence_parallel, gtp=par.gtp,
                                             expert=expert if llm else None, egtp=par.egtp if llm and expert is not None else 1,
                                             bridge_to=None if llm else contexts[config.llm_name].grid)
        llm_ctx = contexts[config.llm_name]
        tied_group = embedding_group(llm_ctx)
        # ---- the modules this rank holds: built, initialised, loaded, adapted ----
        self.parts: list[ModulePart] = [
            ModulePart(name, "llm" if name == config.llm_name else "encoder", ctx, self._build_module(name, ctx, dtype, recompute[name]),
                       config.modules[name].trains) for name, ctx in contexts.items()]
        llm = self.parts[0]
        if llm.module is not None and llm.module.embedding_copy() is not None and tied_group is not None:
            llm.grad_finalisers.append(partial(_sum_tied_embedding, llm.module, tied_group))
        self.fp8: Fp8Config | None = None  # train.fp8 as set on the modules (set_fp8)
        self._set_finalisers()
        self.compiled = False  # its blocks go through torch.compile (mimo.training.run.compile_blocks)
        if config.train.fp8 is not None:
            self.set_fp8(config.train.fp8)  # (its finalisers too)
        # the run's gradient buffers (``mimo.training.optim.GradSync``), built once by the
        # training side on its first step and kept
        self.grad_sync = None
        self.cuda_graphs = False  # the vision blocks replay as CUDA graphs (mimo.training.run.compile_blocks)

    def _build_module(self, name: str, ctx: ParallelContext, dtype: torch.dtype,
                      recompute: tuple[str, int | None]) -> torch.nn.Module | None:
        """This rank's part of module ``name`` (an encoder, or the LLM's pipeline stage),
        initialised, loaded and adapted; None outside its grid."""
        config = self.config
        cfg, llm = config.modules[name], name == config.llm_name
        module = build_stage(cfg.arch, ctx) if llm else build_encoder(cfg, config.llm.arch.hidden, ctx) if ctx.member else None
        if module is None:
            return None
        module.to(device=self.device, dtype=dtype)
        init_module_(module, config, name)
        if llm:
            if cfg.freeze:
                module.requires_grad_(False)
            set_dsa_training(module, cfg.dsa.warmup, cfg.dsa.kl_weight)  # (a no-op without DSA layers)
        adapt_module(module, cfg, name, config.train.seed, llm)  # (its lora section: after the base weights load)
        if llm:
            if config.train.moe_dispatcher == "deepep" and ctx.expert is not None and self.device.type != "cuda":
                raise MimoError("train.moe_dispatcher: deepep runs DeepEP's GPU kernels; this run is on the CPU "
                                "(--device cuda with a GPU per rank, or alltoall)")
            set_dispatchers(module, config.train.moe_dispatcher)
            module.set_attention_kernel(config.train.attention)
        (module if llm else module.tower).set_recompute(*recompute)
        return module

    def _set_finalisers(self) -> None:
        """Each part's once-per-step work after the update, as its module and ``self.fp8`` need it."""
        for part in self.parts:
            part.finalisers = []
            if part.module is None:
                continue
            if find_routers(part.module):  # each stage its own layers, counts summed over its gradient group
                part.finalisers.append(Balancer(part.module, part.dp_group))
            if self.fp8 is not None and self.fp8.recipe == "delayed":  # reduced over the ranks holding the same layers
                part.finalisers.append(partial(history_step, part.module, (part.tp_group, part.dp_group)))
            if self.fp8 is not None and self._fp8_cache():  # the updated weights quantized when the next pass begins
                part.finalisers.append(partial(invalidate_weights, part.module, True))

    # ---- the parts ----
    @property
    def llm(self) -> ModulePart:
        return self.parts[0]

    @property
    def encoder_parts(self) -> list[ModulePart]:
        return self.parts[1:]

    def part(self, name: str) -> ModulePart:
        for part in self.parts:
            if part.name == name:
                return part
        raise KeyError(name)

    def encoder_grids(self) -> dict[str, ParallelGrid]:
        return {part.name: part.grid for part in self.encoder_parts}

    def _in_param_order(self) -> list[ModulePart]:
        """The parts this rank holds, encoders before the LLM: the order of the run's parameter
        table (its gradient buckets, the norm's sum, the optimizers; another would round the
        norm differently)."""
        return [p for p in [*self.encoder_parts, self.llm] if p.module is not None]

    def graph_step(self) -> None:
        """A new step of the CUDA-graphed blocks: outputs of the last one may be overwritten
        (torch.compile's cudagraph trees); called where a step or a forward-only pass begins."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def set_fp8(self, f8: Fp8Config | None) -> None:
        """FP8 GEMMs (``train.fp8``) on every LLM layer but ``bf16_layers`` and every vision
        block (not patch embeddings, projectors, embeddings or the LM head); None: back to the
        run's precision everywhere."""
        if f8 is not None and f8.backend == "torchao":
            problem = torchao_problem(self.device)
            if problem:
                raise MimoError(f"train.fp8.backend: torchao: {problem}")
        if f8 is not None and self.compiled:
            refuse_compiled_fp8(self.device)
        self.fp8 = f8
        self._set_finalisers()  # (the amax histories' step with delayed scaling)
        kept = f8.kept_layers(len(self.config.llm.arch.layer_pattern().layers)) if f8 is not None else set()
        for part in self.parts:
            if part.module is None:
                continue
            if part.role == "llm":
                root, keep = part.module, lambda n: (m := _LAYER_NAME.match(n)) is not None and int(m.group(1)) not in kept
            else:
                root, keep = part.module.tower, lambda n: n.startswith("blocks.")
            if f8 is None:
                clear_fp8(root, gemm.default_recipe)
            else:
                apply_fp8(root, f8.recipe, part.ctx, f8.amax_history, keep, self._fp8_cache(), f8.wgrad, f8.backend)

    def _fp8_cache(self) -> bool:
        """Whether FP8 weights are quantized once per step (``train.fp8.cache_weights``): not
        under a sharded optimizer, whose weight gathers are still in flight when a step begins."""
        return self.fp8.cache_weights and not self.config.train.distributed_optimizer

    def refresh_fp8(self) -> None:
        """The FP8 weight caches brought up to date: where a step or a forward-only pass begins,
        outside the compiled layers (which read the caches unchecked)."""
        for part in self.parts:
            if self.fp8 is not None and part.module is not None:
                refresh_weights(part.module)

    def weights_written(self) -> None:
        """Every weight was written (a checkpoint loaded): the FP8 caches quantize them anew at
        the next ``refresh_fp8`` (an optimizer step's finaliser drops those it updates)."""
        for part in self.parts:
            if self.fp8 is not None and part.module is not None:
                invalidate_weights(part.module)

    def gtp_chains(self) -> list[tuple[str, object]]:
        """(module name, a GTP chain of it on this rank: ``mimo.parallel.gtp``) for each one."""
        return [(part.name, chain) for part in self.parts if part.module is not None
                for chain in (part.ctx.gtp_chain, part.ctx.egtp_chain) if chain is not None]

    def wait_roots(self, module: str) -> list[torch.nn.Module]:
        """The submodules of ``module`` on this rank whose forwards first use its weights, outer
        before inner: the LLM stage and its layers; an encoder and its tower's blocks (a sharded
        optimizer's weight gathers are waited for there)."""
        part = self.part(module)
        return [] if part.module is None else [part.module, *part.blocks]

    def train_params(self) -> list[TrainParam]:
        """Every local trainable parameter with its gradient group and whether this rank's copy
        counts in the norm (read from its placement: one copy of every element in the world)."""
        return [p for part in self._in_param_order() for p in _describe(part)]

    def full_grads(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full gradients by module and canonical name (collective over each TP group)."""
        return self._full(grads=True)

    def full_params(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._full(grads=False)

    def _full(self, grads: bool) -> dict[str, dict[str, torch.Tensor]]:
        from mimo.parallel.params import full_tensors

        return {part.name: full_tensors(part.param_table(), grads=grads) for part in self._in_param_order()}


def _sum_tied_embedding(stage: LLMStage, group, grad_sync) -> None:
    """The gradients of a tied embedding's first- and last-stage copies summed (``sync_tied_grads``)."""
    grad_sync.gather_shards([stage.embedding_copy()])  # (sharded: the two copies' buckets are cut differently)
    sync_tied_grads(stage, group)


def _describe(part: ModulePart) -> list[TrainParam]:
    out = []
    mirror = part.first_stage_copy  # the same parameter as the first stage's: counted once, there
    for name, info in part.param_table().items():
        if not info.param.requires_grad:
            continue
        group = info.view.group("grad")
        counted = info.param is not mirror
        # no weight decay on biases, norms and other vectors (the usual AdamW practice)
        out.append(TrainParam(part.name, name, info.param, group, info.is_owner and counted, info.param.dim() >= 2,
                              partial_groups=info.partial_groups,
                              counts_in_shard_norm=info.is_owner_but_data_parallel and counted))
    return out

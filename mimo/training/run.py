"""What one rank needs to train a config: the model part, the data pipeline, the optimizers.

``build_run(config, rank)`` is called on every rank of the world at the same point (the model
and the pipeline create process groups, in this fixed order). ``mimo train`` and
``mimo verify-train`` assemble their ranks through it, so both run the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimo.compose.config import MimoConfig
from mimo.data.index import Index
from mimo.data.pipeline import DataPipeline
from mimo.compose.inputs import data_plan, encoder_feeds, ensure_index, sample_reader, text_spec
from mimo.compose.model import MimoModel
from mimo.training.bucket_optim import build_optimizers
from mimo.training.optim import GradSync, PrecisionPolicy
from mimo.training.step import grad_sync_for


@dataclass
class Run:
    config: MimoConfig
    model: MimoModel
    pipeline: DataPipeline
    optimizers: dict[str, torch.optim.Optimizer]  # module -> optimizer (only modules training on this rank)
    policy: PrecisionPolicy

    @property
    def grad_sync(self) -> GradSync:
        """The run's gradient buffers and bucketed sums (``mimo.training.step.grad_sync_for``)."""
        return self.model.grad_sync

    def close(self, wait: bool = True) -> None:
        """``wait=False`` on a rank ending on an error (``DataPipeline.close``)."""
        self.pipeline.close(wait)


def build_run(config: MimoConfig, rank: int, index: Index | None = None, policy: PrecisionPolicy | None = None,
              device: torch.device | str = "cpu") -> Run:
    """Model, pipeline and optimizers of ``rank``; ``index`` defaults to the config's
    (prepared beforehand, once: here it is only loaded)."""
    policy = policy or PrecisionPolicy.named(config.train.precision, config.train.grad_reduce)
    model = MimoModel(config, rank, device=device, dtype=policy.params)
    if index is None:
        index, _ = ensure_index(config)
    pipeline = data_pipeline(config, model, data_plan(config, index), config.train.micro_batches)
    optimizers = model_optimizers(config, model, policy)
    if config.train.compile:
        compile_blocks(model)
    return Run(config, model, pipeline, optimizers, policy)


def model_optimizers(config: MimoConfig, model: MimoModel, policy: PrecisionPolicy) -> dict[str, torch.optim.Optimizer]:
    """The optimizer of each module ``model`` trains on this rank, over the run's gradient
    buffers (``grad_sync_for``: made here once; sharded under ``train.distributed_optimizer``)."""
    optimizers = build_optimizers(model.train_params(), grad_sync_for(model, policy), *config.optimizer_settings(),
                                  policy=policy, offload=config.train.optimizer_offload)
    for name, opt in optimizers.items():  # each layer waits for its weights' gather, not the whole model
        opt.wait_hooks(model.wait_roots(name))
    return optimizers


def data_pipeline(config: MimoConfig, model: MimoModel, plan, micro_batches: int, ahead: bool = True, make_reader=None) -> DataPipeline:
    """The data pipeline of ``model``'s rank over ``plan`` (training's, or ``mimo eval``'s
    held-out microbatches), delivering on the model's device. ``ahead``: each step's data
    prepared on a thread of its own during the step before (training's; only one pipeline of
    a run may: they would share the data groups). ``make_reader``: samples read from elsewhere
    than the config's shards (``mimo generate``'s prompts), delivered the same way."""
    return DataPipeline(plan, text_spec(config), model.llm.grid, model.llm.ctx.sequence_parallel,
                        encoder_feeds(config, model.encoder_grids()), micro_batches, config.data.workers, config.data.prefetch,
                        model.rank, make_reader=make_reader or (lambda: sample_reader(config, plan)), device=model.device, ahead=ahead,
                        mrope=config.llm.arch.mrope_section is not None, schedule=config.train.schedule,
                        encoder_prefetch=config.train.encoder_prefetch)


def _dynamic_length_options() -> dict:
    """Inductor options for layers compiled for dynamic lengths: no fusion choice that depends
    on the length. Mix-order reductions (the norms' backward) are chosen by row count, which
    guards the compiled graph on a range of lengths: a pack outside it compiled the layer again
    (seconds, mid-run)."""
    from torch._inductor import config

    return {"triton.mix_order_reduction": False} if hasattr(config.triton, "mix_order_reduction") else {}


def compile_blocks(model: MimoModel) -> int:
    """``train.compile``: each LLM layer and each vision block through ``torch.compile``, in
    place (compiled on first use; the weights stay the module's own). Repeated blocks share one
    compiled graph; LLM layers are compiled for dynamic lengths, since every pack's differs.
    Embedding and head stay eager; the cross entropy's row math compiles into fused kernels
    (``vocab_parallel_cross_entropy(compiled=True)``); a native-resolution tower runs eager.
    ``train.cuda_graphs``: the vision blocks
    in reduce-overhead mode, their kernels replayed as CUDA graphs (on a CUDA device; elsewhere
    torch runs them as compiled). Returns the count."""
    graphs = model.config.train.cuda_graphs
    n = 0
    for part in model.parts:
        if part.module is None:
            continue
        if part.role == "llm":  # every pack's length differs
            how = {"dynamic": True, "options": _dynamic_length_options()}
            part.module.compiled_loss = True
        elif model.config.encoders[part.name].native:
            # a native tower's blocks stay eager: each pack's images (their segment runs, a Python
            # list the attention loops over) would compile them anew for every microbatch
            continue
        else:
            how = {"mode": "reduce-overhead" if graphs else None}
            part.module.tower.graphs = graphs  # its output then leaves the graphs' memory
        for block in part.blocks:
            block.compile(**how)
            n += 1
    model.cuda_graphs = graphs
    return n

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
from mimo.compose.data_spec import data_spec
from mimo.compose.inputs import training_pipeline
from mimo.compose.model import MimoModel, refuse_compiled_fp8
from mimo.core.errors import MimoError
from mimo.training.optim import GradSync, model_optimizers
from mimo.training.precision import PrecisionPolicy


@dataclass
class Run:
    config: MimoConfig
    model: MimoModel
    pipeline: DataPipeline
    optimizers: dict[str, torch.optim.Optimizer]  # module -> optimizer (only modules training on this rank)
    policy: PrecisionPolicy

    @property
    def grad_sync(self) -> GradSync:
        """The run's gradient buffers and bucketed sums (``mimo.training.optim.grad_sync_for``)."""
        return self.model.grad_sync

    def close(self, wait: bool = True) -> None:
        """``wait=False`` on a rank ending on an error (``DataPipeline.close``)."""
        self.pipeline.close(wait)


def build_run(config: MimoConfig, rank: int, index: Index | None = None, policy: PrecisionPolicy | None = None,
              device: torch.device | str = "cpu") -> Run:
    """Model, pipeline and optimizers of ``rank``; ``index`` defaults to the config's
    (prepared beforehand, once: here it is only loaded)."""
    policy = policy or PrecisionPolicy.named(config.train.precision, config.train.grad_reduce)
    if config.train.attention == "flex" and torch.device(device).type != "cuda":
        # (its forwards run on the CPU: eval and generation build no Run)
        raise MimoError("train.attention: flex trains on a GPU only: torch's FlexAttention has no CPU backward "
                        "(--device cuda, or train.attention: auto)")
    model = MimoModel(config, rank, device=device, dtype=policy.params)
    pipeline = training_pipeline(config, data_spec(config), model, index)
    optimizers = model_optimizers(config, model, policy)
    if config.train.compile:
        compile_blocks(model)
    return Run(config, model, pipeline, optimizers, policy)


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
    if model.fp8 is not None:
        refuse_compiled_fp8(model.device)
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
    model.cuda_graphs, model.compiled = graphs, True
    return n

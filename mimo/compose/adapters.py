"""Low-rank adapters on a run's modules (a module's ``lora`` section; ``mimo.parallel.lora``).

A module with ``lora`` trains its adapters only: every base weight of the LLM, or of an encoder's
tower, is frozen (an encoder's projector follows ``freeze`` as without adapters). Adapters are
attached after the base weights are initialised and loaded, each drawn from ``param_seed(seed,
its layer's path)`` (layer paths are global: any layout draws the one-process adapters), and
DoRA's magnitudes are taken from the loaded base.
"""

from __future__ import annotations

import torch

from mimo.compose.config import one_process_module
from mimo.encoders import vit
from mimo.encoders.config import NATIVE_TOWERS
from mimo.llm import model as llm_model
from mimo.parallel.init import param_seed
from mimo.parallel.lora import AdapterSite, adapter_sites, attach_targets, init_magnitudes_
from mimo.parallel.params import load_full_

__all__ = ["adapt_llm", "adapt_encoder", "adapter_layout", "trainable_parameters"]


def adapt_llm(stage: torch.nn.Module, cfg, name: str, seed: int | None) -> list[str]:
    """Adapters on the LLM stage ``stage`` as ``cfg.lora`` says (none: nothing changes); drawn
    from ``seed`` (None: left as built, as on the meta device), or read from ``lora.init``."""
    if cfg.lora is None:
        return []
    adapted = attach_targets(stage, cfg.lora.spec(), None if seed is None else param_seed(seed, f"{name}.lora"),
                             llm_model.LORA_TARGETS, cfg.lora.targets, f"modules.{name}.lora")
    if seed is not None:
        init_magnitudes_(stage)
        _read_init(stage, cfg, name, llm=True)
    return adapted


def adapt_encoder(encoder: torch.nn.Module, cfg, name: str, seed: int | None) -> list[str]:
    """Adapters on an encoder's tower as ``cfg.lora`` says (as ``adapt_llm``)."""
    if cfg.lora is None:
        return []
    table = NATIVE_TOWERS[cfg.kind].tower_module().LORA_TARGETS if cfg.native else vit.LORA_TARGETS
    adapted = attach_targets(encoder.tower, cfg.lora.spec(), None if seed is None else param_seed(seed, f"{name}.lora"),
                             table, cfg.lora.targets, f"modules.{name}.lora")
    if seed is not None:
        init_magnitudes_(encoder.tower)
        _read_init(encoder, cfg, name, llm=False)
    return adapted


def adapter_layout(cfg, name: str, llm: bool) -> list[AdapterSite]:
    """Where the adapters of module ``name`` sit in its one-process state (built on the meta
    device: nothing is allocated)."""
    from mimo.encoders.model import build_encoder

    with torch.device("meta"):
        if llm:
            shell = llm_model.LLMStage(cfg.arch)
            adapt_llm(shell, cfg, name, None)
        else:  # (the projector's width does not matter: it takes no adapter)
            shell = build_encoder(one_process_module(cfg), 1)
            adapt_encoder(shell, cfg, name, None)
    return adapter_sites(shell)


def _read_init(module: torch.nn.Module, cfg, name: str, llm: bool) -> None:
    """``lora.init``: the adapters from a PEFT adapter directory, each rank its shard."""
    if not cfg.lora.init:
        return
    from mimo.compose.peft import module_row_blocks, read_peft_adapter

    full = read_peft_adapter(cfg.lora.init, name, adapter_layout(cfg, name, llm), module_row_blocks(cfg, llm))
    load_full_(module.param_table(), full, strict=False)


def trainable_parameters(config) -> dict[str, int]:
    """Parameters that train, per module, counted on the meta device (no memory, any layout)."""
    from mimo.encoders.model import build_encoder

    count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
    out = {}
    with torch.device("meta"):
        llm = config.llm
        stage = llm_model.LLMStage(llm.arch)
        if llm.freeze:
            stage.requires_grad_(False)
        adapt_llm(stage, llm, config.llm_name, None)
        out[config.llm_name] = count(stage)
        for name, enc in config.encoders.items():
            # one process's module (the count does not depend on the layout)
            module = build_encoder(one_process_module(enc), llm.arch.hidden)
            adapt_encoder(module, enc, name, None)
            out[name] = count(module)
    return out

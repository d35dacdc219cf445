"""Low-rank adapters on a run's modules (a module's ``lora`` section; ``mimo.parallel.lora``).

A module with ``lora`` trains its adapters only: every base weight of the LLM, or of an encoder's
tower, is frozen (an encoder's projector follows ``freeze`` as without adapters). Adapters are
attached after the base weights are initialised and loaded, each drawn from ``param_seed(seed,
its layer's path)`` (layer paths are global: any layout draws the one-process adapters), and
DoRA's magnitudes are taken from the loaded base; ``lora.init``'s adapters (a PEFT directory,
read before attaching) are loaded over them.
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

__all__ = ["adapt_module", "adapter_layout", "trainable_parameters"]


def adapt_module(module: torch.nn.Module, cfg, name: str, seed: int | None, llm: bool) -> list[str]:
    """Adapters on module ``name`` as its ``lora`` section (``cfg.lora``) says (none: nothing
    changes): on the LLM stage ``module`` (``llm``), or on an encoder's tower. Drawn from ``seed``
    (None: left as built, as on the meta device), or read from ``lora.init``: its tensors read
    first, then the adapters attached, DoRA's magnitudes taken from the loaded base, and the
    tensors read loaded over them (each rank its shard). Returns the adapted layers' paths."""
    if cfg.lora is None:
        return []
    root = module if llm else module.tower
    table = llm_model.LORA_TARGETS if llm else _tower_targets(cfg)
    start = None if seed is None else _read_init(cfg, name, llm)
    adapted = attach_targets(root, cfg.lora.spec(), None if seed is None else param_seed(seed, f"{name}.lora"), table,
                             cfg.lora.targets, f"modules.{name}.lora")
    if seed is not None:
        init_magnitudes_(root)
        if start is not None:
            load_full_(module.param_table(), start, strict=False)
    return adapted


def _tower_targets(cfg) -> dict:
    """The ``lora.targets`` names of an encoder's tower."""
    return NATIVE_TOWERS[cfg.kind].tower_module().LORA_TARGETS if cfg.native else vit.LORA_TARGETS


def _read_init(cfg, name: str, llm: bool) -> dict[str, torch.Tensor] | None:
    """``lora.init``: the one-process tensors of the module's adapters, read from a PEFT adapter
    directory (None without one)."""
    if not cfg.lora.init:
        return None
    from mimo.compose.peft import module_row_blocks, read_peft_adapter

    sites = adapter_layout(cfg, name, llm)
    return read_peft_adapter(cfg.lora.init, name, sites, module_row_blocks(cfg, llm))


def adapter_layout(cfg, name: str, llm: bool) -> list[AdapterSite]:
    """Where the adapters of module ``name`` sit in its one-process state (built on the meta
    device: nothing is allocated; the projector's width does not matter: it takes no adapter)."""
    from mimo.encoders.model import build_encoder

    with torch.device("meta"):
        shell = llm_model.LLMStage(cfg.arch) if llm else build_encoder(one_process_module(cfg), 1)
        adapt_module(shell, cfg, name, None, llm)
    return adapter_sites(shell)


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
        adapt_module(stage, llm, config.llm_name, None, llm=True)
        out[config.llm_name] = count(stage)
        for name, enc in config.encoders.items():
            # one process's module (the count does not depend on the layout)
            module = build_encoder(one_process_module(enc), llm.arch.hidden)
            adapt_module(module, enc, name, None, llm=False)
            out[name] = count(module)
    return out

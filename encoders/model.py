"""An encoder module as the config describes it: tower + projector, weights, freezing.

``VisionEncoder(cfg, llm_hidden, ctx)`` maps pixels ``[N, C, S, S]`` to LLM-sized rows
``[N * cfg.rows_per_image, llm_hidden]``, replicated over the TP group of ``ctx`` (the
module's ``ParallelContext``: TP group, sequence parallel, the gradient group). Freezing follows
docs/design.md §2: a frozen part has ``requires_grad=False``; a frozen tower (nothing trainable
upstream of it: its input is pixels) runs without autograd state.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mimo.core.errors import LayoutError
from mimo.encoders.config import EncoderModuleConfig, VitInit
from mimo.encoders.projector import build_projector
from mimo.encoders.vit import VisionTransformer
from mimo.encoders.weights import ImportedWeights
from mimo.parallel.context import ParallelContext
from mimo.parallel.init import param_seed

__all__ = ["VisionEncoder", "load_pretrained"]


def load_pretrained(init: VitInit, arch) -> ImportedWeights | None:
    """The checkpoint ``init`` names, mapped onto ``arch`` (a safetensors file is left in place
    and read slice by slice when loaded); None for random initialisation."""
    if init.hf is not None:
        from mimo.encoders.hf_import import import_hf

        return import_hf(init.hf, arch)
    if init.timm is not None:
        from mimo.encoders.timm_import import import_timm

        return import_timm(init.timm, arch, init.path)
    return None


class VisionEncoder(nn.Module):
    def __init__(self, cfg: EncoderModuleConfig, llm_hidden: int, ctx: ParallelContext | None = None, *, device=None,
                 dtype=None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        if ctx.tp_size != cfg.parallel.tp:
            raise LayoutError(f"the encoder's config says tp={cfg.parallel.tp}, but its parallel context has tp={ctx.tp_size}")
        self.cfg = cfg
        self.tower = VisionTransformer(cfg.arch, cfg.feature_layer, drop_class_token=cfg.drop_class_token, ctx=ctx,
                                       device=device, dtype=dtype)
        self.projector = build_projector(cfg.projector.kind, cfg.arch.hidden, llm_hidden, ctx, device=device, dtype=dtype)
        self.tower_frozen = "tower" in cfg.freeze
        for part in cfg.freeze:
            getattr(self, part).requires_grad_(False)
        self.imported: ImportedWeights | None = None  # kept for export (unused blocks and heads)

    @property
    def rows_per_image(self) -> int:
        return self.tower.rows_per_image

    def init_weights(self, seed: int) -> None:
        """Random TP-invariant init of both parts, then the configured checkpoint if any."""
        self.tower.init_weights(param_seed(seed, "tower"))
        self.projector.init_weights(param_seed(seed, "projector"))
        self.imported = load_pretrained(self.cfg.init, self.cfg.arch)
        if self.imported is not None:
            self.tower.load_weights_(self.imported)

    def export_tower(self) -> dict[str, torch.Tensor]:
        """Collective: the tower in its source's format (timm / HF names), unused heads included."""
        state = self.tower.full_state()
        if self.imported is None:
            return state
        return self.imported.export(state)

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        if self.tower_frozen:
            with torch.no_grad():
                features_TD = self.tower(pixels_NCHW)
        else:
            features_TD = self.tower(pixels_NCHW)
        return self.projector(features_TD)

"""An encoder module as the config describes it: tower + projector, weights, freezing.

``VisionEncoder(cfg, llm_hidden, ctx)`` (``kind: vit``) maps pixels ``[N, C, S, S]`` to LLM-sized
rows ``[N * cfg.rows_per_image, llm_hidden]``, replicated over the TP group of ``ctx`` (the
module's ``ParallelContext``: TP group, sequence parallel, the gradient group). Freezing follows
docs/design.md §2: a frozen part has ``requires_grad=False``; a frozen tower (nothing trainable
upstream of it: its input is pixels) runs without autograd state.

``NativeVisionEncoder(cfg, ctx)`` (``kind: qwen3_vl``, ``kind: kimi_k25``: the kinds of
``mimo.encoders.config.NATIVE_TOWERS``): the kind's tower (the Qwen3-VL tower
``mimo.encoders.qwen3_vl.Qwen3VisionTower``, Kimi-K2.5's MoonViT with its projector
``mimo.encoders.moonvit.MoonViTTower``), ``forward(pixels_PJ, grids_N3) -> rows_RX`` (its
mergers give the LLM's width per level: no projector of ours); ``init.hf`` loads the tower's
tensors of a Hugging Face directory of the kind's model, each rank reading its own slices. Its
parameters are ``tower.*``, as the ViT encoder's, so checkpoints hold it like any module.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mimo.core.batch import PatchBatch
from mimo.core.errors import LayoutError
from mimo.encoders.config import NATIVE_TOWERS, EncoderModuleConfig, NativeEncoderModuleConfig, VitInit
from mimo.encoders.projector import build_projector
from mimo.encoders.vit import VisionTransformer
from mimo.encoders.weights import ImportedWeights
from mimo.parallel.context import ParallelContext
from mimo.parallel.init import param_seed
from mimo.parallel.params import ParamInfo, param_table

__all__ = ["VisionEncoder", "NativeVisionEncoder", "load_pretrained", "build_encoder"]


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

    def param_table(self) -> dict[str, ParamInfo]:
        return param_table(self)

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


class NativeVisionEncoder(nn.Module):
    """A native-resolution tower of any ``NATIVE_TOWERS`` kind (module doc)."""

    def __init__(self, cfg: NativeEncoderModuleConfig, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        if ctx.tp_size != cfg.parallel.tp:
            raise LayoutError(f"the encoder's config says tp={cfg.parallel.tp}, but its parallel context has tp={ctx.tp_size}")
        self.cfg = cfg
        self.tower_kind = NATIVE_TOWERS[cfg.kind]
        self.tower = self.tower_kind.tower_class()(cfg.arch, ctx, device=device, dtype=dtype)
        self.tower_frozen = "tower" in cfg.freeze
        if self.tower_frozen:
            self.tower.requires_grad_(False)
        self.imported: ImportedWeights | None = None  # the Hugging Face tower it loaded (its config.json in meta)

    def param_table(self) -> dict[str, ParamInfo]:
        return param_table(self)

    def init_weights(self, seed: int) -> None:
        """Random TP-invariant init (transformers' scheme), then ``init.hf`` if set."""
        self.tower.init_weights(param_seed(seed, "tower"))
        if self.cfg.init.hf is not None:
            self.imported = self.tower_kind.hf_module().import_hf(self.cfg.init.hf, self.cfg.arch)
            self.tower.load_weights_(self.imported)

    def export_tower(self) -> dict[str, torch.Tensor]:
        """Collective: the tower by Hugging Face name (Qwen3-VL's ``model.visual.*``, ...)."""
        return self.tower_kind.hf_module().tower_state_to_hf(self.tower.full_state(), self.cfg.arch)

    def forward(self, pixels_PJ: torch.Tensor | PatchBatch, grids_N3: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[R, out_hidden * (1 + levels)]`` of the images of ``pixels_PJ`` (patch rows,
        image after image) with grids ``grids_N3``, or of a ``PatchBatch`` (the data pipeline's)."""
        if isinstance(pixels_PJ, PatchBatch):
            pixels_PJ, grids_N3 = pixels_PJ.pixels_PJ, pixels_PJ.grids_N3
        if self.tower_frozen:
            with torch.no_grad():
                return self.tower(pixels_PJ, grids_N3)
        return self.tower(pixels_PJ, grids_N3)


def build_encoder(cfg: EncoderModuleConfig | NativeEncoderModuleConfig, llm_hidden: int, ctx: ParallelContext | None = None, *,
                  device=None, dtype=None) -> VisionEncoder | NativeVisionEncoder:
    """The encoder module of either kind (``llm_hidden``: the projector's output width, ``kind: vit``)."""
    if cfg.native:
        return NativeVisionEncoder(cfg, ctx, device=device, dtype=dtype)
    return VisionEncoder(cfg, llm_hidden, ctx, device=device, dtype=dtype)

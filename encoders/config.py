"""Config of a vision-encoder module (``kind: vit``): architecture, weights, projector, layout."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from mimo.parallel.grid import ParallelConfig
from mimo.core.schema import at_least, join_path, tp_divides

EncoderPart = Literal["tower", "projector"]


@dataclass
class VitArch:
    image_size: int
    patch: int
    hidden: int
    layers: int
    heads: int
    mlp: int
    channels: int = 3
    class_token: bool = True  # a [CLS] row before the patches (CLIP, timm ViT); SigLIP has none
    pre_norm: bool = False  # LayerNorm on the embeddings before the blocks (CLIP's pre_layrnorm)
    act: Literal["gelu", "gelu_tanh", "quick_gelu"] = "gelu"  # quick_gelu: OpenAI CLIP
    norm_eps: float = 1e-5

    @property
    def patches_per_image(self) -> int:
        """Patch rows of one image (without the [CLS] row)."""
        return (self.image_size // self.patch) ** 2

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "image_size", "patch", "hidden", "layers", "heads", "mlp", "channels")
        if self.norm_eps <= 0:
            problems.append(f"{join_path(path, 'norm_eps')}: must be > 0, got {self.norm_eps}")
        if problems:
            return problems
        if self.hidden % self.heads:
            problems.append(f"{join_path(path, 'hidden')}: {self.hidden} is not divisible by heads={self.heads}")
        if self.image_size % self.patch:
            problems.append(f"{join_path(path, 'image_size')}: {self.image_size} is not divisible by patch={self.patch}")
        return problems


@dataclass
class VitInit:
    """Where the tower's weights come from (all None: random initialisation)."""

    timm: str | None = None  # a timm model name; names the architecture of the weights
    path: str | None = None  # a local weights file for that timm model (else timm's own source)
    hf: str | None = None  # a Hugging Face checkpoint directory (CLIPVisionModel, SiglipVisionModel, ...)

    def validate(self, path: str) -> list[str]:
        problems = []
        if self.timm is not None and self.hf is not None:
            problems.append(f"{join_path(path, 'hf')}: give either init.timm or init.hf, not both")
        if self.path is not None:
            if self.timm is None:
                problems.append(f"{join_path(path, 'path')}: needs init.timm to name the model the weights belong to")
            if not os.path.exists(self.path):
                problems.append(f"{join_path(path, 'path')}: no file {self.path!r}")
        if self.hf is not None and not os.path.isdir(self.hf):
            problems.append(f"{join_path(path, 'hf')}: no directory {self.hf!r}")
        return problems


@dataclass
class ProjectorConfig:
    kind: Literal["mlp2x_gelu", "linear"] = "mlp2x_gelu"  # LLaVA-1.5's two-layer MLP, or one linear map


@dataclass
class EncoderModuleConfig:
    kind: Literal["vit"]
    arch: VitArch
    init: VitInit = field(default_factory=VitInit)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    placeholder: str = "<image>"  # the text token that this encoder's rows replace
    # int L: Hugging Face's hidden_states[L] (0 = embeddings, -1 = last block, before the final
    # norm); "post_norm": the last block followed by the final norm.
    feature_layer: int | Literal["post_norm"] = -2
    drop_class_token: bool = True  # LLaVA feeds the patch rows only; no effect without a [CLS] token
    freeze: list[EncoderPart] = field(default_factory=list)
    lr: float | None = None  # this module's AdamW learning rate (None: train.lr)
    weight_decay: float | None = None  # None: train.weight_decay
    # activation recompute of this module (mimo.parallel.recompute); None: train.recompute / recompute_layers
    recompute: Literal["none", "selective", "full"] | None = None
    recompute_layers: int | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def rows_per_image(self) -> int:
        """Rows one image gives the projector (and the LLM): its patches, plus [CLS] if kept."""
        keep_cls = self.arch.class_token and not self.drop_class_token
        return self.arch.patches_per_image + (1 if keep_cls else 0)

    def validate(self, path: str) -> list[str]:
        arch, par = self.arch, self.parallel
        pkey = lambda name: join_path(path, "parallel", name)  # noqa: E731
        problems = []
        for name, what in (
            ("pp", "pipeline parallelism"),
            ("cp", "context parallelism"),
        ):
            if getattr(par, name) > 1:
                problems.append(f"{pkey(name)}: {what} for encoders ({name}={getattr(par, name)}) is not supported yet; use {name}: 1")
        for name in ("ep", "etp", "egtp"):  # expert layouts belong to the LLM's MoE layers
            if getattr(par, name) is not None and getattr(par, name) > 1:
                problems.append(f"{pkey(name)}: {name}={getattr(par, name)} applies only to the LLM's MoE experts; "
                                f"an encoder has none (remove it)")
        if par.tp >= 1:
            sizes = {name: getattr(arch, name) for name in ("heads", "hidden", "mlp")}
            problems += tp_divides(par.tp, sizes, pkey("tp"))
            n = par.tp * par.gtp
            bad = [f"arch.{k}={getattr(arch, k)}" for k in ("hidden", "mlp") if getattr(arch, k) % n]
            if par.gtp > 1 and bad:
                problems.append(f"{pkey('gtp')}: tp*gtp = {n} must divide {', '.join(bad)} (GTP splits each weight's "
                                f"output rows over tp x gtp)")
        layer = self.feature_layer
        if isinstance(layer, int) and not -arch.layers <= layer <= arch.layers:
            problems.append(
                f"{join_path(path, 'feature_layer')}: {layer} is outside -{arch.layers}..{arch.layers} "
                f"(arch.layers={arch.layers}), or use 'post_norm'"
            )
        if not self.placeholder.strip():
            problems.append(f"{join_path(path, 'placeholder')}: must not be empty")
        repeated = sorted({p for p in self.freeze if self.freeze.count(p) > 1})
        if repeated:
            problems.append(f"{join_path(path, 'freeze')}: {', '.join(repeated)} listed more than once")
        return problems

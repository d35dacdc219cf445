"""Config of the vision-encoder modules: architecture, weights, projector, layout.

* ``kind: vit`` (``EncoderModuleConfig``): a fixed-size ViT tower (``VitArch``) and a projector;
  every image gives ``rows_per_image`` rows.
* ``kind: qwen3_vl`` (``NativeEncoderModuleConfig``): the Qwen3-VL native-resolution tower
  (``Qwen3VisionArch``, built by ``mimo.encoders.qwen3_vl``; its mergers are its projector): an
  image gives as many rows as its grid holds merge blocks, each ``out_hidden * (1 + deepstack
  levels)`` wide (docs/design.md §10). Its weights import from a Hugging Face Qwen3-VL directory.
* ``kind: kimi_k25`` (``KimiEncoderModuleConfig``, the same fields): Kimi-K2.5's MoonViT tower and
  its projector (``MoonViTArch``, built by ``mimo.encoders.moonvit``), images cut as Kimi's processor
  cuts them (``KimiImageConfig``); weights from a Hugging Face Kimi-K2.5 directory.

``NATIVE_TOWERS`` is the registry of the native-resolution kinds: each kind's config class, tower
class, Hugging Face weight module and the Hugging Face model types whose tower it is.

Torch-free (``mimo check-config`` reads it without importing torch).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Mapping

from mimo.core.errors import ConfigError, MimoError
from mimo.parallel.grid import ParallelConfig
from mimo.parallel.lora_config import LoraConfig
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


# Hugging Face ``hidden_act`` -> the ViT's activation names (encoders.vit._ACTS); gelu_new is
# the tanh approximation written out, the same function.
HF_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu", "quick_gelu": "quick_gelu"}

# Qwen3VLVisionConfig field -> Qwen3VisionArch field, and the config's defaults (transformers 5)
_HF_FIELDS = {
    "depth": ("depth", 27),
    "hidden_size": ("hidden", 1152),
    "num_heads": ("heads", 16),
    "intermediate_size": ("mlp", 4304),
    "patch_size": ("patch", 16),
    "temporal_patch_size": ("temporal_patch", 2),
    "spatial_merge_size": ("spatial_merge", 2),
    "out_hidden_size": ("out_hidden", 3584),
    "num_position_embeddings": ("num_position_embeddings", 2304),
    "deepstack_visual_indexes": ("deepstack_layers", [8, 16, 24]),
    "hidden_act": ("act", "gelu_pytorch_tanh"),
    "in_channels": ("channels", 3),
}


class _NativeArch:
    """What every native-resolution tower's arch derives alike from its fields (``hidden``,
    ``heads``, ``spatial_merge``, ``channels``, ``temporal_patch``, ``patch``, ``out_hidden``,
    ``deepstack_layers``)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def merge_width(self) -> int:
        """M: the width of a fused merge block (merge^2 * D), the mergers' inner width."""
        return self.spatial_merge**2 * self.hidden

    @property
    def row_numel(self) -> int:
        """J: values in one patch row (C * temporal_patch * patch * patch)."""
        return self.channels * self.temporal_patch * self.patch * self.patch

    @property
    def levels(self) -> int:
        """Feature levels of an output row: the main merger's, then one per deepstack layer."""
        return 1 + len(self.deepstack_layers)

    @property
    def out_width(self) -> int:
        """X: the width of an output row, out_hidden per level."""
        return self.out_hidden * self.levels

    def _head_problems(self, path: str) -> list[str]:
        if self.hidden % self.heads:
            return [f"{join_path(path, 'hidden')}: {self.hidden} is not divisible by heads={self.heads}"]
        if self.head_dim % 4:
            return [f"{join_path(path, 'hidden')}: the head size {self.head_dim} (hidden / heads) must be a multiple of 4 "
                    f"for the 2-D rotary embedding (a quarter of it per axis and half)"]
        return []


@dataclass
class Qwen3VisionArch(_NativeArch):
    """The architecture of a Qwen3-VL vision tower (Hugging Face's ``Qwen3VLVisionConfig``), or of
    Qwen3.5's (``Qwen3_5VisionConfig``: the same tower without deepstack)."""

    # Qwen3.5's model types (whole model, vision config): transformers deletes its tower's deepstack
    # mergers whatever ``deepstack_visual_indexes`` says, so it has no deepstack levels
    NO_DEEPSTACK: ClassVar[tuple[str, ...]] = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vision", "qwen3_5_moe_vision")

    depth: int  # blocks (HF depth)
    hidden: int  # D (hidden_size)
    heads: int  # num_heads
    mlp: int  # the blocks' MLP hidden units (intermediate_size)
    out_hidden: int  # O: each merger's output width (out_hidden_size; the LLM's hidden size)
    num_position_embeddings: int  # rows of the learned position table, a square side x side
    patch: int = 16  # patch_size, pixels
    temporal_patch: int = 2  # temporal_patch_size: frames per patch row (a still image repeats its frame)
    spatial_merge: int = 2  # spatial_merge_size: merge x merge patches fuse into one output row
    # deepstack_visual_indexes: blocks (0-based, increasing) whose output feeds a deepstack merger
    deepstack_layers: list[int] = field(default_factory=list)
    act: str = "gelu_pytorch_tanh"  # hidden_act (Hugging Face's name)
    channels: int = 3  # in_channels
    norm_eps: float = 1e-6  # every LayerNorm's (HF fixes 1e-6)
    rope_theta: float = 10000.0  # rope_parameters.rope_theta (axial 2-D rotary)

    @property
    def grid_side(self) -> int:
        """Side of the square learned position table."""
        return math.isqrt(self.num_position_embeddings)

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "depth", "hidden", "heads", "mlp", "out_hidden", "num_position_embeddings",
                            "patch", "temporal_patch", "spatial_merge", "channels")
        if self.norm_eps <= 0:
            problems.append(f"{join_path(path, 'norm_eps')}: must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            problems.append(f"{join_path(path, 'rope_theta')}: must be > 0, got {self.rope_theta}")
        if self.act not in HF_ACTS:
            problems.append(f"{join_path(path, 'act')}: {self.act!r} is not supported (one of {', '.join(HF_ACTS)})")
        layers = self.deepstack_layers
        ints = isinstance(layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        if not ints:
            problems.append(f"{join_path(path, 'deepstack_layers')}: must be a list of block indices, got {layers!r}")
        elif list(layers) != sorted(set(layers)) or any(not 0 <= i < self.depth for i in layers):
            problems.append(f"{join_path(path, 'deepstack_layers')}: {list(layers)} must be increasing block indices "
                            f"in 0..{self.depth - 1} (depth={self.depth})")
        if problems:
            return problems
        problems += self._head_problems(path)
        side = self.grid_side
        if side * side != self.num_position_embeddings:
            problems.append(f"{join_path(path, 'num_position_embeddings')}: {self.num_position_embeddings} is not a "
                            f"square (the learned positions are a side x side grid)")
        return problems

    @staticmethod
    def _hf_vision(config: Mapping) -> Mapping:
        """The vision config of a whole Qwen3-VL / Qwen3.5 ``config.json`` dict, or ``config`` itself."""
        vision = config.get("vision_config", config) if isinstance(config, Mapping) else None
        if not isinstance(vision, Mapping):
            raise MimoError(f"a Qwen3-VL vision config must be a dict, got {type(vision).__name__}")
        return vision

    @classmethod
    def hf_deepstack_indexes(cls, config: Mapping) -> list[int]:
        """The blocks feeding deepstack mergers of a Qwen3-VL config (whole, or its vision config;
        transformers' default where absent); [] for Qwen3.5's (``NO_DEEPSTACK``)."""
        vision = cls._hf_vision(config)
        if {config.get("model_type"), vision.get("model_type")} & set(cls.NO_DEEPSTACK):
            return []
        return list(vision.get("deepstack_visual_indexes", _HF_FIELDS["deepstack_visual_indexes"][1]) or [])

    @classmethod
    def from_hf_config(cls, config: Mapping) -> "Qwen3VisionArch":
        """From a Hugging Face ``Qwen3VLVisionConfig`` / ``Qwen3_5VisionConfig`` dict, or a whole
        Qwen3-VL / Qwen3.5 ``config.json`` dict holding one under ``vision_config``; keys it lacks
        take transformers' defaults."""
        vision = cls._hf_vision(config)
        kwargs = {ours: vision.get(theirs, default) for theirs, (ours, default) in _HF_FIELDS.items()}
        kwargs["deepstack_layers"] = cls.hf_deepstack_indexes(config)
        rope = vision.get("rope_parameters") or vision.get("rope_scaling") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise MimoError(f"vision rope_parameters.rope_type {rope.get('rope_type')!r}: the Qwen3-VL tower "
                            f"has axial rope only")
        kwargs["rope_theta"] = float(rope.get("rope_theta", vision.get("rope_theta", 10000.0)))
        arch = cls(**kwargs)
        problems = arch.validate("vision_config")
        if problems:
            raise ConfigError(problems)
        return arch

    def to_hf_config(self, deepstack: bool = True) -> dict:
        """The ``Qwen3VLVisionConfig`` keyword arguments of this architecture; without
        ``deepstack``, ``Qwen3_5VisionConfig``'s (no deepstack key: MimoError if the tower has
        deepstack layers)."""
        out = {theirs: getattr(self, ours) for theirs, (ours, _) in _HF_FIELDS.items()}
        if deepstack:
            out["deepstack_visual_indexes"] = list(self.deepstack_layers)
        else:
            del out["deepstack_visual_indexes"]
            if self.deepstack_layers:
                raise MimoError(f"Qwen3.5's vision tower has no deepstack; the tower's deepstack_layers are "
                                f"{list(self.deepstack_layers)}")
        out["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return out

    def to_hf_kwargs(self, model_type: str) -> dict:
        """The whole model's config keyword arguments of this tower (``model_type``: Qwen3.5's take
        no deepstack)."""
        return {"vision_config": self.to_hf_config(deepstack=model_type not in self.NO_DEEPSTACK)}


# Kimi_K25VisionConfig field -> MoonViTArch field, and the config's defaults (transformers 5)
_KIMI_FIELDS = {
    "num_hidden_layers": ("depth", 27),
    "hidden_size": ("hidden", 1152),
    "num_attention_heads": ("heads", 16),
    "intermediate_size": ("mlp", 4304),
    "patch_size": ("patch", 14),
    "pos_emb_height": ("pos_emb_side", 64),
    "pos_emb_time": ("pos_emb_time", 4),
    "hidden_act": ("act", "gelu_pytorch_tanh"),
}
KIMI_TEXT_HIDDEN = 7168  # DeepseekV3Config's hidden_size: the projector's output where a config has no text_config


@dataclass
class MoonViTArch(_NativeArch):
    """The architecture of Kimi-K2.5's MoonViT tower and its projector (Hugging Face's
    ``Kimi_K25VisionConfig`` and the ``mm_projector`` of ``Kimi_K25Config``; ``mimo.encoders.moonvit``).

    What transformers fixes is not a field: 3 channels (its Conv2d), LayerNorm epsilon 1e-5 in the
    blocks and the final norm, one frame per patch row (a Conv2d; videos are not taken here)."""

    depth: int  # blocks (num_hidden_layers)
    hidden: int  # D (hidden_size; also the projector's projection_hidden_size)
    heads: int  # num_attention_heads
    mlp: int  # the blocks' MLP hidden units (intermediate_size)
    out_hidden: int  # O: the projector's output width (text_config.hidden_size: the LLM's hidden)
    pos_emb_side: int = 64  # pos_emb_height = pos_emb_width: the learned position table is side x side
    pos_emb_time: int = 4  # pos_emb_time: the temporal table's rows (videos only; kept for export)
    patch: int = 14  # patch_size, pixels
    spatial_merge: int = 2  # merge_kernel_size (square): merge x merge patches fuse into one output row
    act: str = "gelu_pytorch_tanh"  # hidden_act (Hugging Face's name)
    rope_theta: float = 10000.0  # rope_parameters.rope_theta (axial 2-D rotary)
    projector_eps: float = 1e-5  # projection_layer_norm_eps: the projector's LayerNorm

    channels: ClassVar[int] = 3
    temporal_patch: ClassVar[int] = 1  # one frame per patch row
    norm_eps: ClassVar[float] = 1e-5  # the blocks' and the final LayerNorm's (transformers fixes it)

    @property
    def deepstack_layers(self) -> list[int]:
        """MoonViT has no deepstack: one feature level per row."""
        return []

    @property
    def grid_side(self) -> int:
        return self.pos_emb_side

    @property
    def num_position_embeddings(self) -> int:
        return self.pos_emb_side**2

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "depth", "hidden", "heads", "mlp", "out_hidden", "pos_emb_side", "pos_emb_time",
                            "patch", "spatial_merge")
        for key in ("rope_theta", "projector_eps"):
            if getattr(self, key) <= 0:
                problems.append(f"{join_path(path, key)}: must be > 0, got {getattr(self, key)}")
        if self.act not in HF_ACTS:
            problems.append(f"{join_path(path, 'act')}: {self.act!r} is not supported (one of {', '.join(HF_ACTS)})")
        return problems or self._head_problems(path)

    @classmethod
    def from_hf_config(cls, config: Mapping) -> "MoonViTArch":
        """From a whole Kimi-K2.5 ``config.json`` dict (its ``vision_config``, the projector's keys and
        the text model's hidden size); keys it lacks take transformers' defaults. MimoError naming
        what the tower cannot express (a non-square merge kernel or position table, a projector
        norm over another width than the tower's, a rope type other than axial)."""
        vision = config.get("vision_config") if isinstance(config, Mapping) else None
        vision = {} if vision is None else vision
        if not isinstance(vision, Mapping):
            raise MimoError(f"a Kimi-K2.5 vision_config must be a dict, got {type(vision).__name__}")
        kwargs = {ours: vision.get(theirs, default) for theirs, (ours, default) in _KIMI_FIELDS.items()}
        problems = []
        width = vision.get("pos_emb_width", kwargs["pos_emb_side"])
        if width != kwargs["pos_emb_side"]:
            problems.append(f"vision_config.pos_emb_width={width} with pos_emb_height={kwargs['pos_emb_side']}: transformers "
                            f"indexes the position table as a square (height = width)")
        kernel = list(vision.get("merge_kernel_size", (2, 2)))
        if len(kernel) != 2 or kernel[0] != kernel[1]:
            problems.append(f"vision_config.merge_kernel_size={kernel}: only square merge kernels are supported")
        kwargs["spatial_merge"] = int(kernel[0]) if kernel else 0
        head_dim = vision.get("head_dim")
        if head_dim is not None and head_dim * kwargs["heads"] != kwargs["hidden"]:
            problems.append(f"vision_config.head_dim={head_dim}: the tower's heads are hidden_size / num_attention_heads")
        rope = vision.get("rope_parameters") or vision.get("rope_scaling") or {}
        if rope.get("rope_type", "axial") != "axial":
            problems.append(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r}: MoonViT has axial rope only")
        kwargs["rope_theta"] = float(rope.get("rope_theta", vision.get("rope_theta", 10000.0)))
        projection = config.get("projection_hidden_size", 1152)
        if projection != kwargs["hidden"]:
            problems.append(f"projection_hidden_size={projection}: the projector's LayerNorm runs over each patch's "
                            f"vision_config.hidden_size={kwargs['hidden']} features; they must be equal")
        if config.get("quantization_config") is not None:
            problems.append("quantization_config (quantized weights, e.g. Kimi-K2.5's INT4 experts): dequantize first")
        if problems:
            raise MimoError("Kimi-K2.5 config: " + "; ".join(problems) + " (not supported)")
        kwargs["projector_eps"] = float(config.get("projection_layer_norm_eps", 1e-5))
        kwargs["out_hidden"] = int((config.get("text_config") or {}).get("hidden_size", KIMI_TEXT_HIDDEN))
        arch = cls(**kwargs)
        problems = arch.validate("vision_config")
        if problems:
            raise ConfigError(problems)
        return arch

    def to_hf_kwargs(self, model_type: str = "kimi_k25") -> dict:
        """The ``Kimi_K25Config`` keyword arguments of the tower and its projector (the text
        config's hidden size is the LLM's, ``out_hidden``)."""
        vision = {theirs: getattr(self, ours) for theirs, (ours, _) in _KIMI_FIELDS.items()}
        vision.update(pos_emb_width=self.pos_emb_side, merge_kernel_size=[self.spatial_merge, self.spatial_merge],
                      rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
        return {"vision_config": vision, "projection_hidden_size": self.hidden, "projection_layer_norm_eps": self.projector_eps}


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


def encoder_parallel_problems(par: ParallelConfig, pkey) -> list[str]:
    """What no encoder module takes (either kind): pipeline or context parallelism, expert layouts."""
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
    return problems


def _freeze_problems(freeze: list, path: str, lora: LoraConfig | None = None, gtp: int = 1) -> list[str]:
    repeated = sorted({p for p in freeze if freeze.count(p) > 1})
    out = [f"{join_path(path, 'freeze')}: {', '.join(repeated)} listed more than once"] if repeated else []
    if lora is not None and "tower" in freeze:
        out.append(f"{join_path(path, 'lora')}: the tower's adapters cannot train in a frozen tower (freeze: [tower]); drop one")
    if lora is not None and gtp > 1:
        out.append(f"{join_path(path, 'lora')}: adapters on GTP-sharded weights are not built (parallel.gtp: 1)")
    return out


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
    lora: LoraConfig | None = None  # low-rank adapters on the tower, its base weights frozen (mimo.parallel.lora)
    lr: float | None = None  # this module's AdamW learning rate (None: train.lr)
    weight_decay: float | None = None  # None: train.weight_decay
    # activation recompute of this module (mimo.parallel.recompute); None: train.recompute / recompute_layers
    recompute: Literal["none", "selective", "full"] | None = None
    recompute_layers: int | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    native = False  # a fixed number of rows per image (``kind: qwen3_vl`` is native resolution)

    @property
    def trains(self) -> bool:
        """Some part of it trains (its tower or its projector)."""
        return "tower" not in self.freeze or "projector" not in self.freeze

    @property
    def rows_per_image(self) -> int:
        """Rows one image gives the projector (and the LLM): its patches, plus [CLS] if kept."""
        keep_cls = self.arch.class_token and not self.drop_class_token
        return self.arch.patches_per_image + (1 if keep_cls else 0)

    def validate(self, path: str) -> list[str]:
        arch, par = self.arch, self.parallel
        pkey = lambda name: join_path(path, "parallel", name)  # noqa: E731
        problems = encoder_parallel_problems(par, pkey)
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
        return problems + _freeze_problems(self.freeze, path, self.lora, self.parallel.gtp)


# ---------------------------------------------------------------- kind: qwen3_vl

NATIVE_PLACEHOLDER = "<|image_pad|>"  # Qwen3-VL's image token
NATIVE_VIDEO_PLACEHOLDER = "<|video_pad|>"  # and its video token


@dataclass
class NativeInit:
    """Where the tower's weights come from (None: random initialisation)."""

    # a Hugging Face checkpoint directory of the kind's model (``NATIVE_TOWERS``: Qwen3-VL / Qwen3.5's
    # ``model.visual.`` tensors, Kimi-K2.5's tower and projector)
    hf: str | None = None

    def validate(self, path: str) -> list[str]:
        if self.hf is not None and not os.path.isdir(self.hf):
            return [f"{join_path(path, 'hf')}: no directory {self.hf!r}"]
        return []


@dataclass
class NativeImageConfig:
    """How images are cut for the tower (the Hugging Face image processor's settings; defaults:
    Qwen3-VL's released ``preprocessor_config.json``): each image resized to multiples of
    ``arch.patch * arch.spatial_merge`` holding between ``min_pixels`` and ``max_pixels`` pixels,
    then normalised by ``mean`` / ``std`` (``mimo.data.native_images``)."""

    min_pixels: int = 65536  # size.shortest_edge
    max_pixels: int = 16777216  # size.longest_edge
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])

    def validate(self, path: str) -> list[str]:
        problems = []
        if not 0 < self.min_pixels <= self.max_pixels:
            problems.append(f"{join_path(path, 'min_pixels')}: need 0 < min_pixels <= max_pixels, got "
                            f"{self.min_pixels} and {self.max_pixels}")
        return problems + _mean_std_problems(self, path)

    def spec_fields(self) -> dict:
        """The ``mimo.data.native_images.NativeImageSpec`` fields of this section (the resize rule's)."""
        return {"resize": "smart", "min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "mean": tuple(self.mean),
                "std": tuple(self.std)}

    @staticmethod
    def from_processor(pre: Mapping) -> dict:
        """This section's keys from a Qwen3-VL ``preprocessor_config.json`` dict ({} where it has none)."""
        size = pre.get("size") or {}
        out = {"min_pixels": pre.get("min_pixels", size.get("shortest_edge")),
               "max_pixels": pre.get("max_pixels", size.get("longest_edge")),
               "mean": pre.get("image_mean"), "std": pre.get("image_std")}
        return {k: (list(v) if isinstance(v, (list, tuple)) else int(v)) for k, v in out.items() if v is not None}


def _mean_std_problems(section, path: str) -> list[str]:
    problems = []
    for key in ("mean", "std"):
        values = getattr(section, key)
        if len(values) != 3 or (key == "std" and min(values) <= 0):
            problems.append(f"{join_path(path, key)}: three {'positive ' if key == 'std' else ''}numbers, one per "
                            f"channel, got {values}")
    return problems


@dataclass
class KimiImageConfig:
    """How images are cut for the MoonViT tower (transformers' ``Kimi_K25ImageProcessor``, its
    defaults): an image of more than ``max_patches`` patches, or more than ``max_side`` patches on a
    side, is scaled down to fit (never up; bicubic), then padded with black on the right and at the
    bottom to multiples of ``arch.patch * arch.spatial_merge`` (``mimo.data.native_images``), and
    normalised by ``mean`` / ``std``."""

    max_patches: int = 16384
    max_side: int = 512  # size.max_height (= size.max_width): patches per side
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])

    def validate(self, path: str) -> list[str]:
        return at_least(self, path, 1, "max_patches", "max_side") + _mean_std_problems(self, path)

    def spec_fields(self) -> dict:
        return {"resize": "navit", "max_patches": self.max_patches, "max_side": self.max_side, "mean": tuple(self.mean),
                "std": tuple(self.std)}

    @staticmethod
    def from_processor(pre: Mapping) -> dict:
        """This section's keys from a Kimi-K2.5 ``preprocessor_config.json`` dict ({} where it has
        none); MimoError for a size that is not square (the processor refuses one too)."""
        size = pre.get("size") or {}
        if size.get("max_height") != size.get("max_width"):
            raise MimoError(f"preprocessor_config.json: size {dict(size)} must have equal max_height and max_width "
                            f"(as Kimi_K25ImageProcessor requires)")
        out = {"max_patches": pre.get("max_patches"), "max_side": size.get("max_height"), "mean": pre.get("image_mean"),
               "std": pre.get("image_std")}
        return {k: (list(v) if isinstance(v, (list, tuple)) else int(v)) for k, v in out.items() if v is not None}


@dataclass
class NativeVideoConfig:
    """How videos are sampled and cut for the tower (the Hugging Face video processor's settings;
    defaults: Qwen3-VL's released ``video_preprocessor_config.json``): ``fps`` frames per second,
    at least ``min_frames`` and at most ``max_frames``, resized to multiples of
    ``arch.patch * arch.spatial_merge`` with between ``min_pixels`` and ``max_pixels`` pixels over
    all frames (``mimo.data.native_video``; normalised by the ``image`` section's mean / std)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4096  # size.shortest_edge
    max_pixels: int = 25165824  # size.longest_edge
    cap_pixels_per_frame: bool = False  # qwen-vl-utils' per-frame cap (transformers' option of that name)
    max_video_tokens: int = 768  # the cap's patches per frame

    def validate(self, path: str) -> list[str]:
        problems = []
        if not self.fps > 0:
            problems.append(f"{join_path(path, 'fps')}: must be > 0, got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            problems.append(f"{join_path(path, 'min_frames')}: need 1 <= min_frames <= max_frames, got "
                            f"{self.min_frames} and {self.max_frames}")
        if not 0 < self.min_pixels <= self.max_pixels:
            problems.append(f"{join_path(path, 'min_pixels')}: need 0 < min_pixels <= max_pixels, got "
                            f"{self.min_pixels} and {self.max_pixels}")
        if self.max_video_tokens < 1:
            problems.append(f"{join_path(path, 'max_video_tokens')}: must be >= 1, got {self.max_video_tokens}")
        return problems


@dataclass
class NativeEncoderModuleConfig:
    """``kind: qwen3_vl``: the Qwen3-VL vision tower (``mimo.encoders.qwen3_vl``), mergers
    included (they map to the LLM's width: no projector); deepstack levels travel beside each
    row (an output row is ``arch.out_hidden * (1 + len(arch.deepstack_layers))`` wide, which must
    be the LLM's ``hidden * (1 + len(deepstack_layers))``)."""

    kind: Literal["qwen3_vl"]
    arch: Qwen3VisionArch
    init: NativeInit = field(default_factory=NativeInit)
    placeholder: str = NATIVE_PLACEHOLDER  # the text token that this encoder's rows replace
    image: NativeImageConfig = field(default_factory=NativeImageConfig)
    video: NativeVideoConfig | None = None  # set: the tower also takes videos (video files of a sample)
    video_placeholder: str = NATIVE_VIDEO_PLACEHOLDER  # the text marking where each video goes
    # texts written around each image's rows (Qwen3-VL's processor's); "" for none
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    freeze: list[Literal["tower"]] = field(default_factory=list)  # "tower": the whole tower, mergers included
    lora: LoraConfig | None = None  # low-rank adapters on the tower, its base weights frozen (mimo.parallel.lora)
    lr: float | None = None  # this module's AdamW learning rate (None: train.lr)
    weight_decay: float | None = None  # None: train.weight_decay
    # activation recompute of the tower's blocks (mimo.parallel.recompute); None: train.recompute / recompute_layers
    recompute: Literal["none", "selective", "full"] | None = None
    recompute_layers: int | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    native = True  # rows per image follow each image's grid

    @property
    def trains(self) -> bool:
        return "tower" not in self.freeze

    @property
    def rows_per_image(self) -> int:
        """There is no fixed count: each image has its own (``mimo.data``: the image's grid)."""
        raise ConfigError([f"kind {self.kind} (native resolution) has no fixed rows per image: each image's follow "
                           f"from its grid"])

    def validate(self, path: str) -> list[str]:
        arch, par = self.arch, self.parallel
        pkey = lambda name: join_path(path, "parallel", name)  # noqa: E731
        problems = encoder_parallel_problems(par, pkey)
        if par.gtp > 1:
            problems.append(f"{pkey('gtp')}: gtp={par.gtp} is not supported for the {self.kind} tower yet; use gtp: 1")
        if par.tp >= 1 and min(arch.heads, arch.mlp, arch.hidden, arch.spatial_merge) >= 1:
            problems += tp_divides(par.tp, {"heads": arch.heads, "mlp": arch.mlp}, pkey("tp"))
            if arch.merge_width % par.tp:
                problems.append(f"{pkey('tp')}: tp={par.tp} must divide the mergers' width arch.spatial_merge^2 * "
                                f"arch.hidden = {arch.merge_width}")
        if not self.placeholder.strip():
            problems.append(f"{join_path(path, 'placeholder')}: must not be empty")
        problems += self.image.validate(join_path(path, "image"))
        if self.video is not None:
            problems += self.video.validate(join_path(path, "video"))
            if not self.video_placeholder.strip() or self.video_placeholder == self.placeholder:
                problems.append(f"{join_path(path, 'video_placeholder')}: must be a text of its own (not empty, not the "
                                f"image placeholder {self.placeholder!r})")
        return problems + _freeze_problems(self.freeze, path, self.lora, self.parallel.gtp)


# ---------------------------------------------------------------- kind: kimi_k25


@dataclass
class KimiEncoderModuleConfig(NativeEncoderModuleConfig):
    """``kind: kimi_k25``: Kimi-K2.5's MoonViT tower and its projector (``mimo.encoders.moonvit``;
    one feature level per row, ``arch.out_hidden`` wide: the LLM's hidden), the fields of
    ``kind: qwen3_vl`` with Kimi's defaults: its image token ``<|media_pad|>`` between
    ``<|media_begin|>image<|media_content|>`` and ``<|media_end|>`` (as Kimi-K2.5's chat template
    writes an image), images cut as ``Kimi_K25ImageProcessor`` cuts them. Still images only:
    a ``video`` section is refused."""

    kind: Literal["kimi_k25"]
    arch: MoonViTArch
    placeholder: str = "<|media_pad|>"
    image: KimiImageConfig = field(default_factory=KimiImageConfig)
    video_placeholder: str = "<|kimi_k25_video_placeholder|>"
    vision_start: str = "<|media_begin|>image<|media_content|>"
    vision_end: str = "<|media_end|>"

    def validate(self, path: str) -> list[str]:
        problems = super().validate(path)
        if self.video is not None:
            problems.append(f"{join_path(path, 'video')}: the Kimi-K2.5 tower (kind kimi_k25) takes still images only; "
                            f"videos are not supported (remove the video section)")
        return problems


@dataclass(frozen=True)
class NativeTower:
    """A native-resolution tower kind: its module config, and where its tower and its Hugging
    Face weight mapping live (imported when asked: this module stays torch-free)."""

    kind: str
    title: str  # for messages
    config: type  # its module config class (``kind: <kind>``)
    arch: type  # its arch class (``from_hf_config`` of a whole config.json, ``to_hf_kwargs``)
    image: type  # its ``image`` section's class (``from_processor`` of a preprocessor_config.json)
    tower: str  # "module:Class" of the tower (``forward(pixels_PJ, grids_N3) -> rows_RX``)
    hf: str  # the module of its Hugging Face weights (``hf_rules``, ``import_hf``, ``import_hf_state``, ``tower_state_to_hf``)
    model_types: tuple[str, ...]  # the Hugging Face model types (config.json) whose vision tower it is
    videos: bool  # whether it takes videos

    def tower_module(self):
        """The module of its tower (``LORA_TARGETS``: the paths ``lora.targets`` names)."""
        import importlib

        return importlib.import_module(self.tower.split(":")[0])

    def tower_class(self):
        return getattr(self.tower_module(), self.tower.split(":")[1])

    def hf_module(self):
        import importlib

        return importlib.import_module(self.hf)


NATIVE_TOWERS = {
    "qwen3_vl": NativeTower("qwen3_vl", "Qwen3-VL", NativeEncoderModuleConfig, Qwen3VisionArch, NativeImageConfig,
                            "mimo.encoders.qwen3_vl:Qwen3VisionTower", "mimo.encoders.hf_qwen3_vl",
                            ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), True),
    "kimi_k25": NativeTower("kimi_k25", "Kimi-K2.5 (MoonViT)", KimiEncoderModuleConfig, MoonViTArch, KimiImageConfig,
                            "mimo.encoders.moonvit:MoonViTTower", "mimo.encoders.hf_kimi_k25", ("kimi_k25",), False),
}


def native_tower_of(model_type: str | None) -> NativeTower:
    """The native tower kind of a Hugging Face model type (MimoError naming the supported ones)."""
    for tower in NATIVE_TOWERS.values():
        if model_type in tower.model_types:
            return tower
    known = ", ".join(t for tower in NATIVE_TOWERS.values() for t in tower.model_types)
    raise MimoError(f"model_type {model_type!r} has no native-resolution tower mimo builds ({known})")

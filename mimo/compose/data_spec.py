"""What the data path needs of the encoders, from a config, without torch (``check-config``'s
tokenizer and shard checks use it too): rows per image, native towers' image specs, the text spec.
A run derives it first, once (``data_spec``), and builds its pipeline from that
(``mimo.compose.inputs.training_pipeline``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mimo.compose.config import MimoConfig
from mimo.core.errors import DataError
from mimo.data.index import TextSpec
from mimo.data.native_images import NativeImageSpec, NativePlaceholder, NativeVideoSpec
from mimo.encoders.config import NativeEncoderModuleConfig


def rows_per_image(config: MimoConfig) -> dict[str, int]:
    """Placeholder -> rows per image, in encoder order (0: a native tower's, each image's own)."""
    return {e.placeholder: 0 if e.native else e.rows_per_image for e in config.encoders.values()}


def native_spec(enc: NativeEncoderModuleConfig) -> NativePlaceholder:
    """How the data path cuts a native tower's images and writes them into the text."""
    a = enc.arch
    image = NativeImageSpec(patch=a.patch, temporal_patch=a.temporal_patch, merge=a.spatial_merge, channels=a.channels,
                            **enc.image.spec_fields())
    video = None if enc.video is None else NativeVideoSpec(**asdict(enc.video))  # the same fields
    return NativePlaceholder(enc.placeholder, image, enc.vision_start, enc.vision_end, video, enc.video_placeholder)


def text_spec(config: MimoConfig) -> TextSpec:
    native = tuple(native_spec(e) for e in config.encoders.values() if e.native)
    rows = tuple(rows_per_image(config).items())
    if config.data.source == "synthetic":  # no tokenizer: the ids are drawn directly
        return TextSpec("", config.data.template, rows, native)
    if config.data.tokenizer is None:
        raise DataError("data.tokenizer is not set")
    return TextSpec(config.data.tokenizer, config.data.template, rows, native)


@dataclass(frozen=True)
class DataSpec:
    """What a run's data path derives from its config without torch, once, before its pipeline
    is built on it (``mimo.compose.inputs.training_pipeline``, which derives none of it again)."""

    text: TextSpec
    synthetic: tuple[int, tuple[int, int]]  # ``MimoConfig.synthetic_shape`` (used by source: synthetic only)


def data_spec(config: MimoConfig) -> DataSpec:
    return DataSpec(text_spec(config), config.synthetic_shape())


def mrope_merge(config: MimoConfig) -> dict[str, int] | None:
    """What packs need for 3-D positions (``mimo.data.pack.pack``): None for a 1-D LLM."""
    return text_spec(config).mrope_merge() if getattr(config.llm.arch, "mrope_section", None) is not None else None

"""A native-resolution VLM (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Kimi-K2.5) on one rank: samples with
images and videos, their pack, and the composition tower rows -> LLM image rows -> logits
(docs/design.md §10).

Samples. A ``VLMSample`` is token ids plus its ``Visual`` s (images and videos) in order of
appearance, laid out as transformers' Qwen3-VL processor lays them out:

* an image of grid ``(1, h, w)`` (patches): ``<vision_start> <image_pad> x (h*w / merge^2) <vision_end>``;
* a video of grid ``(t, h, w)`` (``t`` temporal patches of ``temporal_patch`` frames each):
  per temporal patch its timestamp (text tokens), then its own ``<vision_start> <video_pad> x
  (h*w / merge^2) <vision_end>`` (``mimo.data.positions``: each such frame block is positioned as a
  one-step image).

Pixels: an image through ``mimo.data.native_images.preprocess`` (the processor's resize and
patch order); a video's frames each through the same preprocessing (one frame size for all),
then grouped ``temporal_patch`` at a time into rows ``C x temporal_patch x p x p`` as the video
processor's ``patchify`` writes them (``video_patches``; frames padded with the last one to a
whole temporal patch, as there). The video processor picks the frame size with its own pixel
budget (over all frames); here each frame follows the image rule, a preprocessing choice only:
the rows' layout is the processor's.

The pack (``pack_samples``): the training packer (``mimo.data.pack.pack``) over the samples'
tokens with next-token labels inside each sample, targets every token but the image / video
pads (a pad is never predicted; the token before a vision block predicts its
``<vision_start>``); the 3-D positions of ``mimo.data.positions.packed_positions_3d``; one image
key (``KEY``) whose slots are every image and every video pad position, in token order. The
tower runs once on every visual of the pack in that same order (``pixels_PJ``, ``grids_N3``),
so its rows (main features, then each deepstack level: ``Qwen3VisionTower``) land row for row
on those slots, and the LLM adds each deepstack level at the same positions: Hugging Face's
``visual_pos_masks`` over images and videos together.

Kimi-K2.5 lays an image out alike (its ``<|media_begin|>`` / ``<|media_end|>`` ids as vision start /
end), takes no videos (``random_samples(videos=False)``) and rotates its LLM by 1-D positions (the
pack's 3-D ones go unused).

``NativeVLM`` holds the tower and the LLM stage of one rank (tower colocated with the LLM's
first stage; its own context, e.g. the LLM's dense grid: TP inside, data parallel across),
``forward(pack)`` -> this rank's vocab-parallel logits. ``build_vlm`` / ``load_vlm_``
build it from a ``config.json`` (the tower of its model type's kind,
``mimo.encoders.config.NATIVE_TOWERS``) and load a Hugging Face checkpoint directory through the
mappings (the kind's, e.g. ``encoders.hf_qwen3_vl``; ``llm.hf``). ``random_samples`` draws the
samples ``mimo verify-hf`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn

from mimo.core.batch import PackedBatch
from mimo.core.errors import DataError, MimoError
from mimo.data.native_images import NativeImageSpec, preprocess
from mimo.data.pack import PackItem, pack
from mimo.encoders.config import native_tower_of
from mimo.encoders.qwen3_vl import NativeTower, Qwen3VisionArch
from mimo.llm.config import HybridArch
from mimo.llm.model import LLMStage
from mimo.data.positions import packed_positions_3d
from mimo.parallel.context import ParallelContext

__all__ = ["KEY", "VisionTokenIds", "Visual", "VLMSample", "VLMPack", "NativeVLM", "image_spec", "video_patches",
           "image_block", "video_blocks", "text_ids", "random_samples", "pack_samples", "stage_image_rows",
           "vlm_archs", "build_vlm", "load_vlm_"]

KEY = "<image>"  # the one placeholder key of a native VLM: image and video rows share it, in token order

# transformers' Qwen3VLConfig defaults
_TOKEN_FIELDS = {"image": ("image_token_id", 151655), "video": ("video_token_id", 151656),
                 "start": ("vision_start_token_id", 151652), "end": ("vision_end_token_id", 151653)}


@dataclass(frozen=True)
class VisionTokenIds:
    """The special tokens of a Qwen3-VL vocabulary."""

    image: int  # <|image_pad|>: one per merged image row
    video: int  # <|video_pad|>: one per merged video row
    start: int  # <|vision_start|>: before every image and every video frame block
    end: int  # <|vision_end|>: after them

    @classmethod
    def from_hf_config(cls, config: Mapping) -> "VisionTokenIds":
        """From a Qwen3-VL ``config.json`` dict (transformers' defaults where it has none)."""
        return cls(**{ours: int(config.get(theirs, default)) for ours, (theirs, default) in _TOKEN_FIELDS.items()})

    def all(self) -> tuple[int, int, int, int]:
        return (self.image, self.video, self.start, self.end)


@dataclass
class Visual:
    """One image or video of a sample: its patch rows ``[t*h*w, C*tp*p*p]`` and grid ``(t, h, w)``."""

    kind: str  # "image" or "video"
    pixels_PJ: torch.Tensor
    grid: tuple[int, int, int]

    def rows(self, merge: int) -> int:
        """Tower output rows = LLM tokens: one per merge x merge block of every temporal patch."""
        t, h, w = self.grid
        return t * h * w // (merge * merge)


@dataclass
class VLMSample:
    """Token ids and the visuals their vision blocks hold, in order of appearance."""

    tokens: list[int]
    visuals: list[Visual] = field(default_factory=list)

    def target(self, ids: VisionTokenIds) -> list[bool]:
        """Which tokens are predicted (labels): all but the image / video pads."""
        return [t != ids.image and t != ids.video for t in self.tokens]


# ---------------------------------------------------------------- pixels and token blocks


def image_spec(arch: Qwen3VisionArch, max_blocks: int = 16, min_blocks: int = 1,
               mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), resize: str = "smart") -> NativeImageSpec:
    """The preprocessing of ``arch``'s tower (patch, temporal patch, merge, channels) with a
    pixel budget of ``min_blocks .. max_blocks`` merge blocks (LLM tokens) per image: small
    budgets for verification; Qwen3-VL's released mean / std by default. ``resize: navit``
    (Kimi-K2.5's rule): images over ``max_blocks`` blocks' patches scaled down, none up."""
    f = arch.patch * arch.spatial_merge
    budget = ({"min_pixels": f * f * min_blocks, "max_pixels": f * f * max_blocks} if resize == "smart"
              else {"max_patches": arch.spatial_merge**2 * max_blocks})
    return NativeImageSpec(patch=arch.patch, temporal_patch=arch.temporal_patch, merge=arch.spatial_merge,
                           mean=tuple(mean), std=tuple(std), channels=arch.channels, resize=resize, **budget)


def video_patches(frames: Sequence, spec: NativeImageSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames (PIL images or uint8 HWC arrays, all one size) -> (patch rows ``[t*h*w, C*tp*p*p]``,
    ``(t, h, w)``) in the video processor's layout (module doc): temporal patch by temporal
    patch, merge block by merge block; each row channel, then the ``tp`` frames, then pixels."""
    if not frames:
        raise DataError("a video needs at least one frame")
    per_frame = [preprocess(f, spec) for f in frames]
    grids = {g for _, g in per_frame}
    if len(grids) != 1:
        raise DataError(f"the frames of a video must have one size; they give grids {sorted(grids)}")
    (_, h, w), = grids
    C, tp, pp = spec.channels, spec.temporal_patch, spec.patch * spec.patch
    # each preprocessed frame repeats itself in time: keep one copy, [h*w, C, p*p]
    one_NCQ = [rows.view(h * w, C, tp, pp)[:, :, 0] for rows, _ in per_frame]
    one_NCQ += [one_NCQ[-1]] * (-len(one_NCQ) % tp)  # a whole last temporal patch, as the processor pads
    t = len(one_NCQ) // tp
    groups = [torch.stack(one_NCQ[k * tp:(k + 1) * tp], dim=2).reshape(h * w, C * tp * pp) for k in range(t)]
    return torch.cat(groups).contiguous(), (t, h, w)


def image_block(grid: tuple[int, int, int], merge: int, ids: VisionTokenIds) -> list[int]:
    """The tokens of one image: vision start, its pads, vision end."""
    t, h, w = grid
    return [ids.start] + [ids.image] * (t * h * w // (merge * merge)) + [ids.end]


def video_blocks(grid: tuple[int, int, int], merge: int, ids: VisionTokenIds, stamps: Sequence[Sequence[int]]) -> list[int]:
    """The tokens of one video: per temporal patch its timestamp tokens, then its own block."""
    t, h, w = grid
    if len(stamps) != t:
        raise DataError(f"a video of {t} temporal patches needs {t} timestamps, got {len(stamps)}")
    out: list[int] = []
    for stamp in stamps:
        out += list(stamp) + [ids.start] + [ids.video] * (h * w // (merge * merge)) + [ids.end]
    return out


# ---------------------------------------------------------------- random samples


def text_ids(vocab: int, ids: VisionTokenIds, other_special: Sequence[int] = ()) -> torch.Tensor:
    """Token ids that random text may use: below the lowest special id (Qwen's special tokens
    close the vocabulary), or, where that leaves too few, every id but the special ones."""
    special = {i for i in (*ids.all(), *other_special) if i is not None and 0 <= i < vocab}
    low = min(special, default=vocab)
    if low >= 8:
        return torch.arange(low)
    keep = torch.tensor([i for i in range(vocab) if i not in special], dtype=torch.long)
    if keep.numel() < 2:
        raise MimoError(f"vocab of {vocab} leaves no room for text beside the special tokens {sorted(special)}")
    return keep


def _side(rng: np.random.Generator, factor: int, blocks: int) -> int:
    """A side of about ``blocks`` merge blocks that is not a multiple of 32 (nor of ``factor``)."""
    while True:
        side = factor * blocks + int(rng.integers(1, factor))
        if side % 32:
            return side


def random_samples(arch: Qwen3VisionArch, vocab: int, ids: VisionTokenIds, seed: int, count: int = 3,
                   other_special: Sequence[int] = (), frames: int = 4, videos: bool = True,
                   resize: str = "smart") -> list[VLMSample]:
    """``count`` (at least 3) random samples cycling through three kinds: a video of ``frames``
    frames between text (timestamps of two text tokens); two images of different sizes (one
    wide, one tall) between text; text only. The video comes first, so that the pack's token
    order, which its rows follow, is not Hugging Face's images-then-videos order. Without
    ``videos`` (a tower that takes none) a large image (over the budget: scaled down under
    ``resize: navit``) stands in its place. Random RGB PIL images (and frames) whose sides are
    not multiples of 32 (nor of patch * merge), through ``image_spec(arch, resize=resize)``'s
    preprocessing; text from ``text_ids``. Deterministic in ``seed``."""
    from PIL import Image

    spec = image_spec(arch, resize=resize)
    f, m = spec.factor, arch.spatial_merge
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    pool = text_ids(vocab, ids, other_special)

    def text(lo: int, hi: int) -> list[int]:
        n = int(rng.integers(lo, hi + 1))
        return pool[torch.randint(0, pool.numel(), (n,), generator=g)].tolist()

    def picture(h: int, w: int):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")

    out = []
    for i in range(max(3, count)):
        kind = i % 3
        if kind == 1:  # two images: one wider than tall, one taller than wide
            visuals = [Visual("image", *preprocess(picture(_side(rng, f, 1), _side(rng, f, 3)), spec)),
                       Visual("image", *preprocess(picture(_side(rng, f, 3), _side(rng, f, 1)), spec))]
            tokens = (text(2, 5) + image_block(visuals[0].grid, m, ids) + text(1, 4)
                      + image_block(visuals[1].grid, m, ids) + text(2, 5))
        elif kind == 0 and not videos:  # one large image
            visuals = [Visual("image", *preprocess(picture(_side(rng, f, 6), _side(rng, f, 5)), spec))]
            tokens = text(2, 5) + image_block(visuals[0].grid, m, ids) + text(2, 5)
        elif kind == 0:  # a video (first: in token order a video comes before images)
            h, w = _side(rng, f, 2), _side(rng, f, 2)
            pixels, grid = video_patches([picture(h, w) for _ in range(frames)], spec)
            visuals = [Visual("video", pixels, grid)]
            tokens = text(2, 5) + video_blocks(grid, m, ids, [text(2, 2) for _ in range(grid[0])]) + text(2, 5)
        else:
            visuals, tokens = [], text(5, 12)
        out.append(VLMSample(tokens, visuals))
    return out


# ---------------------------------------------------------------- the pack


@dataclass
class VLMPack:
    """One rank's packed batch and every visual's patch rows and grids in token order."""

    batch: PackedBatch
    pixels_PJ: torch.Tensor
    grids_N3: torch.Tensor  # int64 [N, 3]
    kinds: list[str]  # "image" / "video" per grid
    key: str = KEY


def _vision_runs(tokens: torch.Tensor, ids: VisionTokenIds) -> list[str]:
    """Kinds of the runs of image / video pads, in order."""
    kind = torch.zeros_like(tokens)
    kind[tokens == ids.image], kind[tokens == ids.video] = 1, 2
    runs, prev = [], 0
    for k in kind.tolist():
        if k and k != prev:
            runs.append("image" if k == 1 else "video")
        prev = k
    return runs


def pack_samples(samples: Sequence[VLMSample], ids: VisionTokenIds, merge: int, *, tp: int = 1,
                 sequence_parallel: bool = False, pad_id: int = 0, sample_ids: Sequence[int] | None = None,
                 key: str = KEY) -> VLMPack:
    """The samples as one THD pack (module doc), padded for ``tp`` / ``sequence_parallel`` as
    ``mimo.data.pack`` pads; ``DataError`` where tokens and visuals disagree."""
    if pad_id in (ids.image, ids.video):
        raise DataError(f"pad_id {pad_id} is an image / video token")
    sample_ids = list(range(len(samples))) if sample_ids is None else list(sample_ids)
    items = [PackItem(i, list(s.tokens), s.target(ids), {}) for i, s in zip(sample_ids, samples)]
    batch = pack(items, {}, tp, 1, sequence_parallel, pad_id)
    visuals = [v for s in samples for v in s.visuals]
    want = [v.kind for v in visuals for _ in range(v.grid[0] if v.kind == "video" else 1)]
    got = _vision_runs(batch.tokens, ids)
    if got != want:
        raise DataError(f"the tokens' vision blocks ({got}) do not match the samples' visuals ({want})")
    image_grids = [v.grid for v in visuals if v.kind == "image"]
    video_grids = [v.grid for v in visuals if v.kind == "video"]
    batch.positions_3d = packed_positions_3d(batch.tokens, batch.cu_seqlens, image_grids or None, video_grids or None,
                                             merge, ids.image, ids.video, ids.start)
    batch.image_slots = {key: torch.nonzero((batch.tokens == ids.image) | (batch.tokens == ids.video)).flatten()}
    rows = sum(v.rows(merge) for v in visuals)
    if rows != batch.image_slots[key].numel():
        raise DataError(f"the visuals give {rows} rows, the tokens hold {batch.image_slots[key].numel()} pads")
    batch.validate()
    width = visuals[0].pixels_PJ.shape[1] if visuals else 0
    pixels = torch.cat([v.pixels_PJ for v in visuals]) if visuals else torch.zeros(0, width)
    grids = torch.tensor([v.grid for v in visuals], dtype=torch.long).reshape(-1, 3)
    return VLMPack(batch, pixels, grids, [v.kind for v in visuals], key)


# ---------------------------------------------------------------- the model on one rank


def stage_image_rows(stage: LLMStage, batch: PackedBatch, key: str, rows_RX: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{key: rows}`` as the stage takes them: the whole pack's rows, or under sequence
    parallelism those of the slots this rank holds (``LLMStage.local_image_slots``)."""
    if not stage.sequence_parallel:
        return {key: rows_RX}
    slots = batch.image_slots[key]
    n = stage.local_len(batch)
    lo = stage.tp_rank * n
    return {key: rows_RX[(slots >= lo) & (slots < lo + n)]}


class NativeVLM(nn.Module):
    """The tower and the LLM stage of one rank (the first and only stage: the tower's rows and
    their deepstack levels go to it); ``forward(pack)`` -> vocab-parallel logits ``[T, V/tp]``."""

    def __init__(self, tower: NativeTower, stage: LLMStage):
        super().__init__()
        if not (stage.is_first and stage.is_last):
            raise MimoError("NativeVLM runs one pipeline stage (pp = 1)")
        levels = 1 + len(stage.arch.deepstack_layers)
        if tower.arch.out_hidden != stage.arch.hidden or tower.arch.levels != levels:
            raise MimoError(f"the tower gives {tower.arch.levels} level(s) of {tower.arch.out_hidden}; the LLM takes "
                            f"{levels} of {stage.arch.hidden} (hidden, 1 + deepstack levels)")
        self.tower, self.stage = tower, stage

    def rows(self, pack: VLMPack) -> torch.Tensor:
        """The tower's rows of the pack's visuals ``[R, out_hidden * levels]``."""
        dtype = self.tower.patch_embed.weight.dtype
        return self.tower(pack.pixels_PJ.to(device=self.tower.patch_embed.weight.device, dtype=dtype),
                          pack.grids_N3)

    def forward(self, pack: VLMPack) -> torch.Tensor:
        rows_RX = self.rows(pack)
        return self.stage(pack.batch, image_rows=stage_image_rows(self.stage, pack.batch, pack.key, rows_RX))

    def loss(self, logits: torch.Tensor, pack: VLMPack, num_loss_tokens) -> torch.Tensor:
        return self.stage.loss(logits, pack.batch, num_loss_tokens)


def vlm_archs(config: Mapping) -> tuple[Qwen3VisionArch, HybridArch]:
    """(tower arch, LLM arch) of a native VLM's ``config.json`` dict (``mimo.llm.hf.QWEN3_VL``'s
    model types; the tower's arch class that of its kind)."""
    from mimo.llm.hf import normalised_qwen3_vl_config, qwen3_vl_arch

    whole = normalised_qwen3_vl_config(config)
    return native_tower_of(config.get("model_type")).arch.from_hf_config(whole), qwen3_vl_arch(config)


def build_vlm(config: Mapping, llm_ctx: ParallelContext, tower_ctx: ParallelContext | None = None) -> NativeVLM:
    """The rank's ``NativeVLM`` of a native VLM's ``config.json`` dict, weights uninitialised
    (``load_vlm_``); ``tower_ctx`` default: the LLM's dense layout."""
    tower_arch, arch = vlm_archs(config)
    tower_cls = native_tower_of(config.get("model_type")).tower_class()
    tower = tower_cls(tower_arch, llm_ctx if tower_ctx is None else tower_ctx)
    return NativeVLM(tower, LLMStage(arch, llm_ctx))


def load_vlm_(vlm: NativeVLM, path: str) -> None:
    """Load a Hugging Face native-VLM checkpoint directory (``save_pretrained``'s safetensors,
    one file or shards; Kimi-K2.5's published naming too) into this rank's slices: the tower
    through its kind's mapping (``encoders.hf_qwen3_vl``: ``model.visual.*``;
    ``encoders.hf_kimi_k25``), the language model through ``llm.hf`` (``model.language_model.*``,
    ``lm_head``); every tensor checked by name and shape."""
    from mimo.encoders.hf_import import load_hf_state, read_config_json
    from mimo.llm.hf import load_hf_checkpoint

    tower = native_tower_of(read_config_json(path).get("model_type"))
    state = load_hf_state(path, lazy=True)
    vlm.tower.load_weights_(tower.hf_module().import_hf_state(state, vlm.tower.arch, where=f"checkpoint {path!r}"))
    load_hf_checkpoint(vlm.stage, path)

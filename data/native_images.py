"""Native-resolution image preprocessing in the Qwen3-VL style (the first brick of issue 47).

A native-resolution tower does not crop images to one square: each image keeps (about) its own
aspect ratio and size, is resized so both sides are multiples of ``patch * merge`` and its pixel
count lies in ``[min_pixels, max_pixels]``, and becomes a variable number of patch rows. The
numbers here are those of transformers' Qwen2-VL image processor with Qwen3-VL's released
settings (the processor Qwen3-VL loads), so a checkpoint trained there sees the same inputs here:

* target size: round each side to the nearest multiple of ``factor = patch * merge``; if that
  holds more than ``max_pixels``, scale both sides down by one factor and floor to multiples
  (never below one factor); if fewer than ``min_pixels``, scale up and ceil to multiples;
* resize: bicubic with antialiasing on uint8 (torch's CPU uint8 kernel, as the processor's
  torchvision backend runs it), the result rounded back to uint8;
* values: ``(x - 255*mean) / (255*std)`` in float32, i.e. rescale by 1/255 then normalise,
  folded into one step the way the processor folds it (so the floats agree bit for bit);
* rows: one row per ``patch x patch`` patch, patches listed merge block by merge block (the
  ``merge x merge`` patches the bridge later fuses into one LLM token sit next to each other),
  each row ``C x temporal_patch x patch x patch`` with the single frame repeated in time.

Kimi-K2.5's processor (``resize: navit``, ``Kimi_K25ImageProcessor``) cuts otherwise: an image of
more than ``max_patches`` patches (``floor(side / patch)`` per side), or more than ``max_side``
patches on a side, is scaled down by one factor to fit (never up; each side truncated to whole
pixels), resized as above, then padded with black (zero bytes, before normalising) on the right
and at the bottom to multiples of ``patch * merge`` (``navit_sizes``); its rows are laid out as
above (the processor lists them in raster order: the tower takes this order, ``mimo.encoders.moonvit``).

The row count and the token count depend only on the image size, which an image file's header
gives without decoding the pixels (``grid_from_bytes``): planners can lay out packs before any
decode. Images that cannot be honoured raise ``DataError`` (a pipeline may count them as skips):
an empty side, an aspect ratio over 200 (the processor refuses these too), a size whose target
would break the ``[min_pixels, max_pixels]`` budget (only tight budgets reach it: a short side
bumped up to one factor, or a ceil/floor that jumps over the other bound), and a file whose
header is unreadable or bigger than PIL agrees to decode (its decompression-bomb limit).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mimo.core.errors import DataError

if TYPE_CHECKING:
    import torch

MAX_ASPECT = 200  # longest side / shortest side beyond which the processor refuses an image


@dataclass(frozen=True)
class NativeImageSpec:
    """How a native-resolution tower cuts images (defaults: Qwen3-VL's released processor:
    16-pixel patches, 2 frames per temporal patch, 2x2 merge, 256^2..4096^2 pixels, mean/std 0.5)."""

    patch: int = 16
    temporal_patch: int = 2
    merge: int = 2
    min_pixels: int = 65536  # 256 * 256
    max_pixels: int = 16777216  # 4096 * 4096
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    channels: int = 3
    # the resize rule: "smart" (Qwen3-VL's processor: min_pixels / max_pixels) or "navit" (Kimi-K2.5's:
    # scaled down to max_patches / max_side patches, then padded to whole merge blocks)
    resize: str = "smart"
    max_patches: int = 16384  # navit: the patch budget of an image
    max_side: int = 512  # navit: patches per side

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: whole merge blocks of whole patches."""
        return self.patch * self.merge

    @property
    def row_numel(self) -> int:
        """Values in one patch row: channels x temporal patch x patch x patch."""
        return self.channels * self.temporal_patch * self.patch * self.patch


@dataclass(frozen=True)
class NativeVideoSpec:
    """How a native-resolution tower samples and cuts videos (``mimo.data.native_video``;
    defaults: Qwen3-VL's released ``video_preprocessor_config.json``)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4096  # size.shortest_edge: over all frames
    max_pixels: int = 25165824  # size.longest_edge: over all frames
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768


def smart_size(height: int, width: int, spec: NativeImageSpec = NativeImageSpec()) -> tuple[int, int]:
    """The ``(height, width)`` an image of this size is resized to (the processor's
    ``smart_resize``), or ``DataError`` where no honest target exists."""
    if height < 1 or width < 1:
        raise DataError(f"image too small: {height}x{width} (height x width) is empty, nothing to cut into patches")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT:
        raise DataError(f"image aspect ratio too large: {height}x{width} (height x width) has aspect ratio {ratio:.1f}, "
                        f"over the limit of {MAX_ASPECT} that native-resolution towers accept")
    f = spec.factor
    # Python's round: halves go to the even multiple, as in the processor.
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > spec.max_pixels:
        shrink = math.sqrt(height * width / spec.max_pixels)
        h = max(f, math.floor(height / shrink / f) * f)
        w = max(f, math.floor(width / shrink / f) * f)
    elif h * w < spec.min_pixels:
        grow = math.sqrt(spec.min_pixels / (height * width))
        h = math.ceil(height * grow / f) * f
        w = math.ceil(width * grow / f) * f
    if not spec.min_pixels <= h * w <= spec.max_pixels:
        kind = "small" if h * w < spec.min_pixels else "large"
        raise DataError(f"image too {kind}: {height}x{width} (height x width) is too {kind} for the pixel budget "
                        f"[{spec.min_pixels}, {spec.max_pixels}] at a {f}-pixel grid: the nearest target "
                        f"{h}x{w} holds {h * w} pixels")
    return h, w


def navit_sizes(height: int, width: int, spec: NativeImageSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized, padded) ``(height, width)`` of an image under Kimi-K2.5's rule (module doc; the
    processor's ``navit_resize``, the same float operations), or ``DataError`` for an empty one."""
    if height < 1 or width < 1:
        raise DataError(f"image too small: {height}x{width} (height x width) is empty, nothing to cut into patches")
    p = spec.patch
    patches = max(1.0, height // p) * max(1.0, width // p)
    scale = min(1.0, math.sqrt(spec.max_patches / patches), spec.max_side * p / height, spec.max_side * p / width)
    h = min(max(1, int(height * scale)), spec.max_side * p)
    w = min(max(1, int(width * scale)), spec.max_side * p)
    f = spec.factor
    return (h, w), (h + (f - h % f) % f, w + (f - w % f) % f)


def target_sizes(height: int, width: int, spec: NativeImageSpec = NativeImageSpec()) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized, padded) ``(height, width)`` of an image under ``spec``'s rule (``smart``: no padding)."""
    if spec.resize == "navit":
        return navit_sizes(height, width, spec)
    if spec.resize != "smart":
        raise DataError(f"unknown resize rule {spec.resize!r} (smart, navit)")
    size = smart_size(height, width, spec)
    return size, size


def image_grid(height: int, width: int, spec: NativeImageSpec = NativeImageSpec()) -> tuple[int, int, int]:
    """``(t, gh, gw)`` patches of one image (the processor's ``image_grid_thw``): a still image is
    one temporal patch (its frame repeated), so ``t`` is 1."""
    _, (h, w) = target_sizes(height, width, spec)
    return 1, h // spec.patch, w // spec.patch


def image_tokens(height: int, width: int, spec: NativeImageSpec = NativeImageSpec()) -> int:
    """LLM tokens one image becomes: its patches over the ``merge x merge`` fusion."""
    t, gh, gw = image_grid(height, width, spec)
    return t * gh * gw // (spec.merge * spec.merge)


def _open(data: bytes):
    """PIL image opened lazily (header parsed, pixels not decoded), failures as ``DataError``."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise DataError(f"image too large to decode: {e}") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"corrupt image: unreadable header ({len(data)} bytes): {e}") from None


def grid_from_bytes(data: bytes, spec: NativeImageSpec = NativeImageSpec()) -> tuple[int, int, int]:
    """``image_grid`` of an encoded image from its header alone (``Image.open`` reads the size
    without decoding pixels), so packs can be planned before any decode. Like the processor,
    EXIF orientation is not applied: the stored size is the one that is cut."""
    width, height = _open(data).size
    return image_grid(height, width, spec)


def _rgb_uint8_CHW(img) -> torch.Tensor:
    """PIL image or uint8 ``[H, W, 3]`` / ``[H, W]`` array -> contiguous uint8 ``[3, H, W]``.
    Transparent PIL images are composited onto white first, as the processor does."""
    import torch
    from PIL import Image

    if isinstance(img, Image.Image):
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        arr_HWC = np.asarray(img.convert("RGB"))
    else:
        arr_HWC = np.asarray(img)
        if arr_HWC.dtype != np.uint8:
            raise DataError(f"image array must be uint8, got {arr_HWC.dtype}")
        if arr_HWC.ndim == 2:
            arr_HWC = arr_HWC[:, :, None]
        if arr_HWC.ndim != 3 or arr_HWC.shape[2] not in (1, 3):
            raise DataError(f"image array must be [H, W, 3] or [H, W] uint8 (pass images with alpha as PIL), "
                            f"got shape {tuple(arr_HWC.shape)}")
        if arr_HWC.shape[2] == 1:
            arr_HWC = np.repeat(arr_HWC, 3, axis=2)
    # A copy: PIL's arrays are read-only views, and the caller's array stays untouched.
    return torch.from_numpy(np.array(arr_HWC, order="C", copy=True)).permute(2, 0, 1).contiguous()


def resize_uint8(x_NCHW, size: tuple[int, int]):
    """uint8 ``[N, C, H, W]`` at ``size`` (unchanged where it is that size already)."""
    import torch.nn.functional as F

    if tuple(x_NCHW.shape[-2:]) == tuple(size):
        return x_NCHW
    # uint8 in, uint8 out: torch's CPU antialiased bicubic kernel works on bytes directly
    # (PIL's algorithm), which is what the processors' torchvision resize calls.
    return F.interpolate(x_NCHW, size=tuple(size), mode="bicubic", align_corners=False, antialias=True)


def _resized(img, spec: NativeImageSpec):
    """uint8 ``[C, h, w]`` of an image at its ``target_sizes`` (resized, then padded with zeros on
    the right and at the bottom where the rule pads)."""
    import torch.nn.functional as F

    x_CHW = _rgb_uint8_CHW(img)
    _, H, W = x_CHW.shape
    (h, w), (ph, pw) = target_sizes(H, W, spec)
    x_CHW = resize_uint8(x_CHW[None], (h, w))[0]
    return F.pad(x_CHW, (0, pw - w, 0, ph - h)) if (ph, pw) != (h, w) else x_CHW


def _blocks(x_CHW, spec: NativeImageSpec):
    """``[C, h, w]`` -> ``[h/(p m), w/(p m), m, m, C, p, p]``: patches merge block by merge block
    (row-major), row-major inside a block; each patch channel, then its pixels row-major."""
    C, h, w = x_CHW.shape
    p, m = spec.patch, spec.merge
    # [C, block row, row in block, pixel row, block col, col in block, pixel col]
    return x_CHW.reshape(C, h // p // m, m, p, w // p // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)


def preprocess(img, spec: NativeImageSpec = NativeImageSpec()) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """PIL image or uint8 HWC array -> (float32 ``[gh*gw, C*tp*p*p]`` patch rows, ``(t, gh, gw)``),
    the processor's ``pixel_values`` / ``image_grid_thw`` for one image (on the CPU)."""
    import torch

    x_CHW = _resized(img, spec)
    C = x_CHW.shape[0]
    # Rescale and normalise folded into one affine step in byte units, as the processor folds them.
    mean_C11 = (torch.tensor(spec.mean, dtype=torch.float32) * 255.0).view(C, 1, 1)
    std_C11 = (torch.tensor(spec.std, dtype=torch.float32) * 255.0).view(C, 1, 1)
    x = _blocks((x_CHW.to(torch.float32) - mean_C11) / std_C11, spec)  # [gh/m, gw/m, m, m, C, p, p]
    bh, bw, m, _, _, p, _ = x.shape
    gh, gw = bh * m, bw * m
    x = x.unsqueeze(5).expand(bh, bw, m, m, C, spec.temporal_patch, p, p)  # the still frame repeated in time
    patches_NP = x.reshape(gh * gw, C * spec.temporal_patch * p * p).contiguous()
    return patches_NP, (1, gh, gw)


def rows_of_grid(grid, spec: NativeImageSpec) -> int:
    """LLM rows (tokens) of a ``(t, gh, gw)`` grid: its patches over the ``merge x merge`` fusion."""
    t, gh, gw = grid
    return t * gh * gw // (spec.merge * spec.merge)


def patch_bytes(img, spec: NativeImageSpec = NativeImageSpec(), frames: int = 1) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """PIL image or uint8 HWC array -> (uint8 ``[gh*gw, C*frames*p*p]`` patch rows, grid):
    ``preprocess``'s resize and patch order without the normalisation, which ``PatchNorm`` applies
    on the tower's device. ``frames`` 1: one frame per row (``PatchNorm`` repeats it in time; a
    row travels as a quarter of fp32's bytes divided by ``temporal_patch``); ``temporal_patch``:
    the frame repeated here, for towers whose rows also carry videos' real frames."""
    x = _blocks(_resized(img, spec), spec)
    bh, bw, m, _, C, p, _ = x.shape
    gh, gw = bh * m, bw * m
    if frames > 1:
        x = x.unsqueeze(5).expand(bh, bw, m, m, C, frames, p, p)
    return x.reshape(gh * gw, C * frames * p * p).contiguous(), (1, gh, gw)


class PatchNorm:
    """uint8 patch rows ``[P, C*p*p]`` of one frame (``patch_bytes``) or ``[P, C*tp*p*p]`` of a
    temporal patch's frames (a video's, or images where the tower also takes videos) -> the
    processor's float32 rows ``[P, C*tp*p*p]`` on the rows' device, bit for bit: each byte looked
    up in a per-channel table of its 256 values, computed on the CPU as ``preprocess`` computes
    them, a single frame then repeated in time."""

    def __init__(self, spec: NativeImageSpec):
        import torch

        self.spec = spec
        values_C1 = torch.arange(256, dtype=torch.float32).view(1, 256)
        mean_C1 = (torch.tensor(spec.mean, dtype=torch.float32) * 255.0).view(-1, 1)
        std_C1 = (torch.tensor(spec.std, dtype=torch.float32) * 255.0).view(-1, 1)
        self.table_C256 = (values_C1 - mean_C1) / std_C1
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, x_PB: torch.Tensor) -> torch.Tensor:
        import torch

        spec = self.spec
        C, pp, tp = spec.channels, spec.patch * spec.patch, spec.temporal_patch
        frames = x_PB.shape[1] // (C * pp)
        if frames not in (1, tp) or x_PB.shape[1] != frames * C * pp:
            raise DataError(f"patch rows of {x_PB.shape[1]} bytes: need {C * pp} (one frame) or {C * tp * pp} "
                            f"({tp} frames)")
        table = self._on.get(x_PB.device)
        if table is None:
            table = self._on[x_PB.device] = self.table_C256.reshape(-1).to(x_PB.device)
        offsets_1C1 = torch.arange(C, dtype=torch.int32, device=x_PB.device).mul_(256).view(1, C, 1)
        index = x_PB.view(-1, C, frames * pp).int().add_(offsets_1C1)
        P = x_PB.shape[0]
        x_PCFQ = table.index_select(0, index.view(-1)).view(P, C, frames, pp)
        return x_PCFQ.expand(P, C, tp, pp).reshape(P, C * tp * pp)


@dataclass(frozen=True)
class NativePlaceholder:
    """What the text and the index need of a native-resolution encoder: its placeholder, how it
    cuts images, and the texts around each image's rows (as Qwen3-VL's processor writes them:
    ``<|vision_start|>``, one ``<|image_pad|>`` per row, ``<|vision_end|>``; "" for none)."""

    placeholder: str
    image: NativeImageSpec
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    # videos (None: the tower takes none): how they are sampled and cut (mimo.data.native_video),
    # and the text marking where each one goes
    video: NativeVideoSpec | None = None
    video_placeholder: str = "<|video_pad|>"

    @property
    def row_frames(self) -> int:
        """Frames per routed patch row: one (images only), else a temporal patch's."""
        return 1 if self.video is None else self.image.temporal_patch

    def rows(self, grid) -> int:
        return rows_of_grid(grid, self.image)

"""Native-resolution video in the Qwen3-VL style (issue 47): a video file becomes temporal patches
of frames, each a block of patch rows behind its own timestamp text.

The numbers are those of transformers' ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor``:

* frames: ``fps`` frames per second of the container's frame count and rate (at least
  ``min_frames``, at most ``max_frames`` and the frame count), at ``linspace(0, frames - 1, n)``
  rounded (``sample_frames``);
* size: the video ``smart_resize``: each side to the nearest multiple of ``patch * merge`` (a side
  under one factor first scaled up), the pixel budget counted over all frames (frames rounded to
  whole temporal patches); over ``max_pixels`` scale down and floor, under ``min_pixels`` scale up
  and ceil; with ``cap_pixels_per_frame`` the budget is first capped per frame at
  ``max_video_tokens`` patches and the budget's even share, floored at 1.05 ``min_pixels``;
* rows: frames resized as images are (``mimo.data.native_images``), padded with the last frame to
  whole temporal patches, then per temporal patch one row per patch, merge block by merge block,
  each row ``C x temporal_patch x patch x patch`` (two real frames, where an image repeats one);
* text: per temporal patch ``<{t:.1f} seconds>`` (the mean time of its first and last frame),
  then ``vision_start``, its rows, ``vision_end``.

Because timestamps separate the temporal patches, Qwen3-VL treats each as an image of grid
``(1, h, w)``: the tower attends within one temporal patch, and M-RoPE gives each its own block
of 3-D positions. So the data path hands a video on as that many image slots of the tower
(``VideoLayout.grids``), and nothing downstream of the index and the reader tells them apart.

Frame count, rate and size come from the container's header (no decode), so the index plans
packs before any frame is decoded. Videos need PyAV (``pip install av``); a video it cannot
read, one of fewer frames than a temporal patch, or a size outside the budget is a ``DataError``.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mimo.core.errors import DataError
from mimo.data.native_images import (MAX_ASPECT, NativeImageSpec, NativeVideoSpec, PatchNorm, _blocks, _rgb_uint8_CHW,
                                     resize_uint8)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class VideoMeta:
    """What the container's header says: frames, frames per second, height, width."""

    frames: int
    fps: float
    height: int
    width: int


@dataclass(frozen=True)
class VideoLayout:
    """How one video enters the sample: its frame indices, size after resize, grid ``(t, h, w)``
    and the timestamp text of each temporal patch."""

    indices: tuple[int, ...]
    size: tuple[int, int]
    grid: tuple[int, int, int]
    stamps: tuple[str, ...]

    @property
    def grids(self) -> list[list[int]]:
        """One ``(1, h, w)`` image slot per temporal patch (module doc)."""
        _, h, w = self.grid
        return [[1, h, w] for _ in range(self.grid[0])]


def _av():
    try:
        import av
    except ImportError:
        raise DataError("video needs PyAV: pip install av") from None
    return av


def _container(data: bytes):
    av = _av()
    try:
        container = av.open(io.BytesIO(data))
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise DataError(f"corrupt video: unreadable container ({len(data)} bytes): {e}") from None
    if not container.streams.video:
        container.close()
        raise DataError("corrupt video: no video stream")
    return container


def video_meta(data: bytes) -> VideoMeta:
    """Frames, rate and size of an encoded video from its container (no frame decoded; a
    container that does not state its frame count has its packets counted)."""
    av = _av()
    container = _container(data)
    try:
        stream = container.streams.video[0]
        frames = int(stream.frames)
        if frames <= 0:  # not in the header (e.g. webm): count the packets, still no decode
            frames = sum(1 for packet in container.demux(stream) if packet.size)
        fps = float(stream.average_rate) if stream.average_rate else 0.0
        height, width = int(stream.codec_context.height), int(stream.codec_context.width)
    except av.error.FFmpegError as e:
        raise DataError(f"corrupt video: {e}") from None
    finally:
        container.close()
    if frames < 1 or height < 1 or width < 1:
        raise DataError(f"corrupt video: {frames} frames of {height}x{width} (height x width)")
    if fps <= 0:
        raise DataError("corrupt video: no frame rate in the container (needed for the timestamps)")
    return VideoMeta(frames, fps, height, width)


def sample_indices(meta: VideoMeta, spec: NativeVideoSpec) -> list[int]:
    """The frames taken (the processor's ``sample_frames`` with ``fps``)."""
    n = int(meta.frames / meta.fps * spec.fps)
    n = min(max(n, spec.min_frames), spec.max_frames, meta.frames)
    return np.linspace(0, meta.frames - 1, n).round().astype(int).tolist()


def video_size(frames: int, height: int, width: int, image: NativeImageSpec, spec: NativeVideoSpec) -> tuple[int, int]:
    """The ``(height, width)`` every frame is resized to (the video ``smart_resize``)."""
    tp, f = image.temporal_patch, image.factor
    if frames < tp:
        raise DataError(f"video too short: {frames} frame(s) sampled, fewer than one temporal patch of {tp}")
    max_pixels = spec.max_pixels
    if spec.cap_pixels_per_frame:
        per_frame = max(min(spec.max_video_tokens * f * f, spec.max_pixels // frames), int(spec.min_pixels * 1.05))
        max_pixels = per_frame * frames
    if height < f or width < f:
        scale = max(f / height, f / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise DataError(f"video aspect ratio too large: {height}x{width} (height x width) is over the limit of "
                        f"{MAX_ASPECT}")
    h, w, t = round(height / f) * f, round(width / f) * f, round(frames / tp) * tp
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif t * h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def timestamps(indices: list[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's (the last frame
    repeated to whole patches, as the processor pads)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch)
    seconds = [i / fps for i in padded]
    return [(seconds[i] + seconds[i + temporal_patch - 1]) / 2 for i in range(0, len(padded), temporal_patch)]


def video_layout(meta: VideoMeta, image: NativeImageSpec, spec: NativeVideoSpec) -> VideoLayout:
    indices = sample_indices(meta, spec)
    h, w = video_size(len(indices), meta.height, meta.width, image, spec)
    t = -(-len(indices) // image.temporal_patch)
    stamps = tuple(f"<{s:.1f} seconds>" for s in timestamps(indices, meta.fps, image.temporal_patch))
    return VideoLayout(tuple(indices), (h, w), (t, h // image.patch, w // image.patch), stamps)


def layout_from_bytes(data: bytes, image: NativeImageSpec, spec: NativeVideoSpec) -> VideoLayout:
    return video_layout(video_meta(data), image, spec)


def decode_frames(data: bytes, indices: list[int]) -> list[np.ndarray]:
    """The RGB uint8 ``[H, W, 3]`` frames at ``indices`` (decoded in order, as transformers'
    PyAV reader takes them)."""
    av = _av()
    wanted, frames = set(indices), {}
    container = _container(data)
    try:
        for i, frame in enumerate(container.decode(video=0)):
            if i > indices[-1]:
                break
            if i in wanted:
                frames[i] = frame.to_ndarray(format="rgb24")
    except av.error.FFmpegError as e:
        raise DataError(f"corrupt video: {e}") from None
    finally:
        container.close()
    missing = [i for i in indices if i not in frames]
    if missing:
        raise DataError(f"corrupt video: frame {missing[0]} of the header's count could not be decoded")
    return [frames[i] for i in indices]


def _frames_TCHW(frames: list, size: tuple[int, int], image: NativeImageSpec) -> torch.Tensor:
    """uint8 ``[t*tp, C, h, w]``: each frame resized as an image is, the last repeated to whole
    temporal patches."""
    import torch

    x_TCHW = resize_uint8(torch.stack([_rgb_uint8_CHW(f) for f in frames]), size)
    pad = -x_TCHW.shape[0] % image.temporal_patch
    return torch.cat([x_TCHW, x_TCHW[-1:].expand(pad, *x_TCHW.shape[1:])]) if pad else x_TCHW


def _rows(x_TCHW: torch.Tensor, image: NativeImageSpec) -> torch.Tensor:
    """``[t*tp, C, h, w]`` -> rows ``[t*gh*gw, C*tp*p*p]`` in the processor's order."""
    import torch

    tp = image.temporal_patch
    blocks = [_blocks(x_TCHW[k], image) for k in range(x_TCHW.shape[0])]  # each [bh, bw, m, m, C, p, p]
    bh, bw, m, _, C, p, _ = blocks[0].shape
    x = torch.stack(blocks).unflatten(0, (-1, tp))  # [t, tp, bh, bw, m, m, C, p, p]
    x = x.permute(0, 2, 3, 4, 5, 6, 1, 7, 8)  # [t, bh, bw, m, m, C, tp, p, p]
    return x.reshape(-1, C * tp * p * p).contiguous()


def video_patch_bytes(data: bytes, layout: VideoLayout, image: NativeImageSpec) -> torch.Tensor:
    """uint8 rows ``[t*gh*gw, C*tp*p*p]`` of an encoded video (``PatchNorm`` normalises them on the
    tower's device), temporal patch after temporal patch: the rows of its image slots in order."""
    return _rows(_frames_TCHW(decode_frames(data, list(layout.indices)), layout.size, image), image)


def video_preprocess(frames: list, meta: VideoMeta, image: NativeImageSpec, spec: NativeVideoSpec
                     ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The processor's ``pixel_values_videos`` / ``video_grid_thw`` of already sampled frames (float32
    rows on the CPU): for checks against transformers."""
    layout = video_layout(meta, image, spec)
    rows = _rows(_frames_TCHW(frames, layout.size, image), image)
    return PatchNorm(image)(rows), layout.grid

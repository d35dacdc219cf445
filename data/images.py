"""Image preprocessing from parameters the composition passes in (size, crop, mean/std).

Decoded images travel as bytes: ``decode`` gives uint8 ``[C, size, size]`` (resized and
cropped), which the data pipeline routes to the encoder ranks (a quarter of fp32's bytes);
``PixelNorm`` turns them into the encoder's float input on the encoder's device. Its numbers are
those of ``preprocess`` (scale to [0, 1], subtract the mean, divide by the std, in fp32) bit for
bit on any device: a uint8 value has 256 possible results per channel, computed once on the CPU
exactly as ``preprocess`` computes them and looked up on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSpec:
    """How an encoder wants its pixels: resize the short side to ``size`` (bicubic), centre
    crop ``size`` x ``size``, scale to [0, 1], normalise by ``mean`` / ``std``."""

    size: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    channels: int = 3

    @property
    def numel(self) -> int:
        return self.channels * self.size * self.size


def decode(img, spec: ImageSpec) -> torch.Tensor:
    """PIL RGB image -> uint8 ``[C, size, size]`` (resized, centre-cropped; not normalised)."""
    from PIL import Image

    w, h = img.size
    if (w, h) != (spec.size, spec.size):
        scale = spec.size / min(w, h)
        nw, nh = max(spec.size, round(w * scale)), max(spec.size, round(h * scale))
        img = img.resize((nw, nh), Image.BICUBIC)
        left, top = (nw - spec.size) // 2, (nh - spec.size) // 2
        img = img.crop((left, top, left + spec.size, top + spec.size))
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(spec.size, spec.size, 3)
    return x.permute(2, 0, 1).contiguous()


def normalise(x_CHW: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """uint8 ``[C, ...]`` -> the encoder's fp32 numbers by arithmetic on the CPU (the one
    definition: ``preprocess`` and ``PixelNorm``'s table use it)."""
    mean = torch.tensor(spec.mean).view(3, 1, 1)
    std = torch.tensor(spec.std).view(3, 1, 1)
    return (x_CHW.float().div_(255.0) - mean) / std


def preprocess(img, spec: ImageSpec) -> torch.Tensor:
    """PIL RGB image -> float32 ``[C, size, size]``, normalised (on the CPU: references, tools)."""
    return normalise(decode(img, spec), spec)


class PixelNorm:
    """uint8 ``[N, C, S, S]`` -> the float32 ``preprocess`` numbers, on the tensor's device: a
    look-up of each byte in a per-channel table of its 256 normalised values, which
    ``normalise`` computes on the CPU (so no device arithmetic can round differently)."""

    def __init__(self, spec: ImageSpec):
        values = torch.arange(256, dtype=torch.uint8).view(1, 1, 256).expand(spec.channels, 1, 256)
        self.table_C256 = normalise(values, spec).view(spec.channels, 256)
        self._on: dict[torch.device, torch.Tensor] = {}  # the flat table per device

    def __call__(self, x_NCHW: torch.Tensor) -> torch.Tensor:
        N, C, H, W = x_NCHW.shape
        table = self._on.get(x_NCHW.device)
        if table is None:
            table = self._on[x_NCHW.device] = self.table_C256.reshape(-1).to(x_NCHW.device)
        # channel c's byte v sits at c * 256 + v of the flat table; int32 indices (index_select takes them)
        offsets = torch.arange(C, dtype=torch.int32, device=x_NCHW.device).mul_(256).view(1, C, 1, 1)
        index = x_NCHW.int().add_(offsets)
        return table.index_select(0, index.view(-1)).view(N, C, H, W)

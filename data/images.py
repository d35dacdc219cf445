"""Image preprocessing from parameters the composition passes in (size, crop, mean/std)."""

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


def preprocess(img, spec: ImageSpec) -> torch.Tensor:
    """PIL RGB image -> float32 ``[C, size, size]``."""
    from PIL import Image

    w, h = img.size
    if (w, h) != (spec.size, spec.size):
        scale = spec.size / min(w, h)
        nw, nh = max(spec.size, round(w * scale)), max(spec.size, round(h * scale))
        img = img.resize((nw, nh), Image.BICUBIC)
        left, top = (nw - spec.size) // 2, (nh - spec.size) // 2
        img = img.crop((left, top, left + spec.size, top + spec.size))
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(spec.size, spec.size, 3)
    x_CHW = x.permute(2, 0, 1).float().div_(255.0)
    mean = torch.tensor(spec.mean).view(3, 1, 1)
    std = torch.tensor(spec.std).view(3, 1, 1)
    return (x_CHW - mean) / std

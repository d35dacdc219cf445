"""mimo.data.native_images against transformers' own image processor for Qwen3-VL (issue 47).

The reference is built from its class with Qwen3-VL's released settings (no hub access), and a
tiny-budget variant that reaches the max-pixels shrink and the short-side clamp on small images.
"""

from __future__ import annotations

import io
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from mimo.core.errors import DataError
from mimo.data.native_images import (NativeImageSpec, grid_from_bytes, image_grid, image_tokens, preprocess,
                                     smart_size)

hf_qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl")

DEFAULT = NativeImageSpec()
# 4..40 merge blocks: 513x300 must shrink, 31x1300 has its short side clamped up to one factor
TINY = NativeImageSpec(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 40)
SPECS = {"qwen3vl": DEFAULT, "tiny": TINY}
# height x width, none a multiple of 32
SIZES = [(37, 53), (100, 17), (224, 224), (513, 300), (31, 1300)]


def hf_processor(spec: NativeImageSpec):
    """The processor class Qwen3-VL loads, set as its released preprocessor_config sets it."""
    return hf_qwen2_vl.Qwen2VLImageProcessor(
        patch_size=spec.patch, temporal_patch_size=spec.temporal_patch, merge_size=spec.merge,
        image_mean=list(spec.mean), image_std=list(spec.std),
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels})


def random_image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG with a header and no pixel data at all: opening it cannot have decoded anything."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"")


def test_qwen3_vl_loads_the_qwen2_vl_processor():
    """The reference below is the right one: transformers maps qwen3_vl's (default, torchvision)
    image processor to the Qwen2-VL class, whose resize runs through torch (not PIL)."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    assert IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_vl"]["torchvision"] == "Qwen2VLImageProcessor"


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_pixel_values_and_grid_match_transformers(spec_name, capsys):
    spec = SPECS[spec_name]
    proc = hf_processor(spec)
    worst = 0.0
    for i, (h, w) in enumerate(SIZES):
        arr = random_image(h, w, seed=i)
        ours_NP, grid = preprocess(Image.fromarray(arr), spec)
        ref = proc(images=Image.fromarray(arr), return_tensors="pt")
        ref_NP = ref["pixel_values"]
        assert ref["image_grid_thw"].tolist() == [list(grid)], (h, w)
        assert ours_NP.dtype == torch.float32 and ours_NP.shape == ref_NP.shape == (math.prod(grid), spec.row_numel)
        diff = (ours_NP - ref_NP).abs().max().item()
        worst = max(worst, diff)
        assert torch.allclose(ours_NP, ref_NP, rtol=0, atol=1e-6), f"{h}x{w}: max |diff| {diff}"
        # same uint8 resize kernel, same folded affine step: the floats agree bit for bit
        assert diff == 0.0, f"{h}x{w}: max |diff| {diff} (the rescale/normalise order changed?)"
        # an array in gives the same rows as the PIL image
        assert torch.equal(preprocess(arr, spec)[0], ours_NP)
    with capsys.disabled():
        print(f"\n[native_images] {spec_name}: max |pixel_values - transformers| = {worst:.3g}")


def test_transparent_and_grey_images_match_transformers():
    """Alpha composited onto white, grey expanded to RGB, as the processor does."""
    proc = hf_processor(DEFAULT)
    rgba = Image.fromarray(np.random.default_rng(7).integers(0, 256, (45, 70, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(np.random.default_rng(8).integers(0, 256, (45, 70), dtype=np.uint8), "L")
    for img in (rgba, grey):
        ours_NP, grid = preprocess(img, DEFAULT)
        ref = proc(images=img, return_tensors="pt")
        assert ref["image_grid_thw"].tolist() == [list(grid)]
        assert torch.allclose(ours_NP, ref["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_smart_size_is_the_processors_smart_resize(spec_name):
    """Over many sizes (exact halves of the factor included, where the rounding rule shows), the
    target equals transformers' smart_resize, except where that target breaks its own pixel
    budget: there we raise instead."""
    spec = SPECS[spec_name]
    f = spec.factor
    rng = np.random.default_rng(1)
    sizes = [(int(a), int(b)) for a, b in rng.integers(1, 3000, (400, 2))]
    sizes += [(f * k + f // 2, f * j + f // 2) for k in range(0, 12) for j in range(0, 12)]
    sizes += [(f * k + f // 2 + d, 64) for k in range(1, 8) for d in (-1, 1)]
    # long thin images both ways up: the short side may floor to 0 and be clamped to one factor
    thin = [(a, b) for a in range(17, 40, 2) for b in range(1200, 1500, 9)]
    sizes += thin + [(b, a) for a, b in thin]
    checked = refused = 0
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        ref = hf_qwen2_vl.smart_resize(h, w, factor=f, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
        if spec.min_pixels <= ref[0] * ref[1] <= spec.max_pixels:
            assert smart_size(h, w, spec) == ref, (h, w)
            checked += 1
        else:
            with pytest.raises(DataError, match="pixel budget"):
                smart_size(h, w, spec)
            refused += 1
    assert checked > 300
    assert refused == 0 or spec is TINY


def test_tokens_are_patches_over_the_merge():
    proc = hf_processor(DEFAULT)
    for h, w in SIZES + [(1080, 1920), (4000, 3000)]:
        t, gh, gw = image_grid(h, w, DEFAULT)
        assert t == 1 and gh % DEFAULT.merge == 0 and gw % DEFAULT.merge == 0
        assert image_tokens(h, w, DEFAULT) == gh * gw // 4 == proc.get_number_of_image_patches(h, w) // 4


def test_grid_from_header_equals_the_decoded_grid():
    for i, (h, w) in enumerate(SIZES):
        img = Image.fromarray(random_image(h, w, seed=10 + i))
        decoded_grid = preprocess(img, DEFAULT)[1]
        for fmt in ("PNG", "JPEG"):
            assert grid_from_bytes(encoded(img, fmt), DEFAULT) == decoded_grid, (h, w, fmt)
        # a file with no pixel data at all still gives the grid: only the header is read
        assert grid_from_bytes(png_header_only(w, h), DEFAULT) == decoded_grid


def test_refusals_are_clear_data_errors():
    with pytest.raises(DataError, match="empty"):
        smart_size(0, 40)
    with pytest.raises(DataError, match="empty"):
        preprocess(np.zeros((5, 0, 3), np.uint8))
    with pytest.raises(DataError, match="aspect ratio 201.0"):
        smart_size(3, 603)
    with pytest.raises(DataError, match="aspect ratio"):
        grid_from_bytes(png_header_only(401, 2))  # 200.5 : 1
    h, w = hf_qwen2_vl.smart_resize(3, 600, factor=32, min_pixels=DEFAULT.min_pixels, max_pixels=DEFAULT.max_pixels)
    assert image_grid(3, 600) == (1, h // 16, w // 16)  # exactly 200 : 1 is accepted
    # a tight budget that an image cannot be fitted into, either way
    budget = NativeImageSpec(min_pixels=4096, max_pixels=4096)
    with pytest.raises(DataError, match=r"too small for the pixel budget \[4096, 4096\].*64x32"):
        smart_size(90, 60, budget)
    with pytest.raises(DataError, match=r"too large for the pixel budget"):
        smart_size(100, 17, budget)
    with pytest.raises(DataError, match="too large"):
        smart_size(17, 1300, TINY)  # short side clamped up to 32: 32x1760 is over TINY's 40960
    # a header claiming 30000 x 30000 is refused before any decode
    with pytest.raises(DataError, match="too large to decode"):
        grid_from_bytes(png_header_only(30000, 30000))
    with pytest.raises(DataError, match="unreadable"):
        grid_from_bytes(b"not an image at all")
    with pytest.raises(DataError, match=r"\[H, W, 3\]"):
        preprocess(np.zeros((40, 40, 4), np.uint8))

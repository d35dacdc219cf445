"""Small WebDataset shards for two encoders feeding one LLM (docs/design.md §2 "several encoders"):
an image tower with ``<image>`` and a sketch tower with ``<sketch>``.

Samples mix every way images can map to encoders (``mimo.data.text``): a picture and a
sketch of it, one file each (``<image>`` and ``<sketch>`` take the first and second file); one
picture seen by both towers (both placeholders, one file); a picture alone; a sketch alone;
text only. Used by the two-encoder tests and ``tests/configs/two_encoders.yaml``.
"""

from __future__ import annotations

import io
import json
import os
import random

from mimo.data.demo import _random_shape, draw, make_tokenizer


def _sketch(png: bytes) -> bytes:
    """The picture as a grey outline (what a second, different tower sees)."""
    from PIL import Image, ImageFilter, ImageOps

    img = ImageOps.grayscale(Image.open(io.BytesIO(png))).filter(ImageFilter.FIND_EDGES).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_sample(i: int, rng: random.Random, image_size: int) -> dict:
    key, kind = f"{i:07d}", rng.random()
    s = _random_shape(rng)
    picture = draw(s, image_size, rng)
    files: dict[str, bytes] = {}
    if kind < 0.1:  # text only
        prompt, answer = "Name a colour.", s.colour
    elif kind < 0.45:  # a picture and its sketch: one file per tower, in placeholder order
        files = {"0.png": picture, "1.png": _sketch(picture)}
        prompt, answer = "<image>\n<sketch>\nWhat colour is the shape?", s.colour
    elif kind < 0.65:  # one picture, both towers
        files = {"png": picture}
        prompt, answer = "<sketch>\n<image>\nWhat shape is it?", s.shape
    elif kind < 0.85:  # the picture alone
        files = {"png": picture}
        prompt, answer = "<image>\nWhere is the shape?", s.position
    else:  # the sketch alone
        files = {"png": _sketch(picture)}
        prompt, answer = "<sketch>\nWhat shape is it?", s.shape
    conv = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
    return {"__key__": key, **files, "json": json.dumps({"conversations": conv}).encode()}


def make_two_tower_data(out_dir: str, samples: int = 400, shard_size: int = 200, image_size: int = 32, seed: int = 0) -> str:
    """Write ``train-NNNNNN.tar`` shards and ``tokenizer/`` into ``out_dir``; returns the shard pattern."""
    import webdataset as wds

    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    shards = max(1, -(-samples // shard_size))
    for s in range(shards):
        path = os.path.join(out_dir, f"train-{s:06d}.tar")
        with wds.TarWriter(path + ".tmp") as sink:
            for i in range(s * shard_size, min(samples, (s + 1) * shard_size)):
                sink.write(make_sample(i, rng, image_size))
        os.replace(path + ".tmp", path)
    make_tokenizer(os.path.join(out_dir, "tokenizer"))
    return os.path.join(out_dir, f"train-{{000000..{shards - 1:06d}}}.tar")


if __name__ == "__main__":
    import sys

    print(make_two_tower_data(sys.argv[1] if len(sys.argv) > 1 else "two-tower-data"))

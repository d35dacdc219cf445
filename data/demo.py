"""``mimo make-demo-data``: learnable synthetic LLaVA-style shards and a local byte-level tokenizer.

Each image is a coloured shape on a dark background at one of four positions; the native split
also holds short videos of a shape moving between positions ("where does it end?"). Samples are
captions (``txt``) or conversations (``json``) asking for the colour, shape or position, with
short answers checkable by exact match; a few samples have no image ("say the word red") or two
images ("what colour is the second shape?"). Each question is answerable from its inputs, and a
tiny model learns all of them in a couple of hundred steps (``mimo demo``'s budget; harder tasks
such as digit sums or comparing two colours stayed near chance there). Everything is generated
from a seed: no network.
"""

from __future__ import annotations

import io
import json
import os
import random
from dataclasses import dataclass

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"top left": (0.25, 0.25), "top right": (0.75, 0.25), "bottom left": (0.25, 0.75), "bottom right": (0.75, 0.75)}
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
VIDEO_FPS = 4  # the native split's videos (a tenth of its samples): 3 to 9 frames


@dataclass(frozen=True)
class Shape:
    colour: str
    shape: str
    position: str


def draw(shape: Shape, size: int | tuple[int, int], rng: random.Random) -> bytes:
    """PNG bytes of one shape (lossless, so the task stays exactly learnable); ``size``: the
    side of a square, or (width, height)."""
    from PIL import Image, ImageDraw

    width, height = (size, size) if isinstance(size, int) else size
    noise = rng.randint(0, 20)
    img = Image.new("RGB", (width, height), (noise, noise, noise + 10))
    d = ImageDraw.Draw(img)
    fx, fy = POSITIONS[shape.position]
    cx, cy = int(fx * width), int(fy * height)
    r = max(2, min(width, height) // 6)
    colour = COLOURS[shape.colour]
    if shape.shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape.shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def video(shapes: list[Shape], size: tuple[int, int], rng: random.Random, fps: int = VIDEO_FPS) -> bytes:
    """MP4 bytes (MPEG-4 part 2, one thread: the same bytes every time) of one frame per shape
    (``draw``'s picture, decoded), at ``fps`` frames per second."""
    import av
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps, options={"threads": "1"})
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for shape in shapes:
            rgb = np.asarray(Image.open(io.BytesIO(draw(shape, size, rng))).convert("RGB"))
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _random_shape(rng: random.Random) -> Shape:
    return Shape(rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(POSITIONS)))


def make_sample(i: int, rng: random.Random, image_size: int, sizes: list[tuple[int, int]] | None = None) -> dict:
    """One WebDataset sample dict (``__key__`` plus its files); ``sizes``: each image drawn at
    one of these (width, height), picked at random (the native-resolution split), else square."""
    if sizes is not None:
        image_size = rng.choice(sizes)
    key = f"{i:07d}"
    kind = rng.random()
    if sizes is not None and kind > 0.9:  # a video (native split): a shape moving; where does it end?
        s = _random_shape(rng)
        path = [Shape(s.colour, s.shape, rng.choice(list(POSITIONS))) for _ in range(rng.randint(3, 9))]
        conv = [{"from": "human", "value": "<video>\nWhere does the shape end?"}, {"from": "gpt", "value": path[-1].position}]
        return {"__key__": key, "mp4": video(path, image_size, rng), "json": json.dumps({"conversations": conv}).encode()}
    if kind < 0.05:  # text only: copy a word
        word = rng.choice([*COLOURS, *SHAPES])
        conv = [{"from": "human", "value": f"Say the word {word}."}, {"from": "gpt", "value": word}]
        return {"__key__": key, "json": json.dumps({"conversations": conv}).encode()}
    if kind < 0.12:  # two images: the colour of one of them
        s1, s2 = _random_shape(rng), _random_shape(rng)
        which = rng.choice(("first", "second"))
        answer = (s1 if which == "first" else s2).colour
        conv = [{"from": "human", "value": f"<image>\n<image>\nWhat colour is the {which} shape?"}, {"from": "gpt", "value": answer}]
        return {"__key__": key, "0.png": draw(s1, image_size, rng), "1.png": draw(s2, image_size, rng), "json": json.dumps({"conversations": conv}).encode()}
    s = _random_shape(rng)
    image = draw(s, image_size, rng)
    if kind < 0.35:  # caption
        return {"__key__": key, "png": image, "txt": f"a {s.colour} {s.shape} at the {s.position}".encode()}
    question, answer = rng.choice([
        ("What colour is the shape?", s.colour),
        ("What shape is it?", s.shape),
        ("Where is the shape?", s.position),
    ])
    conv = [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]
    return {"__key__": key, "png": image, "json": json.dumps({"conversations": conv}).encode()}


def make_tokenizer(path: str) -> None:
    """A byte-level tokenizer (256 byte tokens + specials, no merges): any text tokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(byte_vocab):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)


MANIFEST = "manifest.json"
TRAIN_SAMPLES, HELDOUT_SAMPLES, NATIVE_SAMPLES = 4000, 400, 400  # what `mimo make-demo-data` and `mimo demo` write
# the native split's image sizes (width, height): several aspect ratios, none a multiple of 32, some
# not even of a small tower's patch x merge, so resizing to the grid is exercised
NATIVE_SIZES = [(40, 24), (24, 44), (56, 36), (36, 36), (70, 46), (30, 58)]


def make_demo_data(out_dir: str, train_samples: int = TRAIN_SAMPLES, heldout_samples: int = HELDOUT_SAMPLES, shard_size: int = 500,
                   image_size: int = 32, seed: int = 0, native_samples: int = NATIVE_SAMPLES) -> dict:
    """Write ``train-NNNNNN.tar``, ``heldout-NNNNNN.tar``, ``native-NNNNNN.tar`` (the same task with
    images of several sizes, ``NATIVE_SIZES``: native-resolution towers' data), ``tokenizer/``
    and, last, ``manifest.json`` (what was asked for and written) into ``out_dir``.

    The held-out split is drawn from its own random stream (seeded apart from the train
    stream), so its samples are new draws, never copies of train samples, and do not change
    when the train split's size does."""
    import webdataset as wds

    os.makedirs(out_dir, exist_ok=True)
    request = {"train_samples": train_samples, "heldout_samples": heldout_samples, "shard_size": shard_size,
               "image_size": image_size, "seed": seed, "native_samples": native_samples}
    written = {}
    for split, n in (("train", train_samples), ("heldout", heldout_samples), ("native", native_samples)):
        if n < 1:
            continue
        sizes = NATIVE_SIZES if split == "native" else None
        rng = random.Random(seed) if split == "train" else random.Random(f"{seed}:{split}")
        shards = max(1, -(-n // shard_size))
        for s in range(shards):
            path = os.path.join(out_dir, f"{split}-{s:06d}.tar")
            tmp = path + ".tmp"
            with wds.TarWriter(tmp) as sink:
                for i in range(s * shard_size, min(n, (s + 1) * shard_size)):
                    sink.write(make_sample(i, rng, image_size, sizes))
            os.replace(tmp, path)  # a half-written shard never looks complete
        written[split] = os.path.join(out_dir, f"{split}-{{000000..{shards - 1:06d}}}.tar")
    make_tokenizer(os.path.join(out_dir, "tokenizer"))
    written["tokenizer"] = os.path.join(out_dir, "tokenizer")
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"request": request, "written": written}, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))  # written last: its presence means complete
    return written


def demo_data_ready(out_dir: str, **request) -> bool:
    """Whether ``out_dir`` holds complete demo data made with these ``make_demo_data`` arguments
    (the defaults where not given)."""
    import inspect

    asked = {k: p.default for k, p in inspect.signature(make_demo_data).parameters.items() if k != "out_dir"}
    asked.update(request)
    try:
        with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
            return json.load(f)["request"] == asked
    except (OSError, ValueError, KeyError):
        return False

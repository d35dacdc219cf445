"""Videos in WebDataset shards for native-resolution towers (issue 47, ``mimo.data.native_video``).

* frame sampling, size, patch rows and grid equal transformers' ``Qwen3VLVideoProcessor`` on the
  frames its PyAV reader decodes, and the timestamps its ``Qwen3VLProcessor`` writes;
* a sample's video becomes, per temporal patch, its timestamp text, the vision start text, its
  rows, the vision end text; each temporal patch one image slot of the tower of grid (1, h, w);
* packs' M-RoPE positions equal the token rule with the video as ONE grid (t, h, w) split by its
  timestamps (transformers' ``get_rope_index``: test_llm_qwen3_vl shows the rule equal to it);
* the reader routes each slot's rows: a video's real frame pairs, an image's frame repeated;
* bad videos and mismatched placeholders are counted skips.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mimo.data.native_images import NativeImageSpec, PatchNorm, preprocess
from mimo.data.native_video import (NativeVideoSpec, VideoMeta, decode_frames, layout_from_bytes, sample_indices,
                                    video_meta, video_patch_bytes, video_preprocess)

av = pytest.importorskip("av")
hf_video = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "examples" / "qwen3-vl-moe.yaml"


def mp4(frames_THWC: np.ndarray, fps: float) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps, options={"threads": "1"})
        stream.height, stream.width, stream.pix_fmt = frames_THWC.shape[1], frames_THWC.shape[2], "yuv420p"
        for f in frames_THWC:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def noise(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth random frames (an encoder keeps them close to what was drawn)."""
    from PIL import Image

    g = np.random.default_rng(seed)
    small = g.integers(0, 256, (frames, max(2, height // 8), max(2, width // 8), 3)).astype(np.uint8)
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height))) for f in small])


SMALL = NativeImageSpec(patch=4, merge=2, min_pixels=64, max_pixels=4096)
# (frames, fps, height, width, image spec, video spec): released settings; fps sampling of a longer
# clip to an odd count (the last frame padded in); a side under one factor; a budget that shrinks;
# qwen-vl-utils' per-frame cap; fewer frames than min_frames
CASES = {
    "released": (10, 5, 38, 54, NativeImageSpec(), NativeVideoSpec()),
    "odd_fps_sampled": (61, 24, 40, 70, SMALL, NativeVideoSpec(min_pixels=64, max_pixels=8192)),
    "short_side": (6, 3, 6, 50, SMALL, NativeVideoSpec(min_pixels=64, max_pixels=8192)),
    "shrink": (8, 2, 90, 130, SMALL, NativeVideoSpec(min_pixels=64, max_pixels=4 * 1024)),
    "cap": (12, 2, 90, 130, SMALL, NativeVideoSpec(min_pixels=256, max_pixels=64 * 1024, cap_pixels_per_frame=True,
                                                  max_video_tokens=40)),
    "few_frames": (3, 2, 30, 44, SMALL, NativeVideoSpec(min_pixels=64, max_pixels=8192)),
}


def hf_processor(image: NativeImageSpec, video: NativeVideoSpec):
    return hf_video.Qwen3VLVideoProcessor(
        patch_size=image.patch, temporal_patch_size=image.temporal_patch, merge_size=image.merge,
        image_mean=list(image.mean), image_std=list(image.std), fps=video.fps, min_frames=video.min_frames,
        max_frames=video.max_frames, size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
        cap_pixels_per_frame=video.cap_pixels_per_frame, max_video_tokens=video.max_video_tokens)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_grid_and_timestamps_equal_transformers(case, tmp_path):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import read_video_pyav

    frames, fps, height, width, image, video = CASES[case]
    data = mp4(noise(frames, height, width, seed=len(case)), fps)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    proc = hf_processor(image, video)
    hf_frames, hf_meta = read_video_pyav(str(path), sample_indices_fn=proc.sample_frames)
    out = proc(videos=[hf_frames], video_metadata=[hf_meta], do_sample_frames=False, return_tensors="pt")

    meta = video_meta(data)
    assert meta == VideoMeta(frames, float(fps), height, width)
    layout = layout_from_bytes(data, image, video)
    assert list(layout.indices) == list(hf_meta.frames_indices)
    assert list(layout.grid) == out["video_grid_thw"][0].tolist()
    rows = video_patch_bytes(data, layout, image)
    assert rows.dtype == torch.uint8
    assert torch.equal(PatchNorm(image)(rows), out["pixel_values_videos"])  # bit for bit
    # the same from frames already decoded (verify tools' path)
    got, grid = video_preprocess(decode_frames(data, list(layout.indices)), meta, image, video)
    assert torch.equal(got, out["pixel_values_videos"]) and list(grid) == list(layout.grid)
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(hf_meta.frames_indices), hf_meta.fps,
                                                    image.temporal_patch)
    assert list(layout.stamps) == [f"<{t:.1f} seconds>" for t in stamps]
    assert layout.grids == [[1, layout.grid[1], layout.grid[2]]] * layout.grid[0]


def test_sampling_rule_by_hand():
    spec = NativeVideoSpec(fps=2, min_frames=4, max_frames=6)
    assert sample_indices(VideoMeta(100, 10.0, 8, 8), spec) == [0, 20, 40, 59, 79, 99]  # 10 s: 20 wanted, 6 at most
    assert sample_indices(VideoMeta(3, 30.0, 8, 8), spec) == [0, 1, 2]  # fewer frames than min_frames: all
    assert sample_indices(VideoMeta(10, 10.0, 8, 8), spec) == [0, 3, 6, 9]  # 1 s: 2 wanted, min_frames 4


# --------------------------------------------------------------------------------------------
# shards

def _conv(text: str, answer: str = "red") -> bytes:
    return json.dumps({"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]}).encode()


def _shard(path: Path) -> dict[str, bytes]:
    import webdataset as wds

    from mimo.data.demo import Shape, draw, video

    rng = random.Random(3)
    still = draw(Shape("red", "circle", "top left"), (44, 28), rng)
    path_shapes = [Shape("blue", "square", p) for p in ("top left", "top right", "bottom right", "bottom left", "top left")]
    clip = video(path_shapes, (40, 24), rng)
    one_frame = video(path_shapes[:1], (40, 24), rng)
    samples = {
        "mixed": {"0.png": still, "1.mp4": clip, "json": _conv("<video>\nand <image>\nWhere does it end?")},
        "video": {"mp4": clip, "json": _conv("<video>\nWhere does it end?")},
        "caption": {"mp4": clip, "txt": b"a blue square moving"},
        "corrupt": {"mp4": clip[:200], "json": _conv("<video>\nWhere?")},
        "short": {"mp4": one_frame, "json": _conv("<video>\nWhere?")},
        "no_file": {"json": _conv("<video>\nWhere?")},
        "no_mark": {"mp4": clip, "json": _conv("Where?")},
    }
    with wds.TarWriter(str(path)) as sink:
        for key, files in samples.items():
            sink.write({"__key__": key, **files})
    return {"still": still, "clip": clip}


@pytest.fixture(scope="module")
def shard(tmp_path_factory, indexes_here):
    from mimo.data.demo import make_tokenizer

    root = tmp_path_factory.mktemp("video")
    files = _shard(root / "v-000000.tar")
    make_tokenizer(str(root / "tokenizer"))
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["data"].update(shards=str(root / "v-{000000..000000}.tar"), tokenizer=str(root / "tokenizer"))
    path = root / "video.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), files


def _index(config_path: str, overrides=()):
    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index

    config = load_config(config_path, list(overrides))
    return config, ensure_index(config)[0]


def test_bad_videos_and_placeholders_are_counted_skips(shard, indexes_here):
    from mimo.data.plan import DataPlan

    with indexes_here():
        config, index = _index(shard[0])
    verdicts = {e.key: e.bad for e in index.entries}
    assert {k for k, v in verdicts.items() if v is None} == {"mixed", "video", "caption"}
    assert verdicts["corrupt"].startswith("corrupt video")
    assert verdicts["short"].startswith("video too short: 1 frame(s)")
    assert verdicts["no_file"].startswith("placeholder and image counts differ")
    assert verdicts["no_mark"].startswith("placeholder and image counts differ")
    plan = DataPlan(index, 768, 512, seed=0)
    assert plan.skipped_counts() == {"corrupt video": 1, "video too short": 1, "placeholder and image counts differ": 2}
    # a tower that takes no videos: every sample with one is a counted skip, not an image
    with indexes_here():
        _, plain = _index(shard[0], ["modules.vision.video=null"])
    assert {e.key: (e.bad or "").split(":")[0] for e in plain.entries}["mixed"] == "video not taken"


def test_a_video_becomes_timestamped_slots_and_routes_its_frames(shard, indexes_here):
    from mimo.compose.data_spec import text_spec
    from mimo.compose.inputs import encoder_feeds
    from mimo.data.pipeline import SampleReader, wire_rows
    from mimo.data.plan import PlannedSample

    with indexes_here():
        config, index = _index(shard[0])
    spec = text_spec(config)
    (native,) = spec.native
    (feed,) = encoder_feeds(config)
    assert feed.row_frames == 2 and feed.numel == 3 * 2 * 4 * 4
    layout = layout_from_bytes(shard[1]["clip"], native.image, native.video)
    t, h, w = layout.grid
    assert t == 2 and len(layout.stamps) == 2  # 5 frames at 4 fps: all 5 (min_frames 4), padded to 6
    entry = next(e for e in index.entries if e.key == "mixed")
    still_grid = entry.image_grids["<image>"][-1]
    # the text's order: the video's temporal patches, then the image
    assert entry.image_grids["<image>"] == [[1, h, w], [1, h, w], still_grid]
    per_slot = h * w // 4
    assert entry.image_rows["<image>"][:2] == [per_slot, per_slot]

    reader = SampleReader(index, spec, [feed])
    read = reader.read(PlannedSample(index.entries.index(entry), entry.tokens, entry.images, entry.image_starts,
                                     entry.image_rows, entry.image_grids))
    assert read.failure is None
    tokens = read.item.tokens
    decode = reader.tokenizer.decode
    pad = reader.encoder.image_tokens["<image>"]
    starts = entry.image_starts["<image>"]
    for k in range(2):  # "<t seconds><v>" then the slot's pad rows, then "</v>"
        before = decode(tokens[: starts[k]])
        assert before.endswith(layout.stamps[k] + native.vision_start), before[-40:]
        assert tokens[starts[k]: starts[k] + per_slot] == [pad] * per_slot
        assert decode(tokens[starts[k] + per_slot: starts[k] + per_slot + 5]).startswith(native.vision_end)

    wire = wire_rows(read, feed)
    got = PatchNorm(native.image)(wire[:, :-1])
    frames = decode_frames(shard[1]["clip"], list(layout.indices))
    want_video, _ = video_preprocess(frames, video_meta(shard[1]["clip"]), native.image, native.video)
    from mimo.data.shards import decode_image

    want_still, _ = preprocess(decode_image(shard[1]["still"]), native.image)
    assert torch.equal(got, torch.cat([want_video, want_still]))
    # the video's two frames of a temporal patch differ (the shape moved); the image's repeat
    frames_PCFQ = wire[:, :-1].view(-1, 3, 2, 16)  # rows are C x tp x p x p
    video_rows = 2 * per_slot * 4
    assert not torch.equal(frames_PCFQ[:video_rows, :, 0], frames_PCFQ[:video_rows, :, 1])
    assert torch.equal(frames_PCFQ[video_rows:, :, 0], frames_PCFQ[video_rows:, :, 1])


def test_packs_give_videos_the_token_rules_positions(shard, indexes_here):
    """The pack's layout-made positions equal ``packed_positions_3d`` over its tokens with each
    video as one ``(t, h, w)`` grid whose temporal patches are split by their timestamps."""
    from mimo.compose.data_spec import mrope_merge, text_spec
    from mimo.data.pack import pack
    from mimo.data.pipeline import SampleReader
    from mimo.data.plan import PlannedSample
    from mimo.data.positions import packed_positions_3d

    with indexes_here():
        config, index = _index(shard[0])
    reader = SampleReader(index, text_spec(config), [])
    good = [e for e in index.entries if e.bad is None]
    items = [reader.read(PlannedSample(index.entries.index(e), e.tokens, e.images, e.image_starts, e.image_rows,
                                       e.image_grids)).item for e in good]
    whole = pack(items, {"<image>": 0}, 1, 1, False, reader.pad_id, mrope_merge(config))
    video_id = -7
    tokens = whole.tokens.clone()
    image_grids, video_grids = [], []
    for it, off in zip(items, whole.cu_seqlens.tolist()):
        slots, k = it.image_grids["<image>"], 0
        for kind, n in _slot_kinds(reader, index, it):  # n: the video's temporal patches (1: an image)
            if kind == "video":
                video_grids.append([n, *slots[k][1:]])
                for j in range(k, k + n):
                    s = off + it.image_starts["<image>"][j]
                    tokens[s: s + it.image_rows["<image>"][j]] = video_id
            else:
                image_grids.append(slots[k])
            k += n
    assert len(video_grids) == 3 and image_grids, "the shard's packs hold videos and images"
    want = packed_positions_3d(tokens, whole.cu_seqlens, image_grids, video_grids, 2,
                               reader.encoder.image_tokens["<image>"], video_id, None)
    assert torch.equal(whole.positions_3d, want)


def _slot_kinds(reader, index, item) -> list[tuple[str, int]]:
    """Per image or video of an item, in text order: ("video", its temporal patches) or ("image", 1)."""
    from mimo.data.index import sample_text
    from mimo.data.shards import SampleLocation, read_files

    entry = index.entries[item.id]
    files = read_files(index.shards[entry.shard], SampleLocation(entry.key, dict(entry.files)))
    read = sample_text(files, reader.encoder, reader.text)
    return [("video", len(read.layouts[f].stamps)) if kind == "video" else ("image", 1)
            for kind, f, t in read.tokens.slot_files["<image>"] if t == 0]


def test_video_config_problems_are_named(shard):
    from mimo.compose.config import load_config
    from mimo.core.errors import ConfigError

    for overrides, want in ((["modules.vision.video.fps=0"], "modules.vision.video.fps: must be > 0"),
                            (["modules.vision.video.min_frames=9"], "need 1 <= min_frames <= max_frames"),
                            (["modules.vision.video_placeholder=<image>"], "modules.vision.video_placeholder: must be a text of its own")):
        with pytest.raises(ConfigError) as e:
            load_config(shard[0], overrides)
        assert want in str(e.value), str(e.value)

"""Two encoders feeding one LLM, each with its own placeholder (docs/design.md §2): which image file
feeds which encoder, bad mappings listed with a clear reason, and training with an image tower
colocated with the LLM and a different sketch tower on its own ranks equal to the one-process
reference under 1F1B with encoder prefetch."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from mimo.compose.config import load_config
from mimo.data.text import TextEncoder, Turn, image_files, load_tokenizer
from mimo.core.errors import DataError
from mimo.compose.inputs import data_plan, encoder_feeds, ensure_index, text_spec
from mimo.commands.verify_train import compare, references, train_case

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "two_encoders.yaml")
TOL = 1e-5


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    from mimo.data.two_towers import make_two_tower_data

    root = tmp_path_factory.mktemp("two_towers")
    shards = make_two_tower_data(str(root / "data"), samples=300, shard_size=150, seed=3)
    with open(CONFIG) as f:
        cfg = yaml.safe_load(f)
    cfg["data"]["shards"] = shards
    cfg["data"]["tokenizer"] = str(root / "data" / "tokenizer")
    cfg["train"]["checkpoint"]["dir"] = str(root / "ckpt")
    path = root / "two_encoders.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ensure_index(load_config(str(path)))
    return str(path)


def test_image_files_follow_the_placeholders():
    # one file per placeholder occurrence, in text order, whichever encoder's
    assert image_files({"<image>": [0], "<sketch>": [1]}, 2) == {"<image>": [0], "<sketch>": [1]}
    assert image_files({"<image>": [1, 2], "<sketch>": [0]}, 3) == {"<image>": [1, 2], "<sketch>": [0]}
    assert image_files({"<image>": [0], "<sketch>": []}, 1) == {"<image>": [0], "<sketch>": []}
    # every placeholder once per file: each file feeds every encoder
    assert image_files({"<image>": [1, 3], "<sketch>": [0, 2]}, 2) == {"<image>": [0, 1], "<sketch>": [0, 1]}
    assert image_files({"<image>": [], "<sketch>": []}, 0) == {"<image>": [], "<sketch>": []}
    for occurrences, files in [({"<image>": [0], "<sketch>": []}, 2), ({"<image>": [0, 1], "<sketch>": [2]}, 2),
                               ({"<image>": [], "<sketch>": []}, 1)]:
        with pytest.raises(DataError, match="placeholder and image counts differ"):
            image_files(occurrences, files)


def test_text_encoder_maps_files_in_placeholder_order(config_path):
    config = load_config(config_path)
    spec = text_spec(config)
    enc = TextEncoder(load_tokenizer(spec.tokenizer), spec.template, dict(spec.rows_per_image))
    turns = lambda text: [Turn("human", text), Turn("gpt", "red")]  # noqa: E731
    s = enc.encode(turns("<sketch>\nand\n<image>\nColour?"), 2)
    assert s.image_files == {"<image>": [1], "<sketch>": [0]}
    assert s.image_starts["<sketch>"][0] < s.image_starts["<image>"][0]
    assert enc.encode(turns("<image><sketch>"), 1).image_files == {"<image>": [0], "<sketch>": [0]}
    with pytest.raises(DataError, match="placeholder and image counts differ") as e:
        enc.encode(turns("<image>\nBoth?"), 2)
    assert all(part in str(e.value) for part in ("1 x '<image>'", "0 x '<sketch>'", "for 2 image(s)"))


def test_reader_gives_each_encoder_its_own_files(config_path):
    """The pixels each encoder gets are the files its placeholders take, decoded to bytes."""
    from mimo.data.images import decode
    from mimo.data.pipeline import SampleReader
    from mimo.data.shards import SampleLocation, decode_image, image_keys, read_files

    config = load_config(config_path)
    index, _ = ensure_index(config)
    plan = data_plan(config, index)
    feeds = {f.placeholder: f for f in encoder_feeds(config)}
    reader = SampleReader(index, text_spec(config), list(feeds.values()))
    seen = set()
    for k in range(6):
        for s in plan.microbatch(k):
            entry = index.entries[s.id]
            files = read_files(index.shards[entry.shard], SampleLocation(entry.key, dict(entry.files)))
            images = [decode_image(files[ext]) for ext in image_keys(files)]
            prompt = json.loads(files["json"])["conversations"][0]["value"]
            got = reader.read(s)
            assert got.failure is None
            for p, feed in feeds.items():
                # the order in the generated prompt says which file each placeholder takes
                if len(images) == 2:
                    want = [images[0]] if prompt.index(p) < max(prompt.index(q) for q in feeds) else [images[1]]
                else:
                    want = images if p in prompt else []
                assert s.images_for(p) == len(want)
                expect = (torch.stack([decode(im, feed.image).reshape(-1) for im in want]) if want
                          else torch.zeros(0, feed.image.numel, dtype=torch.uint8))
                assert torch.equal(got.pixels[feed.name], expect)
            seen.add((len(images), tuple(p in prompt for p in feeds)))
    # every kind of sample was read: both files, one file for both, one for each, none
    assert {(2, (True, True)), (1, (True, True)), (1, (True, False)), (1, (False, True)), (0, (False, False))} <= seen


def test_a_mismatch_is_listed_as_a_bad_sample(tmp_path, config_path):
    import io

    import webdataset as wds
    from PIL import Image

    from mimo.data.demo import make_tokenizer
    from mimo.data.index import prepare

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    image = buf.getvalue()
    conv = lambda text: json.dumps({"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "x"}]}).encode()  # noqa: E731
    with wds.TarWriter(str(tmp_path / "mixed-0.tar")) as sink:
        sink.write({"__key__": "own", "0.png": image, "1.png": image, "json": conv("<image>\n<sketch>")})
        sink.write({"__key__": "shared", "png": image, "json": conv("<image>\n<sketch>")})
        sink.write({"__key__": "short", "0.png": image, "1.png": image, "json": conv("<image>\nWhich?")})
        sink.write({"__key__": "extra", "png": image, "json": conv("<image>\n<image>\n<sketch>")})
    make_tokenizer(str(tmp_path / "tok"))
    spec = text_spec(load_config(config_path))
    index, _ = prepare(str(tmp_path / "mixed-0.tar"), type(spec)(str(tmp_path / "tok"), spec.template, spec.rows_per_image), workers=1)
    bad = {e.key: e.bad for e in index.entries}
    assert bad["own"] is None and bad["shared"] is None
    for key, parts in (("short", ("1 x '<image>'", "0 x '<sketch>'", "for 2 image(s)")),
                       ("extra", ("2 x '<image>'", "1 x '<sketch>'", "for 1 image(s)"))):
        assert bad[key].startswith("placeholder and image counts differ") and all(p in bad[key] for p in parts), bad[key]


def _trace_case(config_path, overrides):
    import torch.distributed as dist

    from mimo.training.precision import PrecisionPolicy
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config = load_config(config_path, overrides)
    run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
    result = train_step(run.model, run.pipeline, 1, run.optimizers, trace=True)
    run.close()
    return result.trace


@pytest.mark.parametrize("overrides", [[], ["modules.sketch.freeze=[tower]", "modules.vision.parallel.tp=1",
                                            "modules.vision.parallel.dp=4", "train.encoder_prefetch=1"]],
                         ids=["both trained, prefetch 2", "sketch tower frozen, vision dp4, prefetch 1"])
def test_two_encoders_equal_one_process_reference(pools, config_path, overrides):
    layout = pools(6).run(train_case, config_path, overrides, 2, False)
    reference, fp64 = references(pools(1), config_path, overrides, 2)
    report = compare(layout, reference, TOL, fp64=fp64)
    assert report["ok"], report
    assert set(reference[0]["steps"][0]["grads"]) == {"vision", "sketch", "language"}
    assert reference[0]["steps"][0]["grads"]["sketch"]  # the sketch tower's gradients are compared too


def test_two_encoders_trace(pools, config_path):
    """Both encoders run and reduce their gradients during their last backward; the sketch
    ranks (their own) run ahead: their forward of microbatch i+1 starts before the LLM's
    backward of i ends."""
    per_rank = pools(6).run(_trace_case, config_path, [])
    mbs = 4
    for rank, events in enumerate(per_rank):
        fwd = {e["module"] for e in events if e["kind"] == "encoder_fwd"}
        assert fwd == ({"vision"} if rank < 4 else {"sketch"})
        for module in fwd:
            last = [e for e in events if e["kind"] == "encoder_bwd" and e["module"] == module and e["microbatch"] == mbs - 1]
            first = min(e["time"] for e in events if e["kind"] == "bucket_reduce_start" and e["module"] == module)
            assert last[0]["start"] < first < last[0]["time"]
    stage0 = [e for r in (0, 1, 2, 3) for e in per_rank[r] if e["kind"] == "backward" and e.get("stage") == 0]
    b_end = {k: max(e["time"] for e in stage0 if e["microbatch"] == k) for k in range(mbs)}
    for events in per_rank[4:]:
        f_start = {e["microbatch"]: e["start"] for e in events if e["kind"] == "encoder_fwd"}
        for k in range(mbs - 1):
            assert f_start[k + 1] < b_end[k]


"""Data: index, bad samples, tokenization and labels, packing, planning, per-rank delivery, resume."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from mimo.core.batch import PackedBatch
from mimo.data.demo import make_demo_data
from mimo.data.images import ImageSpec
from mimo.data.index import TextSpec, index_path, load_index, prepare
from mimo.data.pack import PackItem, pack
from mimo.data.plan import DataPlan
from mimo.core.errors import DataError
from mimo.parallel.layout import PackLayout

ROWS = 16  # rows per image of the test encoder
TEMPLATE = "chatml"


def _spec(root):
    return TextSpec(os.path.join(root, "tokenizer"), TEMPLATE, (("<image>", ROWS),))


def _write_bad_shard(path, image_bytes):
    import webdataset as wds

    conv = lambda text, answer: json.dumps({"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": answer}]}).encode()  # noqa: E731
    with wds.TarWriter(path) as sink:
        sink.write({"__key__": "good1", "png": image_bytes, "json": conv("<image>\nColour?", "red")})
        sink.write({"__key__": "corrupt", "png": b"definitely not a png", "json": conv("<image>\nColour?", "red")})
        sink.write({"__key__": "truncimg", "png": image_bytes[: len(image_bytes) // 2], "json": conv("<image>\nColour?", "red")})
        sink.write({"__key__": "nokey", "png": image_bytes})
        sink.write({"__key__": "badjson", "png": image_bytes, "json": b"{not json"})
        sink.write({"__key__": "nogpt", "png": image_bytes, "json": json.dumps({"conversations": [{"from": "human", "value": "<image>"}]}).encode()})
        sink.write({"__key__": "mismatch", "png": image_bytes, "json": conv("<image>\n<image>\nSame?", "yes")})
        sink.write({"__key__": "toolong", "png": image_bytes, "txt": ("a very long caption " * 40).encode()})
        sink.write({"__key__": "good2", "json": conv("What is 1 plus 2?", "3")})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("demo"))
    made = make_demo_data(root, train_samples=240, heldout_samples=20, shard_size=80, image_size=32, seed=1)
    with open(os.path.join(root, "train-000000.tar"), "rb") as f:
        data = f.read()
    from mimo.data.shards import scan_shard

    locs, _ = scan_shard(os.path.join(root, "train-000000.tar"))
    off, size = next(loc.files["png"] for loc in locs if "png" in loc.files)
    _write_bad_shard(os.path.join(root, "bad-000000.tar"), data[off : off + size])
    with open(os.path.join(root, "bad-000001.tar"), "wb") as f:  # a tar cut inside a file
        f.write(data[: 128 * 1024 + 100])
    with open(os.path.join(root, "bad-000002.tar"), "wb") as f:  # a tar cut between files
        f.write(data[: 128 * 1024])
    pattern = os.path.join(root, "{train-000000,train-000001,train-000002,bad-000000,bad-000001,bad-000002}.tar")
    index, status = prepare(pattern, _spec(root), workers=2)
    return {"root": root, "pattern": pattern, "index": index, "status": status, "made": made}


# ---------------------------------------------------------------------------------------------
def test_index_lists_every_kind_of_bad_sample(dataset):
    index = dataset["index"]
    bad = {e.key: e.bad for e in index.entries if e.bad}
    assert bad["corrupt"].startswith("corrupt image")
    assert bad["truncimg"].startswith("corrupt image")
    assert bad["nokey"].startswith("missing key")
    assert bad["badjson"].startswith("invalid json")
    assert bad["nogpt"].startswith("no assistant turn")
    assert bad["mismatch"].startswith("placeholder and image counts differ")
    truncated = [e for e in index.entries if e.bad and e.bad.startswith("truncated")]
    assert len(truncated) == 2  # the last sample of each cut tar
    assert {os.path.basename(s) for s in index.shard_errors} == {"bad-000001.tar", "bad-000002.tar"}
    good = {e.key for e in index.entries if not e.bad}
    assert {"good1", "good2", "toolong"} <= good
    plan = DataPlan(index, tokens_per_microbatch=1024, max_sample_tokens=512, seed=0)
    counts = plan.skipped_counts()
    assert counts["too long"] == 1 and counts["corrupt image"] == 2 and counts["missing key"] == 1
    assert counts["invalid json"] == 1 and counts["placeholder and image counts differ"] == 1


def test_index_is_reused_then_rebuilt_when_stale(dataset, tmp_path):
    root = str(tmp_path)
    for name in ("train-000000.tar", "tokenizer"):
        src = os.path.join(dataset["root"], name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(root, name))
    pattern = os.path.join(root, "train-000000.tar")
    spec = _spec(root)
    _, status = prepare(pattern, spec, workers=1)
    assert status == "built"
    assert prepare(pattern, spec, workers=1)[1] == "loaded"
    os.utime(os.path.join(root, "train-000000.tar"), ns=(1, 1))  # the shard "changed"
    with pytest.raises(DataError, match="stale"):
        load_index(pattern, spec)
    assert prepare(pattern, spec, workers=1)[1].startswith("rebuilt")
    other = TextSpec(spec.tokenizer, TEMPLATE, (("<image>", ROWS + 1),))  # encoders changed
    assert prepare(pattern, other, workers=1)[1].startswith("rebuilt")
    assert os.path.isfile(index_path(pattern, spec))


def test_tokens_labels_and_placeholders(dataset):
    from mimo.data.pipeline import SampleReader

    index = dataset["index"]
    reader = SampleReader(index, _spec(dataset["root"]), [])
    tok = reader.tokenizer
    plan = DataPlan(index, 1024, 512, seed=0)
    seen_image = False
    for s in plan.microbatch(0) + plan.microbatch(1):
        r = reader.read(s)
        assert r.failure is None and len(r.item.tokens) == s.tokens == index.entries[s.id].tokens
        starts = r.item.image_starts["<image>"]
        assert len(starts) == s.images
        for start in starts:  # each placeholder expanded to exactly the encoder's rows
            assert r.item.tokens[start : start + ROWS] == [reader.pad_id] * ROWS
            assert not any(r.item.target[start : start + ROWS])
            seen_image = True
        # targets are exactly the assistant answers and their end markers
        target_text = tok.decode([t for t, m in zip(r.item.tokens, r.item.target) if m])
        assert target_text.count("<|im_end|>") == 1 and target_text.endswith("<|im_end|>")
        assert "user" not in target_text and "<|im_start|>" not in target_text
    assert seen_image


def _items(lens, with_images=True):
    g = torch.Generator().manual_seed(sum(lens))
    out = []
    for i, n in enumerate(lens):
        toks = torch.randint(5, 50, (n,), generator=g).tolist()
        starts = {"<image>": [1] if with_images and n > ROWS + 1 else []}
        out.append(PackItem(i, toks, [j >= n // 2 for j in range(n)], starts))
    return out


@pytest.mark.parametrize("tp,cp,sp", [(1, 1, False), (2, 1, True), (3, 1, True), (2, 2, False), (2, 2, True)])
def test_pack_never_splits_samples_and_pads_only_as_needed(tp, cp, sp):
    lens = [20, 1, 7, 33, 2]
    items = _items(lens)
    batch: PackedBatch = pack(items, {"<image>": ROWS}, tp, cp, sp, pad_id=0)
    batch.validate()
    layout = PackLayout(tuple(lens), tp, cp, sp)
    assert batch.num_tokens == layout.total_len
    seg = batch.seqlens
    real = [s for s, n in zip(seg, layout.padded_lens)]
    assert real[: len(lens)] == layout.padded_lens  # one segment per sample (its own padding inside)
    for i, it in enumerate(items):
        a = int(batch.cu_seqlens[i])
        assert batch.tokens[a : a + lens[i]].tolist() == it.tokens
        assert batch.positions[a : a + seg[i]].tolist() == list(range(seg[i]))
        # next-token labels, loss only on targets, none on the last token or padding
        assert batch.labels[a : a + lens[i] - 1].tolist() == it.tokens[1:]
        assert batch.loss_mask[a : a + lens[i]].tolist() == it.target[1:] + [False]
        assert not batch.loss_mask[a + lens[i] : a + seg[i]].any()
    slots = batch.image_slots["<image>"].tolist()
    expect = [int(batch.cu_seqlens[i]) + 1 + r for i, n in enumerate(lens) if n > ROWS + 1 for r in range(ROWS)]
    assert slots == expect
    if cp == 1 and not sp:
        assert batch.num_tokens == sum(lens)


def test_plan_is_seeded_and_fills_microbatches(dataset):
    a = DataPlan(dataset["index"], 1024, 512, seed=3)
    b = DataPlan(dataset["index"], 1024, 512, seed=3)
    c = DataPlan(dataset["index"], 1024, 512, seed=4)
    ids = lambda plan, k: [s.id for s in plan.microbatch(k)]  # noqa: E731
    assert [ids(a, k) for k in range(6)] == [ids(b, k) for k in range(6)]
    assert [ids(a, k) for k in range(6)] != [ids(c, k) for k in range(6)]
    for k in range(6):
        mb = a.microbatch(k)
        assert sum(s.tokens for s in mb) <= 1024
        assert sum(s.tokens for s in mb) + a.index.entries[a._stream(a._starts[k + 1])].tokens > 1024
    # a later plan object finds step 3 without being walked through steps 1-2
    fresh = DataPlan(dataset["index"], 1024, 512, seed=3)
    assert [[s.id for s in m] for m in fresh.step(3, 2)] == [[s.id for s in m] for m in a.step(3, 2)]
    # epochs: every valid sample once per epoch
    n = len(a.valid)
    seen = []
    k = 0
    while len(seen) < n:
        seen += [s.id for s in a.microbatch(k)]
        k += 1
    assert sorted(seen[:n]) == sorted(a.valid)


# ---- per-rank delivery over real process groups -------------------------------------------------
def _deliver(root, pattern, llm_shape, llm_offset, enc_shape, enc_offset, steps, start_step=1, corrupt=None):
    """Runs the pipeline on every rank; returns what this rank got, and the pixel error against
    a one-process read of the samples its encoder block names."""
    from mimo.data.index import prepare
    from mimo.data.pipeline import DataPipeline, EncoderFeed, SampleReader, encoder_dp_blocks
    from mimo.parallel.grid import ParallelGrid

    spec = _spec(root)
    index, _ = prepare(pattern, spec, workers=1)
    dist.barrier()  # every rank holds the index before anything changes on disk
    if corrupt is not None and dist.get_rank() == 0:
        path, offset = corrupt
        with open(path, "r+b") as f:  # same size, garbage content: corrupt after indexing
            f.seek(offset)
            f.write(b"\x00" * 64)
    dist.barrier()
    plan = DataPlan(index, 1024, 512, seed=0)
    llm, enc = ParallelGrid(llm_shape, llm_offset), ParallelGrid(enc_shape, enc_offset)
    feed = EncoderFeed("vision", "<image>", ROWS, ImageSpec(32), enc)
    pipe = DataPipeline(plan, spec, llm, False, [feed], micro_batches=2, workers=2, prefetch=1)
    reference = SampleReader(index, spec, [feed])
    out = []
    rank = dist.get_rank()
    for step in range(start_step, start_step + steps):
        for mb in pipe.step(step):
            got = {"samples": [s.id for s in mb.plan.samples], "failures": dict(mb.read_failures)}
            if mb.pack is not None:
                mb.pack.validate()
                got["pack_ids"] = mb.pack.sample_ids.tolist()
                got["dp"] = llm.coords(rank)["dp"]
                got["loss_tokens"] = int(mb.pack.loss_mask.sum())
                got["tokens"] = mb.pack.tokens.tolist()
            if "vision" in mb.pixels:
                e = enc.coords(rank)["dp"]
                block = [mb.plan.samples[i] for i in encoder_dp_blocks(mb.plan.samples, feed)[e]]
                want = [_encoder_numbers(reference.read(s), feed) for s in block]
                want = torch.cat(want) if want else torch.zeros(0, 3, 32, 32)
                got["pixel_ids"] = [s.id for s in block]
                got["enc_dp"] = e
                got["pixel_err"] = (mb.pixels["vision"] - want).abs().max().item() if want.numel() else 0.0
                got["pixel_rows"] = mb.pixels["vision"].shape[0]
            out.append(got)
    pipe.close()
    return out


def _encoder_numbers(read, feed):
    """What the encoder must see of a read sample: its bytes normalised by CPU arithmetic
    (``preprocess``'s), zeros for a failed sample's slot."""
    from mimo.data.images import normalise

    x = read.pixels[feed.name].view(-1, 3, 32, 32)
    if read.failure:
        return torch.zeros(x.shape)
    return torch.stack([normalise(image, feed.image) for image in x]) if len(x) else torch.zeros(x.shape)


LAYOUTS = {  # (llm dp, encoder dp): colocated and non-colocated rank layouts
    "4-2 colocated": ({"tp": 1, "cp": 1, "dp": 4, "pp": 1}, 0, {"tp": 2, "dp": 2}, 0),
    "2-3 colocated": ({"tp": 3, "cp": 1, "dp": 2, "pp": 1}, 0, {"tp": 2, "dp": 3}, 0),
    "1-4 colocated": ({"tp": 2, "cp": 1, "dp": 1, "pp": 2}, 0, {"tp": 1, "dp": 4}, 0),
    "2-3 non-colocated": ({"tp": 1, "cp": 1, "dp": 2, "pp": 1}, 3, {"tp": 1, "dp": 3}, 0),
    "1-4 non-colocated": ({"tp": 2, "cp": 1, "dp": 1, "pp": 1}, 4, {"tp": 1, "dp": 4}, 0),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_sample_reaches_one_llm_rank_and_its_pixels_the_named_encoder_rank(pools, dataset, name):
    llm_shape, llm_off, enc_shape, enc_off = LAYOUTS[name]
    results = pools(6).run(_deliver, dataset["root"], dataset["pattern"], llm_shape, llm_off, enc_shape, enc_off, 2)
    n_mb = len(results[0])
    for k in range(n_mb):
        samples = results[0][k]["samples"]
        assert all(r[k]["samples"] == samples for r in results if r)  # the same plan everywhere
        by_dp: dict[int, list] = {}
        for r in results:
            if r and "pack_ids" in r[k]:
                prev = by_dp.setdefault(r[k]["dp"], r[k]["pack_ids"])
                assert prev == r[k]["pack_ids"]  # the DP group's ranks agree (broadcast)
        packed = [i for d in sorted(by_dp) for i in by_dp[d]]
        assert packed == samples  # every sample on exactly one LLM DP rank, in order
        by_enc: dict[int, list] = {}
        for r in results:
            if r and "pixel_ids" in r[k]:
                assert r[k]["pixel_err"] == 0.0  # exactly the pixels of the samples its block names
                assert by_enc.setdefault(r[k]["enc_dp"], r[k]["pixel_ids"]) == r[k]["pixel_ids"]
        assert [i for e in sorted(by_enc) for i in by_enc[e]] == samples  # each sample's pixels on one encoder DP rank


def test_same_plan_whatever_the_dp(pools, dataset):
    seen = {}
    for dp in (1, 2, 3, 4):
        llm = {"tp": 1, "cp": 1, "dp": dp, "pp": 1}
        results = pools(6).run(_deliver, dataset["root"], dataset["pattern"], llm, 0, {"tp": 1, "dp": 1}, 5, 1)
        seen[dp] = [mb["samples"] for mb in results[0]]
    assert seen[1] == seen[2] == seen[3] == seen[4]


def test_resume_mid_epoch_gives_identical_batches(pools, dataset):
    llm, enc = {"tp": 1, "cp": 1, "dp": 2, "pp": 1}, {"tp": 2, "dp": 1}
    full = pools(6).run(_deliver, dataset["root"], dataset["pattern"], llm, 0, enc, 0, 3, 1)
    resumed = pools(6).run(_deliver, dataset["root"], dataset["pattern"], llm, 0, enc, 0, 1, 3)
    for r_full, r_res in zip(full, resumed):
        if r_full:
            assert r_full[4:] == r_res  # step 3's two microbatches, tokens and pixels alike


def test_image_corrupted_after_indexing_is_counted_and_nothing_hangs(pools, dataset, tmp_path):
    root = str(tmp_path)
    for name in ("train-000001.tar", "tokenizer"):
        src = os.path.join(dataset["root"], name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(root, name))
    pattern = os.path.join(root, "train-000001.tar")
    index, _ = prepare(pattern, _spec(root), workers=1)
    # the first image of the first microbatch is overwritten (same size) after indexing
    plan = DataPlan(index, 1024, 512, seed=0)
    first = [s for s in plan.microbatch(0) if s.images]
    path = index.shards[0]
    off, _ = index.entries[first[0].id].files[[k for k in index.entries[first[0].id].files if k.endswith("png")][0]]
    results = pools(6).run(_deliver, root, pattern, {"tp": 1, "cp": 1, "dp": 2, "pp": 1}, 0, {"tp": 1, "dp": 2}, 0, 1, 1, (path, off), timeout_s=120)
    failures = sum(mb["failures"].get("corrupt image", 0) for r in results if r for mb in r)
    assert failures == 1


# ---- pixels as bytes, data a step ahead ----------------------------------------------------------
class _FloatReader:
    """The reader before pixels travelled as bytes: the encoder's fp32 numbers (``preprocess``'s
    CPU arithmetic), zeros for a failed sample. ``fail_id``: reading that sample raises."""

    def __init__(self, reader, feed, floats: bool, fail_id=None):
        self.reader, self.feed, self.floats, self.fail_id = reader, feed, floats, fail_id
        self.pad_id = reader.pad_id

    def read(self, s):
        if s.id == self.fail_id:
            raise RuntimeError(f"injected read failure of sample {s.id}")
        got = self.reader.read(s)
        if self.floats:
            got.pixels = {self.feed.name: _encoder_numbers(got, self.feed).reshape(-1, self.feed.image.numel)}
        return got


def _route(root, pattern, llm_shape, llm_offset, enc_shape, enc_offset, order, ahead=True, floats=False, fail_id=None):
    """The pipeline over the steps of ``order`` (asked in that order): per microbatch this rank's
    sample ids, pack tokens and delivered pixels; and the pixel bytes this rank sent."""
    from mimo.data.index import prepare
    from mimo.data.pipeline import DataPipeline, EncoderFeed, SampleReader
    from mimo.parallel.grid import ParallelGrid

    spec = _spec(root)
    index, _ = prepare(pattern, spec, workers=1)
    plan = DataPlan(index, 1024, 512, seed=0)
    llm, enc = ParallelGrid(llm_shape, llm_offset), ParallelGrid(enc_shape, enc_offset)
    feed = EncoderFeed("vision", "<image>", ROWS, ImageSpec(32), enc, torch.float32 if floats else torch.uint8)
    reader = lambda: _FloatReader(SampleReader(index, spec, [feed]), feed, floats, fail_id)  # noqa: E731
    pipe = DataPipeline(plan, spec, llm, False, [feed], micro_batches=2, workers=2, prefetch=1, make_reader=reader, ahead=ahead)
    pipe.last_step = max(order)
    out = []
    for step in order:
        for mb in pipe.step(step):
            out.append({"step": step, "samples": [s.id for s in mb.plan.samples],
                        "tokens": mb.pack.tokens.tolist() if mb.pack is not None else None,
                        "pixels": mb.pixels.get("vision")})
    pipe.close()
    return out, pipe.pixel_bytes


def _same_delivery(a, b) -> None:
    for rank_a, rank_b in zip(a, b):
        assert len(rank_a[0]) == len(rank_b[0])
        for x, y in zip(rank_a[0], rank_b[0]):
            assert (x["step"], x["samples"], x["tokens"]) == (y["step"], y["samples"], y["tokens"])
            assert (x["pixels"] is None) == (y["pixels"] is None)
            if x["pixels"] is not None:  # bit for bit
                assert x["pixels"].dtype == y["pixels"].dtype == torch.float32
                assert torch.equal(x["pixels"].view(torch.int32), y["pixels"].view(torch.int32))


def test_pixel_norm_is_preprocess_bit_for_bit():
    from mimo.data.images import PixelNorm, normalise

    spec = ImageSpec(24, mean=(0.5, 0.25, 0.125), std=(0.3, 0.2, 0.7))
    x = torch.randint(0, 256, (5, 3, 24, 24), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    want = torch.stack([normalise(image, spec) for image in x])
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        got = PixelNorm(spec)(x.to(device)).cpu()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), device


BYTE_LAYOUTS = {  # colocated (all-to-all), non-colocated with the encoder's TP all-gather
    "colocated": ({"tp": 3, "cp": 1, "dp": 2, "pp": 1}, 0, {"tp": 2, "dp": 3}, 0),
    "non-colocated": ({"tp": 2, "cp": 1, "dp": 1, "pp": 1}, 4, {"tp": 2, "dp": 2}, 0),
}


@pytest.mark.parametrize("name", list(BYTE_LAYOUTS))
def test_pixels_travel_as_bytes_and_arrive_as_the_same_numbers(pools, dataset, name):
    """Bytes (plus one read flag per image) against the old fp32 route of the same pixels: the
    encoder ranks get the same numbers bit for bit, for a quarter of the bytes."""
    layout = BYTE_LAYOUTS[name]
    as_bytes = pools(6).run(_route, dataset["root"], dataset["pattern"], *layout, [1, 2])
    as_floats = pools(6).run(_route, dataset["root"], dataset["pattern"], *layout, [1, 2], floats=True)
    _same_delivery(as_bytes, as_floats)
    sent_bytes, sent_floats = sum(r[1] for r in as_bytes), sum(r[1] for r in as_floats)
    numel = ImageSpec(32).numel
    # a quarter, plus the read flag (and a byte of padding to the all-gather's even chunks)
    assert sent_floats > 0 and sent_floats <= sent_bytes * 4 <= sent_floats * (numel + 2) / numel


@pytest.mark.parametrize("name", ["4-2 colocated", "2-3 non-colocated"])
def test_a_step_ahead_delivers_the_inline_microbatches(pools, dataset, name):
    """Prepared on the data thread over its own groups, a step ahead, also across a jump back and
    forth (a resume): the same microbatches as prepared inline on the training groups."""
    order = [1, 2, 4, 3, 3]
    ahead = pools(6).run(_route, dataset["root"], dataset["pattern"], *LAYOUTS[name], order)
    inline = pools(6).run(_route, dataset["root"], dataset["pattern"], *LAYOUTS[name], order, ahead=False)
    _same_delivery(ahead, inline)
    assert [x["step"] for x in ahead[0][0]] == [s for s in order for _ in range(2)]


def test_an_error_on_the_data_thread_ends_the_case_with_its_message(pools, dataset):
    """A reader failing while step 2 is prepared ahead (on one rank): that rank raises the error
    when it asks for step 2, and the case ends at once with its message, not at a timeout."""
    import time

    from mimo.core.errors import DistributedError
    from mimo.data.index import prepare

    index, _ = prepare(dataset["pattern"], _spec(dataset["root"]), workers=1)
    plan = DataPlan(index, 1024, 512, seed=0)
    fail_id = plan.microbatch(2)[0].id  # step 2's first sample: read by the reader of LLM DP rank 0, rank 3
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=f"rank 3 failed:(.|\n)*injected read failure of sample {fail_id}"):
        pools(6).run(_route, dataset["root"], dataset["pattern"], *LAYOUTS["2-3 non-colocated"], [1, 2, 3],
                     fail_id=fail_id, timeout_s=100)
    assert time.monotonic() - t0 < 60


def test_the_step_thread_fails_later_jobs_without_running_them():
    from mimo.data.pipeline import StepThread

    ran = []

    def job(x):
        ran.append(x)
        if x == 2:
            raise ValueError("job 2 failed")
        return x

    thread = StepThread()
    futures = [thread.submit(job, x) for x in (1, 2, 3)]
    assert futures[0].result(timeout=10) == 1
    for f in futures[1:]:
        with pytest.raises(ValueError, match="job 2 failed"):
            f.result(timeout=10)
    thread.close()
    assert ran == [1, 2]
    # closed, it refuses new work with a clear error: no job would ever run, and the caller
    # (a step asked of a closed run's pipeline) would wait forever
    from mimo.core.errors import DataError

    with pytest.raises(DataError, match="pipeline is closed"):
        thread.submit(job, 4)


def test_batched_tokenization_equals_the_tokenizer_call(dataset):
    from mimo.data.text import TextEncoder, load_tokenizer

    tok = load_tokenizer(os.path.join(dataset["root"], "tokenizer"))
    enc = TextEncoder(tok, TEMPLATE, {"<image>": ROWS})
    texts = ["<|im_start|>user\nWhat colour?<|im_end|>\n", "héllo wörld", " red</s>", "\n"]
    assert enc.ids(texts) == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

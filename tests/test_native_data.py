"""Native-resolution VLMs trained from WebDataset shards (issue 47: data, bridges, training).

On the demo data's native split (coloured shapes on images of six sizes, none a multiple of 32,
some not of the tower's 8-pixel grid either) with ``configs/examples/qwen3-vl-moe.yaml``:

* the index holds each image's grid and rows as its header gives them, and each sample's text
  expands every placeholder to the vision start text, that image's own rows, the vision end text;
* packs carry M-RoPE positions equal to the token-based rule (``packed_positions_3d``, itself equal
  to transformers' ``get_rope_index``), also as a CP rank's share;
* the patch rows the tower receives (uint8 one-frame rows routed, normalised on its device) are
  ``preprocess``'s, which equals transformers' processor (test_native_images);
* bad images and mismatched placeholders are counted skips, nothing lost;
* ``verify-train`` of the example equals the one-process reference colocated (world 2: tower dp 2,
  LLM tp 2 with SP) and non-colocated (world 4, as shipped); a resumed run equals a straight one.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mimo.compose.config import load_config
from mimo.compose.data_spec import text_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "examples" / "qwen3-vl-moe.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def native(tmp_path_factory, write_native_example) -> str:
    """The example config over fresh demo data (its native split: 160 samples in two shards)."""
    return write_native_example(EXAMPLE, tmp_path_factory.mktemp("native"), 5, 160, shards=2, tokens_per_microbatch=768)


def _index(config_path: str):
    from mimo.compose.inputs import ensure_index

    config = load_config(config_path)
    return config, ensure_index(config)[0]


def test_index_holds_each_images_grid_and_the_text_its_rows(native):
    from PIL import Image

    from mimo.data.native_images import image_grid
    from mimo.data.native_video import layout_from_bytes
    from mimo.data.shards import SampleLocation, image_keys, read_files, video_keys

    from mimo.data.pipeline import SampleReader

    config, index = _index(native)
    spec = text_spec(config)
    (taker,) = spec.native
    image = taker.image
    reader = SampleReader(index, spec, [])
    encoder = reader.encoder
    start, end = (encoder.ids([t])[0] for t in ("<v>", "</v>"))
    sizes, rows_seen, videos = set(), set(), 0
    for entry in index.entries:
        assert entry.bad is None
        files = read_files(index.shards[entry.shard], SampleLocation(entry.key, dict(entry.files)))
        shapes = [Image.open(io.BytesIO(files[k])).size for k in image_keys(files)]
        sizes.update(shapes)
        grids = [list(image_grid(h, w, image)) for w, h in shapes]
        # a demo sample holds images or one video: a video's slots, one per temporal patch
        for k in video_keys(files):
            grids += layout_from_bytes(files[k], image, taker.video).grids
            videos += 1
        assert entry.image_grids == {"<image>": grids} and entry.images == len(shapes)
        assert entry.image_rows == {"<image>": [t * h * w // 4 for t, h, w in grids]}
        rows_seen.update(entry.image_rows["<image>"])
        # the tokens around every image: the vision start text before it, the end text after it
        read = reader.read(_planned(index, entry))
        tokens = read.item.tokens
        assert read.failure is None and len(tokens) == entry.tokens
        for s, n in zip(entry.image_starts["<image>"], entry.image_rows["<image>"]):
            assert tokens[s - len(start):s] == start and tokens[s + n:s + n + len(end)] == end
            assert set(tokens[s:s + n]) == {encoder.image_tokens["<image>"]}
    assert len(sizes) >= 5 and all(w % 32 and h % 32 for w, h in sizes) and len(rows_seen) >= 4 and videos >= 5


def _planned(index, entry):
    from mimo.data.plan import PlannedSample

    i = index.entries.index(entry)
    return PlannedSample(i, entry.tokens, entry.images, entry.image_starts, entry.image_rows, entry.image_grids)


def test_packs_carry_the_token_rules_positions_whole_and_as_cp_shares(native):
    """``pack``'s layout-made positions equal ``packed_positions_3d`` over the pack's own tokens
    (images found by their token, grids in order), at cp 1 and as each CP rank's share at cp 2."""
    from mimo.compose.data_spec import mrope_merge
    from mimo.data.pack import cp_share, pack
    from mimo.data.pipeline import SampleReader
    from mimo.data.plan import DataPlan
    from mimo.data.positions import packed_positions_3d
    from mimo.parallel.layout import PackLayout

    config, index = _index(native)
    spec = text_spec(config)
    reader = SampleReader(index, spec, [])
    plan = DataPlan(index, 768, 512, seed=1)
    image_token = reader.encoder.image_tokens["<image>"]
    assert image_token == reader.pad_id  # the demo tokenizer has no image token: pad marks the rows
    checked = 0
    for k in range(3):
        items = [reader.read(s).item for s in plan.microbatch(k)]
        whole = pack(items, {"<image>": 0}, 1, 1, False, reader.pad_id, mrope_merge(config))
        grids = [g for it in items for g in it.image_grids["<image>"]]
        want = packed_positions_3d(whole.tokens, whole.cu_seqlens, grids or None, None, 2, image_token, -1, None)
        assert torch.equal(whole.positions_3d, want)
        assert not torch.equal(whole.positions_3d[1], whole.positions_3d[2])  # 3-D where images are
        slots = torch.cat([s + torch.arange(n) for it, off in zip(items, whole.cu_seqlens.tolist())
                           for s, n in zip(np.add(it.image_starts["<image>"], off), it.image_rows["<image>"])])
        assert torch.equal(whole.image_slots["<image>"], slots)
        cp_whole = pack(items, {"<image>": 0}, 1, 2, False, reader.pad_id, mrope_merge(config))
        for r in range(2):
            share = cp_share(cp_whole, r)
            ids = torch.tensor(PackLayout(tuple(4 * c for c in cp_whole.cp.chunk_lens), 1, 2, False).cp_local_index(r))
            assert torch.equal(share.positions_3d, cp_whole.positions_3d[:, ids])
        # the whole CP pack: the samples' real tokens have the cp 1 positions
        real_cp = torch.cat([torch.arange(a, a + len(it.tokens)) for it, a in zip(items, cp_whole.cu_seqlens.tolist())])
        assert torch.equal(cp_whole.positions_3d[:, real_cp], whole.positions_3d)
        checked += len(items)
    assert checked > 10


def test_the_tower_receives_the_processors_patch_rows(native):
    """What a reader routes (uint8 patch rows of a temporal patch's frames: the tower takes
    videos) becomes, on the tower's side (``PatchNorm``), ``preprocess``'s rows of each image (and
    ``video_preprocess``'s of each video: test_native_video shows both equal to transformers'
    processors), image after image, bit for bit."""
    from mimo.compose.inputs import encoder_feeds
    from mimo.data.native_images import PatchNorm, preprocess
    from mimo.data.native_video import decode_frames, layout_from_bytes, video_meta, video_preprocess
    from mimo.data.pipeline import SampleReader, wire_rows
    from mimo.data.shards import SampleLocation, decode_image, image_keys, read_files, video_keys

    config, index = _index(native)
    (feed,) = encoder_feeds(config)
    (taker,) = text_spec(config).native
    reader = SampleReader(index, text_spec(config), [feed])
    norm = PatchNorm(feed.native)
    videos = [e for e in index.entries if video_keys(e.files)][:3]
    for entry in index.entries[:12] + videos:
        read = reader.read(_planned(index, entry))
        wire = wire_rows(read, feed)
        assert wire.dtype == torch.uint8 and wire.shape[1] == 3 * 2 * 4 * 4 + 1 and bool(wire[:, -1].all())
        files = read_files(index.shards[entry.shard], SampleLocation(entry.key, dict(entry.files)))
        want = [preprocess(decode_image(files[k]), feed.native) for k in image_keys(files)]
        for k in video_keys(files):
            layout = layout_from_bytes(files[k], feed.native, taker.video)
            rows, grid = video_preprocess(decode_frames(files[k], list(layout.indices)), video_meta(files[k]),
                                          feed.native, taker.video)
            want += [(rows, g) for rows, g in zip(rows.chunk(grid[0]), layout.grids)]
        got = norm(wire[:, :-1])
        assert torch.equal(got, torch.cat([w for w, _ in want]) if want else got[:0])
        assert [list(g) for _, g in want] == entry.image_grids["<image>"]


def _bad_shard(path: Path) -> None:
    import webdataset as wds
    from PIL import Image

    import random

    from mimo.data.demo import Shape, draw

    def png(width, height):
        buf = io.BytesIO()
        Image.new("RGB", (width, height), (90, 20, 20)).save(buf, format="PNG")
        return buf.getvalue()

    conv = lambda text: json.dumps({"conversations": [{"from": "human", "value": text},  # noqa: E731
                                                      {"from": "gpt", "value": "red"}]}).encode()
    good = draw(Shape("red", "circle", "top left"), (44, 28), random.Random(0))
    with wds.TarWriter(str(path)) as sink:
        sink.write({"__key__": "good", "png": good, "json": conv("<image>\nWhat colour?")})
        sink.write({"__key__": "thin", "png": png(300, 1), "json": conv("<image>\nWhat colour?")})  # aspect 300
        sink.write({"__key__": "corrupt", "png": good[:40] + b"\0" * 50, "json": conv("<image>\nWhat colour?")})
        sink.write({"__key__": "two", "png": good, "json": conv("<image>\n<image>\nWhat colour?")})
        sink.write({"__key__": "text", "json": conv("Say red.")})


def test_bad_images_and_placeholders_are_counted_skips(native, tmp_path):
    from mimo.compose.inputs import ensure_index
    from mimo.data.plan import DataPlan

    shard = tmp_path / "bad-000000.tar"
    _bad_shard(shard)
    cfg = yaml.safe_load(Path(native).read_text())
    cfg["data"]["shards"] = str(tmp_path / "bad-{000000..000000}.tar")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    index, _ = ensure_index(load_config(str(path)))
    verdicts = {e.key: e.bad for e in index.entries}
    assert verdicts["good"] is None and verdicts["text"] is None
    assert verdicts["thin"].startswith("image aspect ratio too large: 1x300")
    assert verdicts["corrupt"].startswith("corrupt image")
    assert verdicts["two"].startswith("placeholder and image counts differ")
    plan = DataPlan(index, 768, 512, seed=0)
    assert plan.skipped_counts() == {"image aspect ratio too large": 1, "corrupt image": 1,
                                     "placeholder and image counts differ": 1}
    assert len(plan.valid) + sum(plan.skipped_counts().values()) == len(index.entries) == 5


@pytest.fixture(scope="module")
def one_process(pools, native):
    """The one-process runs (fp32, fp64) every layout below is compared with."""
    from mimo.commands.verify_train import references

    return references(pools(1), native, [], STEPS)


@pytest.mark.parametrize("layout", ["colocated", "non-colocated"])
def test_verify_train_equals_one_process(pools, native, one_process, layout):
    """The whole run (tower DP blocks by cost, pixels routed per patch, bridges of variable rows
    with the deepstack level beside them, M-RoPE, MoE) at the layout equals the one-process run."""
    from mimo.commands.verify_train import compare, train_case

    overrides = {"colocated": ["world_size=2", "modules.language.parallel.ranks=0:2"], "non-colocated": []}[layout]
    ran = pools(2 if overrides else 4).run(train_case, native, overrides, STEPS, False)
    report = compare(ran, one_process[0], 1e-5, fp64=one_process[1])
    assert report["ok"], report
    assert all(0 < loss < 10 for loss in report["losses"])


# issue 52's first run, on gloo: the tower at tp 2 x dp 2 beside the LLM at tp 2 x ep 2 (its experts
# split over its TP ranks), colocated (the LLM then also dp 2) and on ranks of its own
WIDE_TOWER = ["modules.vision.arch.heads=4", "modules.vision.arch.hidden=64"]  # tp 2 divides its heads
TOWER_TP2_DP2 = ["modules.vision.parallel.tp=2", "modules.vision.parallel.dp=2", 'modules.vision.parallel.ranks="0:4"']
LLM_TP2_EP2 = {"colocated": ["world_size=4", 'modules.language.parallel={tp: 2, dp: 2, ep: 2, etp: 1, ranks: "0:4", '
                                            'sequence_parallel: true}'],
               "non-colocated": ["world_size=6", 'modules.language.parallel={tp: 2, ep: 2, etp: 1, ranks: "4:6", '
                                                 'sequence_parallel: true}']}


@pytest.mark.parametrize("layout", sorted(LLM_TP2_EP2))
def test_tower_tp2_dp2_beside_llm_tp2_ep2_equals_one_process(pools, native, layout):
    """The whole native VLM at that layout equals the one-process run; every microbatch's bridge
    plans equal the reference builders' on every rank, and send and all-gather exactly the
    reference's minimum of elements (the MoE dispatch its own minimum)."""
    from mimo.commands.verify_train import compare, references, train_case

    overrides = WIDE_TOWER + TOWER_TP2_DP2 + LLM_TP2_EP2[layout]
    ref = references(pools(1), native, WIDE_TOWER, STEPS)
    report = compare(pools(4 if layout == "colocated" else 6).run(train_case, native, overrides, STEPS, False), ref[0],
                     1e-5, fp64=ref[1])
    assert report["ok"], report
    plans = report["bridge_plans"]
    assert plans["checked"] > 0 and plans["problems"] == 0 and plans["sent"] == plans["minimum"] > 0, plans
    assert plans["gathered"] == plans["gather_minimum"], plans  # the tower's TP pair completes the gradient
    assert report["moe_dispatch"]["bytes_ratio"] == 1.0, report["moe_dispatch"]


def test_lora_and_dora_on_the_native_vlm_equal_one_process(pools, native):
    """Adapters on both modules of the native VLM (DoRA on the tower's fused qkv and MLP, LoRA on
    the LLM's attention and routed experts, its experts split over tp 2 with sequence parallelism;
    the tower data parallel on its own ranks) equal the one-process run of the same config."""
    from mimo.commands.verify_train import compare, references, train_case

    lora = ["modules.vision.lora={rank: 4, alpha: 8, dora: true, targets: [qkv, fc1, fc2]}",
            "modules.language.lora={rank: 4, alpha: 8, targets: [q, k, v, o, experts]}"]
    ref = references(pools(1), native, lora, STEPS)
    report = compare(pools(4).run(train_case, native, lora, STEPS, False), ref[0], 1e-5, fp64=ref[1])
    assert report["ok"], report
    assert "lora" in report["worst"]["grads"], report["worst"]


def test_a_resumed_run_equals_a_straight_one(pools, native, resume_case, tmp_path):
    overrides = ["world_size=2", "modules.language.parallel.ranks=0:2"]
    out = pools(2).run(resume_case, native, overrides, str(tmp_path))
    for got in out:
        assert got["straight"] == got["resumed"]


def _delivered_pack(config_path: str, overrides: list[str]) -> dict:
    """Rank function: step 1's packs as the training pipeline delivers them, their M-RoPE
    positions against the token rule over their own tokens."""
    import torch.distributed as dist

    from mimo.data.positions import packed_positions_3d
    from mimo.training.run import build_run

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    try:
        out = []
        for mb in run.pipeline.step(1):
            p = mb.pack
            grids = mb.plan.arrays.image_grids("<image>").tolist()
            want = packed_positions_3d(p.tokens, p.cu_seqlens, grids or None, None, 2, run.pipeline.pad_id, -1, None)
            out.append(p.positions_3d is not None and torch.equal(p.positions_3d, want))
            # the bridge was planned with the microbatch, on the data thread: as the runner would
            from mimo.data.pipeline import microbatch_bridge_plans as image_bridge_plans

            src, dst, plans = image_bridge_plans(mb.plan.arrays, "<image>", 0, 64 * 2, run.model.part("vision").grid,
                                                 mb.plan.encoder_blocks["vision"], run.model.llm.grid, mb.plan.llm_blocks,
                                                 run.model.llm.ctx.sequence_parallel, dist.get_rank())
            got = mb.plan.bridges["vision"]
            out.append(got[0].to_placement() == src.to_placement() and got[1].to_placement() == dst.to_placement()
                       and all(repr(a) == repr(b) for a, b in zip(got[2], plans)))
        return {"equal": out}
    finally:
        run.pipeline.close()


def test_the_training_pipeline_delivers_m_rope_positions_and_bridge_plans(pools, native):
    (got,) = pools(1).run(_delivered_pack, native, ["world_size=1", "modules.vision.parallel.dp=1",
                                                    "modules.vision.parallel.ranks=0:1", "modules.language.parallel.tp=1",
                                                    "modules.language.parallel.ranks=0:1"])
    assert got["equal"] == [True] * 4


def test_tower_dp_blocks_balance_compute_and_inspect_data_reports_it(native, capsys):
    """The tower's DP blocks balance each image's cost (patches x (2D + F + patches): matmuls
    and attention), which on these ragged images spreads work more evenly than balancing rows;
    ``inspect-data`` reports images, patches and tokens per microbatch and the tower's padding."""
    from mimo.commands.cli import main
    from mimo.compose.inputs import data_plan, encoder_feeds
    from mimo.data.pipeline import encoder_dp_blocks
    from mimo.parallel.layout import dp_blocks

    config, index = _index(native)
    (feed,) = encoder_feeds(config)
    plan = data_plan(config, index)  # inspect-data's
    arch = config.encoders["vision"].arch
    ours, by_rows = [], []
    for k in range(30):
        arrays = plan.microbatch_arrays(k)
        patches_I = 4 * arrays.image_rows("<image>", 0)  # what a sample costs, from its images' patches
        owner_I = np.repeat(np.arange(len(arrays.tokens_N)), arrays.images_for("<image>"))
        cost_N = np.bincount(owner_I, patches_I * (2 * arch.hidden + arch.mlp + patches_I), len(arrays.tokens_N))
        for blocks, out in ((encoder_dp_blocks(arrays, feed), ours), (dp_blocks(arrays.rows_per_sample("<image>", 0), 2), by_rows)):
            costs = [int(cost_N[b.start:b.stop].sum()) for b in blocks]
            out.append(max(costs) / (sum(costs) / len(costs)))
    # (a sample is indivisible: a video's temporal patches, all of one size, stay on one rank)
    assert np.mean(ours) < np.mean(by_rows) and max(ours) < 1.5, (ours, by_rows)

    assert main(["inspect-data", native, "--batches", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tower = result["native_towers"]["vision"]
    for k in range(3):
        arrays = plan.microbatch_arrays(k)
        rows = int(arrays.image_rows("<image>", 0).sum())
        assert tower["images_per_microbatch"][k] == int(arrays.images_for("<image>").sum())
        assert tower["tokens_per_microbatch"][k] == rows and tower["patches_per_microbatch"][k] == 4 * rows
    assert tower["tower_padding_fraction"] == 0.0  # no SP on the tower: its packs hold patches only


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
WORLD_1 = ["world_size=1", "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1",
           "modules.language.parallel.tp=1", "modules.language.parallel.ranks=0:1"]


@needs_cuda
@pytest.mark.timeout(900)  # train.compile recompiles for each step's lengths: ~230 s of the ~300 on an H100
def test_native_vlm_trains_on_the_gpu_as_on_the_cpu(native):
    """On the GPU: the pipeline delivers the tower ``preprocess``'s rows bit for bit (``PatchNorm``
    looked up there) with the plan's grids, and 3 fp32 steps eager and with ``train.compile`` (the
    tower stays eager, the LLM layers compile for dynamic lengths) give the CPU's losses."""
    from mimo.compose.inputs import encoder_feeds
    from mimo.data.native_images import PatchNorm
    from mimo.data.pipeline import SampleReader, wire_rows
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config, index = _index(native)
    (feed,) = encoder_feeds(config)
    reader, norm = SampleReader(index, text_spec(config), [feed]), PatchNorm(feed.native)
    for entry in index.entries[:8]:
        wire = wire_rows(reader.read(_planned(index, entry)), feed)
        assert torch.equal(norm(wire[:, :-1].cuda()).cpu(), norm(wire[:, :-1]))

    losses = {}
    for device, extra in (("cpu", []), ("cuda", []), ("cuda", ["train.compile=true"])):
        torch.manual_seed(0)
        run = build_run(load_config(native, WORLD_1 + extra), 0, device=torch.device(device))
        try:
            mb = run.pipeline.step(1)[0]
            if device == "cuda":
                pixels = mb.pixels["vision"]
                assert pixels.pixels_PJ.is_cuda and pixels.grids_N3.tolist() == mb.plan.arrays.image_grids("<image>").tolist()
            losses[(device, bool(extra))] = [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss
                                             for s in range(1, 4)]
        finally:
            run.close()
    cpu = losses[("cpu", False)]
    for key, got in losses.items():
        for a, b in zip(got, cpu):
            assert abs(a - b) <= 2e-3 * abs(b), (key, got, cpu)


def test_microbatches_hold_both_budgets(native):
    """``data.patches_per_microbatch`` bounds a microbatch's tower patches beside its tokens; a
    sample with more patches than that alone is a counted skip ("too many patches")."""
    from mimo.data.plan import DataPlan, entry_patches

    _, index = _index(native)
    patches = sorted(entry_patches(e) for e in index.entries)
    budget = patches[-3]  # the two biggest samples alone exceed it (or tie it)
    plan = DataPlan(index, 768, 512, seed=2, patches_per_microbatch=budget)
    skipped = sum(p > budget for p in patches)
    assert plan.skipped_counts() == ({"too many patches": skipped} if skipped else {})
    cut_by_patches = 0
    for k in range(40):
        arrays = plan.microbatch_arrays(k)
        used, tokens = int(arrays.image_grids("<image>").prod(1).sum()), int(arrays.tokens_N.sum())
        assert used <= budget and tokens <= 768
        following = index.entries[int(plan._ids(k + 1)[0])]  # the stream's next sample did not fit
        assert tokens + following.tokens > 768 or used + entry_patches(following) > budget
        cut_by_patches += tokens + following.tokens <= 768
    assert cut_by_patches > 0

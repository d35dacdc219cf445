"""`mimo eval`: the matching rules by hand, greedy generation through the distributed model against
a one-process argmax loop (sample by sample, no packing, no bridges), the held-out loss against the
one-process loss, and the command end to end on a trained checkpoint (and at a wrong layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mimo.data.demo import make_demo_data
from mimo.commands.eval import EvalRequest, cut_at, eval_rank, exact_match, last_answer, normalise, subset_blocks

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = "heldout-{000000..000000}.tar"


@pytest.fixture(scope="module")
def pools(session_pools):
    """This module's worker pools are the session's (``session_pools``): started once for the
    modules that share them, not once per module."""
    return session_pools


# ---------------------------------------------------------------- matching, by hand


def test_normalise_and_exact_match():
    assert normalise("  Bottom   Right \n") == "bottom right"
    assert exact_match(" Red<|im_end|>\n<|im_start|>", "red<|im_end|>", "<|im_end|>")
    assert exact_match("top  left</s>", "Top left</s>", "</s>")
    assert not exact_match("red green<|im_end|>", "red<|im_end|>", "<|im_end|>")  # more than the answer
    assert not exact_match("re", "red<|im_end|>", "<|im_end|>")  # cut short by max_new_tokens
    assert not exact_match("", "no<|im_end|>", "<|im_end|>")
    assert cut_at("yes<|im_end|>no", "<|im_end|>") == "yes" and cut_at("yes", "") == "yes"


def test_last_answer_is_the_last_run_of_targets():
    assert last_answer([False, False, True, True, False]) == (2, 4)
    assert last_answer([False, True, False, False, True, True, True]) == (4, 7)  # two turns: the last one
    assert last_answer([False, False]) is None


def test_subset_blocks_keep_each_sample_in_its_block():
    blocks = [range(0, 3), range(3, 3), range(3, 6)]
    assert subset_blocks(blocks, {0, 2, 4}) == [range(0, 2), range(2, 2), range(2, 3)]
    assert subset_blocks(blocks, set()) == [range(0, 0)] * 3


# ---------------------------------------------------------------- generation through the layout


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval_data")
    make_demo_data(str(root), train_samples=60, heldout_samples=24, shard_size=60, seed=3)
    return root


def write_config(tmp: Path, data: Path, **train) -> str:
    with open(ROOT / "configs" / "demo.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["data"].update(shards=str(data / "train-{000000..000000}.tar"), tokenizer=str(data / "tokenizer"), tokens_per_microbatch=400, max_sample_tokens=200)
    cfg["eval"] = {"shards": str(data / HELDOUT), "samples": 12, "max_new_tokens": 3}
    cfg["train"].update(checkpoint={"dir": str(tmp / "run" / "ckpt")}, **train)
    path = tmp / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


NON_COLOCATED_PP = [  # vision on ranks 0:2, the LLM on 2:4 as two pipeline stages
    "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2", "modules.language.parallel.tp=1",
    "modules.language.parallel.dp=1", "modules.language.parallel.pp=2", "modules.language.parallel.ranks=2:4",
    "modules.language.parallel.sequence_parallel=false",
]
ONE_PROCESS = ["world_size=1", "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1",
               "modules.language.parallel.tp=1", "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:1"]


def reference_rank(config_path: str, overrides: list[str], req: EvalRequest, samples: int) -> dict:
    """One process: each sample alone, the whole model, argmax at the last position, repeated."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.data.images import PixelNorm
    from mimo.data.pack import PackItem, pack
    from mimo.data.pipeline import SampleReader
    from mimo.compose.inputs import encoder_feeds, ensure_index, text_spec
    from mimo.compose.model import MimoModel

    config = load_config(config_path, overrides)
    model = MimoModel(config, dist.get_rank())
    index, _ = ensure_index(config, shards=req.shards)
    reader = SampleReader(index, text_spec(config), encoder_feeds(config))
    norm = PixelNorm(encoder_feeds(config)[0].image)  # the reader's bytes -> the encoder's numbers
    vision, stage = model.part("vision").module, model.llm.module
    rows = {"<image>": config.encoders["vision"].rows_per_image}
    loss_sum = loss_tokens = 0.0
    generated = {}
    with torch.no_grad():
        for i in [e for e, entry in enumerate(index.entries) if not entry.bad][:samples]:
            read = reader.read(reader_sample(index, i))
            item, pixels = read.item, read.pixels["vision"]
            image = {"<image>": vision(norm(pixels.view(-1, 3, 32, 32)))} if len(pixels) else {}
            batch = pack([item], rows, 1, 1, False, reader.pad_id)
            logits = stage(batch, image_rows=image)
            loss_sum += float(stage.token_losses(logits, batch).sum())
            loss_tokens += float(batch.loss_mask.sum())
            if "json" not in index.entries[i].files:
                continue  # a caption: loss only
            start, _ = last_answer(item.target)
            tokens, out = list(item.tokens[:start]), []
            while len(out) < req.max_new_tokens and (not out or out[-1] != req.stop_id):
                batch = pack([PackItem(i, tokens, [False] * len(tokens), item.image_starts)], rows, 1, 1, False, reader.pad_id)
                out.append(int(stage(batch, image_rows=image)[-1, : config.llm.arch.vocab].argmax()))
                tokens.append(out[-1])
            generated[i] = out
    return {"loss": loss_sum / loss_tokens, "generated": generated}


def reader_sample(index, i: int):
    from mimo.data.plan import PlannedSample

    e = index.entries[i]
    return PlannedSample(i, e.tokens, e.images, e.image_starts)


def stops_some_not_all(generated, token: int) -> bool:
    ends = [token in g for g in generated]
    return any(ends) and not all(ends)


@pytest.mark.parametrize("layout", [[], NON_COLOCATED_PP], ids=["colocated-tp2-dp2-sp", "noncolocated-pp2"])
def test_generation_through_the_layout_matches_one_process_argmax(pools, data, tmp_path, layout):
    from mimo.compose.config import load_config
    from mimo.commands.eval import end_marker
    from mimo.data.text import load_tokenizer
    from mimo.compose.inputs import ensure_index

    config_path = write_config(tmp_path, data)
    varied = ["modules.language.arch.init_std=0.5"]  # an untrained model whose answers depend on the input
    layout, one = [*layout, *varied], [*ONE_PROCESS, *varied]
    config = load_config(config_path, layout)
    ensure_index(config, shards=config.eval.shards)
    marker, _ = end_marker(config, load_tokenizer(config.data.tokenizer))
    # stop at a token the untrained model does emit, so that some samples finish early
    probe = EvalRequest(None, config.eval.shards, 12, 3, marker, None)
    first = pools(1).run(reference_rank, config_path, one, probe, 12)[0]
    stop = next(t for g in first["generated"].values() for t in g if stops_some_not_all(first["generated"].values(), t))
    req = EvalRequest(None, config.eval.shards, 12, 3, marker, stop)
    ref = pools(1).run(reference_rank, config_path, one, req, 12)[0]
    assert any(len(g) < 3 for g in ref["generated"].values()) and any(len(g) == 3 for g in ref["generated"].values())
    assert len({tuple(g) for g in ref["generated"].values()}) > 2
    results = pools(4).run(eval_rank, config_path, layout, req)
    generated = {k: v for r in results for k, v in r["generated"].items()}
    assert generated == ref["generated"]
    assert len(generated) == sum(r["scored"] for r in results) >= 6
    assert abs(results[0]["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert all(r["loss"] == results[0]["loss"] for r in results)
    assert sum(r["captions"] for r in results) + len(generated) == 12


# ---------------------------------------------------------------- the command


@pytest.fixture
def mimo(tmp_path, monkeypatch, mimo_here):
    """``mimo(*args) -> Ran``: ``mimo ARGS`` from ``tmp_path`` (``mimo_here``: its command line
    in this process, its ranks fresh processes every command)."""
    monkeypatch.chdir(tmp_path)
    return mimo_here


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_eval_command_on_a_trained_checkpoint(data, tmp_path, mimo):
    two = ["world_size=2", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
           "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:2"]
    config = write_config(tmp_path, data, steps=2)
    trained = mimo("train", config, *two)
    assert trained.returncode == 0, trained.stderr[-2000:]
    proc = mimo("eval", config, *two, "--checkpoint", str(tmp_path / "run" / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = last_json(proc)
    assert result["ok"] and result["command"] == "eval" and result["checkpoint_step"] == 2
    assert result["checkpoint"].endswith("step-00000002")
    assert result["samples"] == 12 and result["scored"] + result["captions"] + result["read_failures"] == 12
    assert 0.0 <= result["exact_match"] <= 1.0 and result["matched"] == round(result["exact_match"] * result["scored"])
    assert result["loss"] > 0 and result["loss_tokens"] > 0
    # the same checkpoint at another layout: resharded on load (a warning says so), the same results
    moved = mimo("eval", config, *two, "modules.language.parallel.tp=1", "modules.language.parallel.dp=2",
                 "modules.language.parallel.sequence_parallel=false")
    assert moved.returncode == 0, moved.stderr[-2000:]
    assert "resharding it on load" in moved.stderr
    other = last_json(moved)
    assert abs(other["loss"] - result["loss"]) <= 1e-5 * result["loss"] and other["loss_tokens"] == result["loss_tokens"]
    assert other["matched"] == result["matched"] and other["scored"] == result["scored"]
    # no checkpoint at all, and no held-out shards: clear errors too
    none = mimo("eval", config, *two, f"train.checkpoint.dir={tmp_path / 'nothing'}")
    assert none.returncode == 2 and "no complete checkpoint" in last_json(none)["errors"][0]
    missing = mimo("eval", config, *two, "--shards", str(tmp_path / "nope-{0..1}.tar"))
    assert missing.returncode == 2 and "--shards: no file matches" in last_json(missing)["errors"][0]
    if torch.cuda.device_count() < 2:  # one GPU per rank, as mimo train: a clear error without them
        gpus = mimo("eval", config, *two, "--device", "cuda")
        assert gpus.returncode == 2 and "one rank per GPU" in last_json(gpus)["errors"][0]

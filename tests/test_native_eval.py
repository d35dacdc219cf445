"""`mimo eval` and `mimo generate` on a native-resolution Qwen3-VL config (configs/examples/qwen3-vl-moe.yaml,
tiny, on 2 ranks), against a one-process reference computed here, sample by sample: the tower on the
sample's own patches, the LLM on the sample alone, no bridges, no cache, every generation step the
whole sequence again, with Hugging Face Qwen3-VL's positions — the prompt's 3-D M-RoPE positions
(``get_rope_index``), and each generated token at ``its index + rope_deltas`` on all three axes
(``rope_deltas = max(prompt positions) + 1 - prompt length``). The reference runs in fp32 and fp64;
the layouts' logits must lie within the yardstick (``mimo.core.testing.Yardstick``) of the fp64 run.

* decode positions: ``rope_deltas`` of packed prompts of different lengths and images equal
  Hugging Face's ``get_rope_index`` deltas (a batch with padding), and differ from 0 for prompts
  with an image, so a decode step at the 1-D position (prompt length + k) would be caught;
* the evaluator (held-out loss, greedy tokens, per-step logits) with the cache and without it, at
  five 2-rank layouts (colocated tower dp2 + LLM tp2-SP; tower and LLM on a rank each; LLM dp2;
  LLM pp2; LLM cp2, where both runs are uncached), equals the reference: the same tokens, the loss
  at 1e-5, the logits within the yardstick (samples leaving the cache at different steps);
* ``mimo generate``'s ``Generator`` on a checkpoint: prompts with images of different sizes (and one
  without), with the cache and without, equal the reference token for token, logits within the
  yardstick;
* what cannot work is a clear error before any process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from mimo.core.testing import Yardstick

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 4
SAMPLES = 6
COLOCATED = []  # the fixture's own layout: vision dp2 and the LLM tp2 with SP, both on ranks 0:2
NON_COLOCATED = ["modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1", "modules.language.parallel.tp=1",
                 "modules.language.parallel.ranks=1:2", "modules.language.parallel.sequence_parallel=false"]
LLM_DP2 = ["modules.language.parallel.tp=1", "modules.language.parallel.dp=2",
           "modules.language.parallel.sequence_parallel=false"]
LLM_PP2 = ["modules.language.parallel.tp=1", "modules.language.parallel.pp=2",
           "modules.language.parallel.sequence_parallel=false"]
LLM_CP2 = ["modules.language.parallel.tp=1", "modules.language.parallel.cp=2",  # no cache under CP: both runs uncached
           "modules.language.parallel.sequence_parallel=false"]


# ---------------------------------------------------------------- the config


@pytest.fixture(scope="module")
def config_path(pools, tmp_path_factory, indexes_here) -> str:
    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index
    from mimo.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("native_eval")
    # the ranks start (and import what they will run) while the data is written here
    warming = threading.Thread(target=pools(2).run, args=(warm_rank,))
    warming.start()
    make_demo_data(str(root / "data"), train_samples=0, heldout_samples=0, shard_size=12, native_samples=12, seed=5)
    cfg = yaml.safe_load((ROOT / "configs" / "examples" / "qwen3-vl-moe.yaml").read_text())
    shards = str(root / "data" / "native-{000000..000000}.tar")
    cfg["world_size"] = 2
    cfg["modules"]["vision"]["parallel"] = {"tp": 1, "dp": 2, "ranks": "0:2"}
    cfg["modules"]["language"]["parallel"] = {"tp": 2, "ranks": "0:2", "sequence_parallel": True}
    cfg["modules"]["language"]["arch"]["init_std"] = 0.5  # an untrained model whose answers depend on the input
    cfg["data"].update(shards=shards, tokenizer=str(root / "data" / "tokenizer"), tokens_per_microbatch=400,
                       max_sample_tokens=200)
    cfg["eval"] = {"shards": shards, "samples": SAMPLES, "max_new_tokens": MAX_NEW}
    cfg["train"]["checkpoint"] = {"dir": str(root / "ckpt")}
    path = root / "qwen3-vl.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with indexes_here():
        ensure_index(load_config(str(path)), shards=shards)
    warming.join()
    return str(path)


def warm_rank() -> None:
    """What a rank imports first: the model, the evaluator, generation, the tokenizers' library."""
    from transformers import AutoTokenizer  # noqa: F401

    from mimo.compose.model import MimoModel  # noqa: F401
    from mimo.training.evaluation import Evaluator  # noqa: F401
    from mimo.training.generation import generate_rank  # noqa: F401


# ---------------------------------------------------------------- the one-process reference


def hf_positions(n: int, starts, rows, grids, merge: int) -> torch.Tensor:
    """``[3, n]`` positions of a sample's tokens as Hugging Face's ``get_rope_index`` lays them out
    (``mimo.data.positions.positions_3d``, which matches it, on the tokens' kinds: text / image)."""
    from mimo.data.positions import positions_3d

    kind = torch.zeros(n, dtype=torch.int64)
    for s, r in zip(starts, rows):
        kind[s : s + r] = 1
    return positions_3d(kind, [list(g) for g in grids], None, merge, 1, 2, None)


class Reference:
    """The config's model on one process (the weights every layout initialises to), in ``dtype``."""

    def __init__(self, config_path: str, dtype: torch.dtype):
        from mimo.commands.verify_train import one_process
        from mimo.compose.config import load_config
        from mimo.compose.inputs import encoder_feeds, text_spec
        from mimo.data.native_images import PatchNorm
        from mimo.encoders.model import build_encoder
        from mimo.llm.model import LLMStage
        from mimo.parallel.init import param_seed

        self.config = config = one_process(load_config(config_path))
        self.dtype, self.spec, self.feeds = dtype, text_spec(config), encoder_feeds(config)
        enc = config.encoders["vision"]
        self.placeholder, self.merge = enc.placeholder, enc.arch.spatial_merge
        self.tower = build_encoder(enc, config.llm.arch.hidden).to(dtype=dtype)
        self.tower.init_weights(param_seed(config.train.seed, "vision"))
        self.stage = LLMStage(config.llm.arch).to(dtype=dtype)
        self.stage.init_weights(param_seed(config.train.seed, config.llm_name))
        self.norm = PatchNorm(self.feeds[0].native)
        self.vocab = config.llm.arch.vocab

    def _forward(self, tokens, starts, rows, grids, image, positions_3T, target=None):
        from mimo.data.pack import PackItem, pack

        target = [False] * len(tokens) if target is None else list(target)
        item = PackItem(0, list(tokens), target, {self.placeholder: list(starts)}, image_rows={self.placeholder: list(rows)})
        batch = dataclasses.replace(pack([item], {self.placeholder: 0}, 1, 1, False, 0), positions_3d=positions_3T)
        return batch, self.stage(batch, image_rows=image)

    def image_rows(self, patches_u8: torch.Tensor, grids) -> dict:
        if not len(grids):
            return {}
        x = self.norm(patches_u8).to(self.dtype)
        return {self.placeholder: self.tower(x, torch.tensor([list(g) for g in grids], dtype=torch.int64))}

    def greedy(self, prompt, starts, rows, grids, image, max_new: int, stop: int | None) -> tuple[list[int], list]:
        """Greedy tokens and each step's full-vocabulary logits, the whole sequence every step;
        generated tokens at Hugging Face's cached positions: index + rope_deltas on every axis."""
        pos = hf_positions(len(prompt), starts, rows, grids, self.merge)
        delta = int(pos.max()) + 1 - len(prompt)  # get_rope_index's mrope_position_deltas
        tokens, out, logits = list(prompt), [], []
        with torch.no_grad():
            while len(out) < max_new and (not out or out[-1] != stop):
                new = (torch.arange(len(prompt), len(tokens)) + delta).expand(3, -1)
                _, all_TV = self._forward(tokens, starts, rows, grids, image, torch.cat([pos, new], 1))
                logits.append(all_TV[len(tokens) - 1, : self.vocab].double())
                out.append(int(logits[-1].argmax()))
                tokens.append(out[-1])
        return out, logits

    def evaluate(self, stop: int | None) -> dict:
        """The evaluator's numbers: loss over the first ``SAMPLES`` samples, each question's greedy answer."""
        from mimo.compose.inputs import ensure_index
        from mimo.data.pipeline import SampleReader
        from mimo.data.plan import PlannedSample
        from mimo.training.evaluation import last_answer

        index, _ = ensure_index(self.config, shards=self.config.eval.shards)
        reader = SampleReader(index, self.spec, self.feeds)
        loss_sum = loss_tokens = 0.0
        generated, logits = {}, {}
        p = self.placeholder
        for i in [e for e, entry in enumerate(index.entries) if not entry.bad][:SAMPLES]:
            e = index.entries[i]
            read = reader.read(PlannedSample(i, e.tokens, e.images, e.image_starts, e.image_rows, e.image_grids))
            item = read.item
            assert read.failure is None, read.failure
            starts, rows, grids = item.image_starts.get(p, []), item.image_rows.get(p, []), item.image_grids.get(p, [])
            with torch.no_grad():
                image = self.image_rows(read.pixels["vision"], grids)
                batch, all_TV = self._forward(item.tokens, starts, rows, grids, image,
                                              hf_positions(len(item.tokens), starts, rows, grids, self.merge), item.target)
                loss_sum += float(self.stage.token_losses(all_TV, batch).sum())
            loss_tokens += float(batch.loss_mask.sum())
            if "json" not in e.files:
                continue  # a caption: loss only
            start, _ = last_answer(item.target)
            generated[i], logits[i] = self.greedy(item.tokens[:start], starts, rows, grids, image, MAX_NEW, stop)
        return {"loss": loss_sum / loss_tokens, "generated": generated, "logits": logits}

    def generate(self, prompt, max_new: int) -> tuple[list[int], list]:
        """A ``mimo.training.generation.EncodedPrompt`` completed (no stop token: ``max_new`` tokens)."""
        from mimo.data.native_images import patch_bytes
        from mimo.data.shards import decode_image

        p = self.placeholder
        files = prompt.image_files.get(p, [])
        patches = [patch_bytes(decode_image(prompt.images[f]), self.feeds[0].native)[0] for f in files]
        grids = prompt.image_grids.get(p, [])
        with torch.no_grad():
            image = self.image_rows(torch.cat(patches) if patches else None, grids)
        return self.greedy(prompt.tokens, prompt.image_starts.get(p, []), prompt.image_rows.get(p, []), grids, image,
                           max_new, None)


@contextlib.contextmanager
def one_thread():
    """The reference's small products on one thread, as the ranks run theirs (many threads on a
    busy machine make torch's CPU grouped products of the experts orders of magnitude slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def references(config_path):
    with one_thread():
        return {dtype: Reference(config_path, dtype) for dtype in (torch.float32, torch.float64)}


def yardstick_logits(got: dict, ref32: dict, ref64: dict) -> Yardstick:
    """Every step's logits row of every sample, against the fp64 reference's (module doc)."""
    ys = Yardstick(1e-5)
    for i, rows in ref64.items():
        assert len(got[i]) == len(ref32[i]) == len(rows), i
        for t, row in enumerate(rows):
            ys.check(f"{i}.{t}", got[i][t], ref32[i][t], row)
    return ys


# ---------------------------------------------------------------- decode positions: Hugging Face's rule


def hf_rope_deltas(prompts: list[dict], merge: int) -> list[int]:
    """Hugging Face Qwen3-VL's ``get_rope_index`` on the prompts as one left-padded batch."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    longest = max(p["n"] for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    kinds, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    grids = []
    for b, p in enumerate(prompts):
        pad = longest - p["n"]
        mask[b, pad:] = 1
        ids[b, pad:] = 7
        for s, r, g in zip(p["starts"], p["rows"], p["grids"]):
            kinds[b, pad + s : pad + s + r] = 1
            grids.append(g)
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)))
    fake.get_vision_position_ids = lambda *a, **k: Qwen3VLModel.get_vision_position_ids(fake, *a, **k)
    _, deltas = Qwen3VLModel.get_rope_index(fake, ids, kinds, torch.tensor(grids) if grids else None, attention_mask=mask)
    return deltas.flatten().tolist()


def test_decode_positions_are_hugging_faces_rope_deltas():
    from mimo.data.pack import PackItem, pack
    from mimo.llm.cache import decode_pack
    from mimo.training.evaluation import rope_deltas

    merge = 2
    # prompts of different lengths: images of several grids (rows = t*h*w / merge^2), none, two,
    # one ending the prompt (its advance max(h, w)/merge, not its rows, sets the next position)
    prompts = [dict(n=30, starts=[3], rows=[12], grids=[[1, 8, 6]]),
               dict(n=9, starts=[], rows=[], grids=[]),
               dict(n=50, starts=[1, 20], rows=[16, 6], grids=[[1, 8, 8], [1, 2, 12]]),
               dict(n=14, starts=[4], rows=[10], grids=[[1, 10, 4]])]
    items = [PackItem(k, [7] * p["n"], [False] * p["n"], {"<image>": p["starts"]}, image_rows={"<image>": p["rows"]},
                      image_grids={"<image>": p["grids"]}) for k, p in enumerate(prompts)]
    whole = pack(items, {"<image>": 0}, 2, 1, True, 0, {"<image>": merge})  # SP padding: a trailing segment
    lengths = [p["n"] for p in prompts]
    ids = [10, 11, 12, 13]
    got = rope_deltas(whole, lengths, ids)
    want = hf_rope_deltas(prompts, merge)
    assert [got[i] for i in ids] == want
    assert want[1] == 0 and all(d < 0 for k, d in enumerate(want) if k != 1)  # an image makes 1-D positions wrong
    # a decode step: the token at sequence index c sits at c + delta on every axis
    c = [n + 2 for n in lengths]
    b = decode_pack([5, 6, 7, 8], [c[k] + got[i] for k, i in enumerate(ids)], ids, 2, True, 0, mrope=True)
    assert b.positions_3d.shape == (3, 4) and (b.positions_3d == b.positions).all()
    assert b.positions.tolist() == [c[k] + want[k] for k in range(4)]
    assert decode_pack([5], [3], [0], 1, False, 0).positions_3d is None
    assert rope_deltas(pack(items, {"<image>": 0}, 1, 1, False, 0), lengths, ids) == dict.fromkeys(ids, 0)  # a 1-D LLM


# ---------------------------------------------------------------- the evaluator through layouts


def eval_case(config_path: str, overrides: list[str], stop: int | None) -> dict:
    """One rank: the evaluator without and with the cache; each sample's logits rows recorded
    where its token was picked (the last stage's TP rank 0)."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.data.text import load_tokenizer
    from mimo.training import evaluation

    config = load_config(config_path, overrides)
    marker, _ = evaluation.end_marker(config, load_tokenizer(config.data.tokenizer))
    req = evaluation.EvalRequest(None, config.eval.shards, config.eval.samples, config.eval.max_new_tokens, marker, stop)
    rows: dict[int, list] = {}
    scorer = evaluation._Scorer

    class Recording(scorer):  # the evaluator's scorer, keeping the logits it picks from
        def generate(self, mb):
            def pick(logits_NV, samples):
                for n, i in enumerate(samples):
                    rows.setdefault(mb.plan.samples[i].id, []).append(logits_NV[n].double().cpu())
                return evaluation.greedy(logits_NV, samples)

            self.pick = pick
            return super().generate(mb)

    evaluation._Scorer = Recording
    evaluator = evaluation.Evaluator(config, MimoModel(config, dist.get_rank()), req)
    out = {"cache_on": evaluator.cache}
    try:
        for cached in (False, True):
            rows.clear()
            evaluator.cache = cached and out["cache_on"]
            out[cached] = {**evaluator.run(), "logits": dict(rows)}
        return out
    finally:
        evaluation._Scorer = scorer
        evaluator.close()


def stopped(ref: dict, stop: int) -> dict:
    """The reference's greedy answers as they are with ``stop`` ending them: cut after its first
    occurrence (greedy tokens do not depend on where they stop)."""
    cut = {i: g.index(stop) + 1 if stop in g else len(g) for i, g in ref["generated"].items()}
    return {"loss": ref["loss"], "generated": {i: g[: cut[i]] for i, g in ref["generated"].items()},
            "logits": {i: rows[: cut[i]] for i, rows in ref["logits"].items()}}


@pytest.fixture(scope="module")
def eval_reference(references) -> tuple[int, dict, dict]:
    """(stop token, fp32 reference, fp64 reference): a stop token the answers emit for some
    samples only, so that samples leave the cache at different steps."""
    with one_thread():
        ref32, ref64 = (references[d].evaluate(None) for d in (torch.float32, torch.float64))
    assert ref64["generated"] == ref32["generated"]
    runs = list(ref32["generated"].values())
    stop = next(t for g in runs for t in g if 0 < sum(t in h for h in runs) < len(runs))
    return stop, stopped(ref32, stop), stopped(ref64, stop)


@pytest.mark.parametrize("layout", [COLOCATED, NON_COLOCATED, LLM_DP2, LLM_PP2, LLM_CP2],
                         ids=["tp2-sp", "noncolocated", "llm-dp2", "llm-pp2", "llm-cp2"])
def test_eval_equals_the_one_process_reference_with_and_without_cache(pools, config_path, eval_reference, layout):
    stop_token, ref32, ref64 = eval_reference
    lengths = {len(g) for g in ref32["generated"].values()}
    assert len(ref32["generated"]) >= 3 and min(lengths) < MAX_NEW == max(lengths)
    results = pools(2).run(eval_case, config_path, layout, stop_token)
    assert all(r["cache_on"] == (layout is not LLM_CP2) for r in results)
    for cached in (False, True):
        generated = {k: v for r in results for k, v in r[cached]["generated"].items()}
        assert generated == ref32["generated"], f"cache={cached}"
        for r in results:
            assert abs(r[cached]["loss"] - ref32["loss"]) <= 1e-5 * ref32["loss"], (cached, r[cached]["loss"], ref32["loss"])
        logits = {k: v for r in results for k, v in r[cached]["logits"].items()}
        yardstick_logits(logits, ref32["logits"], ref64["logits"]).assert_ok(f"logits, cache={cached}")
    for key in ("loss", "matched", "scored", "captions", "generated_tokens"):
        assert results[0][True][key] == results[0][False][key], key


# ---------------------------------------------------------------- mimo generate


def checkpoint_rank(config_path: str) -> str:
    """The config's initial weights as a checkpoint (step 0) in train.checkpoint.dir."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import save_checkpoint

    config = load_config(config_path)
    return save_checkpoint(MimoModel(config, dist.get_rank()), {}, 0, config.train.checkpoint.dir)


def write_image(path: Path, height: int, width: int, seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(pools, config_path) -> str:
    return pools(2).run(checkpoint_rank, config_path)[0]


def test_generate_equals_the_reference_with_and_without_cache(pools, config_path, references, checkpoint, tmp_path):
    from mimo.training.generation import Generator

    wide, tall = write_image(tmp_path / "wide.png", 20, 60, 1), write_image(tmp_path / "tall.png", 48, 24, 2)
    prompts = [("What colour is the shape?", [wide]), ("Where is the shape?", [tall]), ("Say something.", []),
               ("<image> and <image>: which is larger?", [tall, wide])]
    runs = {}
    for cache in ("true", "false"):
        with Generator(config_path, [f"eval.cache={cache}"], pool=pools(2)) as g:
            encoded = [g.encode(text, images) for text, images in prompts]
            runs[cache] = g.generate_many(prompts, max_new_tokens=MAX_NEW, logits=True)
    assert len({len(p.tokens) for p in encoded}) == 4  # prompts of different lengths
    grids = encoded[3].image_grids["<image>"]  # each image cut at its own size: its own grid and rows
    assert grids == encoded[1].image_grids["<image>"] + encoded[0].image_grids["<image>"] and grids[0] != grids[1]
    assert encoded[3].image_rows["<image>"] == [t * h * w // 4 for t, h, w in grids]
    with one_thread():
        ref = {d: [references[d].generate(p, MAX_NEW) for p in encoded] for d in (torch.float32, torch.float64)}
    for cache, out in runs.items():
        assert [o.tokens for o in out] == [t for t, _ in ref[torch.float32]], f"cache={cache}"
        got = {k: list(o.logits) for k, o in enumerate(out)}
        yardstick_logits(got, {k: r for k, (_, r) in enumerate(ref[torch.float32])},
                         {k: r for k, (_, r) in enumerate(ref[torch.float64])}).assert_ok(f"generate, cache={cache}")
    assert len({tuple(o.tokens) for o in runs["true"]}) > 1  # the answers depend on the prompt


# ---------------------------------------------------------------- what cannot work: clear errors


def errors_of(capsys, *args: str) -> list[str]:
    """``mimo ARGS`` in this process: its errors (exit status 2: refused before any process started)."""
    import json

    from mimo.commands.cli import main

    code = main(list(args))
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 2 and not result["ok"] and result["command"] == args[0], result
    return result["errors"]


def test_what_cannot_work_is_a_clear_error(config_path, checkpoint, capsys, tmp_path):
    cfg = yaml.safe_load(Path(config_path).read_text())
    # a second native tower of another spatial merge: one M-RoPE pack cannot place both
    sketch = {**cfg["modules"]["vision"], "placeholder": "<sketch>",
              "arch": {**cfg["modules"]["vision"]["arch"], "spatial_merge": 1}}
    sketch.pop("video", None)  # (one tower at most takes videos)
    cfg["modules"] = {"vision": cfg["modules"]["vision"], "sketch": sketch, "language": cfg["modules"]["language"]}
    two = tmp_path / "two_towers.yaml"
    two.write_text(yaml.safe_dump(cfg, sort_keys=False))
    for command in (["eval", str(two)], ["generate", str(two), "--prompt", "hi"]):
        (error,) = errors_of(capsys, *command)
        assert "different spatial merges" in error and "modules.sketch.arch.spatial_merge=1" in error, error
    # an image the native tower cannot cut: named, before any process starts
    thin = write_image(tmp_path / "thin.png", 2, 600, 3)
    (error,) = errors_of(capsys, "generate", config_path, "--prompt", "hi", "--image", thin)
    assert "thin.png" in error and "aspect ratio" in error, error
    wide = write_image(tmp_path / "wide.png", 20, 60, 1)
    (error,) = errors_of(capsys, "generate", config_path, "--prompt", "<image> and <image>?", "--image", wide)
    assert "do not fit the config's placeholders" in error and "1 image(s)" in error, error

"""`mimo generate`: on a briefly trained demo checkpoint, held-out questions (with their images,
read back from the shard) get exactly the evaluator's greedy tokens for those samples, at the
demo's 4-rank layout, at another one (resharded on load) and, through the command, in one
process; sampling is reproducible by its seed; bad input is a clear error, not a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mimo.commands.cli import main
from mimo.commands.eval import eval_rank, request_for
from mimo.compose.config import load_config
from mimo.compose.inputs import ensure_index
from mimo.core.errors import DataError
from mimo.training.generation import Generator, prompt_text
from test_eval import NON_COLOCATED_PP, ONE_PROCESS  # the layouts eval is checked at

STEPS = 2


def train_rank(config_path: str, steps: int) -> float:
    """A few training steps of the config at its layout, and the checkpoint in train.checkpoint.dir."""
    import torch.distributed as dist

    from mimo.training.checkpoint import save_checkpoint
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config = load_config(config_path)
    run = build_run(config, dist.get_rank())
    try:
        for step in range(1, steps + 1):
            loss = train_step(run.model, run.pipeline, step, run.optimizers, run.policy).loss
        save_checkpoint(run.model, run.optimizers, steps, config.train.checkpoint.dir)
    finally:
        run.close()
    return loss


def questions(config, ids: list[int], folder: Path) -> dict[int, tuple[str, list[str]]]:
    """Each held-out sample's question and its image files (written to ``folder``), from the shard."""
    from mimo.data.shards import SampleLocation, image_keys, read_files

    index, _ = ensure_index(config, shards=config.eval.shards)
    out = {}
    for i in ids:
        e = index.entries[i]
        files = read_files(index.shards[e.shard], SampleLocation(e.key, dict(e.files)))
        turns = json.loads(files["json"])["conversations"]
        paths = []
        for ext in image_keys(files):
            paths.append(str(folder / f"{e.key}.{ext}"))
            Path(paths[-1]).write_bytes(files[ext])
        out[i] = turns[0]["value"], paths
    return out


@pytest.fixture(scope="module")
def demo(pools, write_demo_config, tmp_path_factory):
    """The demo config trained a few steps on 4 ranks, the evaluator's greedy tokens of its first
    held-out samples there, and those samples' questions (every other one without its
    placeholders: generate puts them in front, as the samples have them)."""
    root = tmp_path_factory.mktemp("generate")

    def edit(cfg):
        cfg["data"]["shards"] = cfg["data"]["shards"].replace("000001", "000000")  # one shard: indexed inline, fast
        cfg["eval"].update(samples=18, max_new_tokens=5)  # seed 4: among them a two-image and a text-only question
        cfg["modules"]["language"]["arch"]["init_std"] = 0.5  # answers that depend on the input after a few steps

    path = write_demo_config(root, seed=4, edit=edit)
    config = load_config(path)
    pools(4).run(train_rank, path, STEPS)
    req = request_for(config, config.train.checkpoint.dir, None)
    ensure_index(config, shards=req.shards)  # once, before the ranks read it (as mimo eval does)
    greedy = {k: v for r in pools(4).run(eval_rank, path, [], req) for k, v in r["generated"].items()}
    asked = questions(config, sorted(greedy), root)
    prompts = {i: (q.replace("<image>\n", "") if n % 2 else q, images) for n, (i, (q, images)) in enumerate(asked.items())}
    assert len({tuple(g) for g in greedy.values()}) > 1, greedy  # answers that depend on the input
    assert {len(images) for _, images in prompts.values()} == {0, 1, 2}
    return {"path": path, "root": root, "greedy": greedy, "prompts": prompts, "checkpoint": req.checkpoint}


def test_greedy_generation_is_the_evaluators_at_two_layouts(pools, demo):
    ids = sorted(demo["prompts"])
    with Generator(demo["path"], pool=pools(4)) as g:  # the config's layout, its newest checkpoint
        got = g.generate_many([demo["prompts"][i] for i in ids], logits=True)
        assert g.checkpoint == demo["checkpoint"] and g.checkpoint_step == STEPS
    assert {i: out.tokens for i, out in zip(ids, got)} == demo["greedy"]
    for out in got:  # row t of the logits chose token t
        assert out.logits.shape == (len(out.tokens), 261) and out.logits.argmax(-1).tolist() == out.tokens
    # the checkpoint folder as the source (its recorded config) at another layout: resharded on load
    with Generator(demo["checkpoint"], NON_COLOCATED_PP, pool=pools(4)) as g:
        moved = g.generate_many([demo["prompts"][i] for i in ids])
    assert {i: out.tokens for i, out in zip(ids, moved)} == demo["greedy"]
    assert [out.text for out in moved] == [out.text for out in got]


def test_sampling_is_reproducible_by_its_seed(pools, demo):
    prompts = list(demo["prompts"].values())
    with Generator(demo["path"], pool=pools(4)) as g:
        first = [o.tokens for o in g.generate_many(prompts, temperature=1.5, seed=3)]
        again = [o.tokens for o in g.generate_many(prompts, temperature=1.5, seed=3)]
        other = [o.tokens for o in g.generate_many(prompts, temperature=1.5, seed=4)]
        top1 = [o.tokens for o in g.generate_many(prompts, temperature=1.0, top_k=1, seed=3)]
    assert first == again and first != other
    assert top1 == [demo["greedy"][i] for i in demo["prompts"]]  # only the most likely token: greedy


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_command_in_one_process(demo, capsys, tmp_path):
    i, (question, images) = next((i, p) for i, p in demo["prompts"].items() if p[1])
    image_args = [a for path in images for a in ("--image", path)]
    logits = tmp_path / "logits.npy"
    code = main(["generate", demo["path"], "--prompt", question, *image_args, *ONE_PROCESS, "--device", "cpu",
                 "--logits", str(logits)])
    result = last_json(capsys)
    assert code == 0 and result["ok"] and result["command"] == "generate"
    assert result["tokens"] == demo["greedy"][i] and result["checkpoint_step"] == STEPS
    assert np.load(logits).shape == (len(result["tokens"]), 261)
    assert np.load(logits).argmax(-1).tolist() == result["tokens"]


def error_of(capsys, *args: str) -> str:
    code = main(["generate", *args])
    result = last_json(capsys)
    assert code == 2 and not result["ok"] and result["command"] == "generate"
    return result["errors"][0]


def test_bad_input_is_a_clear_error(demo, capsys, tmp_path):
    path = demo["path"]
    _, (question, images) = next((i, p) for i, p in demo["prompts"].items() if len(p[1]) == 1)
    assert "no such file" in error_of(capsys, path, "--prompt", "hi", "--image", str(tmp_path / "nope.png"))
    (tmp_path / "text.png").write_text("not an image")
    assert "not a readable image" in error_of(capsys, path, "--prompt", "hi", "--image", str(tmp_path / "text.png"))
    assert "no complete checkpoint" in error_of(capsys, path, "--prompt", "hi", f"train.checkpoint.dir={tmp_path}")
    assert "no such config file or checkpoint" in error_of(capsys, str(tmp_path / "none.yaml"), "--prompt", "hi")
    assert "do not fit the config's placeholders" in error_of(capsys, path, "--prompt", "<image>\nWhat colour?")  # no image
    two = error_of(capsys, path, "--prompt", "<image>\nWhat colour?", "--image", images[0], "--image", images[0])
    assert "do not fit" in two and "2 image(s)" in two
    assert ".pt or .npy" in error_of(capsys, path, "--prompt", "hi", "--logits", str(tmp_path / "x.txt"))
    assert "temperature must be >= 0" in error_of(capsys, path, "--prompt", "hi", "--temperature", "-1")
    with pytest.raises(DataError, match="no image encoder"):
        prompt_text("<image>\nWhat colour?", 0, [])
    with pytest.raises(DataError, match="takes no images"):
        prompt_text("What colour?", 1, [])
    assert prompt_text("What?", 2, ["<image>", "<sketch>"]) == "<image>\n<sketch>\n<image>\n<sketch>\nWhat?"
    assert prompt_text("<image> What?", 1, ["<image>"]) == "<image> What?"

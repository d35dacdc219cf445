"""Checkpoints that load at another layout (``mimo.training.reshard``).

Train N steps at layout A with a checkpoint at N, and on; load the checkpoint at layout B and
train the same steps: the losses equal the run that stayed at A (fp32, 1e-5 relative per step),
for every layout change of the issue (tests/configs/cp.yaml: Mamba-2, attention, GDN, MLP,
MoE with expert bias and the per-sample aux loss, a ViT). Weights, AdamW moments, step counts,
expert biases move; a mutation (moments not moved) fails. Plus: a wrong architecture is a clear
error, and ``mimo convert-checkpoint`` writes the checkpoint at the new layout.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

LANG = "modules.language.parallel."
VIS = "modules.vision.parallel."
N, TOTAL = 2, 4  # checkpoint after step N, compare steps N+1..TOTAL

# (A, B): overrides of tests/configs/cp.yaml (vision dp4, LLM cp2 dp2, world 4)
CASES = {
    "vision dp4 + llm tp2 dp2 -> vision tp2 dp2 + llm pp2 dp2": (
        [LANG + "cp=1", LANG + "tp=2", LANG + "dp=2"],
        [VIS + "tp=2", VIS + "dp=2", LANG + "cp=1", LANG + "pp=2", LANG + "dp=2"]),
    "colocated -> non-colocated (vision rank 0, llm dp3 on 1:4)": (
        [],
        [VIS + "dp=1", VIS + "ranks=0:1", LANG + "cp=1", LANG + "dp=3", LANG + "ranks=1:4"]),
    "llm tp2 SP -> tp1 pp2, SP off": (
        [LANG + "cp=1", LANG + "tp=2", LANG + "dp=2", LANG + "sequence_parallel=true"],
        [LANG + "cp=1", LANG + "pp=2", LANG + "dp=2"]),
    "ep2 (tp2 etp2) -> ep4 (etp1)": (
        ["modules.language.arch.moe.experts=8", LANG + "cp=1", LANG + "tp=2", LANG + "dp=2", LANG + "ep=2"],
        ["modules.language.arch.moe.experts=8", LANG + "cp=1", LANG + "dp=4", LANG + "ep=4", LANG + "etp=1"]),
    "distributed optimizer dp4 -> dp2 (tp2)": (
        ["train.distributed_optimizer=true", LANG + "cp=1", LANG + "dp=4"],
        ["train.distributed_optimizer=true", LANG + "cp=1", LANG + "tp=2", LANG + "dp=2"]),
    "distributed optimizer on -> off, gtp2 -> tp2": (
        ["train.distributed_optimizer=true", LANG + "cp=1", LANG + "dp=2", LANG + "gtp=2"],
        [LANG + "cp=1", LANG + "tp=2", LANG + "dp=2"]),
    "plain AdamW tp2 dp2 -> distributed optimizer dp4, experts over edp": (
        ["modules.language.arch.moe.experts=8", LANG + "cp=1", LANG + "tp=2", LANG + "dp=2"],
        ["modules.language.arch.moe.experts=8", "train.distributed_optimizer=true", LANG + "cp=1", LANG + "dp=4",
         LANG + "ep=2", LANG + "etp=1"]),
    "cp2 -> cp1": (
        [],
        [LANG + "cp=1", LANG + "dp=4"]),
}


@pytest.fixture(scope="module")
def pools(session_pools):
    """This module's worker pools are the session's (``session_pools``): started once for the
    modules that share them, not once per module."""
    return session_pools


@pytest.fixture(scope="module")
def cp_config(tmp_path_factory, write_moe_configs, indexes_here):
    with indexes_here():
        return write_moe_configs(tmp_path_factory.mktemp("reshard"), train_samples=160, seed=5, names=("cp",))["cp"]


def _steps(run, numbers):
    from mimo.training.step import train_step

    return [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss for s in numbers]


def _train_and_save(config_path: str, overrides: list[str], directory: str) -> list[float]:
    """Rank function: TOTAL steps at one layout, a checkpoint after step N."""
    from mimo.compose.config import load_config
    from mimo.training.checkpoint import save_checkpoint
    from mimo.training.run import build_run

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    losses = _steps(run, range(1, N + 1))
    save_checkpoint(run.model, run.optimizers, N, directory)
    losses += _steps(run, range(N + 1, TOTAL + 1))
    run.close()
    return losses


def _resume(config_path: str, overrides: list[str], path: str, mutate: bool = False) -> list[float]:
    """Rank function: load ``path`` at this layout, train steps N+1..TOTAL. ``mutate``: the
    moments are zeroed after loading (what a loader that drops them would do)."""
    from mimo.compose.config import load_config
    from mimo.training.checkpoint import load_checkpoint
    from mimo.training.run import build_run

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    load_checkpoint(run.model, path, run.optimizers)
    if mutate:
        for opt in run.optimizers.values():
            for state in opt.state.values():  # (views of the optimizer's buffers)
                state["exp_avg"].zero_()
    losses = _steps(run, range(N + 1, TOTAL + 1))
    run.close()
    return losses


def _world(overrides: list[str]) -> int:
    return next((int(o.split("=")[1]) for o in overrides if o.startswith("world_size=")), 4)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def trained(pools, cp_config, tmp_path_factory):
    """``trained(a) -> (losses, path)``: ``_train_and_save`` at layout ``a`` (its TOTAL losses and
    its step-N checkpoint), run once for the module per layout: the tests that start from the
    same layout share it (they only read the checkpoint)."""
    made = {}

    def get(a: list[str]) -> tuple[list[float], str]:
        if tuple(a) not in made:
            directory = str(tmp_path_factory.mktemp("trained"))
            losses = pools(_world(a)).run(_train_and_save, cp_config, a, directory)[0]
            made[tuple(a)] = losses, os.path.join(directory, f"step-{N:08d}")
        return made[tuple(a)]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_resume_at_another_layout_equals_staying(pools, cp_config, trained, name):
    a, b = CASES[name]
    stayed, path = trained(a)
    moved = pools(_world(b)).run(_resume, cp_config, b, path)[0]
    worst = max(_rel(x, y) for x, y in zip(moved, stayed[N:]))
    assert worst < 1e-5, (name, moved, stayed[N:])
    if name == "llm tp2 SP -> tp1 pp2, SP off":  # the mutation: moments not carried over fail it
        dropped = pools(_world(b)).run(_resume, cp_config, b, path, True)[0]
        assert max(_rel(x, y) for x, y in zip(dropped, stayed[N:])) > 1e-4


@pytest.fixture
def cli(tmp_path, monkeypatch, mimo_here):
    """``cli(*args) -> (ran, last JSON line)``: ``mimo ARGS`` from ``tmp_path`` (``mimo_here``:
    its command line in this process, its ranks fresh processes every command)."""
    import json

    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple:
        proc = mimo_here(*args)
        lines = proc.stdout.strip().splitlines()
        return proc, (json.loads(lines[-1]) if lines else None)

    return run


def _losses(run) -> dict[int, float]:
    from mimo.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(run, "metrics.jsonl"))}


def test_mimo_train_resumes_and_convert_checkpoint_rewrites_at_another_layout(pools, cp_config, tmp_path, cli, lend_pools):
    """``mimo train`` at layout A (3 steps, a checkpoint at 2); at layout B (the LLM tp2 x pp2, the
    vision tp2 dp2): ``mimo train --resume-from A/step-2`` warns and goes on as A did;
    ``mimo convert-checkpoint`` writes step 2 at B, which then resumes without resharding, the
    same; a checkpoint of another model is a clear error, not a traceback. The reference run A
    and the conversion run their ranks on the session's 4-rank pool (``lend_pools``); the two
    runs that resume (from A's checkpoint, from the converted one) start fresh ranks, as from a
    shell: only the checkpoint carries A on."""
    from mimo.training.checkpoint import layout_of, read_meta
    from mimo.compose.config import load_config

    steps = ["train.steps=3", "train.checkpoint.every=2"]
    b = [VIS + "tp=2", VIS + "dp=2", LANG + "cp=1", LANG + "tp=2", LANG + "pp=2", LANG + "dp=1"]
    a_run, b_run, c_run = (str(tmp_path / n) for n in ("a", "b", "c"))
    with lend_pools(pools):
        proc, _ = cli("train", cp_config, *steps, f"train.checkpoint.dir={a_run}/ckpt", "--run-dir", a_run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stayed = _losses(a_run)
    step2 = os.path.join(a_run, "ckpt", "step-00000002")

    proc, _ = cli("train", cp_config, *steps, *b, f"train.checkpoint.dir={b_run}/ckpt", "--run-dir", b_run,
                  "--resume-from", step2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharding it on load" in proc.stderr and "will not reproduce" not in proc.stderr
    moved = _losses(b_run)
    assert sorted(moved) == [3] and _rel(moved[3], stayed[3]) < 1e-5, (moved, stayed)

    out = str(tmp_path / "converted")
    with lend_pools(pools):
        proc, result = cli("convert-checkpoint", step2, "--config", cp_config, *b, "--out", out)
    assert proc.returncode == 0 and result["ok"] and result["step"] == 2, proc.stderr[-3000:]
    converted = os.path.join(out, "step-00000002")
    assert read_meta(converted)["layout"] == layout_of(load_config(cp_config, b))
    proc, _ = cli("train", cp_config, *steps, *b, f"train.checkpoint.dir={c_run}/ckpt", "--run-dir", c_run,
                  "--resume-from", converted)
    assert proc.returncode == 0 and "resharding" not in proc.stderr, proc.stderr[-3000:]
    again = _losses(c_run)
    assert sorted(again) == [3] and _rel(again[3], stayed[3]) < 1e-5, (again, stayed)

    # converting onto itself, and into a model with fewer layers: clear errors
    proc, result = cli("convert-checkpoint", step2, "--config", cp_config, *b, "--out", out)
    assert proc.returncode == 2 and "already holds" in result["errors"][0]
    proc, result = cli("convert-checkpoint", step2, "--config", cp_config, "modules.language.arch.pattern=M*G-E",
                       "--out", str(tmp_path / "fewer"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "another model" in result["errors"][0], proc.stderr[-3000:]


def _load_error(config_path: str, overrides: list[str], path: str) -> str:
    """Rank function: the error loading ``path`` into the model of ``overrides`` ("" if none)."""
    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import load_checkpoint

    model = MimoModel(load_config(config_path, overrides), dist.get_rank())
    try:
        load_checkpoint(model, path, rng=False)
    except Exception as e:  # noqa: BLE001 (the message is the result)
        return f"{type(e).__name__}: {e}"
    return ""


def test_resharding_into_another_model_is_a_clear_error(pools, cp_config, trained):
    """Fewer layers (every tensor of the smaller model is there: only the world-wide check sees
    the rest unread), another expert count (shapes differ): CheckpointErrors naming the tensor."""
    _, path = trained([])
    moved = [LANG + "cp=1", LANG + "dp=4"]
    fewer = pools(4).run(_load_error, cp_config, [*moved, "modules.language.arch.pattern=M*G-E"], path)
    assert all(e.startswith("CheckpointError") and "does not have" in e and "layers.5." in e for e in fewer), fewer
    experts = pools(4).run(_load_error, cp_config, [*moved, "modules.language.arch.moe.experts=4"], path)
    assert all(e.startswith("CheckpointError") and "another architecture" in e for e in experts if e), experts
    assert any(experts)

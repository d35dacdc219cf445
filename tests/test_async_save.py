"""Asynchronous checkpoint saves (train.checkpoint.async_save; real processes, gloo, CPU): the
save returns before its files are written and training goes on meanwhile; the files are those
a synchronous save writes of the same state, and a run resumed from them continues bit for bit;
the next save waits for the previous one; a rank whose write fails, or that never finishes, is
a clear error on every rank. (kill -9 during an asynchronous save: tests/test_train_loop.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from mimo.core.errors import CheckpointError
from mimo.training.checkpoint import validate_checkpoint


def _async_case(config_path: str, overrides: list[str], root: str) -> dict:
    """Rank function: 4 steps straight; 2 steps, a synchronous save and an asynchronous one of
    step 2 (its writer held at a gate before writing), step 3 trained meanwhile, a save of step
    3 that must wait for step 2's; a fresh run resumed from the asynchronous step 2 for steps
    3..4; then a save whose write fails on rank 2."""
    import threading

    import torch.distributed as dist

    import mimo.training.async_save as async_save
    from mimo.compose.config import load_config
    from mimo.training.checkpoint import load_checkpoint, save_checkpoint
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config, rank = load_config(config_path, overrides), dist.get_rank()

    def steps(run, numbers):
        return [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss for s in numbers]

    whole = build_run(config, rank)
    straight = steps(whole, range(1, 5))
    run = build_run(config, rank)
    head = steps(run, range(1, 3))
    save_checkpoint(run.model, run.optimizers, 2, os.path.join(root, "sync"))

    saver = async_save.CheckpointSaver(os.path.join(root, "async"), async_save=True, timeout_s=60)
    gate, waiting = threading.Event(), threading.Event()
    real_write, real_wait = async_save._write_files, saver.wait

    def held_write(files, tmp):  # the writer starts only once the gate opens
        gate.wait()
        return real_write(files, tmp)

    def wait():  # the gate opens once the next save waits for this one
        waiting.set()
        real_wait()

    async_save._write_files, saver.wait = held_write, wait
    try:
        path = saver.save(run.model, run.optimizers, 2)
        own_rng = os.path.join(path + ".tmp", f"rng-rank{rank:05d}.safetensors")
        returned_early = not os.path.exists(path) and not os.path.exists(own_rng)
        meanwhile = steps(run, [3])  # changes every weight the snapshot copied
        threading.Thread(target=lambda: (waiting.wait(), gate.set()), daemon=True).start()
        saver.save(run.model, run.optimizers, 3)
        step2_committed_first = os.path.isfile(os.path.join(path, "meta.json"))
    finally:
        async_save._write_files, saver.wait = real_write, real_wait
        gate.set()
    saver.wait()

    resumed = build_run(config, rank)
    load_checkpoint(resumed.model, path, resumed.optimizers)
    tail = steps(resumed, range(3, 5))

    def fail():
        raise RuntimeError("disk full (injected)")

    saver.save(run.model, run.optimizers, 4, after_write=fail if rank == 2 else None)
    try:
        saver.wait()
        failure = ""
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    for r in (whole, run, resumed):
        r.close()
    return {"straight": straight, "resumed": head + tail, "meanwhile": meanwhile, "returned_early": returned_early,
            "step2_committed_first": step2_committed_first, "failure": failure, "path": path}


def _files(path: str) -> dict[str, tuple[dict, dict]]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out[name] = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "distributed"])
def test_async_save_writes_what_a_sync_save_writes_and_resumes_exactly(pools, write_demo_config, tmp_path, optimizer):
    config = write_demo_config(tmp_path, seed=3)
    overrides = ["train.distributed_optimizer=true"] if optimizer == "distributed" else []
    results = pools(4).run(_async_case, config, overrides, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert r["returned_early"], rank  # the save returned before any file of it was written
        assert r["step2_committed_first"], rank  # the save of step 3 waited for step 2's
        assert r["meanwhile"] == r["straight"][2:3], rank  # training went on during the write
        assert r["resumed"] == r["straight"], rank  # bit for bit from the asynchronous checkpoint
    sync, done = str(tmp_path / "ckpt" / "sync" / "step-00000002"), results[0]["path"]
    assert sorted(os.listdir(done)) == sorted(os.listdir(sync))  # no marks left behind
    meta, want = (json.load(open(os.path.join(p, "meta.json"))) for p in (done, sync))
    assert {k: v for k, v in meta.items() if k not in ("written_at", "checksums")} == \
        {k: v for k, v in want.items() if k not in ("written_at", "checksums")}
    # sizes equal; the crc32s may not be: safetensors orders a header's metadata keys as its hash map does
    assert {n: c["bytes"] for n, c in meta["checksums"].items()} == {n: c["bytes"] for n, c in want["checksums"].items()}
    validate_checkpoint(done)
    got, expected = _files(done), _files(sync)
    assert sorted(got) == sorted(expected) and not any(n.endswith(".optim.safetensors") for n in got)  # (the format before)
    assert json.loads(got["vision-rank00000.dopt.safetensors"][0]["shard"])["sharded"] == (optimizer == "distributed")
    for name, (metadata, tensors) in expected.items():
        assert got[name][0] == metadata, name
        assert sorted(got[name][1]) == sorted(tensors), name
        for key, t in tensors.items():  # the state of step 2, not of step 3 trained during the write
            assert got[name][1][key].dtype == t.dtype and torch.equal(got[name][1][key], t), (name, key)
    # a write that fails on rank 2: an error on every rank naming it, nothing committed
    failures = [r["failure"] for r in results]
    assert failures[2] == "RuntimeError: disk full (injected)", failures
    assert failures[0].startswith("CheckpointError: ") and "rank(s) [2] could not write" in failures[0], failures
    assert all("failed on rank(s) [0, 2]" in failures[r] for r in (1, 3)), failures
    assert not (tmp_path / "ckpt" / "async" / "step-00000004").exists()


def test_rank_zero_waits_for_every_mark_then_names_the_missing_ranks(tmp_path):
    from mimo.training.async_save import _mark, await_marks

    _mark(str(tmp_path), "done", 0)
    _mark(str(tmp_path), "done", 2)
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1, 3\] did not finish writing their checkpoint files within 0.2 s"):
        await_marks(str(tmp_path), 4, timeout_s=0.2)
    _mark(str(tmp_path), "error", 3, "OSError: no space left")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[3\] could not write .*rank 3: OSError: no space left"):
        await_marks(str(tmp_path), 4, timeout_s=60)
    _mark(str(tmp_path), "done", 1)
    (tmp_path / "error-rank00003").unlink()
    _mark(str(tmp_path), "done", 3)
    await_marks(str(tmp_path), 4, timeout_s=0)  # all there: returns at once

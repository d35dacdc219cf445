"""Checkpoint checksums and safe rotation (issue 53, "nothing lost silently"; one process, CPU):
every file a save writes carries the crc32 of its bytes in meta.json; a file whose bytes were
overwritten in place (same size, header intact) is found: ``usable_checkpoint`` falls back to the
older checkpoint with a warning naming the file, ``resolve_checkpoint`` refuses it; a checkpoint
written before checksums still loads; pruning only follows a checked save and counts only
usable checkpoints toward ``keep``, so damaged ones never cost the last good one its place."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zlib

import pytest
import torch
import yaml
from safetensors import safe_open

import mimo.training.checkpoint as ckpt
from mimo.core.errors import CheckpointError
from mimo.parallel.params import set_main_grad_
from mimo.training.checkpoint import (complete_checkpoints, load_checkpoint, resolve_checkpoint, save_checkpoint,
                                      usable_checkpoint, validate_checkpoint)

DEMO = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")
LOG = "mimo.training.checkpoint"


def demo_at_world_1(overrides: list[str]):
    """The demo config at world 1 (no processes; synthetic data, nothing read), with ``overrides``."""
    from mimo.compose.config import config_from_dict

    with open(DEMO) as f:
        cfg = yaml.safe_load(f)
    cfg.update(world_size=1, data={"source": "synthetic", "max_sample_tokens": 512})
    cfg.pop("eval", None)
    for module in cfg["modules"].values():
        module.pop("parallel", None)
    return config_from_dict(cfg, overrides)


def _model(seed: int = 1):
    """The demo model at world 1 (no processes) and its optimizers after one step (state to save)."""
    from mimo.compose.model import MimoModel
    from mimo.training.optim import model_optimizers
    from mimo.training.precision import PrecisionPolicy

    config = demo_at_world_1([f"train.seed={seed}"])
    model = MimoModel(config, 0)
    optimizers = model_optimizers(config, model, PrecisionPolicy.named("fp32"))
    for p in model.train_params():
        set_main_grad_(p.param, torch.full(p.param.shape, 0.01))
    for opt in optimizers.values():
        opt.step()
    return model, optimizers


def _weights(model) -> dict[str, torch.Tensor]:
    return {f"{part.module}.{n}": info.param.detach().clone() for part in ckpt._local_parts(model) for n, info in part.table.items()}


@pytest.fixture(scope="module")
def trained():
    return _model()


def _overwrite_in_place(file: str) -> None:
    """Flip 16 bytes in the middle of ``file``'s tensor data: same size, header intact."""
    with open(file, "r+b") as f:
        header = struct.unpack("<Q", f.read(8))[0]
        at = 8 + header + (os.path.getsize(file) - 8 - header) // 2
        f.seek(at)
        old = f.read(16)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in old))


def _steps(directory) -> list[int]:
    return [step for step, _ in complete_checkpoints(str(directory))]


_EVERY_DTYPE = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "f16": torch.randn(2, 2).half(),
                "f64": torch.randn(3).double(), "c64": torch.randn(2, dtype=torch.complex64), "i64": torch.arange(5),
                "i32": torch.arange(3, dtype=torch.int32), "i16": torch.arange(3, dtype=torch.int16),
                "i8": torch.arange(3, dtype=torch.int8), "u64": torch.tensor([1, 2], dtype=torch.uint64),
                "u32": torch.tensor([1, 2], dtype=torch.uint32), "u16": torch.tensor([1, 2], dtype=torch.uint16),
                "u8": torch.arange(3, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
                "fp8": torch.randn(4).to(torch.float8_e4m3fn), "fp8b": torch.randn(3).to(torch.float8_e5m2),
                "e8m0": torch.ones(2).to(torch.float8_e8m0fnu), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
                "strided": torch.randn(4, 6).t()}


def _written_as_saved(file, tensors, records, name="a.safetensors") -> None:
    """``records`` hold ``file``'s crc32 and size; it holds ``tensors`` (bytes equal) and the demo metadata."""
    assert records == {name: {"crc32": f"{zlib.crc32(file.read_bytes()):08x}", "bytes": file.stat().st_size}}
    with ckpt._crc_threads() as pool:
        assert ckpt._file_crc32(str(file), pool) == records[name]["crc32"]
    with safe_open(str(file), "pt") as f:
        assert f.metadata() == {"placements": "{}", "step": "3"}
        assert sorted(f.keys()) == sorted(tensors)
        for key, t in tensors.items():
            got = f.get_tensor(key)
            same = torch.equal(got.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))  # bytes: fp8 has no ==
            assert got.dtype == t.dtype and got.shape == t.shape and same, key


@pytest.mark.parametrize("piece", [ckpt._WRITE_CHUNK, 40])
def test_the_writer_writes_safetensors_with_the_crc32_of_its_bytes(tmp_path, monkeypatch, caplog, piece):
    """Pieces of 40 bytes: tensors cut and grouped, their crc32s combined on the threads. Every
    dtype safetensors stores: the layout checksummed is save_file's (no fallback to reading the file)."""
    monkeypatch.setattr(ckpt, "_WRITE_CHUNK", piece)
    with caplog.at_level(logging.WARNING, logger=LOG):
        records = ckpt._write_files([("a.safetensors", _EVERY_DTYPE, {"placements": "{}", "step": "3"})], str(tmp_path))
    assert not caplog.records
    _written_as_saved(tmp_path / "a.safetensors", _EVERY_DTYPE, records)
    header, _ = ckpt._safetensors_layout({k: t.contiguous() for k, t in _EVERY_DTYPE.items()}, {"placements": "{}", "step": "3"})
    assert len(ckpt._header_of(str(tmp_path / "a.safetensors"))) == len(header)


def test_a_safetensors_that_orders_tensors_otherwise_has_the_checksum_read_from_the_file(tmp_path, monkeypatch, caplog):
    """The layout mimo expects, wrong (the dtype order reversed): the header read back differs, the
    crc32 comes from the file, right, with a warning."""
    monkeypatch.setattr(ckpt, "_DTYPE_ORDER", {k: -v for k, v in ckpt._DTYPE_ORDER.items()})
    with caplog.at_level(logging.WARNING, logger=LOG):
        records = ckpt._write_files([("a.safetensors", _EVERY_DTYPE, {"placements": "{}", "step": "3"})], str(tmp_path))
    assert "lays files out otherwise than mimo expects" in caplog.text
    _written_as_saved(tmp_path / "a.safetensors", _EVERY_DTYPE, records)


def test_bytes_overwritten_in_place_are_found_and_the_older_checkpoint_taken(trained, tmp_path, caplog):
    model, optimizers = trained
    saved = _weights(model)
    first = save_checkpoint(model, optimizers, 1, str(tmp_path))
    second = save_checkpoint(model, optimizers, 2, str(tmp_path))
    meta = json.loads(open(os.path.join(second, "meta.json")).read())
    assert sorted(meta["checksums"]) == meta["files"] and not any(n.startswith("checksums-") for n in os.listdir(second))
    bad = os.path.join(second, "language-rank00000.model.safetensors")
    size = os.path.getsize(bad)
    _overwrite_in_place(bad)
    assert os.path.getsize(bad) == size
    validate_checkpoint(second, checksums=False)  # what headers and sizes alone see: nothing wrong
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert usable_checkpoint(str(tmp_path)) == (1, first)
    assert f"checkpoint {second} is not usable, skipped: {bad}: damaged: its bytes are not those written" in caplog.text
    assert f"falling back to {first} (step 1)" in caplog.text
    with pytest.raises(CheckpointError, match=re.escape(bad) + r": damaged: its bytes are not those written \(crc32 \w{8}, "
                       r"written \w{8}\) \(restore the file, or use an older checkpoint\)"):
        resolve_checkpoint(second)  # --resume-from, train.init_from
    assert resolve_checkpoint(str(tmp_path)) == first
    other, other_opts = _model(seed=7)
    assert any(not torch.equal(w, saved[k]) for k, w in _weights(other).items())
    load_checkpoint(other, resolve_checkpoint(str(tmp_path)), other_opts)
    assert all(torch.equal(w, saved[k]) for k, w in _weights(other).items())


def test_a_checkpoint_written_before_checksums_still_loads(trained, tmp_path, caplog):
    model, optimizers = trained
    path = save_checkpoint(model, optimizers, 4, str(tmp_path))
    meta_file = os.path.join(path, "meta.json")
    meta = json.loads(open(meta_file).read())
    del meta["checksums"]  # as an earlier mimo wrote it
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    with caplog.at_level(logging.INFO, logger=LOG):
        assert usable_checkpoint(str(tmp_path)) == (4, path) and resolve_checkpoint(path) == path
    assert caplog.text.count(f"{path}: written without checksums") == 1  # logged once
    other, other_opts = _model(seed=7)
    load_checkpoint(other, path, other_opts)
    assert all(torch.equal(w, _weights(model)[k]) for k, w in _weights(other).items())


def test_a_resumed_run_keeps_the_good_checkpoint_until_keep_verified_ones_of_its_own(trained, tmp_path):
    """keep=3, checkpoints 10, 20, 30, the newest two overwritten in place: the launcher falls
    back to 10; the resumed run's saves at 15, 16 delete nothing (20 and 30 are later steps: not
    this run's, not counted); 17 makes three verified ones, and 10 goes; its save of 20 replaces
    the damaged one. (Counting every checkpoint, the save at 15 deleted 10: the last good one
    but 15, beside two damaged ones.)"""
    model, optimizers = trained
    for step in (10, 20, 30):
        save_checkpoint(model, optimizers, step, str(tmp_path), keep=3)
    for step in (20, 30):
        _overwrite_in_place(os.path.join(ckpt.step_dir(str(tmp_path), step), "vision-rank00000.dopt.safetensors"))
    assert usable_checkpoint(str(tmp_path))[0] == 10
    save_checkpoint(model, optimizers, 15, str(tmp_path), keep=3)
    assert _steps(tmp_path) == [10, 15, 20, 30]
    save_checkpoint(model, optimizers, 16, str(tmp_path), keep=3)
    assert _steps(tmp_path) == [10, 15, 16, 20, 30]
    save_checkpoint(model, optimizers, 17, str(tmp_path), keep=3)
    assert _steps(tmp_path) == [15, 16, 17, 20, 30]
    save_checkpoint(model, optimizers, 20, str(tmp_path), keep=3)
    assert _steps(tmp_path) == [16, 17, 20, 30]
    validate_checkpoint(ckpt.step_dir(str(tmp_path), 20))  # the damaged one replaced


def test_damaged_checkpoints_do_not_count_toward_keep(trained, tmp_path, caplog):
    """keep=2 during a run: checkpoint 2 cut short; the save of 3 keeps 1 (the damaged 2 does not
    count), the save of 4 makes two good newer ones: 1 and the damaged 2 go."""
    model, optimizers = trained
    for step in (1, 2):
        save_checkpoint(model, optimizers, step, str(tmp_path), keep=2)
    cut = os.path.join(ckpt.step_dir(str(tmp_path), 2), "rng-rank00000.safetensors")
    os.truncate(cut, os.path.getsize(cut) - 8)
    with caplog.at_level(logging.WARNING, logger=LOG):
        save_checkpoint(model, optimizers, 3, str(tmp_path), keep=2)
    assert _steps(tmp_path) == [1, 2, 3]
    assert f"checkpoint {ckpt.step_dir(str(tmp_path), 2)} is damaged, not counted toward train.checkpoint.keep: {cut}" in caplog.text
    save_checkpoint(model, optimizers, 4, str(tmp_path), keep=2)
    assert _steps(tmp_path) == [3, 4]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_whose_file_is_short_on_disk_is_not_committed_and_prunes_nothing(trained, tmp_path, monkeypatch, async_save):
    """A file that ends up shorter on disk than written (as if the storage dropped its tail): the
    rank's check of sizes finds it, nothing is committed, the older checkpoint stays although
    keep=1; the asynchronous writer likewise, its error raised by ``wait``. Without the fault its
    save carries the same checksums as a synchronous one."""
    from mimo.training.async_save import CheckpointSaver

    model, optimizers = trained
    saver = CheckpointSaver(str(tmp_path), keep=1, async_save=async_save, timeout_s=30)
    saver.save(model, optimizers, 1)
    saver.wait()
    meta = json.loads(open(os.path.join(ckpt.step_dir(str(tmp_path), 1), "meta.json")).read())
    assert sorted(meta["checksums"]) == meta["files"]
    validate_checkpoint(ckpt.step_dir(str(tmp_path), 1))
    real_save_file = ckpt.save_file

    def loses_its_tail(tensors, path, metadata=None):
        real_save_file(tensors, path, metadata=metadata)
        if ".model." in path:
            os.truncate(path, os.path.getsize(path) - 4)

    monkeypatch.setattr(ckpt, "save_file", loses_its_tail)
    with pytest.raises(CheckpointError, match=r"rank00000\.model\.safetensors: \d+ bytes on disk right after writing \d+ "
                       r".*; not committed, the previous checkpoint stays in force"):
        saver.save(model, optimizers, 2)
        saver.wait()
    assert _steps(tmp_path) == [1]

"""Checkpoints written before the one optimizer-state format still load: a per-parameter
optimizer's state in ``*.optim`` files (``{name}/{field}`` whole local tensors and
``{name}/step``, metadata ``optimizer`` / ``params`` / ``scalars``), as mimo wrote them until then.

The old files are built by hand from a checkpoint of today's format (``_as_old_format``: the
writer of the format before, kept here as its specification), and the two checkpoints must load
into the same weights and optimizer state, bit for bit, and train on alike (demo model, world 1,
no processes: fp32 AdamW, bf16 master-weight AdamW, bf16-pure AdamW)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mimo.parallel.params import set_main_grad_


def _build(precision: str, seed: int):
    """The demo model at world 1 and its optimizers (the run's: over its gradient buffers)."""
    from test_checkpoint_integrity import demo_at_world_1

    from mimo.compose.model import MimoModel
    from mimo.training.optim import model_optimizers
    from mimo.training.precision import PrecisionPolicy

    config = demo_at_world_1([f"train.precision={precision}", "train.weight_decay=0.1", f"train.seed={seed}"])
    policy = PrecisionPolicy.named(precision)
    model = MimoModel(config, 0, dtype=policy.params)
    return model, model_optimizers(config, model, policy)


def _step(model, optimizers, k: int) -> None:
    """An optimizer step on seeded gradients (as a training step leaves them in the buffers)."""
    sync = model.grad_sync
    sync.zero_grad()
    for i, p in enumerate(model.train_params()):
        g = torch.Generator().manual_seed(1000 * k + i)
        set_main_grad_(p.param, 0.01 * torch.randn(p.param.shape, generator=g))
    sync.finish()
    for opt in optimizers.values():
        opt.step()


def _state(model, optimizers) -> dict[str, torch.Tensor]:
    """Every weight and optimizer-state tensor (step counts too) by name."""
    from mimo.training.checkpoint import _local_parts

    out = {}
    for part in _local_parts(model):
        for name, info in part.table.items():
            out[f"{part.module}.{name}"] = info.param.detach().clone()
            for key, value in optimizers[part.module].state.get(info.param, {}).items():
                out[f"{part.module}.{name}/{key}"] = value.clone()
    return out


def _as_old_format(new: str, old: str) -> None:
    """A copy of the checkpoint ``new`` whose optimizer state is in the format before (``*.optim``
    beside each owner's model file), as mimo's writer of then laid it out; meta.json lists the
    files (without checksums: a checkpoint from before them loads too)."""
    shutil.copytree(new, old)
    files = []
    for name in sorted(os.listdir(old)):
        if not name.endswith(".dopt.safetensors"):
            files.append(name)
            continue
        with safe_open(os.path.join(old, name), "pt") as f:
            meta = f.metadata()
            shard = json.loads(meta["shard"])
            tensors, scalars, params = {}, {}, list(shard.get("fresh", ()))  # (trained, no state yet)
            for pname, got in shard["ranges"].items():
                assert got["range"] == [0, got["numel"]]  # a per-parameter optimizer's whole tensors
                params.append(pname)
                shape = shard["placements"][pname]["local_shape"]
                tensors[f"{pname}/step"] = torch.tensor(shard["steps"][str(got["bucket"])], dtype=torch.float32)
                for key in ("exp_avg", "exp_avg_sq", "master"):
                    if f"{pname}.{key}" in f.keys():
                        tensors[f"{pname}/{key}"] = f.get_tensor(f"{pname}.{key}").view(shape)
        os.remove(os.path.join(old, name))
        legacy = name.replace(".dopt.", ".optim.")
        save_file(tensors, os.path.join(old, legacy),
                  metadata={"optimizer": meta["optimizer"], "params": json.dumps(params), "scalars": json.dumps(scalars)})
        files.append(legacy)
    with open(os.path.join(old, "meta.json")) as f:
        meta = json.load(f)
    meta.pop("checksums")
    meta["files"] = sorted(f for f in files if f != "meta.json")
    with open(os.path.join(old, "meta.json"), "w") as f:
        json.dump(meta, f)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_a_checkpoint_of_the_format_before_loads_as_today(tmp_path, precision):
    from mimo.training.checkpoint import load_checkpoint, save_checkpoint

    model, optimizers = _build(precision, seed=1)
    for k in (1, 2):
        _step(model, optimizers, k)
    new = save_checkpoint(model, optimizers, 2, str(tmp_path / "new"))
    old = str(tmp_path / "old" / "step-00000002")
    _as_old_format(new, old)
    assert any(f.endswith(".optim.safetensors") for f in os.listdir(old))
    assert not any(f.endswith(".dopt.safetensors") for f in os.listdir(old))
    got = {}
    for name, path in (("new", new), ("old", old)):
        fresh, fresh_opts = _build(precision, seed=5)
        load_checkpoint(fresh, path, fresh_opts, rng=False)
        loaded = _state(fresh, fresh_opts)
        _step(fresh, fresh_opts, 3)
        got[name] = loaded, _state(fresh, fresh_opts)
    want = _state(model, optimizers)
    for when, (a, b) in enumerate(zip(got["new"], got["old"])):
        assert a.keys() == b.keys() and len(a) > 0
        bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not bad, (when, bad[:3])
    bad = [k for k in want if not torch.equal(want[k].cpu(), got["old"][0][k].cpu())]
    assert not bad and any("/exp_avg" in k for k in want), bad[:3]  # what was saved, restored

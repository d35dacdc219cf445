"""Checkpoints by placement (real processes, gloo, CPU): every element of every parameter is
written exactly once, by its owner, beside a placement record that round-trips; a rank loads
each of its parameters (and their optimizer state) from its owner's file and restores exactly
what was saved; a stored record that does not match is a clear error."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from mimo.core.errors import CheckpointError
from mimo.parallel.params import set_main_grad_
from mimo.parallel.placement import ParamPlacement

DEMO = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")

# every layout on 4 ranks; the vision tower data-parallel (dp4: replicas) or tensor-parallel
LAYOUTS = {
    "tp2 dp2, vision tp2 dp2, fp32": ("fp32", [
        "modules.vision.parallel.tp=2", "modules.vision.parallel.dp=2"]),
    "pp2 dp2, tied embeddings, bf16": ("bf16", [
        "modules.language.parallel.tp=1", "modules.language.parallel.pp=2", "modules.language.parallel.sequence_parallel=false",
        "modules.language.arch.tie_embeddings=true"]),
    "tp2 pp2, tied embeddings, fp32": ("fp32", [
        "modules.language.parallel.dp=1", "modules.language.parallel.pp=2", "modules.language.arch.tie_embeddings=true"]),
}


@pytest.fixture(scope="module")
def pools(session_pools):
    """This module's worker pools are the session's (``session_pools``): started once for the
    modules that share them, not once per module."""
    return session_pools


def _raw_config() -> dict:
    with open(DEMO) as f:
        cfg = yaml.safe_load(f)
    cfg["data"] = {"source": "synthetic", "max_sample_tokens": 512}  # no shards needed: nothing is read
    cfg.pop("eval", None)
    return cfg


def _config(overrides: list[str]):
    from mimo.compose.config import config_from_dict

    return config_from_dict(_raw_config(), overrides)


def _build(overrides: list[str], precision: str):
    import torch.distributed as dist

    from mimo.compose.model import MimoModel
    from mimo.training.optim import model_optimizers
    from mimo.training.precision import PrecisionPolicy

    config, policy = _config(overrides), PrecisionPolicy.named(precision)
    model = MimoModel(config, dist.get_rank(), dtype=policy.params)
    return model, model_optimizers(config, model, policy)


def _step(model, optimizers) -> None:
    """One optimizer step on gradients that are the same full tensor, seeded by name, on every
    rank (sliced by placement): replicas take identical steps, as in training."""
    from mimo.parallel import param_seed
    from mimo.parallel.placement import shard_full
    from mimo.training.checkpoint import _local_parts

    for part in _local_parts(model):
        for name, info in part.table.items():
            g = torch.Generator().manual_seed(param_seed(11, f"{part.module}.{name}"))
            full = torch.randn(info.placement.full_shape, generator=g)
            if info.param.requires_grad:  # (the optimizer steps on the main gradients)
                set_main_grad_(info.param, shard_full(full, info.placement, info.sizes, info.coords).to(info.param.dtype))
    for opt in optimizers.values():
        opt.step()


def _by_name(model, optimizers) -> dict:
    """(module, name) -> (local weights, optimizer state) of every local parameter."""
    from mimo.training.checkpoint import _local_parts

    out = {}
    for part in _local_parts(model):
        opt = optimizers.get(part.module)
        for name, info in part.table.items():
            state = dict(opt.state.get(info.param, {})) if opt is not None else {}
            out[part.module, name] = (info.param.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    return out


def _same(a: dict, b: dict) -> list[str]:
    bad = []
    for key, (w, state) in a.items():
        w2, state2 = b[key]
        if w.dtype != w2.dtype or not torch.equal(w, w2):
            bad.append(f"{key} weights")
        if set(state) != set(state2):
            bad.append(f"{key} state keys {sorted(state)} vs {sorted(state2)}")
            continue
        for k in state:
            x, y = state[k], state2[k]
            same = torch.equal(x.cpu().double(), y.cpu().double()) and x.dtype == y.dtype if torch.is_tensor(x) else x == y
            if not same:
                bad.append(f"{key} state {k}")
    return bad


def _save_then_load(overrides: list[str], precision: str, root: str) -> dict:
    """Rank function: a model after one step is saved; another (other seed) loads it back and
    must hold the same weights and optimizer state; the full tensors for the file check."""
    from mimo.training.checkpoint import load_checkpoint, save_checkpoint

    model, optimizers = _build(overrides, precision)
    _step(model, optimizers)
    path = save_checkpoint(model, optimizers, 3, root)
    want = _by_name(model, optimizers)
    other, other_opts = _build([*overrides, "train.seed=7"], precision)
    before = _same(want, _by_name(other, other_opts))
    meta = load_checkpoint(other, path, other_opts)
    full = {m: {n: t.float() for n, t in ts.items()} for m, ts in model.full_params().items()}  # collective over TP
    trained = defaultdict(set)
    for p in model.train_params():
        trained[p.module].add(p.name)
    return {"path": path, "step": meta["step"], "differed_before": len(before), "mismatch": _same(want, _by_name(other, other_opts)),
            "full": full, "trained": dict(trained)}


def _load_error(overrides: list[str], precision: str, path: str) -> str:
    from mimo.training.checkpoint import load_checkpoint

    model, optimizers = _build(overrides, precision)
    try:
        load_checkpoint(model, path, optimizers)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def _files(path: str, kind: str) -> dict[str, tuple[dict, object]]:
    """Each ``kind`` (model / optim) file: its metadata and an open handle's tensors."""
    out = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(f".{kind}.safetensors"):
            with safe_open(os.path.join(path, file), "pt") as f:
                out[file] = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    return out


def _check_every_element_once(path: str, full: dict, trained: dict) -> None:
    pieces: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for file, (meta, tensors) in _files(path, "model").items():
        records = json.loads(meta["placements"])
        assert set(records) == set(tensors), file
        assert file == f"{meta['module']}-rank{int(meta['rank']):05d}.model.safetensors"
        for name, t in tensors.items():
            pieces[meta["module"]][name].append((records[name], t))
    assert set(pieces) == set(full)
    for module, names in pieces.items():
        assert set(names) == set(full[module]), module  # every parameter is in the checkpoint
        for name, found in names.items():
            want = full[module][name]
            count = torch.zeros(want.shape, dtype=torch.int64)
            got = torch.zeros(want.shape)
            for rec, t in found:
                pl = ParamPlacement.from_record(rec)
                assert pl.record(rec["sizes"], rec["coords"]) == rec, (module, name)  # the record round-trips
                assert list(t.shape) == rec["local_shape"], (module, name)
                for full_index, local_index in pl.runs(rec["sizes"], rec["coords"]):
                    count[full_index] += 1
                    got[full_index] = t[local_index].float()
            coords = [tuple(sorted(rec["coords"].items())) for rec, _ in found]
            assert len(set(coords)) == len(coords), (module, name, coords)  # each shard coordinate once
            assert int(count.sum()) == want.numel(), (module, name)  # the written regions add up to the full tensor
            assert bool((count == 1).all()), (module, name, f"elements written {int(count.min())}..{int(count.max())} times")
            assert torch.equal(got, want), (module, name)  # the right slices
    # optimizer state: in each owner's state file, beside its weights, the state of exactly its
    # trained shards, each piece the whole local tensor, with the weights' placement record
    models, states = _files(path, "model"), _files(path, "dopt")
    for file, (meta, tensors) in models.items():
        wrote = set(json.loads(meta["placements"])) & trained.get(meta["module"], set())
        state = file.replace(".model.", ".dopt.")
        if meta["module"] in trained:
            shard = json.loads(states[state][0]["shard"])
            assert sorted(shard["ranges"]) == sorted(wrote), file
            for name in wrote:
                assert shard["ranges"][name]["range"] == [0, tensors[name].numel()], (file, name)
                assert shard["placements"][name] == json.loads(meta["placements"])[name], (file, name)
                assert states[state][1][f"{name}.exp_avg"].numel() == tensors[name].numel(), (file, name)
        else:
            assert state not in states, file
    assert set(states) <= {f.replace(".model.", ".dopt.") for f in models}
    assert not _files(path, "optim")  # (the format before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_holds_every_element_once_and_loads_back(pools, tmp_path, layout):
    precision, overrides = LAYOUTS[layout]
    results = pools(4).run(_save_then_load, overrides, precision, str(tmp_path / "ckpt"))
    path = results[0]["path"]
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["differed_before"] > 0, rank  # the second model started elsewhere
        assert r["mismatch"] == [], (rank, r["mismatch"][:5])
    full: dict[str, dict] = defaultdict(dict)
    trained: dict[str, set] = defaultdict(set)
    for r in results:
        for module, tensors in r["full"].items():
            full[module].update(tensors)
        for module, names in r["trained"].items():
            trained[module] |= names
    _check_every_element_once(path, full, trained)
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert meta["format"] == 2 and meta["files"] == sorted(f for f in os.listdir(path) if f != "meta.json")


def test_a_stored_record_that_does_not_match_and_a_freezing_change_are_clear_errors(pools, tmp_path):
    precision, overrides = LAYOUTS["tp2 dp2, vision tp2 dp2, fp32"]
    pool = pools(4)
    path = pool.run(_save_then_load, overrides, precision, str(tmp_path / "ckpt"))[0]["path"]
    # freezing changed: the tower's state is in the checkpoint but not trained now
    msgs = pool.run(_load_error, [*overrides, "modules.vision.freeze=[tower]"], precision, path)
    assert all("optimizer state is for other parameters" in m and "not trained now: ['tower." in m for m in msgs), msgs
    # a record that says another shard than the rank holds
    file = os.path.join(path, "language-rank00001.model.safetensors")
    with safe_open(file, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    records = json.loads(meta["placements"])
    name = next(n for n, r in records.items() if r["coords"].get("tp") == 1)
    records[name]["coords"]["tp"] = 0
    save_file(tensors, file, metadata={**meta, "placements": json.dumps(records)})
    msgs = pool.run(_load_error, overrides, precision, path)
    # ranks 1 (tp1 dp0) and 3 (tp1 dp1) read that file; ranks 0 and 2 read rank 0's
    for rank in (1, 3):
        assert "was written with placement" in msgs[rank] and repr(name) in msgs[rank], msgs[rank]
    assert msgs[0] == msgs[2] == "loaded", msgs


class _Experts(torch.nn.Module):
    """Parameters of every kind of placement on one context with an expert view: experts
    [E, F, D] split E over ep and F over etp, a fused q|k|v over tp, a vocab-padded weight, a
    TP-partial norm (replicated: written by tp = 0 only)."""

    def __init__(self, ctx):
        super().__init__()
        from mimo.parallel.placement import ParamPlacement, replicated, sharded

        self.ctx = ctx
        self._placements = {"experts": ParamPlacement((4, 6, 3), (("ep", 0), ("etp", 1))),
                            "qkv": sharded((8, 5), 0, "tp", parts=(4, 2, 2)),
                            "vocab": sharded((7, 5), 0, "tp", pad=True),
                            "norm": replicated((5,), partial=("tp",))}
        for name, pl in self._placements.items():
            view = ctx.view(pl.axes)
            self.register_parameter(name, torch.nn.Parameter(torch.empty(pl.local_shape({a: view.size(a) for a in pl.axes}))))

    def placements(self):
        return dict(self._placements)


def _experts_case(root: str) -> dict:
    """Rank function: save an expert-parallel module's shards through the checkpoint's own
    writer, load them into another one, compare; the full tensors for the file check."""
    import torch.distributed as dist

    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import GroupRegistry, ParallelGrid
    from mimo.parallel.params import full_tensors, init_params_, param_table
    from mimo.parallel.placement import shard_full
    from mimo.training.bucket_optim import build_optimizers
    from mimo.training.checkpoint import _Files, _Part, _read_part, _write_part
    from mimo.training.optim import GradSync, TrainParam

    rank, registry = dist.get_rank(), GroupRegistry()
    ctx = ParallelContext(ParallelGrid({"tp": 2, "cp": 1, "dp": 2, "pp": 1}, registry=registry), rank, registry, expert=(2, 2))
    parts, opts = [], []
    for seed in (1, 2):
        module = _Experts(ctx)
        table = param_table(module)
        init_params_(table, seed, std=1.0)
        parts.append(_Part("moe", table))
        params = [TrainParam("moe", n, info.param, None, True) for n, info in table.items()]  # (no gradient sums)
        opts.append(build_optimizers(params, GradSync(params).module_buckets(), {"moe": 1e-2}, {"moe": 1e-2})["moe"])
    for name, info in parts[0].table.items():
        full = torch.randn(info.placement.full_shape, generator=torch.Generator().manual_seed(len(name)))
        set_main_grad_(info.param, shard_full(full, info.placement, info.sizes, info.coords))
    opts[0].step()
    if rank == 0:
        os.makedirs(root)
    dist.barrier()
    _write_part(parts[0], opts[0], root, rank, 0)
    dist.barrier()
    from contextlib import ExitStack

    with ExitStack() as stack:  # through the checkpoint's one reader, as load_checkpoint reads
        _read_part(parts[1], opts[1], _Files(root, stack), sorted(os.listdir(root)), rank, same=True)
    want = _by_name_of(parts[0], opts[0])
    return {"mismatch": _same(want, _by_name_of(parts[1], opts[1])), "full": full_tensors(parts[0].table),
            "experts_coords": parts[0].table["experts"].coords}


def _by_name_of(part, opt) -> dict:
    return {(part.module, n): (i.param.detach().clone(), {k: v.clone() for k, v in opt.state[i.param].items()})
            for n, i in part.table.items()}


def test_expert_shards_are_written_by_their_owners(pools, tmp_path):
    """Under EP every (ep, etp) shard is written, by its edp = 0 rank, whatever its dense
    dp coordinate (the old dp = cp = 0 rule dropped the shards of ranks with dp = 1)."""
    results = pools(4).run(_experts_case, str(tmp_path / "moe"))
    assert all(r["mismatch"] == [] for r in results), [r["mismatch"][:3] for r in results]
    assert {tuple(r["experts_coords"].items()) for r in results} == {(("ep", e), ("etp", t)) for e in (0, 1) for t in (0, 1)}
    _check_every_element_once(str(tmp_path / "moe"), {"moe": results[0]["full"]}, {"moe": set(results[0]["full"])})
    written = sorted(os.listdir(tmp_path / "moe"))
    assert [f for f in written if f.endswith(".model.safetensors")] == [f"moe-rank{r:05d}.model.safetensors" for r in range(4)]


def test_an_older_format_is_refused(tmp_path):
    from mimo.training.checkpoint import read_meta

    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "step": 2}))
    with pytest.raises(CheckpointError, match="format 1, this mimo reads format 2.*grid coordinates"):
        read_meta(str(tmp_path))

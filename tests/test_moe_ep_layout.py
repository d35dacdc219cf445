"""The experts' own layout (parallel folding, issue 22): ``parallel.ep`` / ``parallel.etp``
checks, the LLM's expert view, expert placements (E over ep, F over etp), gradients summed
over edp and counted once in the norm, checkpoints at an EP layout. The MoE forward at
ep > 1 needs the token dispatcher (mimo.llm.dispatch), so gradients here come from a toy
loss on the local weights that stands in for it: every rank of an expert-model-parallel
group (etp × ep: the ranks with one edp coordinate) sends its tokens to the experts it
routes to, so a rank's expert shard sees the data of those ranks; summed over edp, every
rank's data (see ``_toy_loss``)."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors import safe_open

from mimo.parallel import param_seed
from mimo.parallel.init import init_full, init_local
from mimo.parallel.placement import shard_full

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
LANG = "modules.language."
# world 4, LLM tp2 dp2 (moe_tp.yaml with 8 experts so that ep 4 divides them)
BASE = [LANG + "arch.moe.experts=8"]
LAYOUTS = {
    "ep4 etp1 (EP > DP, edp 1)": BASE + [LANG + "parallel.ep=4", LANG + "parallel.etp=1"],
    "ep2 etp1 (edp 2)": BASE + [LANG + "parallel.ep=2", LANG + "parallel.etp=1"],
    "ep2 etp2 (edp 1)": BASE + [LANG + "parallel.ep=2"],
    "ep1 etp1 != tp (edp 4)": BASE + [LANG + "parallel.etp=1"],
    "tp1 pp2 dp2 ep2 (moe_pp)": ["pp", LANG + "parallel.ep=2"],
}


# ---------------------------------------------------------------- config checks


BAD = {
    "ep not dividing experts": ([LANG + "parallel.ep=4"], "parallel.ep: ep=4 must divide arch.moe.experts=6"),
    "etp not dividing moe.ffn": ([LANG + "parallel.etp=3", LANG + "arch.moe.ffn=16"],
                                 "parallel.etp: etp=3 must divide arch.moe.ffn=16"),
    "etp*ep not dividing the stage": ([LANG + "parallel.ep=3", LANG + "parallel.etp=1"],
                                      "parallel.ep: etp*ep = 1*3 = 3 does not divide the 4 ranks of a pipeline stage "
                                      "(tp*cp*dp = 2*1*2)"),
    "default etp = tp not dividing moe.ffn": ([LANG + "parallel.ep=2", LANG + "arch.moe.ffn=15"],
                                              "parallel.tp: tp=2 must divide arch.moe.ffn=15"),
    "ep on an LLM without MoE layers": ([LANG + 'arch.pattern="*-"', LANG + "parallel.ep=2", LANG + "parallel.etp=1"],
                                        "parallel.ep: ep=2 needs MoE layers"),
    "etp on an encoder": (["modules.vision.parallel.etp=2"], "modules.vision.parallel.etp: etp=2 applies only to the LLM"),
    "ep on an encoder": (["modules.vision.parallel.ep=2"], "modules.vision.parallel.ep: ep=2 applies only to the LLM"),
    "deepep with etp > 1": ([LANG + "parallel.ep=2", LANG + "parallel.etp=2", "train.moe_dispatcher=deepep",
                             "train.precision=bf16"], "train.moe_dispatcher: deepep needs modules.language.parallel.etp = 1, got etp=2"),
    "deepep in fp32": ([LANG + "parallel.ep=2", LANG + "parallel.etp=1", "train.moe_dispatcher=deepep"],
                       "train.moe_dispatcher: deepep moves bf16 rows; train.precision is fp32"),
}


def _check_config(overrides, capsys) -> list[str]:
    from mimo.commands.cli import main

    rc = main(["check-config", os.path.join(CONFIGS, "moe_tp.yaml"), *overrides])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    errors = json.loads(out.out.strip().splitlines()[-1]).get("errors", [])
    assert (rc == 2) == bool(errors)
    return [e for e in errors if not e.startswith("data.")]  # (its data paths do not exist here)


@pytest.mark.parametrize("case", list(BAD))
def test_impossible_expert_layouts_fail_check_config(case, capsys, monkeypatch):
    monkeypatch.chdir(CONFIGS)
    overrides, expected = BAD[case]
    errors = _check_config(overrides, capsys)
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("overrides", [
    [LANG + "parallel.ep=2", LANG + "parallel.etp=1"],
    [LANG + "parallel.ep=2", LANG + "parallel.etp=1", LANG + "arch.moe.ffn=15"],  # etp 1: tp need not divide moe.ffn
    [LANG + "parallel.ep=2", LANG + "parallel.etp=2"],
    [LANG + "arch.moe.experts=8", LANG + "parallel.ep=4", LANG + "parallel.etp=1"],  # EP > DP
    [LANG + "parallel.ep=2", LANG + "parallel.etp=1", "train.moe_dispatcher=deepep", "train.precision=bf16"],
])
def test_possible_expert_layouts_pass_check_config(overrides, capsys, monkeypatch):
    monkeypatch.chdir(CONFIGS)
    assert _check_config(overrides, capsys) == []


def test_expert_layout_resolution():
    """etp defaults to tp; the LLM gets the expert view only when experts fold."""
    config = _config(BASE)
    llm = config.llm
    assert llm.parallel.etp is None and llm.parallel.expert_tp == 2 and llm.expert_layout() is None
    assert _config(BASE + [LANG + "parallel.etp=2"]).llm.expert_layout() is None  # etp = tp: the dense layout
    assert _config(BASE + [LANG + "parallel.ep=4", LANG + "parallel.etp=1"]).llm.expert_layout() == (1, 4)
    assert _config(BASE + [LANG + "parallel.etp=1"]).llm.expert_layout() == (1, 1)


# ---------------------------------------------------------------- placements and init (one process)


@pytest.mark.parametrize("gated", [True, False])
def test_expert_init_is_layout_independent_and_draws_only_local_experts(gated, monkeypatch):
    """Each (ep, etp) shard of a large (tiled) expert weight equals the slice of the
    one-process tensor, and draws only tiles of its own experts."""
    import mimo.parallel.init as init_mod
    from mimo.llm.experts import expert_placements

    experts, dim, ffn = 4, 21, 10  # small tiles stand in for large tensors: tiled, ragged against them
    monkeypatch.setattr(init_mod, "SMALL", 64)
    monkeypatch.setattr(init_mod, "TILE", (4, 8))
    drawn = []
    tiled = init_mod._tiled_normal
    monkeypatch.setattr(init_mod, "_tiled_normal", lambda shape, index, seed, std: drawn.append(index) or tiled(shape, index, seed, std))
    for name, pl in expert_placements(experts, dim, ffn, gated, folded=True).items():
        assert pl.full_shape[0] * pl.full_shape[1] * pl.full_shape[2] > init_mod.SMALL
        full = init_full(pl.full_shape, 5, std=0.02)
        for ep, etp in ((2, 2), (4, 1), (1, 2)):
            for e in range(ep):
                for t in range(etp):
                    drawn.clear()
                    sizes, coords = {"ep": ep, "etp": etp}, {"ep": e, "etp": t}
                    local = init_local(pl, sizes, coords, 5, std=0.02)
                    assert torch.equal(local, shard_full(full, pl, sizes, coords)), (name, ep, etp, e, t)
                    k = experts // ep
                    assert drawn and all(ix[0].start >= e * k and ix[0].stop <= (e + 1) * k for ix in drawn)


def test_gated_up_proj_shard_holds_gate_and_up_rows():
    """etp splits gate and up separately: a shard's first half is gate rows, second up rows."""
    from mimo.llm.experts import expert_placements

    pl = expert_placements(4, 3, 6, True, folded=True)["up_proj"]
    full = torch.arange(4 * 12 * 3, dtype=torch.float32).reshape(4, 12, 3)
    local = shard_full(full, pl, {"ep": 2, "etp": 2}, {"ep": 1, "etp": 1})
    assert torch.equal(local, torch.cat([full[2:4, 3:6], full[2:4, 9:12]], dim=1))
    assert pl.from_record(json.loads(json.dumps(pl.record({"ep": 2, "etp": 2}, {"ep": 1, "etp": 1})))) == pl


# ---------------------------------------------------------------- the model at EP layouts (gloo)


def _raw_config(which: str = "moe_tp") -> dict:
    with open(os.path.join(CONFIGS, f"{which}.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["data"] = {"source": "synthetic", "max_sample_tokens": 256}  # nothing is read
    return cfg


def _config(overrides: list[str]):
    from mimo.compose.config import config_from_dict

    which = "moe_pp" if overrides[:1] == ["pp"] else "moe_tp"
    return config_from_dict(_raw_config(which), [o for o in overrides if o != "pp"])


def _build(overrides: list[str]):
    from mimo.compose.model import MimoModel

    return MimoModel(_config(overrides), dist.get_rank())


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _data(name: str, shape, source: int) -> torch.Tensor:
    """The toy loss's data of one parameter from one source (a rank, or a dense replica)."""
    g = torch.Generator().manual_seed(param_seed(source, name))
    return torch.rand(shape, generator=g, dtype=torch.float64)


def _sources(info, model) -> list[int]:
    """Whose data this rank's copy sees (see module doc): experts on the expert view, the ranks
    of its expert-model-parallel group (one edp coordinate, this stage); a dense parameter its
    own replica (its cp, dp coordinates) and, where its gradient is partial over tp, its tp one."""
    grid, rank = model.llm.grid, model.rank
    if info.view is model.llm.ctx.expert:
        ev = info.view.grid
        mine = ev.coords(rank)
        return [r for r in ev.ranks if ev.coords(r)["edp"] == mine["edp"] and ev.coords(r)["pp"] == mine["pp"]]
    c = grid.coords(rank)
    return [1000 + c["dp"] * 10 + c["cp"] * 100 + (c["tp"] if "tp" in info.placement.partial else 0)]


def _toy_loss(model) -> torch.Tensor:
    """``sum_s  A_s * w^2`` over this rank's LLM shards, ``A_s`` each source's full tensor sliced
    by the parameter's placement (a stand-in for the dispatched MoE forward: see module doc)."""
    total = torch.zeros((), dtype=torch.float64)
    for name, info in model.llm.module.param_table().items():
        for s in _sources(info, model):
            a = shard_full(_data(name, info.placement.full_shape, s), info.placement, info.sizes, info.coords)
            total = total + (a * info.param.double() ** 2).sum()
    return total


def _grad_case(overrides: list[str]) -> dict:
    """Rank function: the toy loss's gradients through the run's GradSync (edp for experts, the
    dense dp for the rest) and the global norm; the LLM's full weights and gradients."""
    from mimo.training.optim import GradSync, global_grad_norm

    model = _build(overrides)
    params = [p for p in model.train_params() if p.module == model.llm.name]
    sync = GradSync(params)
    sync.zero_grad()
    _toy_loss(model).backward()
    sync.finish()
    norm = global_grad_norm(params, "cpu")
    table = model.llm.module.param_table()
    groups = {n: (None if g is None else dist.get_process_group_ranks(g))
              for n, g in ((p.name, p.dp_group) for p in params)}
    from mimo.parallel.params import full_tensors

    shapes = {n: tuple(i.param.shape) for n, i in table.items()}
    partial = {n: i.placement.partial for n, i in table.items()}
    owners = {n: i.is_owner for n, i in table.items()}
    experts = next(m for m in model.llm.module.modules() if type(m).__name__ == "GroupedExperts")
    return {"weights": full_tensors(table), "grads": full_tensors(table, grads=True), "norm": float(norm), "groups": groups,
            "shapes": shapes, "owners": owners, "partial": partial, "pp": model.llm.ctx.pp_rank,
            "local_experts": (experts.first_expert, experts.local_experts)}


def _reference_weights(overrides: list[str]) -> dict:
    """Rank function on a one-rank pool: the one-process model's LLM weights."""
    import dataclasses

    from mimo.compose.model import MimoModel
    from mimo.parallel.params import full_tensors

    config = _config(overrides)
    config.world_size = 1
    for module in config.modules.values():
        module.parallel = dataclasses.replace(module.parallel, tp=1, cp=1, dp=1, pp=1, ep=1, etp=None, ranks="0:1",
                                              sequence_parallel=False)
    return full_tensors(MimoModel(config, 0).llm.module.param_table())


def _reference(pools, overrides: list[str], cache={}) -> dict:
    """The one-process weights, shared by the layouts of one model."""
    key = tuple(o for o in overrides if "parallel" not in o)
    if key not in cache:
        cache[key] = pools(1).run(_reference_weights, list(key))[0]
    return cache[key]


@pytest.fixture(scope="module")
def grad_results(pools):
    return {name: pools(4).run(_grad_case, overrides) for name, overrides in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_weights_are_the_one_process_init(pools, grad_results, name):
    """Gathered over ep and etp, every weight equals the one-process model's, bit for bit; each
    rank holds its contiguous block of E / ep experts and F / etp of each."""
    config = _config(LAYOUTS[name])
    etp, ep = config.llm.expert_layout()
    moe = config.llm.arch.moe
    ref = _reference(pools, LAYOUTS[name])
    stage_names = defaultdict(set)
    for rank, r in enumerate(grad_results[name]):
        stage_names[r["pp"]] |= set(r["weights"])
        for n, w in r["weights"].items():
            assert torch.equal(w, ref[n]), (rank, n)
        ev = config.llm.parallel.grid(4).expert_view(etp, ep)
        e = ev.coords(rank)["ep"]
        assert r["local_experts"] == (e * moe.experts // ep, moe.experts // ep)
        for n, shape in r["shapes"].items():
            if _is_expert(n):
                width = (2 if moe.act == "swiglu" else 1) * moe.ffn // etp
                want = (moe.experts // ep, width, r["weights"][n].shape[2]) if n.endswith("up_proj") else \
                    (moe.experts // ep, r["weights"][n].shape[1], moe.ffn // etp)
                assert shape == want, (rank, n, shape)
    assert set().union(*stage_names.values()) == set(ref)  # every parameter on some stage


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_grads_reduce_over_edp_and_count_once_in_the_norm(grad_results, name):
    """Experts' gradients summed over edp, the rest over the dense dp: equal to the one-process
    gradient of the toy loss; the global norm counts every element once."""
    config = _config(LAYOUTS[name])
    etp, ep = config.llm.expert_layout()
    ev = config.llm.parallel.grid(4).expert_view(etp, ep)
    dense = config.llm.parallel.grid(4)
    results = grad_results[name]

    total = torch.zeros((), dtype=torch.float64)
    seen = set()
    for rank, r in enumerate(results):
        for n, g in r["grads"].items():
            w = r["weights"][n].double()
            if _is_expert(n):  # every rank of this stage sent its tokens to some expert shard
                sources = dense.group_ranks(("tp", "cp", "dp"), rank)
            else:  # each replica's data; each tp rank's own where the gradient is partial over tp
                tps = range(dense.shape["tp"]) if "tp" in r["partial"][n] else (0,)
                sources = [1000 + dp * 10 + cp * 100 + tp for dp in range(dense.shape["dp"])
                           for cp in range(dense.shape["cp"]) for tp in tps]
            a = sum(_data(n, w.shape, s) for s in sources)
            want = 2 * a * w
            torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-7, msg=f"{name}: rank {rank} {n}")
            if n not in seen:
                seen.add(n)
                total += (want ** 2).sum()
            group = r["groups"].get(n)
            if _is_expert(n):
                edp = [q for q in ev.ranks if {k: v for k, v in ev.coords(q).items() if k != "edp"}
                       == {k: v for k, v in ev.coords(rank).items() if k != "edp"}]
                assert (group or [rank]) == edp, (rank, n, group)
                assert r["owners"][n] == (ev.coords(rank)["edp"] == 0)
            elif n in r["groups"]:
                dp = dense.group_ranks(("cp", "dp"), rank)
                assert (group or [rank]) == dp, (rank, n, group)
    for r in results:
        assert abs(r["norm"] - total.sqrt().item()) <= 1e-5 * total.sqrt().item(), (r["norm"], total.sqrt().item())


# ---------------------------------------------------------------- checkpoint at an EP layout


def _state(model, optimizers) -> dict:
    from mimo.training.checkpoint import _local_parts

    out = {}
    for part in _local_parts(model):
        opt = optimizers.get(part.module)
        for n, info in part.table.items():
            st = opt.state.get(info.param, {}) if opt is not None else {}
            out[part.module, n] = (info.param.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()})
    return out


def _differ(a: dict, b: dict) -> list[str]:
    bad = []
    for key, (w, st) in a.items():
        w2, st2 = b[key]
        if not torch.equal(w, w2):
            bad.append(f"{key} weights")
        if set(st) != set(st2) or any(not torch.equal(torch.as_tensor(st[k]), torch.as_tensor(st2[k])) for k in st):
            bad.append(f"{key} optimizer state")
    return bad


def _ckpt_case(overrides: list[str], root: str) -> dict:
    """Rank function: one AdamW step on the toy loss, save; a model of another seed loads it
    and must hold the same weights and optimizer state."""
    from mimo.training.checkpoint import load_checkpoint, save_checkpoint
    from mimo.training.optim import model_optimizers
    from mimo.training.precision import PrecisionPolicy

    def built(extra):
        model = _build(overrides + extra)
        return model, model_optimizers(model.config, model, PrecisionPolicy.named("fp32"))

    model, optimizers = built([])
    sync = model.grad_sync
    sync.zero_grad()
    _toy_loss(model).backward()
    sync.finish()
    for opt in optimizers.values():
        opt.step()
    path = save_checkpoint(model, optimizers, 1, root)
    want = _state(model, optimizers)
    other, other_opts = built(["train.seed=7"])
    before = len(_differ(want, _state(other, other_opts)))
    load_checkpoint(other, path, other_opts)
    from mimo.parallel.params import full_tensors

    return {"path": path, "before": before, "mismatch": _differ(want, _state(other, other_opts)),
            "full": full_tensors(model.llm.module.param_table())}


@pytest.mark.parametrize("name", ["ep4 etp1 (EP > DP, edp 1)", "ep2 etp1 (edp 2)", "ep2 etp2 (edp 1)"])
def test_checkpoint_round_trip_at_an_ep_layout(pools, tmp_path, name):
    """Every expert shard is written once (by its edp = 0 rank, whatever its dense dp
    coordinate) and every rank loads back exactly what was saved."""
    results = pools(4).run(_ckpt_case, LAYOUTS[name], str(tmp_path / "ckpt"))
    assert all(r["before"] > 0 for r in results)  # the other seed did differ
    assert all(r["mismatch"] == [] for r in results), [r["mismatch"][:3] for r in results]
    full, path = results[0]["full"], results[0]["path"]
    pieces = defaultdict(list)
    for file in sorted(os.listdir(path)):
        if file.startswith("language-") and file.endswith(".model.safetensors"):
            with safe_open(os.path.join(path, file), "pt") as f:
                records = json.loads(f.metadata()["placements"])
                for n in f.keys():
                    pieces[n].append((records[n], f.get_tensor(n)))
    assert set(pieces) >= set(full)
    config = _config(LAYOUTS[name])
    etp, ep = config.llm.expert_layout()
    for n, want in full.items():
        count = torch.zeros(want.shape, dtype=torch.int64)
        got = torch.zeros_like(want)
        for rec, t in pieces[n]:
            from mimo.parallel.placement import ParamPlacement

            pl = ParamPlacement.from_record(rec)
            for full_ix, local_ix in pl.runs(rec["sizes"], rec["coords"]):
                count[full_ix] += 1
                got[full_ix] = t[local_ix]
        assert torch.equal(count, torch.ones_like(count)), (n, count.unique())  # every element exactly once
        assert torch.equal(got, want), n
        if _is_expert(n):
            assert len(pieces[n]) == ep * etp and {tuple(sorted(r["coords"].items())) for r, _ in pieces[n]} == \
                {(("ep", e), ("etp", t)) for e in range(ep) for t in range(etp)}


def test_checkpoints_from_before_folding_still_load_at_etp_tp():
    """Checkpoints written before parallel folding recorded etp: 1 for every module (the only
    value then), meaning experts laid out like the dense layers: they load at etp = tp as
    written, and at a folded layout resharded."""
    from mimo.core.errors import CheckpointError
    from mimo.training.checkpoint import check_layout, layout_change, layout_of

    config = _config([])
    old = layout_of(config)
    old.pop("expert_layout")
    for m in old["modules"].values():
        m["etp"] = 1
    assert check_layout({"layout": old}, config, "old") is True
    folded = _config(["modules.language.parallel.etp=1"])
    assert check_layout({"layout": old}, folded, "old") is False
    assert "etp=1" in layout_change({"layout": old}, folded, "old") and "resharding" in layout_change({"layout": old}, folded, "old")
    assert check_layout({"layout": layout_of(config)}, config, "new") is True
    with pytest.raises(CheckpointError, match="modules"):  # another model altogether
        check_layout({"layout": {**old, "modules": {"other": {}}}}, config, "old")

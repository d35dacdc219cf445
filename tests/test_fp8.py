"""FP8 GEMMs through the seam (``mimo.parallel.fp8``, ``train.fp8``).

* each recipe's forward and both gradients against the same quantization written out in fp64
  (``torch._scaled_mm`` runs on this CPU; grouped products dequantize), and against the plain
  product within FP8's rounding;
* layouts: a TP MLP (column- then row-parallel, sequence parallel on and off) and the MoE's
  grouped experts at tp 2 and 3 and at ep 3 (all-to-all) against one process: with the amax
  reductions over TP they quantize exactly as one process does, so they agree to fp32 rounding;
* delayed scaling: the history window, its once-per-step reduction and roll, and resuming a
  `mimo train` run from a checkpoint is exact (the history travels with it);
* the row padding of grouped FP8 products and ``train.fp8``'s config errors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mimo.core.errors import ConfigError
from mimo.core.testing import rel_err
from mimo.llm.experts import GroupedExperts
from mimo.llm.router import Routing
from mimo.parallel import gemm
from mimo.parallel.context import ParallelContext
from mimo.parallel.fp8 import (E4M3, E5M2, FP8Site, amax_of, apply_fp8, fit_history, history_step, padded_groups,
                                quantize)
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mimo.parallel.placement import gather_full, shard_full

TOL = 1e-5  # fp32 accumulation of identical FP8 operands, summed in another order
WORLD = 3


def _deq(x, dtype, amax):
    q, inv = quantize(x, dtype, amax)
    return q.double() * inv.double()


def _reference(kind: str, x, w, g):
    """(y, dx, dw) of ``x @ w.T`` with each recipe's quantization, in fp64 (one process)."""
    if kind == "rowwise":
        y = _deq(x, E4M3, amax_of(x, -1)) @ _deq(w, E4M3, amax_of(w, -1)).T
        wq, w_inv = quantize(w, E4M3, amax_of(w, -1))  # dgrad: the forward's weight, its scales in g
        gw = g * w_inv.T
        dx = _deq(gw, E4M3, amax_of(gw, -1)) @ wq.double()
        dw = _deq(g.T, E4M3, amax_of(g.T, -1)) @ _deq(x, E4M3, amax_of(x, 0))
        return y, dx, dw
    xd, wd, gd = _deq(x, E4M3, amax_of(x, None)), _deq(w, E4M3, amax_of(w, None)), _deq(g, E5M2, amax_of(g, None))
    return xd @ wd.T, gd @ wd, gd.T @ xd


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("rows", [37, 48])
def test_linear_is_its_quantization_in_fp64(kind, rows):
    g_ = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 64, generator=g_) * 3).requires_grad_(True)
    w = torch.nn.Parameter(torch.randn(48, 64, generator=g_) * 0.1)
    owner = torch.nn.Module()
    owner.w = w
    if kind == "delayed":  # empty history: the first step scales by the current amax
        owner.register_buffer("fp8_history", torch.zeros(1, 3, 4))
    site = FP8Site(kind, None, (), owner if kind == "delayed" else None, [w])
    y = gemm.linear(x, w, None, site)
    g = torch.randn(rows, 48, generator=g_)
    y.backward(g)
    ry, rdx, rdw = _reference(kind, x.detach(), w.detach(), g)
    for name, got, want in (("y", y, ry), ("dx", x.grad, rdx), ("dw", w.grad, rdw)):
        assert rel_err(got.double(), want) <= TOL, (name, rel_err(got.double(), want))
    plain = x.detach() @ w.detach().T
    assert 1e-3 < rel_err(y.detach(), plain) < 0.08  # quantized: near the product, not equal to it
    if kind == "delayed":  # this step's amaxes recorded in the current slot
        want = torch.stack([amax_of(x, None), amax_of(w, None), amax_of(g, None)]).float()
        assert torch.equal(owner.fp8_history[0, :, 0], want)


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "delayed"])
def test_a_product_of_no_rows(kind):
    """A rank with no rows this microbatch (a data-parallel tower given no image): an empty output,
    a zero weight gradient, and (delayed) amax 0 recorded, which takes no part in the window's max."""
    w = torch.nn.Parameter(torch.randn(48, 64))
    owner = torch.nn.Module()
    owner.w = w
    if kind == "delayed":
        owner.register_buffer("fp8_history", torch.zeros(1, 3, 4))
    x = torch.zeros(0, 64, requires_grad=True)
    y = gemm.linear(x, w, None, FP8Site(kind, None, (), owner if kind == "delayed" else None, [w]))
    y.backward(torch.zeros(0, 48))
    assert y.shape == (0, 48) and x.grad.shape == (0, 64) and not w.grad.any()
    if kind == "delayed":
        assert owner.fp8_history[0, 0, 0] == 0 and owner.fp8_history[0, 1, 0] == w.detach().abs().max()


def _graph_nodes(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    return names


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "delayed", "blockwise"])
def test_scales_stay_out_of_autograd(kind):
    """The amaxes and scales take no gradient: no autograd node may compute them (it would hold
    |x| until backward, and put a TP group's all-reduce of an amax into the graph)."""
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48, 64))
    owner = torch.nn.Module()
    owner.w = w
    owner.register_buffer("fp8_history", torch.zeros(1, 3, 4))
    site = FP8Site(kind, None, (), owner if kind == "delayed" else None, [w])
    nodes = _graph_nodes(gemm.linear(x * 2, w, None, site))
    experts = torch.nn.Parameter(torch.randn(3, 48, 64))
    grouped_kind = "blockwise" if kind == "blockwise" else "rowwise"
    nodes |= _graph_nodes(gemm.grouped_linear(x * 2, experts, torch.tensor([10, 20, 32]), FP8Site(grouped_kind, None, (), None, [experts])))
    assert not {n for n in nodes if n.startswith(("Abs", "Amax", "Reciprocal", "Clamp", "Div"))}, nodes


def test_delayed_history_window_and_its_scales():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 32))
    owner = torch.nn.Module()
    owner.w = w
    owner.register_buffer("fp8_history", torch.zeros(1, 3, 3))  # current slot + 2 past steps
    site = owner.recipe = FP8Site("delayed", None, (), owner, [w])
    xs = [torch.randn(16, 32) * s for s in (1.0, 4.0, 0.5, 0.25)]
    amaxes = []
    for step, x in enumerate(xs):
        past = owner.fp8_history[0, 0, 1:].max()
        y = gemm.linear(x, w, None, site)
        amax = past if past > 0 else amax_of(x, None)  # the scale came from the window's max
        want = _deq(x, E4M3, amax) @ _deq(w, E4M3, owner.fp8_history[0, 1, 1:].max() if step else amax_of(w, None)).T
        assert rel_err(y.double(), want) <= TOL, step
        gemm.linear(x * 0.5, w, None, site)  # a second microbatch: the slot keeps the max
        amaxes.append(amax_of(x, None))
        assert owner.fp8_history[0, 0, 0] == amaxes[-1]
        history_step(owner)
        assert owner.fp8_history[0, 0, 0] == 0 and owner.fp8_history[0, 0, 1] == amaxes[-1]
        if step:
            assert owner.fp8_history[0, 0, 2] == amaxes[-2]  # the window: 2 steps, oldest dropped
    # microbatches: two forwards (each writing the history) before their backwards
    a, b = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    ya, yb = gemm.linear(a, w, None, site), gemm.linear(b, w, None, site)
    ya.sum().backward()
    yb.sum().backward()
    assert owner.fp8_history[0, 2, 0] == 1.0  # the output gradients (ones) recorded by both backwards


def _group_columns_deq(t, ends):
    """``t``'s rows quantized with one scale per group of rows and column, in fp64 (a plain
    loop: the weight gradient's reference)."""
    out, start = [], 0
    for end in ends.tolist():
        out.append(_deq(t[start:end], E4M3, amax_of(t[start:end], 0)))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("wgrad", [True, False], ids=["fp8-wgrad", "plain-wgrad"])
def test_grouped_is_its_rowwise_quantization_and_pads_to_16(wgrad):
    """Forward and input gradient row-wise; the weight gradient (``wgrad``) with one scale per
    expert and column of both operands (``g`` and the kept ``x``), or unquantized."""
    g_ = torch.Generator().manual_seed(5)
    ends = torch.tensor([10, 10, 33, 50, 50])  # an empty expert, one at the end
    x = torch.randn(50, 32, generator=g_).requires_grad_(True)
    w = torch.nn.Parameter(torch.randn(5, 48, 32, generator=g_))
    site = FP8Site("rowwise", None, (), None, [w], wgrad=wgrad)
    y = gemm.grouped_linear(x, w, ends, site)
    g = torch.randn(50, 48, generator=g_)
    y.backward(g)
    xd = _deq(x.detach(), E4M3, amax_of(x.detach(), -1))
    wd = _deq(w.detach(), E4M3, amax_of(w.detach(), -1))
    wq, w_inv = quantize(w.detach(), E4M3, amax_of(w.detach(), -1))
    gc, xc = (_group_columns_deq(t, ends) for t in (g, x.detach())) if wgrad else (g.double(), x.detach().double())
    start, ry, rdx, rdw = 0, [], [], []
    for e, end in enumerate(ends.tolist()):
        ry.append(xd[start:end] @ wd[e].T)
        gw = g[start:end] * w_inv[e].T  # dgrad: the forward's weight, its row scales in g
        rdx.append(_deq(gw, E4M3, amax_of(gw, -1)) @ wq[e].double())
        rdw.append(gc[start:end].T @ xc[start:end])
        start = end
    for name, got, want in (("y", y, torch.cat(ry)), ("dx", x.grad, torch.cat(rdx)), ("dw", w.grad, torch.stack(rdw))):
        assert rel_err(got.double(), want) <= TOL, name
    dest, pends, cap = padded_groups(ends, 50)
    assert pends.tolist() == [16, 16, 48, 80, 80] and cap == 50 + 16 * 5
    starts = [0, 16, 16, 48, 80]
    want = [starts[e] + i for e, (a, b) in enumerate(zip([0, 10, 10, 33, 50], ends.tolist())) for i in range(b - a)]
    assert dest.tolist() == want


def test_non_multiple_of_16_stays_in_the_activations_dtype():
    x, w = torch.randn(5, 20), torch.randn(24, 20)
    assert torch.equal(gemm.linear(x, w, None, FP8Site("tensorwise")), F.linear(x, w))


# ---- layouts against one process -------------------------------------------------------------

_GRIDS: dict[int, ParallelGrid] = {}


def _group(tp: int):
    grid = _GRIDS.setdefault(tp, ParallelGrid({"tp": tp}))
    group = grid.group("tp")
    rank = dist.get_rank()
    return (group, grid.coord(rank, "tp")) if rank in grid else (None, None)


def _mlp_case(tp: int, kind: str, sp: bool):
    """Column- then row-parallel FP8 MLP on this rank's shards vs the one-process FP8 MLP."""
    group, r = _group(tp)
    if r is None:
        return None
    g_ = torch.Generator().manual_seed(11)
    D, Fh, T = 32, 96, 30  # F / tp: 48, 32 (multiples of 16: FP8 takes them); T: a multiple of tp (SP)
    if kind == "blockwise":  # F / tp 128: shards of whole 128-blocks (D, T: partial tiles, on every rank alike)
        D, Fh = 48, 256
    X, W1, W2, dY = (torch.randn(T, D, generator=g_), torch.randn(Fh, D, generator=g_) * 0.2,
                     torch.randn(D, Fh, generator=g_) * 0.2, torch.randn(T, D, generator=g_))

    def build(ctx):
        up = ColumnParallelLinear(D, Fh, False, ctx, gather_output=False, sequence_parallel=ctx.sequence_parallel)
        down = RowParallelLinear(Fh, D, False, ctx, input_is_parallel=True, sequence_parallel=ctx.sequence_parallel)
        up.load_full_({"weight": W1})
        down.load_full_({"weight": W2})
        mlp = torch.nn.Sequential(up, torch.nn.GELU(), down)
        assert apply_fp8(mlp, kind, ctx, 4) == 2
        return mlp

    out = {}
    for where, ctx in (("one", ParallelContext.for_tp(None)), ("tp", ParallelContext.for_tp(group, sequence_parallel=sp))):
        mlp = build(ctx)
        ys, x = [], None
        for step in range(2):  # delayed: the second step scales from the reduced history
            x = (X.chunk(tp, 0)[r] if where == "tp" and ctx.sequence_parallel else X).clone().requires_grad_(True)
            y = mlp(x)
            y.backward(dY.chunk(tp, 0)[r] if where == "tp" and ctx.sequence_parallel else dY)
            ys.append(y.detach())
            history_step(mlp, (ctx.tp,))
        out[where] = {"y": ys, "dx": x.grad, "dw1": gather_full(mlp[0].weight.grad, mlp[0].placements()["weight"], ctx.dense),
                      "dw2": gather_full(mlp[2].weight.grad, mlp[2].placements()["weight"], ctx.dense)}
    one, got = out["one"], out["tp"]
    errs = {}
    for step in range(2):
        want = one["y"][step].chunk(tp, 0)[r] if sp else one["y"][step]
        errs[f"y{step}"] = rel_err(got["y"][step], want)
    errs["dx"] = rel_err(got["dx"], one["dx"].chunk(tp, 0)[r] if sp else one["dx"])
    errs["dw1"], errs["dw2"] = rel_err(got["dw1"], one["dw1"]), rel_err(got["dw2"], one["dw2"])
    return errs


def _expert_problem(seed: int, E: int, Fh: int, T: int, D: int = 32, K: int = 2):
    """Full expert weights (gated), tokens, output gradients and a routing of ``K`` distinct experts."""
    g_ = torch.Generator().manual_seed(seed)
    up, down = torch.randn(E, 2 * Fh, D, generator=g_) * 0.2, torch.randn(E, D, Fh, generator=g_) * 0.2
    X, dY = torch.randn(T, D, generator=g_), torch.randn(T, D, generator=g_)
    idx = torch.stack([torch.randperm(E, generator=g_)[:K] for _ in range(T)])
    gate = torch.softmax(torch.randn(T, K, generator=g_), -1)
    return up, down, X, dY, idx, gate


def _run_fp8_experts(ctx, up, down, X, dY, idx, gate, kind: str = "rowwise") -> dict:
    """FP8 ``GroupedExperts`` (``kind``: rowwise, or blockwise) on ``ctx`` (its expert view where it has one) holding its
    shard of ``up`` / ``down``: forward and backward on these tokens; the outputs, the input
    gradient and the gathered full weight gradients."""
    E, D, Fh = up.shape[0], up.shape[2], down.shape[2]
    ex = GroupedExperts(E, D, Fh, "swiglu", ctx)
    pls, view = ex.placements(), ctx.expert or ctx.dense
    axes = ("ep", "etp") if ctx.expert else ("tp",)
    sizes, coords = {a: view.size(a) for a in axes}, {a: view.coord(a) for a in axes}
    with torch.no_grad():
        ex.up_proj.copy_(shard_full(up, pls["up_proj"], sizes, coords))
        ex.down_proj.copy_(shard_full(down, pls["down_proj"], sizes, coords))
    assert apply_fp8(ex, kind, ctx) == 1
    x = X.clone().requires_grad_(True)
    y = ex(x, Routing(idx, gate))
    y.backward(dY)
    return {"y": y.detach(), "dx": x.grad, "dup": gather_full(ex.up_proj.grad, pls["up_proj"], view),
            "ddown": gather_full(ex.down_proj.grad, pls["down_proj"], view)}


def _experts_case(tp: int, kind: str = "rowwise"):
    """Grouped FP8 experts (dense view: F split over TP) vs one process, summed over TP
    (blockwise: F / tp 128, whole 128-blocks on each rank)."""
    group, r = _group(tp)
    if r is None:
        return None
    problem = _expert_problem(3, E=4, Fh=128 * tp if kind == "blockwise" else 96, T=40)
    one = _run_fp8_experts(ParallelContext.for_tp(None), *problem, kind)
    got = _run_fp8_experts(ParallelContext.for_tp(group), *problem, kind)
    for k in ("y", "dx"):  # partial sums over TP
        got[k] = got[k].clone()
        dist.all_reduce(got[k], group=group)
    return {k: rel_err(got[k], one[k]) for k in one}


_EP_CTX = {}


def _ep_experts_case(tokens: tuple[int, ...], kind: str = "rowwise"):
    """FP8 experts on the expert view (ep = world, all-to-all dispatch: the grouped products pad
    their rows themselves) vs one process over every rank's tokens: each rank's outputs and
    input gradients, the gathered weight gradients."""
    from mimo.parallel.grid import GroupRegistry

    r, world = dist.get_rank(), dist.get_world_size()
    if world not in _EP_CTX:
        registry = GroupRegistry()
        grid = ParallelGrid({"tp": 1, "cp": 1, "dp": world, "pp": 1}, registry=registry)
        _EP_CTX[world] = ParallelContext(grid, r, registry, expert=(1, world))
    up, down, X, dY, idx, gate = _expert_problem(11, E=2 * world, Fh=16, T=sum(tokens))
    mine = slice(sum(tokens[:r]), sum(tokens[:r + 1]))
    one = _run_fp8_experts(ParallelContext.for_tp(None), up, down, X, dY, idx, gate, kind)
    got = _run_fp8_experts(_EP_CTX[world], up, down, X[mine], dY[mine], idx[mine], gate[mine], kind)
    return {k: rel_err(v, one[k][mine] if k in ("y", "dx") else one[k]) for k, v in got.items() if v.numel()}


def _check(results, tp):
    active = [x for x in results if x is not None]
    assert len(active) == tp
    worst = max(((e, k) for res in active for k, e in res.items()), default=(0.0, ""))
    assert worst[0] <= TOL, f"{worst[1]}: rel err {worst[0]:.3e} > {TOL:.0e}"


@pytest.mark.parametrize("tp,kind,sp", [(tp, kind, sp) for tp in (2, 3) for kind, sp in (
    ("tensorwise", False), ("tensorwise", True), ("rowwise", False), ("rowwise", True), ("delayed", True))]
    + [(2, "blockwise", False), (2, "blockwise", True)])
def test_tp_mlp_quantizes_as_one_process(pools, tp, kind, sp):
    """blockwise: no amax reduction; F / tp a multiple of 128, so every tile and block is whole
    on one rank (see ``mimo.parallel.fp8``)."""
    _check(pools(WORLD).run(_mlp_case, tp, kind, sp), tp)


@pytest.mark.parametrize("tp,kind", [(2, "rowwise"), (3, "rowwise"), (2, "blockwise")])
def test_tp_experts_quantize_as_one_process(pools, tp, kind):
    _check(pools(WORLD).run(_experts_case, tp, kind), tp)


@pytest.mark.parametrize("kind", ["rowwise", "blockwise"])
def test_ep_experts_quantize_as_one_process(pools, kind):
    """ep 3 (all-to-all, ragged tokens per rank, one rank without tokens): FP8 experts quantize
    as one process does (blockwise: each expert's rows reach it in the one-process order, so its
    weight gradient's tiles along them are the same)."""
    _check(pools(WORLD).run(_ep_experts_case, (7, 0, 12), kind), WORLD)


# ---- config ----------------------------------------------------------------------------------


def test_config_errors():
    from mimo.compose.config import config_from_dict
    import yaml
    from pathlib import Path

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "llava-moe.yaml").read_text())
    ok = config_from_dict(cfg, ["train.fp8={recipe: delayed, amax_history: 8, bf16_layers: [first, last, 3]}"])
    assert ok.train.fp8.recipe == "delayed" and ok.train.fp8.kept_layers(32) == {0, 31, 3}
    with pytest.raises(ConfigError, match="train.fp8.recipe: must be 'tensorwise', 'rowwise', 'delayed' or 'blockwise'"):
        config_from_dict(cfg, ["train.fp8={recipe: mxfp8}"])
    with pytest.raises(ConfigError) as e:
        config_from_dict(cfg, ["train.fp8={amax_history: 0, bf16_layers: [middle, -1]}"])
    text = str(e.value)
    assert "train.fp8.amax_history" in text and "'middle'" in text and "-1" in text
    with pytest.raises(ConfigError, match="modules.language.parallel.gtp > 1 is not supported with FP8"):
        config_from_dict(cfg, ["train.fp8={}", "world_size=2", "modules.language.parallel.gtp=2",
                               "modules.language.parallel.ranks=0:2", "modules.vision.parallel.dp=2",
                               "modules.vision.parallel.ranks=0:2"])
    with pytest.raises(ConfigError, match=r"bf16_layers: \[40\] beyond the LLM's 32 layers"):
        config_from_dict(cfg, ["train.fp8={bf16_layers: [40]}"])


# ---- training: delayed scaling resumes exactly -----------------------------------------------


def test_delayed_history_resumes_exactly_from_a_checkpoint(pools, write_demo_config, indexes_here, mimo_here, lend_pools,
                                                          tmp_path):
    """The demo at world 2 (vision dp 2; LLM tp 2 with SP) under ``train.fp8`` delayed: stopped
    after step 2 and resumed, its losses equal the uninterrupted run's (the amax histories are
    in the checkpoint: without them step 3 would scale differently), and differ from plain fp32
    products (FP8 is in effect); turning FP8 off or on across a resume works (the histories are
    optional state). Each ``mimo train`` runs its command line in this process (``mimo_here``). The
    runs that carry a run on from its checkpoint (the resumed run, the changed windows) start
    fresh ranks every run, as from a shell: only the checkpoint carries a run on. The two runs
    from step 0 (the references) and the two that only have to start across an FP8 change run
    their ranks on the session's 2-rank pool (``lend_pools``), no chain's run following its own
    predecessor there."""
    import json
    import os

    from safetensors import safe_open

    with indexes_here():
        config = write_demo_config(tmp_path, seed=4)
    common = ["world_size=2", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
              "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:2", "train.steps=3",
              "train.micro_batches=1", "train.checkpoint.every=1"]
    fp8 = "train.fp8={recipe: delayed, amax_history: 2, bf16_layers: [last]}"

    def train(run, *args, lent=False):
        with lend_pools(pools) if lent else contextlib.nullcontext():
            proc = mimo_here("train", config, f"train.checkpoint.dir={run}/ckpt", *common, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(run / "metrics.jsonl") as f:
            return [json.loads(line)["loss"] for line in f if '"eval"' not in line]

    def histories(run, step):  # every fp8_history of a run's step-N checkpoint, by name
        out = {}
        step_dir = tmp_path / run / "ckpt" / f"step-{step:08d}"
        for f in sorted(p for p in os.listdir(step_dir) if p.endswith(".model.safetensors")):
            with safe_open(f"{step_dir}/{f}", "pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys() if k.endswith("fp8_history") and k not in out})
        return out

    whole = train(tmp_path / "whole", fp8, lent=True)
    train(tmp_path / "resumed", fp8, "--stop-at", "2")
    assert train(tmp_path / "resumed", fp8) == whole
    assert train(tmp_path / "plain", lent=True)[1:] != whole[1:]
    names = list(histories("whole", 3))
    assert any(n.startswith("layers.0.") for n in names) and not any(n.startswith("layers.5.") for n in names)
    assert any("blocks." in n for n in names), names
    # train.fp8 turned off, then on, across a resume: the histories are optional state
    train(tmp_path / "whole", "train.steps=4", lent=True)
    train(tmp_path / "plain", fp8, "train.steps=4", lent=True)

    # amax_history changed across a resume: the stored windows fitted (the newest steps kept, zeros
    # where the window grew), at the same layout and at another (resharded: LLM tp 1 x dp 2)
    before = histories("resumed", 3)
    assert before and all(h.shape[-1] == 3 for h in before.values())
    assert sum(bool(h[..., 1:].any()) for h in before.values()) > len(before) // 2
    at_tp1 = ["modules.language.parallel.tp=1", "modules.language.parallel.dp=2", "modules.language.parallel.sequence_parallel=false"]
    for step, window, layout in ((4, 4, []), (5, 5, at_tp1)):
        train(tmp_path / "resumed", fp8.replace("amax_history: 2", f"amax_history: {window}"), f"train.steps={step}", *layout)
        after = histories("resumed", step)
        assert after.keys() == before.keys()
        kept = before[next(iter(before))].shape[-1] - 1  # past steps stored
        for name, h in after.items():  # slot 1: this step's amaxes; then the stored steps, newest first; then none
            assert h.shape[-1] == window + 1, name
            assert torch.equal(h[..., 2:2 + kept], before[name][..., 1:1 + kept]) and not h[..., 2 + kept:].any(), name
        before = after


def test_compiled_fp8_on_a_gpu_is_refused(monkeypatch):
    """Compiled FP8 products gave zero gradients on an H100 (issue 50): a model on a GPU refuses
    FP8 once its blocks are compiled, and compiling once it has FP8, with the reason; the CPU,
    whose compiled products are the eager ones bit for bit, keeps both."""
    from mimo.compose import model as model_mod
    from mimo.compose.config import Fp8Config
    from mimo.core.errors import MimoError

    model_mod.refuse_compiled_fp8(torch.device("cpu"))
    with pytest.raises(MimoError, match="zero input and weight gradients"):
        model_mod.refuse_compiled_fp8(torch.device("cuda"))

    class Fake:  # what set_fp8 reads before it touches any module
        device, compiled, config = torch.device("cuda"), True, None

    with pytest.raises(MimoError, match="train.compile"):
        model_mod.MimoModel.set_fp8(Fake(), Fp8Config(recipe="rowwise"))


def test_history_fits_another_window():
    saved = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # current slot + 3 past steps
    assert torch.equal(fit_history(saved, (2, 3, 2)), saved[..., :2])  # the current slot and the newest step
    grown = fit_history(saved, (2, 3, 6))
    assert torch.equal(grown[..., :4], saved) and not grown[..., 4:].any()
    assert fit_history(saved, (3, 3, 4)) is None  # another number of products: not a window change


# ---- the GPU's kernels ----------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._scaled_mm / _scaled_grouped_mm kernels)")
@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "delayed"])
def test_gpu_fp8_products_against_bf16_and_the_cpu(kind):
    """On the GPU, bf16 operands: each recipe's dense product and the grouped experts (rows
    padded to 16 per expert, ragged groups, an empty one) against the bf16 product, within FP8's
    rounding (output and gradients within 8% relative: e4m3 keeps 3 mantissa bits, ~3-4% here;
    the experts' weight gradient in FP8 too, per expert and column, padded and aligned rows),
    and against the same quantization of the same bf16 operands run on the CPU (within 1%: the
    GPU's fast accumulation, bf16 rounding of the outputs; fp32 operands would quantize ~2%
    apart from bf16 ones)."""
    dev = torch.device("cuda")
    g_ = torch.Generator().manual_seed(7)
    x0, w0, g0 = torch.randn(333, 256, generator=g_), torch.randn(512, 256, generator=g_) * 0.05, torch.randn(333, 512, generator=g_)
    ends = torch.tensor([40, 40, 200, 333])
    we0 = torch.randn(4, 512, 256, generator=g_) * 0.05

    def dense(device, dtype, fp8):
        x = x0.to(device, dtype).requires_grad_(True)
        w = torch.nn.Parameter(w0.to(device, dtype))
        owner = torch.nn.Module()
        owner.w = w
        if kind == "delayed":
            owner.register_buffer("fp8_history", torch.zeros(1, 3, 4, device=device))
        site = FP8Site(kind, None, (), owner if kind == "delayed" else None, [w]) if fp8 else gemm.DEFAULT_RECIPE
        y = gemm.linear(x, w, None, site)
        y.backward(g0.to(device, dtype))
        return [t.detach().float().cpu() for t in (y, x.grad, w.grad)]

    def grouped(device, dtype, fp8, ends=ends, aligned=False):
        x = x0.to(device, dtype).requires_grad_(True)
        w = torch.nn.Parameter(we0.to(device, dtype))
        site = FP8Site("rowwise", None, (), None, [w]) if fp8 else gemm.DEFAULT_RECIPE
        y = gemm.grouped_linear(x, w, ends.to(device), site, aligned=aligned)
        y.backward(g0.to(device, dtype))
        return [t.detach().float().cpu() for t in (y, x.grad, w.grad)]

    def grouped_aligned(device, dtype, fp8):  # every expert's rows start at a multiple of 16: no padded copies
        return grouped(device, dtype, fp8, torch.tensor([48, 48, 208, 333]), True)

    for name, fn in (("dense", dense), ("grouped", grouped), ("grouped_aligned", grouped_aligned)):
        gpu8, gpu16, cpu8 = fn(dev, torch.bfloat16, True), fn(dev, torch.bfloat16, False), fn("cpu", torch.bfloat16, True)
        for part, a, b, c in zip(("y", "dx", "dw"), gpu8, gpu16, cpu8):
            assert rel_err(a, b) <= 0.08, (name, part, rel_err(a, b))
            assert rel_err(a, c) <= 0.01, (name, part, rel_err(a, c))


@pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch, "_scaled_grouped_mm"),
                    reason="needs a CUDA GPU (torch._scaled_grouped_mm's 2d x 2d form)")
@pytest.mark.parametrize("aligned", [True, False], ids=["laid-out", "padded"])
def test_gpu_native_expert_weight_gradient_against_the_dequantized_one(monkeypatch, aligned):
    """``NATIVE_GROUPED_WGRAD`` (off until this passes on a GPU): the experts' FP8 weight gradient
    by the 2d x 2d kernel against the same float8 operands multiplied dequantized, within 1%
    (bf16 output, another accumulation order); rows not a multiple of 16, an empty expert."""
    from mimo.parallel import fp8 as fp8_mod

    g_ = torch.Generator().manual_seed(9)
    ends = torch.tensor([48, 48, 208, 333] if aligned else [40, 40, 200, 333], device="cuda")
    g, x = torch.randn(333, 512, generator=g_).cuda().bfloat16(), torch.randn(333, 256, generator=g_).cuda().bfloat16()
    want = fp8_mod.grouped_weight_grad_fp8(g, x, ends, aligned, torch.float32)
    monkeypatch.setattr(fp8_mod, "NATIVE_GROUPED_WGRAD", True)
    got = fp8_mod.grouped_weight_grad_fp8(g, x, ends, aligned, torch.float32)
    assert got.shape == want.shape == (4, 512, 256)
    assert rel_err(got.cpu(), want.cpu()) <= 0.01, rel_err(got.cpu(), want.cpu())

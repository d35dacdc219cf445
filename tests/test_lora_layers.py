"""LoRA and DoRA adapters (mimo.parallel.lora) on the TP linear layers against plain torch.

Rank functions build a TP group on the shared 4-rank pool (ranks >= tp sit out and return
None), build the layer at that tp and at one process from the same seeds, and compare the
tp layer (fp32) with a float64 plain-torch reference computed from the one-process layer's full
tensors: ``W' = W + s B A`` (LoRA) or ``m * W' / ||W'||_row`` with the norm detached (DoRA, as
PEFT), ``y = x W'^T + b``. The adapters' B and DoRA's magnitude are randomised (a seeded full
tensor, sliced per placement) so every path of the adapter carries weight. Gradients are read
after ``reduce_partial_grads`` (what training's once-per-step sum of partial gradients does).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mimo.core.errors import ConfigError
from mimo.core.testing import rel_err
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.init import param_seed
from mimo.parallel.layers import ColumnParallelLinear, FusedColumnParallelLinear, RowParallelLinear
from mimo.parallel.lora import LoraSpec, attach, init_magnitudes_
from mimo.parallel.params import full_tensors, load_full_, param_table, reduce_partial_grads
from mimo.parallel.placement import pad_to_multiple, replicated, shard_full, sharded

TOL = 1e-5  # as tests/test_parallel.py (the reference here is float64)
WORLD = 4
TPS = [1, 2, 3]
T_RAGGED = 13
D_IN, D_OUT = 12, 18  # every size divisible by 2 and 3
PARTS = {"q": 12, "k": 6, "v": 6}
GROUPS = [("q",), ("k", "v")]
RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK  # 2, the reference's own (not LoraSpec.scale): a wrong scale shows
KINDS = ("column", "fused_groups", "fused_default", "row")

from tp_cases import seeded as _gen, tp_group as _tp_group  # noqa: E402 (tests/ is on sys.path)


def _build(kind: str, ctx: ParallelContext, bias: bool, spec: LoraSpec, seed: int):
    if kind == "column":
        layer = ColumnParallelLinear(D_IN, D_OUT, bias, ctx)
    elif kind == "row":
        layer = RowParallelLinear(D_OUT, D_IN, bias, ctx)
    else:
        layer = FusedColumnParallelLinear(D_IN, PARTS, bias, ctx)
    layer.init_weights(seed, std=0.3, bias_std=0.5)
    names = attach(layer, spec, param_seed(seed, "lora"), GROUPS if kind == "fused_groups" else None)
    return layer, names


def _adapter_rows(kind: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Each adapter's name under the layer -> the rows [lo, hi) of the full weight it covers."""
    if not kind.startswith("fused"):
        return {"lora": (0, D_IN if kind == "row" else D_OUT)}
    offsets, start = {}, 0
    for p, n in PARTS.items():
        offsets[p] = (start, start + n)
        start += n
    out = {}
    for name in names:
        parts = name.removeprefix("lora.").split("_")
        out[name] = (offsets[parts[0]][0], offsets[parts[-1]][1])
    return out


def _ref_weight(W, leaves, rows, dora: bool):
    """The effective full weight ``W'`` (float64, differentiable in every leaf)."""
    pieces, start = [], 0
    for name, (lo, hi) in sorted(rows.items(), key=lambda kv: kv[1]):
        pieces.append(W[start:lo])
        merged = W[lo:hi] + SCALE * leaves[f"{name}.lora_B"] @ leaves[f"{name}.lora_A"]
        if dora:
            merged = leaves[f"{name}.lora_magnitude"][:, None] * merged / merged.norm(dim=1, keepdim=True).detach()
        pieces.append(merged)
        start = hi
    pieces.append(W[start:])
    return torch.cat(pieces)


def _case(tp: int, kind: str, sp: bool, bias: bool, dora: bool, seed: int, group, r: int):
    """One layer: {check: rel_err} and [names of exact checks that failed]."""
    errs, bad = {}, []
    spec = LoraSpec(RANK, ALPHA, dora=dora)
    layer, names = _build(kind, ParallelContext.for_tp(group, sequence_parallel=sp), bias, spec, seed)
    one, one_names = _build(kind, ParallelContext.for_tp(None), bias, spec, seed)
    assert names == one_names and layer.sequence_parallel == (sp and tp > 1)
    table = param_table(layer)
    full = {n: p.detach().clone() for n, p in one.named_parameters()}
    assert set(full) == set(table), (sorted(full), sorted(table))

    # layout-independent init: every local tensor is its slice of the one-process one; B = 0
    for n, info in table.items():
        if n.endswith("lora_magnitude"):
            continue  # set from the base weight below
        if not torch.equal(info.param.detach(), shard_full(full[n], info.placement, info.sizes, info.coords)):
            bad.append(f"init:{n}")
        if n.endswith("lora_B") and info.param.detach().abs().sum() != 0:
            bad.append(f"init_B_zero:{n}")

    # randomise B (a seeded full tensor, each rank its slice), then DoRA's magnitude
    g = _gen(seed, "B")
    for n in table:
        if n.endswith("lora_B"):
            full[n] = 0.5 * torch.randn(full[n].shape, generator=g)
    load_full_(table, full, strict=False)
    rows = _adapter_rows(kind, names)
    W64 = full["weight"].double()
    if dora:
        init_magnitudes_(layer)
        got = full_tensors(table)
        for name, (lo, hi) in rows.items():
            want = (W64[lo:hi] + SCALE * full[f"{name}.lora_B"].double() @ full[f"{name}.lora_A"].double()).norm(dim=1)
            errs[f"init_magnitude:{name}"] = rel_err(got[f"{name}.lora_magnitude"], want)
            full[f"{name}.lora_magnitude"] = (want * (0.5 + torch.rand(hi - lo, generator=g, dtype=torch.float64))).float()
        load_full_(table, full, strict=False)

    # the reference, float64
    T = pad_to_multiple(T_RAGGED, tp) if sp else T_RAGGED
    n_in = layer.in_features
    n_out = sum(PARTS.values()) if kind.startswith("fused") else layer.out_features
    gx = _gen(seed, "x")
    X, dY = torch.randn(T, n_in, generator=gx), torch.randn(T, n_out, generator=gx)
    leaves = {n: t.double().requires_grad_(True) for n, t in full.items()}
    Xr = X.double().requires_grad_(True)
    Yr = F.linear(Xr, _ref_weight(leaves["weight"], leaves, rows, dora), leaves.get("bias"))
    Yr.backward(dY.double())

    # the layer at tp
    if kind == "row":
        x = X.chunk(tp, -1)[r].clone().requires_grad_(True)  # input_is_parallel
        want_dx = Xr.grad.chunk(tp, -1)[r]
    else:
        x = (X.chunk(tp, 0)[r] if layer.sequence_parallel else X).clone().requires_grad_(True)
        want_dx = Xr.grad.chunk(tp, 0)[r] if layer.sequence_parallel else Xr.grad
    y = layer(x)
    if kind == "row":
        ys = [y]
        if layer.sequence_parallel:
            wants, dys = [Yr.chunk(tp, 0)[r]], [dY.chunk(tp, 0)[r]]
        else:
            wants, dys = [Yr], [dY]
    elif kind == "column":
        ys, wants, dys = [y], [Yr.chunk(tp, -1)[r]], [dY.chunk(tp, -1)[r]]
    else:
        ys = list(y)
        sizes = list(PARTS.values())
        wants = [p.chunk(tp, -1)[r] for p in Yr.split(sizes, -1)]
        dys = [p.chunk(tp, -1)[r] for p in dY.split(sizes, -1)]
    for i, (got, want) in enumerate(zip(ys, wants)):
        errs[f"out{i}"] = rel_err(got, want)
    torch.autograd.backward(ys, dys)
    reduce_partial_grads(table)
    errs["dx"] = rel_err(x.grad, want_dx)
    for n, got in full_tensors(table, grads=True).items():
        errs[f"d:{n}"] = rel_err(got, leaves[n].grad)
    return errs, bad


def _lora_case(tp: int, seed: int, kinds=KINDS):
    group, r = _tp_group(tp)
    if r is None:
        return None
    errs, bad = {}, []
    for kind in kinds:
        for sp in ((False, True) if tp > 1 else (False,)):
            for dora in (False, True):
                bias = sp != dora  # bias on and off, with LoRA and with DoRA (outside DoRA's scaling)
                tag = f"{kind},sp={sp},bias={bias},dora={dora}"
                e, b = _case(tp, kind, sp, bias, dora, param_seed(seed, tag), group, r)
                errs.update({f"{tag}:{k}": v for k, v in e.items()})
                bad += [f"{tag}:{k}" for k in b]
    return {"errs": errs, "bad": bad}


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("tp", TPS)
def test_lora_layers_match_one_process(pools, tp):
    results = pools(WORLD).run(_lora_case, tp, 500 + tp)
    active = [x for x in results if x is not None]
    assert len(active) == tp
    for rank, res in enumerate(active):
        assert not res["bad"], f"rank {rank}: differs from the one-process init: {res['bad']}"
        worst = max(res["errs"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, f"rank {rank}: {worst[0]}: rel err {worst[1]:.3e} > {TOL:.0e}"
        # every kind, layout and adapter path was checked, gradients of every adapter weight included
        assert any(k.endswith("lora.k_v.lora_magnitude") for k in res["errs"])
        assert any(k.endswith("d:lora.lora_A") for k in res["errs"])
        assert any("bias=True,dora=True" in k for k in res["errs"]) and any("bias=False" in k for k in res["errs"])
        assert any("sp=True" in k for k in res["errs"]) == (tp > 1)


def test_attach_refuses_non_consecutive_groups():
    spec = LoraSpec(RANK, ALPHA)
    for groups in ([("q", "v")], [("k", "q")]):
        layer = FusedColumnParallelLinear(D_IN, PARTS, False, None)
        with pytest.raises(ValueError, match="consecutive"):
            attach(layer, spec, 0, groups)
    for groups in ([("q",), ("q", "k")], [("v",), ("v",)]):  # a part takes one adapter
        layer = FusedColumnParallelLinear(D_IN, PARTS, False, None)
        with pytest.raises(ValueError, match="overlap"):
            attach(layer, spec, 0, groups)
    head = ColumnParallelLinear(D_IN, 37, False, ParallelContext.plan(ParallelGrid({"tp": 2})), pad_out_features=True)
    with pytest.raises(ConfigError, match="padded"):
        attach(head, spec, 0)
    with pytest.raises(ConfigError, match="rank"):
        LoraSpec(0, ALPHA)


@pytest.mark.parametrize("tp", [1, 2])
def test_param_table_lists_adapters_with_placements(tp):
    """At tp (a planning context: shapes and placements, no groups) param_table lists each
    adapter weight with its placement: split as the base weight, partial where its gradient is."""
    ctx = ParallelContext.plan(ParallelGrid({"tp": tp}))
    r, part = RANK, ("tp",) if tp > 1 else ()

    def split(shape, dim, parts=()):
        return sharded(shape, dim, parts=parts) if tp > 1 else replicated(shape)

    want = {
        "column": {"lora.lora_A": replicated((r, D_IN), part), "lora.lora_B": split((D_OUT, r), 0),
                   "lora.lora_magnitude": split((D_OUT,), 0)},
        "row": {"lora.lora_A": split((r, D_OUT), 1), "lora.lora_B": replicated((D_IN, r), part),
                "lora.lora_magnitude": replicated((D_IN,), part)},
        "fused_groups": {"lora.q.lora_A": replicated((r, D_IN), part), "lora.q.lora_B": split((12, r), 0),
                         "lora.q.lora_magnitude": split((12,), 0),
                         "lora.k_v.lora_A": replicated((r, D_IN), part),
                         "lora.k_v.lora_B": split((12, r), 0, (6, 6)), "lora.k_v.lora_magnitude": split((12,), 0, (6, 6))},
        "fused_default": {f"lora.{p}.{w}": pl for p, n in PARTS.items() for w, pl in (
            ("lora_A", replicated((r, D_IN), part)), ("lora_B", split((n, r), 0)), ("lora_magnitude", split((n,), 0)))},
    }
    for kind, expected in want.items():
        layer, names = _build(kind, ctx, True, LoraSpec(RANK, ALPHA, dora=True), 3)
        table = param_table(layer)
        assert sorted(names) == sorted({n.rpartition(".")[0] for n in expected}), (kind, names)
        got = {n: info.placement for n, info in table.items() if ".lora_" in n}
        assert got == expected, kind
        for n, info in table.items():
            assert tuple(info.param.shape) == info.placement.local_shape({"tp": tp}), (kind, n)
        assert [n for n in table if ".lora_" not in n] == (["weight", "bias"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA bf16 case needs a GPU (this machine has none)")
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_lora_layers_cuda_bf16(kind, dora):
    """One process, bf16 on CUDA against the same layer in fp32 on the CPU (TF32 off): output,
    input gradient and every weight gradient within 2e-2 (as tests/test_gpu_fastpaths.py)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        spec = LoraSpec(RANK, ALPHA, dora=dora)
        ref, _ = _build(kind, ParallelContext.for_tp(None), True, spec, 77)
        g = _gen(77, "B")
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n.endswith("lora_B"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
        init_magnitudes_(ref)
        gpu, _ = _build(kind, ParallelContext.for_tp(None), True, spec, 77)
        gpu.load_state_dict(ref.state_dict())
        gpu = gpu.to("cuda", torch.bfloat16)
        with torch.no_grad():  # the reference on the bf16-rounded weights
            for p in ref.parameters():
                p.copy_(p.bfloat16().float())
        X = torch.randn(T_RAGGED, ref.in_features, generator=g).bfloat16().float()
        xr, xg = X.clone().requires_grad_(True), X.cuda().bfloat16().requires_grad_(True)
        yr, yg = ref(xr), gpu(xg)
        yr, yg = (list(yr), list(yg)) if kind.startswith("fused") else ([yr], [yg])
        dys = [torch.randn(y.shape, generator=g) for y in yr]
        torch.autograd.backward(yr, dys)
        torch.autograd.backward(yg, [d.cuda().bfloat16() for d in dys])
        errs = {f"out{i}": rel_err(b.float().cpu(), a) for i, (a, b) in enumerate(zip(yr, yg))}
        errs["dx"] = rel_err(xg.grad.float().cpu(), xr.grad)
        grads = dict(gpu.named_parameters())
        for n, p in ref.named_parameters():
            errs[f"d:{n}"] = rel_err(grads[n].grad.float().cpu(), p.grad)
        assert any(k.endswith("lora_A") for k in errs) and (any("magnitude" in k for k in errs) == dora)
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] <= 2e-2, f"{worst[0]}: rel err {worst[1]:.3e}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _gdn_mixer():
    from mimo.llm.gdn import GatedDeltaNetMixer, GDNConfig

    return GatedDeltaNetMixer(GDNConfig(hidden=16, heads=2, v_heads=4, head_dim=4, v_head_dim=4, conv_kernel=4, chunk=4))


def _mamba_mixer():
    from mimo.llm.mamba2 import Mamba2Config, Mamba2Mixer

    return Mamba2Mixer(Mamba2Config(hidden=16, heads=4, head_dim=3, state=5, groups=2, conv_kernel=4, chunk=4))


def _shared_expert(act: str):
    from mimo.llm.experts import SharedExpert

    return lambda: SharedExpert(16, 12, act, gate=True)


FUSED_HOSTS = {  # case -> (layer, target, its adapters)
    "gdn_in": (_gdn_mixer, "gdn_in", ["a", "b", "q_k_v", "z"]),
    "mamba_in": (_mamba_mixer, "mamba_in", ["z_x_dt_B_C"]),
    "shared swiglu": (_shared_expert("swiglu"), "shared", ["down", "gate", "up"]),
    "shared relu2": (_shared_expert("relu2"), "shared", ["down", "up"]),
}


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("case", list(FUSED_HOSTS))
def test_fused_host_adapters_compute_their_merge(case, dora):
    """A Gated DeltaNet mixer with adapters on its fused input projection (``gdn_in``: q | k | v,
    z, b, a), a Mamba-2 mixer with one adapter on its input rows in two weights (``mamba_in``:
    z | x | dt of one, B | C of the other), and a shared expert with one on each of gate, up
    (rows of its fused up weight) and down (a row-parallel weight; a non-gated one has no gate),
    each B drawn, compute what the layer without adapters computes on the merged weights
    (``merge_adapters``: W + s B A per adapter's rows, DoRA rescaled), fp64, 1e-10; and not
    what the base alone computes."""
    import copy

    from mimo.llm.context import SeqContext
    from mimo.llm.model import LORA_TARGETS
    from mimo.parallel.lora import adapter_sites, attach_targets, merge_adapters

    torch.manual_seed(0)
    make, target, adapters = FUSED_HOSTS[case]
    host = torch.nn.Module()
    host.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    where = "shared" if target == "shared" else "mixer"
    setattr(host.layers["0"], where, make().double())
    with torch.no_grad():
        for p in host.parameters():
            p.normal_(0, 0.3)
    base = copy.deepcopy(getattr(host.layers["0"], where))
    assert attach_targets(host, LoraSpec(RANK, ALPHA, dora=dora), 3, LORA_TARGETS, [target], "t") == [f"layers.0.{where}"]
    mixer = getattr(host.layers["0"], where).double()
    init_magnitudes_(mixer)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3)
            elif name.endswith("lora_magnitude"):
                p.mul_(1.5)
    assert sorted(mixer.lora) == adapters
    state = {n: t.detach() for n, t in mixer.state_dict().items()}
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge_adapters(state, adapter_sites(mixer)))
    x, seq = torch.randn(11, 16, dtype=torch.float64), SeqContext.from_seqlens([5, 6])
    call = (lambda m: m(x)) if target == "shared" else (lambda m: m(x, seq))  # noqa: E731
    with torch.no_grad():
        y, want = call(mixer), call(merged)
        assert rel_err(y, want) <= 1e-10
        assert rel_err(call(base), want) > 1e-3


def test_expert_adapters_compute_their_merge():
    """Routed experts with an adapter per expert on the up (gate | up) and down projections
    (``experts``) compute, on rows grouped by expert (an empty group among them), what the
    experts without adapters compute on the merged weights (W_e + s B_e A_e), fp64, 1e-10; not what
    the base computes. DoRA on experts is refused."""
    import copy

    from mimo.llm.experts import GroupedExperts
    from mimo.llm.model import LORA_TARGETS
    from mimo.parallel.lora import adapter_sites, attach_targets, merge_adapters

    torch.manual_seed(0)
    host = torch.nn.Module()
    host.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    host.layers["0"].experts = GroupedExperts(4, 16, 8, "swiglu").double()
    with torch.no_grad():
        for p in host.parameters():
            p.normal_(0, 0.3)
    base = copy.deepcopy(host.layers["0"].experts)
    with pytest.raises(ConfigError, match="DoRA on the MoE experts"):
        attach_targets(copy.deepcopy(host), LoraSpec(RANK, ALPHA, dora=True), 3, LORA_TARGETS, ["experts"], "t")
    assert attach_targets(host, LoraSpec(RANK, ALPHA), 3, LORA_TARGETS, ["experts"], "t") == ["layers.0.experts"]
    experts = host.layers["0"].experts.double()
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3)
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge_adapters({n: t.detach() for n, t in experts.state_dict().items()}, adapter_sites(experts)))
    x, ends = torch.randn(13, 16, dtype=torch.float64), torch.tensor([3, 3, 9, 13], dtype=torch.int32)
    with torch.no_grad():
        want = merged.compute(x, ends)
        assert rel_err(experts.compute(x, ends), want) <= 1e-10
        assert rel_err(base.compute(x, ends), want) > 1e-3


def test_mamba_input_adapter_needs_its_b_c_rows_split():
    """Where tp does not divide mamba_groups, Mamba-2's B | C rows are replicated (each rank's heads
    read all of them): one adapter over z | x | dt | B | C cannot split as its rows do, and says so."""
    from mimo.llm.model import LORA_TARGETS
    from mimo.parallel.lora import attach_targets

    host = torch.nn.Module()
    host.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    host.layers["0"].mixer = mixer = _mamba_mixer()
    mixer.bc_sharded = False  # (as at tp 2 with one group)
    with pytest.raises(ConfigError, match="mamba_in.*tp .* to divide mamba_groups"):
        attach_targets(host, LoraSpec(RANK, ALPHA), 3, LORA_TARGETS, ["mamba_in"], "t")

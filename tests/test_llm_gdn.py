"""Gated DeltaNet (``G``) over packed sequences: chunked rule vs the naive recurrence, packing, TP.

- chunked == naive per-token recurrence (fp64, outputs and gradients), for the rule alone and
  for the whole layer (convs + rule + gated norm), with sample boundaries inside chunks,
  samples of length 1, exact chunk multiples and a ragged tail;
- packed == each sample alone (fp32, <= 1e-5: outputs, input and parameter gradients);
  perturbing one sample leaves every other sample's output bit-identical;
- tp 1 and 2, with and without sequence parallel, == the one-process layer (forward, input
  gradients, parameter gradients gathered to full), from the same TP-invariant init; with as
  many value heads as q/k heads and with twice as many.
"""

from __future__ import annotations

import pytest
import torch

from mimo.core.batch import PackedBatch
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelGrid
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.gdn import GatedDeltaNet, GDNConfig, gated_delta_chunked, l2norm
from mimo.llm.model import LLMStage, build_stage, count_loss_tokens
from mimo.parallel.params import full_tensors, init_params_, load_full_, param_table, reduce_partial_grads
from mimo.llm.pattern import LayerSpec
from mimo.llm.pipeline import run_pipeline
from mimo.llm.recurrence import gated_delta_naive
from mimo.llm.ssm import kernel, segments
from mimo.parallel import param_seed
from mimo.core.testing import rel_err

TOL = 1e-5
SEQLENS = [5, 1, 12, 1, 9, 2, 8]  # 38 tokens: boundaries inside chunks of 8, length-1 samples


def _cfg(v_heads: int = 4, chunk: int = 8) -> GDNConfig:
    return GDNConfig(hidden=32, heads=2, v_heads=v_heads, head_dim=8, v_head_dim=8, conv_kernel=4, chunk=chunk)


def _gen(seed: int, *salt) -> torch.Generator:
    return torch.Generator().manual_seed(param_seed(seed, "/".join(map(str, salt))))


def _randomise_(layer: torch.nn.Module, seed: int) -> None:
    """TP-invariant init, then every parameter perturbed (so no weight is all-ones/zeros)."""
    table = param_table(layer)
    init_params_(table, seed, std=0.3)
    full = full_tensors(table)
    noisy = {n: t + 0.2 * torch.randn(t.shape, generator=_gen(seed, "noise", n)) for n, t in full.items()}
    load_full_(table, noisy)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _grads(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


# --------------------------------------------------------------------------- algorithm (fp64)
@pytest.mark.parametrize("seqlens,chunk", [
    (SEQLENS, 8),
    (SEQLENS, 4),
    ([16, 16], 8),  # boundaries exactly on chunk edges
    ([1], 8),
    ([1, 1, 1, 1, 1], 2),
    ([23], 64),  # one chunk, ragged
])
def test_gated_delta_chunked_equals_naive_recurrence(seqlens, chunk):
    g = _gen(0, *seqlens, chunk)
    t, h, dk, dv = sum(seqlens), 3, 4, 5
    f64 = dict(dtype=torch.float64)
    q0, k0 = torch.randn(t, h, dk, generator=g, **f64), torch.randn(t, h, dk, generator=g, **f64)
    v = _leaf(torch.randn(t, h, dv, generator=g, **f64))
    gate = _leaf(-torch.rand(t, h, generator=g, **f64) * 2)
    beta = _leaf(torch.rand(t, h, generator=g, **f64))
    q, k = _leaf(q0), _leaf(k0)
    do = torch.randn(t, h, dv, generator=g, **f64)
    ctx = SeqContext.from_seqlens(seqlens)
    seg_T, _ = segments(ctx.cu_seqlens, t)
    qn = lambda: l2norm(q) * dk ** -0.5  # noqa: E731
    results = []
    for fn in (lambda: gated_delta_chunked(qn(), l2norm(k), v, gate, beta, seg_T, chunk),
               lambda: gated_delta_naive(qn(), l2norm(k), v, gate, beta, ctx.cu_seqlens)):
        for x in (q, k, v, gate, beta):
            x.grad = None
        o = fn()
        o.backward(do)
        results.append([o.detach(), *(x.grad.clone() for x in (q, k, v, gate, beta))])
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], *results):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("v_heads", [2, 4])
def test_layer_chunked_equals_naive_fp64(v_heads):
    layer = GatedDeltaNet(_cfg(v_heads, chunk=4)).double()
    _randomise_(layer, seed=3)
    ctx = SeqContext.from_seqlens(SEQLENS)
    g = _gen(4, v_heads)
    x0 = torch.randn(sum(SEQLENS), 32, generator=g, dtype=torch.float64)
    dy = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    out = {}
    for impl in ("chunked", "naive"):
        layer.mixer.impl = impl
        layer.zero_grad()
        x = _leaf(x0)
        y = layer(x, ctx)
        y.backward(dy)
        out[impl] = {"y": y - x0, "dx": x.grad, **_grads(layer)}
    for k in out["naive"]:
        assert rel_err(out["chunked"][k], out["naive"][k]) < 1e-12, k


# --------------------------------------------------------------------------- packing
def _packed_and_alone(layer, x0: torch.Tensor, dy: torch.Tensor) -> tuple[dict, dict]:
    """Outputs (less the residual), input grads and parameter grads: the pack, and each sample
    alone (parameter grads accumulated over the samples)."""
    layer.zero_grad()
    x = _leaf(x0)
    y = layer(x, SeqContext.from_seqlens(SEQLENS))
    y.backward(dy)
    packed = {"y": (y - x0).detach(), "dx": x.grad, **_grads(layer)}

    layer.zero_grad()
    ys, dxs = [], []
    cu = SeqContext.from_seqlens(SEQLENS).cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        x = _leaf(x0[s:e])
        y = layer(x, SeqContext.from_seqlens([e - s]))
        y.backward(dy[s:e])
        ys.append((y - x0[s:e]).detach())
        dxs.append(x.grad)
    return packed, {"y": torch.cat(ys), "dx": torch.cat(dxs), **_grads(layer)}


@pytest.mark.parametrize("v_heads", [2, 4])
def test_packed_equals_unpacked(v_heads):
    """fp32: <= 1e-5 (DESIGN §3), and exactly (1e-10) in fp64.

    The gradients of the few decay parameters (A_log, dt_bias: one value per head, summed over
    every token with both signs) can carry more fp32 rounding than 1e-5 whatever the packing:
    the naive per-token recurrence in fp32 is off from fp64 by as much. For such a tensor the
    fp32 bound is 3x its own fp32 noise (the single sample runs against fp64); the fp64 check
    is the exact one for every tensor.
    """
    layer = GatedDeltaNet(_cfg(v_heads))
    _randomise_(layer, seed=5)
    g = _gen(6, v_heads)
    t = sum(SEQLENS)
    x0, dy = torch.randn(t, 32, generator=g), torch.randn(t, 32, generator=g)
    packed, alone = _packed_and_alone(layer, x0, dy)
    packed64, alone64 = _packed_and_alone(layer.double(), x0.double(), dy.double())
    for k in alone:
        assert rel_err(packed64[k], alone64[k]) <= 1e-10, f"fp64 {k}: {rel_err(packed64[k], alone64[k]):.2e}"
        tol = max(TOL, 3 * rel_err(alone[k], alone64[k]))
        assert rel_err(packed[k], alone[k]) <= tol, f"fp32 {k}: {rel_err(packed[k], alone[k]):.2e} > {tol:.1e}"


def test_perturbing_one_sample_changes_no_other():
    layer = GatedDeltaNet(_cfg(4))
    _randomise_(layer, seed=7)
    ctx = SeqContext.from_seqlens(SEQLENS)
    x = torch.randn(sum(SEQLENS), 32, generator=_gen(8))
    cu = ctx.cu_seqlens.tolist()
    with torch.no_grad():
        y = layer(x, ctx)
        for i in (1, 2, len(SEQLENS) - 1):  # a length-1 sample, a long one, the last one
            s, e = cu[i], cu[i + 1]
            x2 = x.clone()
            x2[s:e] += torch.randn(e - s, 32, generator=_gen(9, i))
            y2 = layer(x2, ctx)
            assert torch.equal(y2[:s], y[:s]) and torch.equal(y2[e:], y[e:]), f"sample {i} leaked"
            assert not torch.equal(y2[s:e], y[s:e])


def test_empty_pack_and_registry():
    arch = HybridArch(pattern="G*G*-", hidden=32, heads=4, vocab=16, gdn_heads=2, gdn_v_heads=4, gdn_chunk=8)
    layer = build_layer(arch, LayerSpec(0, "gdn"))
    assert isinstance(layer, GatedDeltaNet)
    assert (layer.mixer.cfg.heads, layer.mixer.cfg.v_heads, layer.mixer.cfg.head_dim, layer.mixer.cfg.chunk) == (2, 4, 8, 8)
    x = _leaf(torch.randn(0, 32))
    y = layer(x, SeqContext.from_seqlens([]))
    y.sum().backward()
    assert y.shape == (0, 32) and x.grad.shape == (0, 32)


# --------------------------------------------------------------------------- tensor / pipeline parallel
# One 4-rank pool per module: a tp=2 x pp=2 grid. The TP cases run on both TP groups ({0,1},
# {2,3}) at once; the pattern step uses the whole grid.
_GRIDS: dict[str, ParallelGrid] = {}


def _grid() -> ParallelGrid:
    return _GRIDS.setdefault("tp2pp2", ParallelGrid({"tp": 2, "pp": 2}))


def _ctx(tp: int = 2, sp: bool = False) -> ParallelContext:
    """This rank's context: on the tp=2 x pp=2 grid, or of one process (tp = 1)."""
    import torch.distributed as dist

    if tp == 1:
        return ParallelContext.for_tp()
    grid = _grid()
    return ParallelContext(grid, dist.get_rank(), grid.registry, sequence_parallel=sp)


def _tp_case(v_heads: int, seed: int) -> dict[str, float]:
    """Every (tp, sp) against the one-process layer, on this rank; returns {case/tensor: err}."""
    cfg = _cfg(v_heads)
    seqlens = [5, 1, 12, 1, 9, 2, 8, 2]  # 40 tokens: divisible by tp for SP
    ctx = SeqContext.from_seqlens(seqlens)
    t = sum(seqlens)
    g = _gen(seed, "data")
    x0, dy = torch.randn(t, cfg.hidden, generator=g), torch.randn(t, cfg.hidden, generator=g)

    ref = GatedDeltaNet(cfg)
    ref.init_weights(seed, std=0.3)
    init_ref = full_tensors(param_table(ref))
    _randomise_(ref, seed)
    x = _leaf(x0)
    y = ref(x, ctx)
    y.backward(dy)
    want = {"y": (y - x0).detach(), "dx": x.grad, "grads": full_tensors(param_table(ref), grads=True)}

    errs = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        pctx = _ctx(tp, sp)
        rank = pctx.tp_rank
        layer = GatedDeltaNet(cfg, pctx)
        table = param_table(layer)
        layer.init_weights(seed, std=0.3)
        init_full = full_tensors(table)  # the init does not depend on tp
        errs[f"tp{tp},sp{sp}/init_exact"] = 0.0 if all(torch.equal(init_full[n], init_ref[n]) for n in init_ref) else 1.0
        _randomise_(layer, seed)
        part = (lambda v: v.chunk(tp)[rank]) if sp else (lambda v: v)
        x = _leaf(part(x0))
        y = layer(x, ctx)
        y.backward(part(dy))
        reduce_partial_grads(table)  # partial (TP) gradients: summed as training's once-per-step sum does
        errs[f"tp{tp},sp{sp}/y"] = rel_err(y - part(x0), part(want["y"]))
        errs[f"tp{tp},sp{sp}/dx"] = rel_err(x.grad, part(want["dx"]))
        got = full_tensors(table, grads=True)
        for n, w in want["grads"].items():
            errs[f"tp{tp},sp{sp}/grad:{n}"] = rel_err(got[n], w)
    return errs


@pytest.mark.parametrize("v_heads", [2, 4])
def test_tp_equals_one_process(pools, v_heads):
    per_rank = pools(4).run(_tp_case, v_heads, 11)
    worst = max(((e, f"rank{r}:{k}") for r, errs in enumerate(per_rank) for k, e in errs.items()))
    assert worst[0] <= TOL, f"{worst[1]}: rel err {worst[0]:.3e}"


PATTERN = "G*G*-"


def _arch() -> HybridArch:
    return HybridArch(pattern=PATTERN, hidden=32, heads=4, vocab=37, gdn_heads=2, gdn_v_heads=4, gdn_head_dim=8, gdn_v_head_dim=8, gdn_chunk=8)


def _batch(seed: int) -> PackedBatch:
    seqlens = [5, 1, 12, 1, 9, 2, 8, 2]
    ctx = SeqContext.from_seqlens(seqlens)
    t, g = sum(seqlens), _gen(seed, "batch")
    loss_mask = torch.rand(t, generator=g) > 0.2
    return PackedBatch(tokens=torch.randint(0, 37, (t,), generator=g), positions=ctx.positions, cu_seqlens=ctx.cu_seqlens,
                       labels=torch.randint(0, 37, (t,), generator=g), loss_mask=loss_mask)


def _step(stage: LLMStage, run) -> tuple[float | None, dict, dict]:
    """forward + backward (``run``), then one SGD step: (loss, full grads, full params after).

    SGD, not Adam: Adam's first step is ~lr * sign(g), which turns fp32 noise on the few
    near-zero gradient entries into lr-sized differences; gradients are compared directly.
    """
    opt = torch.optim.SGD(stage.parameters(), lr=1.0)
    loss = run()
    reduce_partial_grads(stage.param_table())  # as training's once-per-step TP sum of partial gradients
    grads = stage.full_grads()
    opt.step()
    return loss, grads, stage.full_state()


def _pattern_step_case(sp: bool, seed: int) -> tuple[dict[str, float], int]:
    """The pattern at tp=2, pp=2 (this rank's stage) against one process: loss, grads, a step."""
    arch, batch = _arch(), _batch(seed)
    n_loss = count_loss_tokens(batch)
    ref = LLMStage(arch)
    ref.init_weights(seed)

    def run_ref():
        loss = ref.loss(ref(batch), batch, n_loss)
        loss.backward()
        return loss.item()

    want_loss, want_grads, want_after = _step(ref, run_ref)

    grid = _grid()
    stage = build_stage(arch, _ctx(2, sp))
    stage.init_weights(seed)
    loss, grads, after = _step(stage, lambda: run_pipeline(stage, grid, batch, num_loss_tokens=n_loss, backward=True).loss)
    errs = {}
    if loss is not None:
        errs["loss"] = abs(float(loss) - want_loss) / abs(want_loss)
    for n in grads:  # this stage's parameters, by layout-independent name
        errs[f"grad:{n}"] = rel_err(grads[n], want_grads[n])
        errs[f"after_step:{n}"] = rel_err(after[n], want_after[n])
    return errs, sum(isinstance(layer, GatedDeltaNet) for layer in stage.layers.values())


@pytest.mark.parametrize("sp", [False, True])
def test_pattern_trains_a_step_at_tp2_pp2(pools, sp):
    per_rank, recurrent = zip(*pools(4).run(_pattern_step_case, sp, 21))
    assert sum("loss" in errs for errs in per_rank) == 2  # the last stage's two TP ranks
    assert sum(recurrent) == 2 * PATTERN.count(PATTERN[0])  # each recurrent layer on its 2 TP ranks
    worst = max(((e, f"rank{r}:{k}") for r, errs in enumerate(per_rank) for k, e in errs.items()))
    assert worst[0] <= TOL, f"{worst[1]}: rel err {worst[0]:.3e}"


# --------------------------------------------------------------------------- GPU kernels
@pytest.mark.skipif(not torch.cuda.is_available() or kernel("gated_delta") is None,
                    reason="needs CUDA and flash-linear-attention (fla)")
def test_kernel_path_matches_torch_path_bf16():
    layer = GatedDeltaNet(GDNConfig(hidden=64, heads=2, v_heads=4, head_dim=32, v_head_dim=32, chunk=64))
    _randomise_(layer, seed=13)
    layer = layer.cuda()
    ctx = SeqContext.from_seqlens([100, 1, 37, 200, 5], device="cuda")
    x = torch.randn(343, 64, generator=_gen(14)).cuda()
    with torch.no_grad():
        layer.mixer.impl = "chunked"
        want = layer(x, ctx) - x
        layer.mixer.impl = "kernel"
        got = layer.to(torch.bfloat16)(x.bfloat16(), ctx).float() - x
    assert rel_err(got, want) < 3e-2

"""Checks every recurrent sequence-mixing layer (Mamba-2, Gated DeltaNet) must pass, written once
(tests/test_llm_mamba2.py and tests/test_llm_gdn.py run them on their layer):

- the whole layer, chunked == its naive per-token recurrence (fp64, outputs and gradients);
- packed == each sample alone (fp32 within 1e-5 or 3x the tensor's own fp32 noise; fp64 exact),
  and perturbing one sample leaves every other sample's output bit-identical;
- tp 1 and 2, with and without sequence parallel, == the one-process layer (forward, input
  gradients, parameter gradients gathered to full), from the same TP-invariant init;
- a layer pattern trains one step at tp 2 x pp 2 as one process does;
- the GPU kernel path against the torch path (bf16).

A layer is given as ``make(ctx=None)`` (e.g. ``functools.partial(Mamba2, cfg)``: picklable, so
worker pools run the TP cases with it). Layers take ``[T, 32]`` inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo.core.batch import PackedBatch
from mimo.core.testing import rel_err
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.model import LLMStage, build_stage, count_loss_tokens
from mimo.llm.stage_runner import run_pipeline
from mimo.parallel import param_seed
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.params import full_tensors, init_params_, load_full_, param_table, reduce_partial_grads

TOL = 1e-5
SEQLENS = [5, 1, 12, 1, 9, 2, 8]  # 38 tokens: boundaries inside chunks of 8, length-1 samples
TP_SEQLENS = [5, 1, 12, 1, 9, 2, 8, 2]  # 40 tokens: divisible by tp for SP
HIDDEN = 32


def gen(seed: int, *salt) -> torch.Generator:
    return torch.Generator().manual_seed(param_seed(seed, "/".join(map(str, salt))))


def randomise_(layer: torch.nn.Module, seed: int) -> None:
    """TP-invariant init, then every parameter perturbed (so no weight is all-ones/zeros)."""
    table = param_table(layer)
    init_params_(table, seed, std=0.3)
    full = full_tensors(table)
    noisy = {n: t + 0.2 * torch.randn(t.shape, generator=gen(seed, "noise", n)) for n, t in full.items()}
    load_full_(table, noisy)


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def grads(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


def worst_of(per_rank) -> tuple[float, str]:
    return max(((e, f"rank{r}:{k}") for r, errs in enumerate(per_rank) for k, e in errs.items()))


# --------------------------------------------------------------------------- one process
def check_chunked_equals_naive_fp64(layer: torch.nn.Module, salt) -> None:
    """``layer`` (chunk 4, fp64): its chunked path against its naive recurrence."""
    randomise_(layer, seed=3)
    ctx = SeqContext.from_seqlens(SEQLENS)
    g = gen(4, salt)
    x0 = torch.randn(sum(SEQLENS), HIDDEN, generator=g, dtype=torch.float64)
    dy = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    out = {}
    for impl in ("chunked", "naive"):
        layer.mixer.impl = impl
        layer.zero_grad()
        x = leaf(x0)
        y = layer(x, ctx)
        y.backward(dy)
        out[impl] = {"y": y - x0, "dx": x.grad, **grads(layer)}
    for k in out["naive"]:
        assert rel_err(out["chunked"][k], out["naive"][k]) < 1e-12, k


def _packed_and_alone(layer, x0: torch.Tensor, dy: torch.Tensor) -> tuple[dict, dict]:
    """Outputs (less the residual), input grads and parameter grads: the pack, and each sample
    alone (parameter grads accumulated over the samples)."""
    layer.zero_grad()
    x = leaf(x0)
    y = layer(x, SeqContext.from_seqlens(SEQLENS))
    y.backward(dy)
    packed = {"y": (y - x0).detach(), "dx": x.grad, **grads(layer)}

    layer.zero_grad()
    ys, dxs = [], []
    cu = SeqContext.from_seqlens(SEQLENS).cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        x = leaf(x0[s:e])
        y = layer(x, SeqContext.from_seqlens([e - s]))
        y.backward(dy[s:e])
        ys.append((y - x0[s:e]).detach())
        dxs.append(x.grad)
    return packed, {"y": torch.cat(ys), "dx": torch.cat(dxs), **grads(layer)}


def check_packed_equals_unpacked(layer: torch.nn.Module, salt) -> None:
    """fp32: <= 1e-5 (docs/design.md §3), and exactly (1e-10) in fp64.

    The gradients of the few decay parameters (one value per head, summed over every token with
    both signs) can carry more fp32 rounding than 1e-5 whatever the packing: the naive
    per-token recurrence in fp32 is off from fp64 by as much. For such a tensor the fp32 bound
    is 3x its own fp32 noise (the single sample runs against fp64); the fp64 check is the exact
    one for every tensor.
    """
    randomise_(layer, seed=5)
    g = gen(6, salt)
    t = sum(SEQLENS)
    x0, dy = torch.randn(t, HIDDEN, generator=g), torch.randn(t, HIDDEN, generator=g)
    packed, alone = _packed_and_alone(layer, x0, dy)
    packed64, alone64 = _packed_and_alone(layer.double(), x0.double(), dy.double())
    for k in alone:
        assert rel_err(packed64[k], alone64[k]) <= 1e-10, f"fp64 {k}: {rel_err(packed64[k], alone64[k]):.2e}"
        tol = max(TOL, 3 * rel_err(alone[k], alone64[k]))
        assert rel_err(packed[k], alone[k]) <= tol, f"fp32 {k}: {rel_err(packed[k], alone[k]):.2e} > {tol:.1e}"


def check_perturbing_one_sample_changes_no_other(layer: torch.nn.Module) -> None:
    randomise_(layer, seed=7)
    ctx = SeqContext.from_seqlens(SEQLENS)
    x = torch.randn(sum(SEQLENS), HIDDEN, generator=gen(8))
    cu = ctx.cu_seqlens.tolist()
    with torch.no_grad():
        y = layer(x, ctx)
        for i in (1, 2, len(SEQLENS) - 1):  # a length-1 sample, a long one, the last one
            s, e = cu[i], cu[i + 1]
            x2 = x.clone()
            x2[s:e] += torch.randn(e - s, HIDDEN, generator=gen(9, i))
            y2 = layer(x2, ctx)
            assert torch.equal(y2[:s], y[:s]) and torch.equal(y2[e:], y[e:]), f"sample {i} leaked"
            assert not torch.equal(y2[s:e], y[s:e])


def check_kernel_matches_torch_bf16(layer: torch.nn.Module) -> None:
    """The GPU kernel path (bf16) against the chunked torch path (fp32) of ``layer`` (hidden 64)."""
    randomise_(layer, seed=13)
    layer = layer.cuda()
    ctx = SeqContext.from_seqlens([100, 1, 37, 200, 5], device="cuda")
    x = torch.randn(343, 64, generator=gen(14)).cuda()
    with torch.no_grad():
        layer.mixer.impl = "chunked"
        want = layer(x, ctx) - x
        layer.mixer.impl = "kernel"
        got = layer.to(torch.bfloat16)(x.bfloat16(), ctx).float() - x
    assert rel_err(got, want) < 3e-2


# --------------------------------------------------------------------------- tensor / pipeline parallel
# the tp=2 x pp=2 grid of a 4-rank pool: the TP cases use its tp groups (two pairs of ranks
# compute at once); the pattern step uses the whole grid
_GRIDS: dict[str, ParallelGrid] = {}


def _grid() -> ParallelGrid:
    return _GRIDS.setdefault("tp2pp2", ParallelGrid({"tp": 2, "pp": 2}))


def _ctx(tp: int = 2, sp: bool = False) -> ParallelContext:
    """This rank's context: on the tp=2 x pp=2 grid, or of one process (tp = 1)."""
    if tp == 1:
        return ParallelContext.for_tp()
    grid = _grid()
    return ParallelContext(grid, dist.get_rank(), grid.registry, sequence_parallel=sp)


def tp_case(make, seed: int) -> dict[str, float]:
    """Every (tp, sp) against the one-process layer, on this rank; returns {case/tensor: err}."""
    ctx = SeqContext.from_seqlens(TP_SEQLENS)
    t = sum(TP_SEQLENS)
    g = gen(seed, "data")
    x0, dy = torch.randn(t, HIDDEN, generator=g), torch.randn(t, HIDDEN, generator=g)

    ref = make()
    ref.init_weights(seed, std=0.3)
    init_ref = full_tensors(param_table(ref))
    randomise_(ref, seed)
    x = leaf(x0)
    y = ref(x, ctx)
    y.backward(dy)
    want = {"y": (y - x0).detach(), "dx": x.grad, "grads": full_tensors(param_table(ref), grads=True)}

    errs = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        pctx = _ctx(tp, sp)
        rank = pctx.tp_rank
        layer = make(pctx)
        table = param_table(layer)
        layer.init_weights(seed, std=0.3)
        init_full = full_tensors(table)  # the init does not depend on tp
        errs[f"tp{tp},sp{sp}/init_exact"] = 0.0 if all(torch.equal(init_full[n], init_ref[n]) for n in init_ref) else 1.0
        randomise_(layer, seed)
        part = (lambda v: v.chunk(tp)[rank]) if sp else (lambda v: v)
        x = leaf(part(x0))
        y = layer(x, ctx)
        y.backward(part(dy))
        reduce_partial_grads(table)  # partial (TP) gradients: summed as training's once-per-step sum does
        errs[f"tp{tp},sp{sp}/y"] = rel_err(y - part(x0), part(want["y"]))
        errs[f"tp{tp},sp{sp}/dx"] = rel_err(x.grad, part(want["dx"]))
        got = full_tensors(table, grads=True)
        for n, w in want["grads"].items():
            errs[f"tp{tp},sp{sp}/grad:{n}"] = rel_err(got[n], w)
    return errs


def check_tp_equals_one_process(pools, make) -> None:
    worst = worst_of(pools(4).run(tp_case, make, 11))
    assert worst[0] <= TOL, f"{worst[1]}: rel err {worst[0]:.3e}"


def _batch(seed: int, vocab: int) -> PackedBatch:
    ctx = SeqContext.from_seqlens(TP_SEQLENS)
    t, g = sum(TP_SEQLENS), gen(seed, "batch")
    loss_mask = torch.rand(t, generator=g) > 0.2
    return PackedBatch(tokens=torch.randint(0, vocab, (t,), generator=g), positions=ctx.positions, cu_seqlens=ctx.cu_seqlens,
                       labels=torch.randint(0, vocab, (t,), generator=g), loss_mask=loss_mask)


def _step(stage: LLMStage, run) -> tuple[float | None, dict, dict]:
    """forward + backward (``run``), then one SGD step: (loss, full grads, full params after).

    SGD, not Adam: Adam's first step is ~lr * sign(g), which turns fp32 noise on the few
    near-zero gradient entries into lr-sized differences; gradients are compared directly.
    """
    opt = torch.optim.SGD(stage.parameters(), lr=1.0)
    loss = run()
    reduce_partial_grads(stage.param_table())  # as training's once-per-step TP sum of partial gradients
    grads_ = stage.full_grads()
    opt.step()
    return loss, grads_, stage.full_state()


def pattern_step_case(arch: HybridArch, layer_type: type, sp: bool, seed: int) -> tuple[dict[str, float], int]:
    """``arch``'s pattern at tp=2, pp=2 (this rank's stage) against one process: loss, grads, a
    step; and how many ``layer_type`` layers this rank's stage holds."""
    batch = _batch(seed, arch.vocab)
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
    loss, grads_, after = _step(stage, lambda: run_pipeline(stage, grid, batch, num_loss_tokens=n_loss, backward=True).loss)
    errs = {}
    if loss is not None:
        errs["loss"] = abs(float(loss) - want_loss) / abs(want_loss)
    for n in grads_:  # this stage's parameters, by layout-independent name
        errs[f"grad:{n}"] = rel_err(grads_[n], want_grads[n])
        errs[f"after_step:{n}"] = rel_err(after[n], want_after[n])
    return errs, sum(isinstance(layer, layer_type) for layer in stage.layers.values())


def check_pattern_trains_a_step_at_tp2_pp2(pools, arch: HybridArch, layer_type: type, sp: bool) -> None:
    """``arch.pattern`` starts with the recurrent layer's symbol."""
    per_rank, recurrent = zip(*pools(4).run(pattern_step_case, arch, layer_type, sp, 21))
    assert sum("loss" in errs for errs in per_rank) == 2  # the last stage's two TP ranks
    assert sum(recurrent) == 2 * arch.pattern.count(arch.pattern[0])  # each recurrent layer on its 2 TP ranks
    worst = worst_of(per_rank)
    assert worst[0] <= TOL, f"{worst[1]}: rel err {worst[0]:.3e}"

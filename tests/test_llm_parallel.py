"""LLM stages over real process groups (gloo) against the one-process model.

tp in {1, 2, 4} with and without sequence parallel, pp in {1, 2}: loss, logits, every full
parameter gradient, and the gradient of the image rows scattered into the first stage (on every
TP replica), fp32, under the yardstick (mimo.core.testing: the one-process model runs in fp32
and fp64; each tensor within max(1e-5, 4 x the fp32 model's own error) of fp64). Also:
TP/PP-invariant init, the declared image-row placement, tied embeddings over two stages, and a
few optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelGrid
from mimo.llm.config import HybridArch
from mimo.llm.model import LLMStage, build_stage, count_loss_tokens, embedding_group, sync_tied_grads
from mimo.llm.stage_runner import run_pipeline
from mimo.llm.verify import pack_samples
from mimo.parallel.layout_reference import packed_placement
from mimo.parallel.params import reduce_partial_grads
from mimo.core.testing import Yardstick

TOL = 1e-5
WORLD = 8
# Adam's eps: with the default 1e-8 a gradient element that happens to be ~1e-8 (rounding-level
# differences between layouts are ~1e-8 absolute) gets a step that differs by a good part of lr;
# 1e-5 keeps the comparison meaningful while the step stays nearly scale-free.
ADAM_EPS = 1e-5
KEY = "<image>"


def arch_for(pattern: str = "*-*-", **kw) -> HybridArch:
    base = dict(pattern=pattern, hidden=32, heads=4, kv_heads=4, head_dim=12, vocab=61, ffn=40,
                qk_norm=True, qkv_bias=True, o_bias=True, rope_theta=500.0)
    base.update(kw)
    return HybridArch(**base)


def random_state(arch: HybridArch, seed: int) -> dict[str, torch.Tensor]:
    """Full random weights: norm weights 1 + noise, biases noise, matrices ~ 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, info in LLMStage(arch).param_table().items():
        noise = torch.randn(info.placement.full_shape, generator=gen)
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.2 * noise
        elif noise.dim() == 1:
            out[name] = 0.2 * noise
        else:
            out[name] = noise / noise.shape[-1] ** 0.5
    return out


def make_case(arch: HybridArch, tp: int, sp: bool, seed: int):
    """A pack of ragged samples (one of length 1) with image rows at some positions."""
    gen = torch.Generator().manual_seed(seed)
    lens = [7, 1, 12, 4, 9]
    toks = [torch.randint(0, arch.vocab, (n,), generator=gen) for n in lens]
    batch = pack_samples(toks, tp if sp else 1)
    cu = batch.cu_seqlens.tolist()
    rows_at = [[1, 2, 3], [], [0, 5, 6, 11], [2], [8]]  # per sample, positions of image rows
    batch.image_slots[KEY] = torch.tensor([cu[i] + p for i, ps in enumerate(rows_at) for p in ps])
    samples = [(n, ps) for n, ps in zip(lens, rows_at)]
    rows = torch.randn(len(batch.image_slots[KEY]), arch.hidden, generator=gen)
    return batch, samples, rows


def reference(arch, state, batch, rows, steps: int = 0, lr: float = 1e-2, dtype=torch.float32):
    """The one-process model: loss, logits, full grads, image-row grads (and params after steps)."""
    m = LLMStage(arch).to(dtype)
    m.load_full_(state)
    rows = rows.to(dtype)
    n = count_loss_tokens(batch)
    opt = torch.optim.Adam(m.parameters(), lr=lr, eps=ADAM_EPS)
    losses = []
    for _ in range(max(1, steps)):
        opt.zero_grad()
        r = rows.clone().requires_grad_(True)
        logits = m(batch, image_rows={KEY: r})
        loss = m.loss(logits, batch, n)
        loss.backward()
        losses.append(loss.item())
        grads, rows_grad = m.full_grads(), r.grad
        if steps:
            opt.step()
    return {"loss": losses[0], "losses": losses, "logits": logits.detach(), "grads": grads,
            "rows_grad": rows_grad, "state": m.full_state()}


# ---------------------------------------------------------------- on every rank


def llm_context(tp: int, pp: int, sp: bool = False) -> tuple[ParallelGrid, ParallelContext]:
    """A tp x pp LLM grid over the first ranks and this rank's context (collective: every rank)."""
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": 1, "pp": pp})
    return grid, ParallelContext(grid, dist.get_rank(), grid.registry, sequence_parallel=sp)


def local_rows(placement, rank: int, rows: torch.Tensor) -> torch.Tensor:
    """This rank's compact buffer of a placement, cut from the full rows."""
    out = torch.zeros(placement.local_rows.get(rank, 0), rows.shape[1])
    for p in placement.pieces_of(rank):
        out[p.local_row : p.local_row + p.rows] = rows[p.row : p.row + p.rows]
    return out


def parallel_case(arch, tp, pp, sp, state, batch, samples, rows, steps=0, lr=1e-2):
    rank = dist.get_rank()
    grid, ctx = llm_context(tp, pp, sp)
    stage = build_stage(arch, ctx)
    tied_group = embedding_group(ctx)  # collective over the world
    assert ctx.pp_size != 2 or tied_group is ctx.pp  # pp = 2: the PP communicator itself, not a second one
    if stage is None:
        return None
    stage.load_full_(state)
    image_rows, slots_ok = None, True
    if stage.is_first:
        placement = stage.image_placement(grid, samples, [range(len(samples))]).to_placement()
        reference, slots = packed_placement(grid, samples, [range(len(samples))], arch.hidden, stage.sequence_parallel)
        slots_ok = placement == reference and stage.local_image_slots(batch, KEY).tolist() == slots[rank]
        image_rows = {KEY: local_rows(placement, rank, rows).requires_grad_(True)}
    opt = torch.optim.Adam(stage.parameters(), lr=lr, eps=ADAM_EPS)
    losses = []
    for _ in range(max(1, steps)):
        opt.zero_grad()
        if image_rows:
            image_rows[KEY].grad = None
        res = run_pipeline(stage, grid, batch, image_rows=image_rows, num_loss_tokens=count_loss_tokens(batch), backward=True)
        reduce_partial_grads(stage.param_table())  # training's once-per-step TP sum of partial gradients
        sync_tied_grads(stage, tied_group)
        losses.append(None if res.loss is None else res.loss.item())
        grads = stage.full_grads()
        logits = stage.gather_logits(res.logits) if stage.is_last else None
        if steps:
            opt.step()
    out = {
        "tp_rank": stage.tp_rank, "stage": stage.stage, "losses": losses, "logits": logits, "grads": grads,
        "slots_ok": slots_ok, "state": stage.full_state() if steps else None,
    }
    if stage.is_first:
        out["rows_grad"] = image_rows[KEY].grad
        out["pieces"] = placement.pieces_of(rank)
    return out


def references(arch, state, batch, rows, steps: int = 0):
    """The one-process model in fp32 and in fp64 (the yardstick's two references)."""
    return tuple(reference(arch, state, batch, rows, steps, dtype=dt) for dt in (torch.float32, torch.float64))


def check_against_reference(results, refs, rows, steps=0):
    ref, ref64 = refs
    ys = Yardstick(TOL)
    results = [r for r in results if r is not None]
    full = {}
    for r in results:
        assert r["slots_ok"], "image_placement or local_image_slots disagrees with packed_placement"
        where = f"(stage {r['stage']}, tp rank {r['tp_rank']})"
        for name, g in r["grads"].items():  # every TP rank has the complete full gradient
            ys.check(f"grad {name} {where}", g, ref["grads"][name], ref64["grads"][name])
            full[name] = g
        if r["losses"][0] is not None:
            ys.check(f"loss {where}", r["losses"][0], ref["loss"], ref64["loss"])
            ys.check(f"logits {where}", r["logits"], ref["logits"], ref64["logits"])
            if steps:
                ys.check(f"losses over steps {where}", *(torch.tensor(x["losses"], dtype=torch.float64) for x in (r, ref, ref64)))
        if "rows_grad" in r:  # each rank's rows, each replica complete
            for p in r["pieces"]:
                ys.check(f"image-row grads {p.row}:{p.row + p.rows} {where}", r["rows_grad"][p.local_row : p.local_row + p.rows],
                         *(x["rows_grad"][p.row : p.row + p.rows] for x in (ref, ref64)))
        if steps:
            for name, t in r["state"].items():
                ys.check(f"param {name} after steps {where}", t, ref["state"][name], ref64["state"][name])
    ys.assert_ok()
    assert set(full) == set(ref["grads"]), sorted(set(full) ^ set(ref["grads"]))


LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (4, 1, False), (4, 1, True),
           (1, 2, False), (2, 2, False), (2, 2, True), (4, 2, True)]


@pytest.mark.parametrize("tp,pp,sp", LAYOUTS, ids=[f"tp{t}-pp{p}{'-sp' if s else ''}" for t, p, s in LAYOUTS])
def test_layouts_equal_one_process(pools, tp, pp, sp):
    arch = arch_for(pattern="*-*-")
    state = random_state(arch, seed=tp * 10 + pp)
    batch, samples, rows = make_case(arch, tp, sp, seed=100 + tp + 3 * pp + int(sp))
    refs = references(arch, state, batch, rows)
    results = pools(WORLD).run(parallel_case, arch, tp, pp, sp, state, batch, samples, rows)
    check_against_reference(results, refs, rows)


@pytest.mark.parametrize("tp,pp,sp", [(2, 2, True), (4, 2, False), (2, 1, True)])
def test_gqa_tied_head_dim_layouts(pools, tp, pp, sp):
    """GQA, head_dim != hidden/heads, tied embeddings (two copies kept in sync when pp = 2)."""
    arch = arch_for(pattern="*-*-", heads=8, kv_heads=4, head_dim=6, tie_embeddings=True, qkv_bias=True, o_bias=False)
    state = random_state(arch, seed=7)
    batch, samples, rows = make_case(arch, tp, sp, seed=8)
    refs = references(arch, state, batch, rows)
    check_against_reference(pools(WORLD).run(parallel_case, arch, tp, pp, sp, state, batch, samples, rows), refs, rows)


@pytest.mark.parametrize("pattern,tp,pp,sp,tied", [("*-*-", 2, 1, True, False), ("*-*-|*-*-", 2, 2, True, True),
                                                    ("*-*-|*-*-", 1, 2, False, False)])
def test_patterns_train_steps(pools, pattern, tp, pp, sp, tied):
    """A few Adam steps: losses and parameters follow the one-process model; the loss falls."""
    arch = arch_for(pattern=pattern, tie_embeddings=tied)
    state = random_state(arch, seed=21)
    batch, samples, rows = make_case(arch, tp, sp, seed=22)
    refs = references(arch, state, batch, rows, steps=3)
    assert refs[0]["losses"][-1] < refs[0]["losses"][0]
    results = pools(WORLD).run(parallel_case, arch, tp, pp, sp, state, batch, samples, rows, 3)
    check_against_reference(results, refs, rows, steps=3)


def init_case(arch, tp, pp, seed):
    _, ctx = llm_context(tp, pp)
    stage = build_stage(arch, ctx)
    if stage is None:
        return None
    stage.init_weights(seed)
    state = stage.full_state()  # collective over TP
    return state if stage.tp_rank == 0 else None


def test_init_is_layout_invariant(pools):
    """Random init gives the one-process weights, bit for bit, at any TP / PP."""
    arch = arch_for(pattern="*-*-", heads=8, kv_heads=4, vocab=63, tie_embeddings=True)
    one = LLMStage(arch)
    one.init_weights(5)
    want = one.full_state()
    for tp, pp in [(2, 1), (4, 1), (1, 2), (4, 2)]:
        merged = {}
        for r in pools(WORLD).run(init_case, arch, tp, pp, 5):
            for name, t in (r or {}).items():
                assert torch.equal(t, want[name]), f"{name} differs at tp={tp} pp={pp}"
                merged[name] = t
        assert set(merged) == set(want)


def empty_case(arch, tp, pp, sp):
    grid, ctx = llm_context(tp, pp, sp)
    stage = build_stage(arch, ctx)
    if stage is None:
        return None
    stage.init_weights(0)
    res = run_pipeline(stage, grid, pack_samples([]), num_loss_tokens=5, backward=True)
    reduce_partial_grads(stage.param_table())  # every collective, this one too
    grads = stage.full_grads()
    return {"loss": None if res.loss is None else res.loss.item(), "grad_max": max(g.abs().max().item() for g in grads.values())}


def test_empty_pack_runs_every_collective(pools):
    """A DP rank without samples still runs its (empty) step through every stage and collective."""
    for r in filter(None, pools(WORLD).run(empty_case, arch_for(), 2, 2, True)):
        assert r["grad_max"] == 0.0 and r["loss"] in (None, 0.0)


# ---------------------------------------------------------------- partial-gradient placements


def raw_grads_case(arch, tp, sp, state, batch, samples, rows):
    """This rank's gradients of the TP-replicated parameters right after backward (no layer
    sums a parameter's gradient over TP), their plain sum over TP, and what
    ``reduce_partial_grads`` makes of them."""
    from mimo.parallel import collectives

    grid, ctx = llm_context(tp, 1, sp)
    stage = build_stage(arch, ctx)
    if stage is None:
        return None
    stage.load_full_(state)
    placement = stage.image_placement(grid, samples, [range(len(samples))]).to_placement()
    image_rows = {KEY: local_rows(placement, dist.get_rank(), rows)}
    run_pipeline(stage, grid, batch, image_rows=image_rows, num_loss_tokens=count_loss_tokens(batch), backward=True)
    table = stage.param_table()
    raw = {name: info.param.grad.detach().clone() for name, info in table.items() if not info.placement.shards}
    reduce_partial_grads(table)
    out = {}
    for name, info in table.items():
        if not info.placement.shards:  # replicated over TP
            out[name] = (info.placement.partial, raw[name], collectives.all_reduce(raw[name].clone(), ctx.tp),
                         info.param.grad.detach().clone())
    return out


@pytest.mark.parametrize("sp", [False, True])
def test_partial_marks_are_the_gradients_that_need_a_tp_sum(pools, sp):
    """Every TP-replicated parameter of every layer kind: marked ``partial=("tp",)`` exactly when
    its local gradient is only a part of the full one, and then its sum over TP is the full one
    (the contract of a once-per-step TP gradient sum); unmarked ones are complete on each rank."""
    from mimo.core.testing import rel_err

    tp = 2
    arch = arch_for(pattern="*-M-G-", mamba_head_dim=8, mamba_state=8, mamba_chunk=8, gdn_chunk=8)
    assert arch.mamba_groups % tp  # B / C replicated over TP: partial
    state = random_state(arch, seed=31)
    batch, samples, rows = make_case(arch, tp, sp, seed=32)
    ref, ref64 = references(arch, state, batch, rows)
    results = [r for r in pools(WORLD).run(raw_grads_case, arch, tp, sp, state, batch, samples, rows) if r is not None]
    assert len(results) == tp
    ys, marked = Yardstick(TOL), set()
    for rank, r in enumerate(results):
        for name, (partial, raw, summed, reduced) in r.items():
            if partial:
                assert partial == ("tp",), name
                marked.add(name)
                ys.check(f"TP sum of the partial grad {name}", summed, ref["grads"][name], ref64["grads"][name])
                assert torch.equal(reduced, summed), name  # reduce_partial_grads: that sum
            else:
                ys.check(f"local grad of unmarked {name} (tp rank {rank})", raw, ref["grads"][name], ref64["grads"][name])
                assert torch.equal(reduced, raw), name  # left alone
    ys.assert_ok()
    for name in marked:  # and a partial one is not already complete on either rank
        assert all(rel_err(r[name][1], ref64["grads"][name]) > 1e-3 for r in results), name
    expect = {"layers.0.q_norm.weight", "layers.0.k_norm.weight", "layers.2.mixer.in_bc_weight",
              "layers.2.mixer.conv_bc_weight", "layers.2.mixer.conv_bc_bias", "layers.4.mixer.norm_weight"}
    if sp:  # each rank normalises (and adds the o_proj bias to) only its own tokens
        expect |= {f"layers.{i}.norm.weight" for i in range(6)} | {"norm.weight", "layers.0.o_proj.bias"}
    assert marked == expect, sorted(marked ^ expect)

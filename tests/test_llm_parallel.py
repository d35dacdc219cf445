"""LLM stages over real process groups (gloo) against the one-process model.

tp in {1, 2, 4} with and without sequence parallel, pp in {1, 2}: loss, logits, every full
parameter gradient, and the gradient of the image rows scattered into the first stage (on every
TP replica), fp32, ||a-b||/||b|| <= 1e-5. Also: TP/PP-invariant init, the declared image-row
placement, tied embeddings over two stages, and a few optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mimo.parallel.grid import ParallelGrid
from mimo.llm.config import HybridArch
from mimo.llm.model import LLMStage, build_stage, count_loss_tokens, embedding_group, sync_tied_grads
from mimo.llm.pipeline import run_pipeline
from mimo.llm.verify import pack_samples
from mimo.core.testing import assert_close

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
        noise = torch.randn(info.spec.full_shape, generator=gen)
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


def reference(arch, state, batch, rows, steps: int = 0, lr: float = 1e-2):
    """The one-process model: loss, logits, full grads, image-row grads (and params after steps)."""
    m = LLMStage(arch)
    m.load_full_(state)
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


def local_rows(placement, rank: int, rows: torch.Tensor) -> torch.Tensor:
    """This rank's compact buffer of a placement, cut from the full rows."""
    out = torch.zeros(placement.local_rows.get(rank, 0), rows.shape[1])
    for p in placement.pieces_of(rank):
        out[p.local_row : p.local_row + p.rows] = rows[p.row : p.row + p.rows]
    return out


def parallel_case(arch, tp, pp, sp, state, batch, samples, rows, steps=0, lr=1e-2):
    rank = dist.get_rank()
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": 1, "pp": pp})
    stage = build_stage(arch, grid, sequence_parallel=sp)
    tied_group = embedding_group(grid)  # collective over the world
    if stage is None:
        return None
    stage.load_full_(state)
    image_rows, slots_ok = None, True
    if stage.is_first:
        placement, slots = stage.image_placement(grid, samples, [range(len(samples))])
        slots_ok = stage.local_image_slots(batch, KEY).tolist() == slots[rank]
        image_rows = {KEY: local_rows(placement, rank, rows).requires_grad_(True)}
    opt = torch.optim.Adam(stage.parameters(), lr=lr, eps=ADAM_EPS)
    losses = []
    for _ in range(max(1, steps)):
        opt.zero_grad()
        if image_rows:
            image_rows[KEY].grad = None
        res = run_pipeline(stage, grid, batch, image_rows=image_rows, num_loss_tokens=count_loss_tokens(batch), backward=True)
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


def check_against_reference(results, ref, rows, steps=0):
    results = [r for r in results if r is not None]
    full = {}
    for r in results:
        assert r["slots_ok"], "local_image_slots disagrees with image_placement"
        for name, g in r["grads"].items():  # every TP rank has the complete full gradient
            assert_close(g, ref["grads"][name], TOL, f"grad {name} (stage {r['stage']}, tp rank {r['tp_rank']})")
            full[name] = g
        if r["losses"][0] is not None:
            assert abs(r["losses"][0] - ref["loss"]) <= TOL * abs(ref["loss"])
            assert_close(r["logits"], ref["logits"], TOL, "logits")
            if steps:
                assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), TOL, "losses over steps")
        if "rows_grad" in r:  # each rank's rows, each replica complete
            for p in r["pieces"]:
                assert_close(r["rows_grad"][p.local_row : p.local_row + p.rows], ref["rows_grad"][p.row : p.row + p.rows],
                             TOL, "image-row grads")
        if steps:
            assert_close(r["state"], {k: ref["state"][k] for k in r["state"]}, TOL, "params after steps")
    assert set(full) == set(ref["grads"]), sorted(set(full) ^ set(ref["grads"]))


LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (4, 1, False), (4, 1, True),
           (1, 2, False), (2, 2, False), (2, 2, True), (4, 2, True)]


@pytest.mark.parametrize("tp,pp,sp", LAYOUTS, ids=[f"tp{t}-pp{p}{'-sp' if s else ''}" for t, p, s in LAYOUTS])
def test_layouts_equal_one_process(pools, tp, pp, sp):
    arch = arch_for(pattern="*-*-")
    state = random_state(arch, seed=tp * 10 + pp)
    batch, samples, rows = make_case(arch, tp, sp, seed=100 + tp + 3 * pp + int(sp))
    ref = reference(arch, state, batch, rows)
    results = pools(WORLD).run(parallel_case, arch, tp, pp, sp, state, batch, samples, rows)
    check_against_reference(results, ref, rows)


@pytest.mark.parametrize("tp,pp,sp", [(2, 2, True), (4, 2, False), (2, 1, True)])
def test_gqa_tied_head_dim_layouts(pools, tp, pp, sp):
    """GQA, head_dim != hidden/heads, tied embeddings (two copies kept in sync when pp = 2)."""
    arch = arch_for(pattern="*-*-", heads=8, kv_heads=4, head_dim=6, tie_embeddings=True, qkv_bias=True, o_bias=False)
    state = random_state(arch, seed=7)
    batch, samples, rows = make_case(arch, tp, sp, seed=8)
    ref = reference(arch, state, batch, rows)
    check_against_reference(pools(WORLD).run(parallel_case, arch, tp, pp, sp, state, batch, samples, rows), ref, rows)


@pytest.mark.parametrize("pattern,tp,pp,sp,tied", [("*-*-", 2, 1, True, False), ("*-*-|*-*-", 2, 2, True, True),
                                                    ("*-*-|*-*-", 1, 2, False, False)])
def test_patterns_train_steps(pools, pattern, tp, pp, sp, tied):
    """A few Adam steps: losses and parameters follow the one-process model; the loss falls."""
    arch = arch_for(pattern=pattern, tie_embeddings=tied)
    state = random_state(arch, seed=21)
    batch, samples, rows = make_case(arch, tp, sp, seed=22)
    ref = reference(arch, state, batch, rows, steps=3)
    assert ref["losses"][-1] < ref["losses"][0]
    results = pools(WORLD).run(parallel_case, arch, tp, pp, sp, state, batch, samples, rows, 3)
    check_against_reference(results, ref, rows, steps=3)


def init_case(arch, tp, pp, seed):
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": 1, "pp": pp})
    stage = build_stage(arch, grid)
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
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": 1, "pp": pp})
    stage = build_stage(arch, grid, sequence_parallel=sp)
    if stage is None:
        return None
    stage.init_weights(0)
    res = run_pipeline(stage, grid, pack_samples([]), num_loss_tokens=5, backward=True)
    grads = stage.full_grads()
    return {"loss": None if res.loss is None else res.loss.item(), "grad_max": max(g.abs().max().item() for g in grads.values())}


def test_empty_pack_runs_every_collective(pools):
    """A DP rank without samples still runs its (empty) step through every stage and collective."""
    for r in filter(None, pools(WORLD).run(empty_case, arch_for(), 2, 2, True)):
        assert r["grad_max"] == 0.0 and r["loss"] in (None, 0.0)

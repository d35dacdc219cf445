"""The once-per-step MoE balancing update (``mimo.llm.balance``) and its wiring into training.

* one process: the expert-bias step and the quantile-balancing step equal direct formulas;
  eval, ``torch.no_grad`` and padding count nowhere; the aux accumulators start afresh each
  step; a seeded skewed router's max/mean load falls over 100 steps with expert bias on and
  does not with it off;
* dp1 against dp2 (gloo, real process groups) on the same global microbatches: identical
  expert bias and quantile-balancing beta after several steps;
* training (``train_step``): pp2 x dp2 and tp2 x dp2 with sequence parallelism end with the
  one-process run's biases and report its per-layer stats (gathered over stages, TP not
  double counted); a run resumed from a checkpoint
  continues with the unbroken run's bias (and ``train.init_from`` loads it too).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from mimo.llm.balance import balance_step, find_routers
from mimo.llm.config import AuxLoss, MoEArch
from mimo.llm.router import Router, assignment_counts, topk_lowest_index

HIDDEN = 16


def arch(**kw) -> MoEArch:
    base = dict(experts=6, topk=2, ffn=8)
    base.update(kw)
    return MoEArch(**base)


def make_router(cfg: MoEArch, seed: int = 0, skew: tuple[float, ...] = ()) -> Router:
    """A router with seeded weights (scaled up: top-k margins); ``skew`` adds a constant to the
    first experts' logits (a router biased toward them)."""
    router = Router(HIDDEN, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(cfg.experts, HIDDEN, generator=gen))
        if skew:
            router.weight[: len(skew), 0] += torch.tensor(skew)  # tokens carry x[:, 0] = 1
    return router.train()


def tokens(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=gen) * 0.3
    x[:, 0] = 1.0
    return x


def route(router: Router, x_TD: torch.Tensor, pad: int = 0):
    """A training forward's routing of ``x_TD`` whose last ``pad`` rows are padding."""
    valid_T = torch.arange(x_TD.shape[0]) < x_TD.shape[0] - pad
    logits = router.logits(x_TD)
    return logits, router.route(logits, valid_T if pad else None, x_TD.shape[0] - pad), valid_T


def load(counts_E: torch.Tensor) -> float:
    return float(counts_E.max() / counts_E.mean())


# ---------------------------------------------------------------- formulas


def test_expert_bias_step_equals_formula():
    cfg = arch(expert_bias=True, bias_update_rate=0.03)
    router = make_router(cfg)
    bias0 = torch.tensor([0.1, -0.2, 0.0, 0.05, 0.3, -0.1])
    router.expert_bias.copy_(bias0)
    counts = torch.zeros(6)
    for seed, pad in ((1, 3), (2, 0)):
        _, r, _ = route(router, tokens(20, seed), pad)
        counts += assignment_counts(r.idx_TK, 6)
    assert torch.equal(router.step_counts, counts) and counts.sum() == (17 + 20) * 2
    stats = balance_step(router)
    want = bias0 + 0.03 * torch.sign(counts.mean() - counts)
    assert torch.equal(router.expert_bias, want), (router.expert_bias, want)
    assert stats.layers == [0]
    assert stats.table_L3[0, 0].item() == pytest.approx(load(counts))
    assert stats.table_L3[0, 1].item() == (counts == 0).sum().item()
    for name in Router.ACCUMULATORS:  # every accumulator reset
        assert not getattr(router, name).any(), name


def test_dead_experts_are_counted():
    cfg = arch(expert_bias=True)
    router = make_router(cfg)
    router.step_counts.copy_(torch.tensor([5.0, 0, 3, 0, 0, 4]))
    stats = balance_step(router)
    assert stats.table_L3[0].tolist() == pytest.approx([5 / 2, 3.0, 0.0])
    assert router.expert_bias.tolist() == pytest.approx([-1e-3, 1e-3, -1e-3, 1e-3, 1e-3, -1e-3])


def qb_direct(scores_TE, beta_E, k):
    """Megatron-Core's per-microbatch quantile, written out with sorts (not the router's code)."""
    m, n = scores_TE.shape
    alpha_T1 = (scores_TE - beta_E).sort(dim=1, descending=True).values[:, k:k + 1]
    return (scores_TE - alpha_T1).sort(dim=0, descending=True).values[m * k // n]


@pytest.mark.parametrize("ema", [0.0, 0.6])
def test_quantile_balancing_step_equals_formula(ema):
    cfg = arch(quantile_balancing=True, quantile_ema=ema, experts=8)
    router = make_router(cfg, seed=3)
    beta0 = torch.linspace(-0.05, 0.08, 8)
    router.qb_beta.copy_(beta0)
    locals_ = []
    for seed, n, pad in ((4, 24, 0), (5, 19, 5), (6, 40, 8)):  # 14 real of 19: m*k not divisible by n
        x = tokens(n, seed)
        logits, _, valid = route(router, x, pad)
        locals_.append(qb_direct(router.scores(logits.detach())[valid], beta0, cfg.topk))
    assert router.qb_n.item() == 3
    balance_step(router)
    blended = ema * beta0 + (1 - ema) * torch.stack(locals_).mean(0)
    want = blended - blended.mean()
    torch.testing.assert_close(router.qb_beta, want, rtol=0, atol=1e-6)
    assert abs(router.qb_beta.mean().item()) < 1e-6 and not router.qb_n.item()


def test_quantile_balancing_without_tokens_keeps_beta():
    router = make_router(arch(quantile_balancing=True))
    router.qb_beta.copy_(torch.arange(6.0) - 2.5)
    route(router, tokens(8, 1), pad=8)  # a pack of padding only
    assert router.qb_n.item() == 0
    balance_step(router)
    assert torch.equal(router.qb_beta, torch.arange(6.0) - 2.5)


# ---------------------------------------------------------------- what counts


def test_eval_no_grad_and_padding_do_not_count():
    cfg = arch(expert_bias=True, quantile_balancing=False)
    router = make_router(cfg)
    x = tokens(30, 7)
    _, r, valid = route(router, x, pad=9)
    real = topk_lowest_index(router.scores(router.logits(x[valid])).detach() + router.expert_bias, 2)[1]
    assert torch.equal(router.step_counts, assignment_counts(real, 6))  # the 21 real tokens only
    after = router.step_counts.clone()
    with torch.no_grad():  # a recompute's forward
        route(router, x)
    router.eval()
    route(router, x)
    assert torch.equal(router.step_counts, after)
    qb = make_router(arch(quantile_balancing=True))
    with torch.no_grad():
        route(qb, x)
    qb.eval()
    route(qb, x)
    assert qb.qb_n.item() == 0 and not qb.qb_sum.any() and not qb.step_counts.any()


def test_moe_layer_counts_real_tokens_only():
    from mimo.llm.context import SeqContext
    from mimo.llm.moe import MoE

    layer = MoE(HIDDEN, arch(expert_bias=True)).train()
    layer.init_weights(3, 0.5)
    seq = SeqContext.from_seqlens([7, 5, 4])  # the last segment: padding
    seq.num_real = 12
    layer(torch.randn(16, HIDDEN, requires_grad=True), seq).sum().backward()
    assert layer.router.step_counts.sum().item() == 12 * 2
    assert find_routers(torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"3": layer})})) == {3: layer.router}


def test_global_aux_counts_start_afresh_each_step():
    cfg = arch(aux_loss=AuxLoss(kind="global", coeff=1.0))
    router = make_router(cfg, seed=2)
    fresh = make_router(cfg, seed=2)

    def aux(r, x):
        logits, routing, _ = route(r, x)
        return r.aux_loss(logits, routing, None, None, 1, 10.0).detach()

    step1 = [aux(router, tokens(12, 1)), aux(router, tokens(12, 2))]
    assert not torch.allclose(step1[1], aux(fresh, tokens(12, 2)))  # running counts do matter
    stats = balance_step(router)
    torch.testing.assert_close(stats.table_L3[0, 2], step1[0] + step1[1])  # the step's aux loss
    fresh.reset_accumulators()
    torch.testing.assert_close(aux(router, tokens(12, 3)), aux(fresh, tokens(12, 3)), rtol=0, atol=0)


# ---------------------------------------------------------------- the skewed router


def _skewed_loads(expert_bias: bool, steps: int = 100) -> list[float]:
    """max/mean load per step of a router skewed toward experts 0 and 1 (8 experts, top-2,
    128 tokens a step, rate 1e-2); the router weight itself stays fixed (only the balancing
    update acts)."""
    cfg = arch(experts=8, expert_bias=expert_bias, bias_update_rate=1e-2)
    router = make_router(cfg, seed=11, skew=(3.0, 2.5))
    loads = []
    for step in range(steps):
        route(router, tokens(128, 1000 + step))
        loads.append(balance_step(router).table_L3[0, 0].item())
    return loads


def test_expert_bias_lowers_the_load_of_a_skewed_router():
    on, off = _skewed_loads(True), _skewed_loads(False)
    first, last_on, last_off = on[0], sum(on[-10:]) / 10, sum(off[-10:]) / 10
    print(f"\nskewed router, max/mean load: step 1 {first:.3f}; steps 91-100 with expert bias "
          f"{last_on:.3f}, without (control) {last_off:.3f}")
    assert on[0] == off[0] > 2.5  # skewed at the start, identical before any update
    assert last_on < 1.5 and last_on < 0.5 * first
    assert last_off > 0.9 * first


# ---------------------------------------------------------------- dp1 against dp2


def _mb_plan(step: int):
    """The step's global microbatches (seed, tokens, padding); rank 0 of dp2 takes the first two,
    rank 1 the last (unequal counts per rank)."""
    return [(100 * step + 1, 24, 3), (100 * step + 2, 17, 0), (100 * step + 3, 30, 6)]


def _dp_run(cfg: MoEArch, steps: int, rank: int, world: int) -> dict:
    router = make_router(cfg, seed=5, skew=(1.5,))
    group = dist.group.WORLD if world > 1 else None
    history = []
    for step in range(1, steps + 1):
        plan = _mb_plan(step)
        mine = plan if world == 1 else (plan[:2] if rank == 0 else plan[2:])
        for seed, n, pad in mine:
            route(router, tokens(n, seed), pad)
        stats = balance_step(router, group)
        history.append(stats.table_L3.clone())
    out = {"stats": torch.stack(history)}
    for name in ("expert_bias", "qb_beta"):
        if hasattr(router, name):
            out[name] = getattr(router, name).clone()
    return out


def _dp2_case(cfg: MoEArch, steps: int) -> dict:
    return _dp_run(cfg, steps, dist.get_rank(), dist.get_world_size())


DP_CASES = {
    "expert bias": arch(expert_bias=True, bias_update_rate=0.05),
    "quantile balancing, ema": arch(quantile_balancing=True, quantile_ema=0.5),
}


@pytest.mark.parametrize("name", list(DP_CASES))
def test_dp2_balances_like_dp1(pools, name):
    cfg, steps = DP_CASES[name], 5
    want = _dp_run(cfg, steps, 0, 1)
    key = "expert_bias" if cfg.expert_bias else "qb_beta"
    assert want[key].abs().sum() > 0
    for got in pools(2).run(_dp2_case, cfg, steps):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)
        torch.testing.assert_close(got["stats"], want["stats"], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def moe_configs(tmp_path_factory, write_moe_configs):
    """tests/configs/moe_{tp,pp}.yaml over fresh demo shards: name -> path."""
    return write_moe_configs(tmp_path_factory.mktemp("moe_balance"), train_samples=120, seed=5)


def _biases(model) -> dict[int, torch.Tensor]:
    if model.llm.module is None:
        return {}
    return {i: r.expert_bias.clone() for i, r in find_routers(model.llm.module).items()}


def _train(config, steps, run=None):
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    run = run or build_run(config, dist.get_rank())
    out = []
    for step in steps:
        result = train_step(run.model, run.pipeline, step, run.optimizers, run.policy)
        out.append({"loss": result.loss, "moe": result.moe, "bias": _biases(run.model)})
    return run, out


def _layout_case(config_path: str, overrides: list[str], steps: int, one: bool) -> list[dict]:
    from mimo.commands.verify_train import one_process
    from mimo.compose.config import load_config

    config = load_config(config_path, overrides)
    run, out = _train(one_process(config) if one else config, range(1, steps + 1))
    run.pipeline.close()
    return out


LAYOUTS = {  # (config, overrides): both with expert bias and aux losses (stats to compare)
    "pp2 dp2, global aux": ("moe_pp", ["modules.language.arch.moe.expert_bias=true",
                                       "modules.language.arch.moe.bias_update_rate=0.05"]),
    "tp2 dp2 sp, per_sample aux": ("moe_tp", ["modules.language.arch.moe.bias_update_rate=0.05"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_balances_like_one_process(pools, moe_configs, name):
    config, overrides = LAYOUTS[name]
    steps = 2  # step 2 routes with the bias step 1 set
    want = pools(1).run(_layout_case, moe_configs[config], overrides, steps, True)[0]
    got = pools(4).run(_layout_case, moe_configs[config], overrides, steps, False)
    assert set(want[0]["bias"]) == {1, 3} and all(b.abs().sum() > 0 for b in want[0]["bias"].values())
    for rank, per_step in enumerate(got):
        for s, (g, w) in enumerate(zip(per_step, want)):
            for layer, bias in g["bias"].items():  # each stage's own layers
                assert torch.equal(bias, w["bias"][layer]), (rank, s, layer)
            assert set(g["moe"]) == set(w["moe"]), (rank, s)  # every layer's stats on every rank
            for key, value in w["moe"].items():
                assert g["moe"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (rank, s, key)
    if config == "moe_pp":
        stages = [set(per_step[0]["bias"]) for per_step in got]
        assert {1} in stages and {3} in stages  # the layers really are on two stages
    first = want[0]["moe"]
    assert {"moe/max_load", "moe/dead_experts", "moe/aux_loss", "moe/layer1/max_load", "moe/layer3/dead_experts"} <= set(first)
    assert first["moe/max_load"] >= 1 and first["moe/aux_loss"] > 0


def _resume_case(config_path: str, ckpt_dir: str) -> dict:
    from mimo.commands.verify_train import one_process
    from mimo.compose.config import load_config
    from mimo.training.checkpoint import load_checkpoint, save_checkpoint
    from mimo.training.run import build_run

    config = one_process(load_config(config_path, []))
    unbroken, whole = _train(config, range(1, 5))
    first, head = _train(config, range(1, 3))
    path = save_checkpoint(first.model, first.optimizers, 2, ckpt_dir)
    resumed = build_run(config, 0)
    zero = _biases(resumed.model)
    load_checkpoint(resumed.model, path, resumed.optimizers)
    _, tail = _train(config, range(3, 5), resumed)
    init = build_run(config, 0)  # train.init_from's load: weights (and biases) only
    load_checkpoint(init.model, path, rng=False)
    for run in (unbroken, first, resumed, init):
        run.pipeline.close()
    return {"whole": whole, "head": head, "tail": tail, "zero": zero, "init": _biases(init.model)}


def test_resume_continues_with_the_same_bias(pools, moe_configs, tmp_path):
    r = pools(1).run(_resume_case, moe_configs["moe_tp"], str(tmp_path / "ckpt"))[0]
    whole, head, tail = r["whole"], r["head"], r["tail"]
    assert all(not b.any() for b in r["zero"].values())  # a fresh model starts at 0
    assert all(b.abs().sum() > 0 for b in head[-1]["bias"].values())  # the checkpoint holds a bias
    for layer, bias in head[-1]["bias"].items():
        assert torch.equal(r["init"][layer], bias)
    for got, want in zip(tail, whole[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        for layer in want["bias"]:
            assert torch.equal(got["bias"][layer], want["bias"][layer]), layer

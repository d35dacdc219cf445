"""The tolerance yardstick (mimo.core.testing, docs/design.md §9): a tensor of a layout passes when its
error against the fp64 one-process reference is at most max(tol, k * e1), e1 being the fp32
one-process run's own error against fp64.

The rules on synthetic tensors, and mutations of a real training layout (a dropped TP
all-reduce, a wrong sequence slice, a gradient off by a factor 2) that ``mimo verify-train``'s
comparison must still reject, beside the unmutated layout that it accepts.
"""

from __future__ import annotations

import math

import pytest
import torch

from mimo.core.testing import YARDSTICK_K, Measure, Yardstick, yardstick_check

TOL = 1e-5
STEPS = 2


# ---------------------------------------------------------------- the rule


def _truth(n=1000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_bound_is_tol_or_k_times_the_one_process_error():
    truth = _truth()
    noise = _truth(seed=1) * truth.norm() / _truth(seed=1).norm()  # ||noise|| = ||truth||
    ys = Yardstick(TOL)
    # a quiet tensor: the fp32 reference 1e-7 off, the bound is tol
    quiet = ys.check("quiet", truth + 3e-6 * noise, truth + 1e-7 * noise, truth)
    assert quiet.bound == TOL and quiet.ok and quiet.err == pytest.approx(3e-6) and quiet.e1 == pytest.approx(1e-7)
    # a noisy one (reduction-heavy): the fp32 reference itself 1e-5 off, so 2.5e-5 passes ...
    noisy = ys.check("noisy", truth + 2.5e-5 * _truth(seed=2) * truth.norm() / _truth(seed=2).norm(), truth + 1e-5 * noise, truth)
    assert noisy.bound == pytest.approx(YARDSTICK_K * 1e-5) and noisy.ok
    # ... but not k + 1 times its floor
    assert not ys.check("too noisy", truth + (YARDSTICK_K + 1) * 1e-5 * noise, truth + 1e-5 * noise, truth).ok
    assert not ys.ok and [m.name for m in ys.worst(1)] == ["too noisy"]
    assert ys.summary()["failed"] == 1 and "too noisy" in ys.message()
    with pytest.raises(AssertionError, match="too noisy"):
        ys.assert_ok()


def test_layout_bugs_fail_even_on_a_noisy_tensor():
    """A factor 2, a wrong slice and a missing partial sum are O(1) errors: far above a noise
    floor of 1e-4 (ten times the tolerance)."""
    truth = _truth()
    ref32 = truth + 1e-4 * truth.norm() * _truth(seed=3) / _truth(seed=3).norm()
    halves = truth.chunk(2)
    for name, got in {"factor 2": 2 * truth, "swapped halves": torch.cat(halves[::-1]),
                      "one partial sum of two": 0.5 * truth + 0.1 * _truth(seed=4)}.items():
        m = Yardstick(TOL).check(name, got.float(), ref32.float(), truth)
        assert not m.ok and m.ratio > 100, m


def test_scalars_nested_dicts_and_edge_cases():
    t = _truth(6)
    got = {"loss": 2.0, "grads": {"w": t.float(), "b": torch.zeros(3)}}
    ref32 = {"loss": 2.0, "grads": {"w": t.float(), "b": torch.zeros(3)}}
    ref64 = {"loss": 2.0, "grads": {"w": t, "b": torch.zeros(3, dtype=torch.float64)}}
    ys = yardstick_check(got, ref32, ref64, TOL)
    assert ys.ok and {m.name for m in ys.measures} == {"loss", "grads.w", "grads.b"}
    zero = next(m for m in ys.measures if m.name == "grads.b")
    assert zero.absolute and zero.err == 0.0  # an exactly-zero truth is measured in absolute terms
    assert not Yardstick(TOL).check("b", torch.full((3,), 1e-3), torch.zeros(3), torch.zeros(3, dtype=torch.float64)).ok
    assert not Yardstick(TOL).check("nan", torch.tensor([math.nan]), torch.ones(1), torch.ones(1)).ok
    with pytest.raises(ValueError, match="key mismatch"):
        yardstick_check({"a": 1.0}, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match="shape mismatch"):
        Yardstick(TOL).check("s", torch.ones(2), torch.ones(3), torch.ones(3))
    # measures travel (as dicts, from worker ranks) and are re-bounded by the receiving yardstick
    loose = Yardstick(1e-2)
    loose.extend([Measure("x", 5e-3, 0.0, TOL).as_dict()], prefix="rank 1: ")
    assert loose.ok and loose.measures[0].name == "rank 1: x" and loose.measures[0].bound == 1e-2


# ---------------------------------------------------------------- mutations of a training layout

# tp 2 with sequence parallel for the LLM, dp 2 for the encoder, on 2 ranks
LAYOUT = ["world_size=2", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
          "modules.language.parallel.tp=2", "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:2",
          "modules.language.parallel.sequence_parallel=true"]


@pytest.fixture(scope="module")
def config(tmp_path_factory, write_demo_config):
    def edit(cfg):
        cfg["data"]["tokens_per_microbatch"] = 512
        cfg["data"]["max_sample_tokens"] = 256

    return write_demo_config(tmp_path_factory.mktemp("yardstick"), 4, edit)


@pytest.fixture(scope="module")
def refs(pools, config):
    from mimo.commands.verify_train import references

    return references(pools(1), config, LAYOUT, STEPS)


def _mutant_case(config, overrides, steps, mutation):
    """``train_case`` of the layout with one deliberate bug, on every rank:
    ``dropped_reduce``: the first TP RowParallelLinear of the LLM skips its reduction (under SP
    its reduce-scatter only keeps this rank's rows of its own partial sum);
    ``wrong_slice``: that layer's reduce-scatter sums, then keeps the neighbour rank's rows;
    ``factor_2``: one LLM gradient doubled after the gradient sync (before the optimizer);
    ``none``: the layout as it is. Returns the record and how often the bug fired."""
    import torch.distributed as dist

    import mimo.parallel.layers as layers
    import mimo.training.step as step_mod
    from mimo.commands.verify_train import train_case

    fired = []
    saved = (layers.RowParallelLinear.forward, step_mod.train_step)
    forward, train_step = saved
    chosen = []

    def tp_size(group):
        return 1 if group is None else dist.get_world_size(group)

    def dropped_seq(x, group):
        return x.chunk(tp_size(group), 0)[dist.get_rank(group)]

    def wrong_seq(x, group):
        n = tp_size(group)
        return saved_reduce(x, group).chunk(n, 0)[(dist.get_rank(group) + 1) % n]

    saved_reduce, saved_seq = layers.reduce_from_group, layers.reduce_scatter_seq
    mutants = {"dropped_reduce": (lambda x, group: x, dropped_seq), "wrong_slice": (saved_reduce, wrong_seq)}

    def mutant_forward(self, x):
        if not chosen and tp_size(self.group) > 1:
            chosen.append(self)
        if not chosen or self is not chosen[0]:
            return forward(self, x)
        layers.reduce_from_group, layers.reduce_scatter_seq = mutants[mutation]
        fired.append(mutation)
        try:
            return forward(self, x)
        finally:
            layers.reduce_from_group, layers.reduce_scatter_seq = saved_reduce, saved_seq

    def doubling_step(*args, on_grads=None, **kwargs):
        def hook(model, norm):
            p = next(p for p in model.llm.module.parameters() if p.grad is not None)
            p.grad.mul_(2)
            fired.append(mutation)
            if on_grads is not None:
                on_grads(model, norm)

        return train_step(*args, on_grads=hook, **kwargs)

    if mutation in mutants:
        layers.RowParallelLinear.forward = mutant_forward
    elif mutation == "factor_2":
        step_mod.train_step = doubling_step
    elif mutation != "none":
        raise ValueError(mutation)
    try:
        return train_case(config, overrides, steps, False), len(fired)
    finally:  # the pool's processes run later cases too
        layers.RowParallelLinear.forward, step_mod.train_step = saved


@pytest.mark.parametrize("mutation", ["none", "dropped_reduce", "wrong_slice", "factor_2"])
def test_verify_train_rejects_layout_bugs(pools, config, refs, mutation):
    from mimo.commands.verify_train import compare

    out = pools(2).run(_mutant_case, config, LAYOUT, STEPS, mutation)
    layout, fired = [r for r, _ in out], [n for _, n in out]
    report = compare(layout, refs[0], TOL, fp64=refs[1])
    ys = report["yardstick"]
    if mutation == "none":
        assert report["ok"], ys
        assert ys["checked"] > 50 and ys["worst"][0]["err_vs_fp64"] <= ys["worst"][0]["bound"]
        return
    assert all(fired), fired  # the bug ran on every rank
    assert not report["ok"] and ys["failed"] > 0
    worst = ys["worst"][0]
    # orders of magnitude past the bound, not a rounding-level miss
    assert worst["err_vs_fp64"] > 100 * worst["bound"], worst
    if mutation == "factor_2":  # the doubled gradient itself: an error of 1
        assert worst["name"].startswith("grads: ") and worst["err_vs_fp64"] == pytest.approx(1.0, rel=1e-3), worst

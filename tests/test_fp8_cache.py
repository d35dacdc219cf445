"""FP8 weights quantized once per optimizer step (``train.fp8.cache_weights``, issue 50 item 1).

- A product reading the cache is the product quantizing its weight itself, bit for bit,
  forward and both gradients, for every recipe, dense and grouped (delayed: the same amax
  history too).
- Compiled layers read the cache unchecked: after the weights change (written as an optimizer
  writes them, without a version bump) and the cache is refreshed, the compiled products equal
  the eager per-product ones, in one graph for every step.
- Training (world 2, LLM tp 2 with SP, tiny MoE VLM, 2 microbatches, full recompute): the
  losses with the cache equal those without it; with it each FP8 weight is quantized once per
  step, without it once per product (microbatches x (forward + recompute)); a frozen module's
  weights are quantized once in the run.
"""

from __future__ import annotations

import pytest
import torch

from mimo.parallel import gemm
from mimo.parallel.fp8 import FP8Site, invalidate_weights, refresh_weights, weight_cache_bytes
from tests.test_fp8_blockwise import TINY_MOE

RECIPES = ["tensorwise", "rowwise", "delayed", "blockwise"]


class _Owner(torch.nn.Module):
    """A module holding one weight and its recipe (as an FP8 layer does), with a history buffer
    for ``delayed``."""

    def __init__(self, weight: torch.Tensor, kind: str, cache: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        if kind == "delayed":
            self.register_buffer("fp8_history", torch.zeros(1, 3, 4))
        self.recipe = FP8Site(kind, None, (), self if kind == "delayed" else None, [self.weight], cache)

    def forward(self, x, ends=None):
        if ends is None:
            return gemm.linear(x, self.weight, None, self.recipe)
        return gemm.grouped_linear(x, self.weight, ends, self.recipe)


def _pass(owner: _Owner, x0: torch.Tensor, ends, g0: torch.Tensor) -> list[torch.Tensor]:
    x = x0.clone().requires_grad_(True)
    owner.weight.grad = None
    y = owner(x, ends)
    y.backward(g0)
    out = [y.detach(), x.grad, owner.weight.grad]
    return out + ([owner.fp8_history.clone()] if hasattr(owner, "fp8_history") else [])


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
@pytest.mark.parametrize("kind", RECIPES)
def test_cached_weights_give_the_per_product_quantization(kind, grouped):
    """Three steps of two microbatches each, the weight updated between steps in place: the
    cached site's outputs, gradients (and delayed history) equal the per-product site's."""
    g_ = torch.Generator().manual_seed(3)
    shape = (3, 48, 160) if grouped else (48, 160)
    w0 = torch.randn(*shape, generator=g_) * 0.1
    sites = [_Owner(w0, kind, cache) for cache in (False, True)]
    refresh_weights(sites[1])
    assert weight_cache_bytes(sites[1]) > 0 and weight_cache_bytes(sites[0]) == 0
    for step in range(3):
        refresh_weights(sites[1])  # (as a step begins)
        for mb in range(2):
            rows = 37 + 11 * mb
            x0, g0 = torch.randn(rows, 160, generator=g_), torch.randn(rows, 48, generator=g_)
            ends = torch.tensor([10, 10, rows]) if grouped else None
            plain, cached = (_pass(o, x0, ends, g0) for o in sites)
            for a, b in zip(plain, cached):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
        update = torch.randn(*shape, generator=g_) * 0.05
        for o in sites:
            o.weight.data.add_(update)  # no version bump: as an optimizer's own kernel writes
            if kind == "delayed":
                o.fp8_history.copy_(torch.roll(o.fp8_history, 1, dims=-1))
                o.fp8_history[..., 0] = 0
        invalidate_weights(sites[1], trainable_only=True)  # the step's finaliser


def test_eager_products_see_a_weight_written_behind_the_cache():
    """An eager product checks the cached form against the weight's version: a weight written
    in place through autograd-visible ops is quantized anew, not read stale."""
    w0 = torch.randn(32, 64)
    owner = _Owner(w0, "rowwise", True)
    refresh_weights(owner)
    x = torch.randn(5, 64)
    before = owner(x).detach()
    with torch.no_grad():
        owner.weight.mul_(2)
    after = owner(x).detach()
    torch.testing.assert_close(after, _Owner(w0 * 2, "rowwise", False)(x).detach(), rtol=0, atol=0)
    assert not torch.equal(after, before)


def test_compiled_products_read_the_refreshed_cache_in_one_graph():
    """Compiled (dynamo's graph run as it is: the CPU's products bit for bit), dense and grouped
    row-wise: across three steps whose weight updates bump no version, the cached compiled
    products equal the eager per-product ones after each refresh, without recompiling, and the
    graph quantizes no weight (its only amaxes are the inputs')."""
    from torch._dynamo.utils import counters

    g_ = torch.Generator().manual_seed(5)
    dense0, experts0 = torch.randn(48, 160, generator=g_) * 0.1, torch.randn(3, 32, 48, generator=g_) * 0.1
    plain = [_Owner(dense0, "rowwise", False), _Owner(experts0, "rowwise", False)]
    cached = [_Owner(dense0, "rowwise", True), _Owner(experts0, "rowwise", True)]

    def layer(mods, x, ends):
        return mods[1](mods[0](x), ends)

    amaxes = []

    def backend(gm, example_inputs):  # dynamo's graph as it runs: its amax reductions counted
        amaxes.append(sum("amax" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, ends: layer(cached, x, ends), dynamic=True, backend=backend)
    for step in range(3):
        for m in cached:
            refresh_weights(m)
        x0 = torch.randn(70 + step, 160, generator=g_)
        ends = torch.tensor([20, 20, x0.shape[0]])
        got = []
        for fn in (lambda x, e: layer(plain, x, e), compiled):
            x = x0.clone().requires_grad_(True)
            for m in plain + cached:
                m.weight.grad = None
            y = fn(x, ends)
            y.square().sum().backward()
            mods = plain if not got else cached
            got.append([y.detach(), x.grad] + [m.weight.grad for m in mods])
        for a, b in zip(*got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        stale = [m.recipe.cached[0][0].clone() for m in cached]
        for m, p in zip(cached, plain):
            update = torch.randn(m.weight.shape, generator=g_)
            m.weight.data.add_(update)
            p.weight.data.add_(update)
            invalidate_weights(m, trainable_only=True)
            refresh_weights(m)
        assert not any(torch.equal(s, m.recipe.cached[0][0]) for s, m in zip(stale, cached))
        for m in cached:  # the next step's refresh finds nothing more to do
            assert refresh_weights(m) == 0
            invalidate_weights(m, trainable_only=True)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert amaxes == [2], amaxes  # the two inputs' row amaxes: the weights come quantized


def test_frozen_weights_stay_cached_across_steps():
    """A step's finaliser drops the cached forms of the weights that train; a frozen weight's
    stays (quantized once), and a load (``invalidate_weights`` of all) drops it too."""
    owner = _Owner(torch.randn(32, 64), "rowwise", True)
    owner.weight.requires_grad_(False)
    assert refresh_weights(owner) == 1
    first = owner.recipe.cached[0]
    invalidate_weights(owner, trainable_only=True)
    assert refresh_weights(owner) == 0 and owner.recipe.cached[0] is first
    invalidate_weights(owner)
    assert refresh_weights(owner) == 1


# test_fp8_blockwise's tiny MoE VLM at world 2: LLM tp 2 with SP, 2 microbatches, full recompute
AT_TP2 = ["world_size=2", "modules.vision.parallel.dp=2", "modules.language.parallel.tp=2",
          "modules.language.parallel.sequence_parallel=true", "train.micro_batches=2", "train.recompute=full"]


def _cached_steps(config_path: str, recipe: str) -> dict:
    """Three steps with and without the cache: the losses, and per step how many weights were
    quantized and how many FP8 weights the model has on this rank."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.parallel import fp8
    from mimo.parallel.fp8 import fp8_sites
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    calls = [0]
    original = fp8.FP8Site.quantize_weight

    def counted(self, weight):
        calls[0] += 1
        return original(self, weight)

    fp8.FP8Site.quantize_weight = counted
    out = {}
    try:
        for cache in (True, False):
            overrides = [*AT_TP2, f"train.fp8.recipe={recipe}", f"train.fp8.cache_weights={cache}"]
            run = build_run(load_config(config_path, overrides), dist.get_rank())
            try:
                weights = sum(len(s.weights) for part in run.model.parts if part.module is not None
                              for s in fp8_sites(part.module))
                losses, counts = [], []
                for s in (1, 2, 3):
                    calls[0] = 0
                    losses.append(train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss)
                    counts.append(calls[0])
                out[cache] = {"losses": losses, "counts": counts, "weights": weights}
            finally:
                run.close()
    finally:
        fp8.FP8Site.quantize_weight = original
    return out


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_training_with_the_cache_equals_training_without(pools, tmp_path, recipe):
    (tmp_path / "tiny.yaml").write_text(TINY_MOE)
    got = pools(2).run(_cached_steps, str(tmp_path / "tiny.yaml"), recipe)
    for rank in got:
        with_cache, without = rank[True], rank[False]
        assert with_cache["losses"] == without["losses"], (with_cache, without)
        n = with_cache["weights"]
        # once a step (the first: those the optimizer laid out anew in its buffers since the build)
        assert n > 0 and with_cache["counts"][1:] == [n, n] and with_cache["counts"][0] <= n, with_cache
        # without: each FP8 product quantizes its weight, per microbatch, in forward and recompute
        assert all(c >= 4 * n for c in without["counts"]), without


def test_a_compiled_product_without_a_cached_form_quantizes_itself():
    """A weight dropped from the cache and not refreshed (a forward outside the steps' and
    forward-only passes' refresh): the compiled product quantizes it, as an uncached one does."""
    g_ = torch.Generator().manual_seed(8)
    w0, x = torch.randn(48, 160, generator=g_), torch.randn(20, 160, generator=g_)
    plain, cached = _Owner(w0, "rowwise", False), _Owner(w0, "rowwise", True)
    torch._dynamo.reset()
    compiled = torch.compile(cached, backend="eager", dynamic=True)
    torch.testing.assert_close(compiled(x), plain(x), rtol=0, atol=0)
    refresh_weights(cached)
    torch.testing.assert_close(compiled(x), plain(x), rtol=0, atol=0)

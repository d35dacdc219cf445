"""The run's gradients (``mimo.training.optim.GradSync``): persistent main-gradient buffers (and
direct buckets without one), fp32 accumulation of bf16 microbatches, the reduce-scatter mode
against the all-reduce, and the once-per-step TP sums of partial gradients, counted in a real
training step."""

from __future__ import annotations

import pytest
import torch

from mimo.training.bucket_optim import build_optimizers
from mimo.training.optim import GradSync, TrainParam, grad_norm
from mimo.training.precision import PrecisionPolicy


def _params(*sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]


def _inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    start, size = buf.data_ptr(), buf.numel() * buf.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + size


def test_grads_with_nothing_to_sum_are_autograds_own():
    """A bucket without a DP or partial sum, of the weights' dtype, is direct: no buffer;
    backward hands each weight its own gradient tensor, later microbatches add into it, a new
    step starts from None (no zero fill), and the optimizer and the norm read ``.grad``; a
    weight backward never reached steps on zeros."""
    a, b, unused = _params(5, 3, 2)
    params = [TrainParam("m", n, p, None, True) for n, p in (("a", a), ("b", b), ("u", unused))]
    sync = GradSync(params, bucket_numel=100)
    (bucket,) = sync._all
    assert bucket.direct and bucket.flat is None and bucket.numel == 10
    opt = build_optimizers(params, sync.module_buckets(), {"m": 0.1}, {"m": 0.0})["m"]
    made = []
    for step in range(2):
        sync.zero_grad()
        assert a.grad is None and b.grad is None and not hasattr(a, "main_grad")
        for k in range(3):  # microbatches
            ((k + 1) * a.sum() + (a * b.sum()).sum()).backward()
            sync.accumulate("m")  # what the schedule runner does after each backward of the module
        sync.finish()
        want_a = 6 + 3 * b.detach().sum()
        assert torch.allclose(a.grad, want_a.expand(5)) and torch.allclose(b.grad, (3 * a.detach().sum()).expand(3))
        assert unused.grad is None
        made.append(a.grad)
        norm = grad_norm([opt], "cpu")
        assert torch.allclose(norm, torch.cat([a.grad, b.grad]).double().norm())
        before = unused.detach().clone()
        opt.step()  # AdamW on a zero gradient: the moments stay zero, the weight stays
        assert torch.equal(unused.detach(), before)
    assert made[0] is not made[1]  # autograd's fresh tensor each step, no persistent buffer
    sync.close()


def test_bf16_microbatches_accumulate_in_fp32():
    """bf16 weights: each microbatch's bf16 ``.grad`` goes into the fp32 main gradient and is
    freed; the sum is the exact fp32 sum of the microbatch gradients (bf16 accumulation is not),
    and the optimizer steps its fp32 masters on it."""
    (w,) = _params(64, dtype=torch.bfloat16)
    policy = PrecisionPolicy.named("bf16")
    sync = GradSync([TrainParam("m", "w", w, None, True)], policy)
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(64, generator=gen).to(torch.bfloat16) * (1 + 10 * k) for k in range(8)]
    sync.zero_grad()
    for g in parts:
        (w * g).sum().backward()
        sync.accumulate("m")  # what the schedule runner does after each backward of the module
        assert w.grad is None
    assert w.main_grad.dtype == torch.float32
    exact = torch.stack([g.float() for g in parts]).sum(0)
    assert torch.equal(w.main_grad, exact)
    in_bf16 = parts[0].clone()
    for g in parts[1:]:
        in_bf16 += g
    assert not torch.equal(in_bf16.float(), exact)  # what accumulating in .grad would have lost
    # the optimizer reads the main gradient: the same update as on an fp32 copy with that gradient
    ref = torch.nn.Parameter(w.detach().float())
    ref.grad = exact.clone()
    opt = build_optimizers([TrainParam("m", "w", w, None, True)], sync.module_buckets(), {"m": 1e-2}, {"m": 1e-2}, policy=policy)["m"]
    opt_ref = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95))
    opt.step()
    opt_ref.step()
    assert torch.equal(opt.state[w]["master"], ref.detach()) and torch.equal(w.detach(), ref.detach().to(torch.bfloat16))
    # a new step: the first microbatch overwrites last step's sum (no zeroing pass), and a
    # step in which the weight gets no gradient leaves it zero after finish
    sync.zero_grad()
    (w * parts[1]).sum().backward()
    sync.finish()  # accumulates what the last backward left
    assert torch.equal(w.main_grad, parts[1].float()) and w.grad is None
    sync.zero_grad()
    sync.finish()
    assert torch.equal(w.main_grad, torch.zeros(64))
    sync.close()


# ---------------------------------------------------------------- over process groups


def _reduce_scatter_case(sizes, seed):
    """Each rank's random gradients, summed by an all-reduce GradSync and by a reduce-scatter
    one (ragged buckets: padded to a multiple of the group size); returns this rank's shards,
    their offsets and the all-reduced buckets."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.group.WORLD
    out = {}
    for mode in ("all_reduce", "reduce_scatter"):
        params = _params(*sizes)
        sync = GradSync([TrainParam("m", str(i), p, world, True) for i, p in enumerate(params)], bucket_numel=10, mode=mode)
        gen = torch.Generator().manual_seed(seed + rank)
        sync.zero_grad()
        sync.arm("m")
        sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params).backward()
        sync.flush("m")
        sync.finish()
        if mode == "all_reduce":
            out["buckets"] = [(b.flat.clone(), sum(p.numel() for p in b.params)) for b in sync.buckets["m"]]
        else:
            # read where the shard lives in the bucket (the main gradients a sharded optimizer steps on)
            out["shards"] = [(b.flat[off : off + s.numel()].clone(), off) for (s, off), b in zip(sync.shards("m"), sync.buckets["m"])]
            out["padded"] = [b.flat.numel() for b in sync.buckets["m"]]
        sync.close()
    return out


def test_reduce_scatter_gives_each_rank_its_shard_of_the_sum(pools):
    world, sizes = 3, (7, 2, 5, 4, 1)  # buckets of 10 elements at most: 5 | 4+1 | 2+... ragged, none divisible by 3
    per_rank = pools(world).run(_reduce_scatter_case, sizes, 5)
    buckets = per_rank[0]["buckets"]
    assert len(buckets) >= 2 and any(n % world for _, n in buckets)
    for r, res in enumerate(per_rank):
        assert all(torch.equal(f, g) for (f, _), (g, _) in zip(res["buckets"], buckets))  # the all-reduce agrees
        for (shard, off), (flat, n), padded in zip(res["shards"], buckets, res["padded"]):
            assert padded == -(-n // world) * world and off == r * (padded // world)  # contiguous, in rank order
            want = torch.nn.functional.pad(flat, (0, padded - n))[off : off + padded // world]
            assert torch.allclose(shard, want, rtol=1e-6, atol=1e-6), (r, off)
    for i, (flat, n) in enumerate(buckets):  # the shards tile the whole bucket
        whole = torch.cat([res["shards"][i][0] for res in per_rank])[:n]
        assert torch.allclose(whole, flat[:n], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory, write_demo_config):
    return write_demo_config(tmp_path_factory.mktemp("grads"), 3)


MICROBATCHES = 4


def _old_rms_forward(self, x):
    """RMSNorm as it was: its partial weight through ``copy_to_group`` (a gradient all-reduce
    per layer per microbatch) -- the mutation the count must catch."""
    from mimo.parallel.collectives import copy_to_group

    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    weight = copy_to_group(self.weight, self.ctx.tp) if self.partial else self.weight
    return weight * x32.to(x.dtype)


def _tp_collectives_case(config_path, overrides, mutate):
    """One training step, twice from the same start: as is, and with every TP-partial parameter
    frozen. Counts the collectives each step issues on this rank's LLM TP group (forward,
    backward, gradient sums); the difference is what the partial parameters' gradients cost."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.llm.norm import RMSNorm
    from mimo.training.optim import grad_sync_for, model_optimizers
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    names = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter_single",
             "all_to_all_single", "broadcast", "reduce"]
    real = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    real_forward = RMSNorm.forward
    config = load_config(config_path, overrides)
    out = {}
    try:
        if mutate:
            RMSNorm.forward = _old_rms_forward
        for frozen in (False, True):
            run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
            model, tp = run.model, run.model.llm.ctx.tp
            partial = [i.param for i in model.llm.module.param_table().values() if i.partial_groups]
            optimizers = run.optimizers
            if frozen:
                for p in partial:
                    p.requires_grad_(False)
                model.grad_sync.close()
                model.grad_sync = None
                grad_sync_for(model, run.policy)
                optimizers = model_optimizers(config, model, run.policy)
            else:
                out["partial_params"] = len(partial)
                out["partial_norms"] = sum(isinstance(m, RMSNorm) and m.partial for m in model.llm.module.modules())
                out["tp_buckets"] = sum(len(b.partial_groups) for bs in model.grad_sync.partial_buckets.values() for b in bs)
            count = [0]

            def spy(fn):
                def wrapped(*args, **kwargs):
                    if kwargs.get("group") is tp:
                        count[0] += 1
                    return fn(*args, **kwargs)
                return wrapped

            for n, fn in real.items():
                setattr(dist, n, spy(fn))
            try:
                train_step(model, run.pipeline, 1, optimizers, run.policy)
            finally:
                for n, fn in real.items():
                    setattr(dist, n, fn)
            run.close()
            out["frozen" if frozen else "all"] = count[0]
    finally:
        RMSNorm.forward = real_forward
    return out


@pytest.mark.parametrize("mutate", [False, True])
def test_partial_gradients_cost_one_tp_collective_per_bucket(pools, demo_config, mutate):
    """tp=2 with sequence parallelism, 4 microbatches: the gradients of the TP-partial
    parameters (every RMSNorm weight under SP, ...) cost exactly one TP collective per TP bucket
    in a step -- not one per layer per microbatch. Mutation: the old per-layer
    ``copy_to_group`` of the norm weight puts layers x microbatches collectives back."""
    overrides = [f"train.micro_batches={MICROBATCHES}"]  # the demo layout: LLM tp2 dp2 with SP
    for r in pools(4).run(_tp_collectives_case, demo_config, overrides, mutate):
        assert r["partial_norms"] >= 5 and r["partial_params"] >= r["partial_norms"]
        assert r["tp_buckets"] == 1  # all of them fit one bucket of the default size
        cost = r["all"] - r["frozen"]
        if mutate:
            assert cost == r["tp_buckets"] + r["partial_norms"] * MICROBATCHES
        else:
            assert cost == r["tp_buckets"], r


def _persistent_case(config_path, precision, grad_reduce="fp32"):
    """Two training steps of a built run: the same GradSync and buffers both steps, every
    trained parameter's gradient a view of one of its buckets (fp32: ``.grad`` itself; bf16:
    an fp32 ``main_grad``, ``.grad`` freed; bf16 with ``grad_reduce`` bf16: ``.grad`` itself)."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    run = build_run(load_config(config_path), dist.get_rank(), policy=PrecisionPolicy.named(precision, grad_reduce))
    sync = run.grad_sync
    buffers = [b.flat.data_ptr() for b in sync._all]
    losses = [train_step(run.model, run.pipeline, step, run.optimizers, run.policy).loss for step in (1, 2)]
    run.close()
    params = run.model.train_params()
    return {
        "same": run.model.grad_sync is sync and [b.flat.data_ptr() for b in sync._all] == buffers,
        "in_buckets": all(any(_inside(p.param.main_grad, b.flat) for b in sync._all) for p in params),
        "main_dtypes": sorted({str(p.param.main_grad.dtype) for p in params}),
        "grad_is_main": all(p.param.grad is p.param.main_grad for p in params),
        "grad_freed": all(p.param.grad is None for p in params),
        "trained": len(params), "losses": losses,
    }


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_main_gradients_persist_across_steps(pools, demo_config, precision):
    for r in pools(4).run(_persistent_case, demo_config, precision):
        assert r["trained"] > 0 and r["same"] and r["in_buckets"] and r["main_dtypes"] == ["torch.float32"], r
        assert r["grad_is_main"] if precision == "fp32" else r["grad_freed"], r
        assert all(0 < loss < 20 for loss in r["losses"]), r


def test_bf16_gradients_are_the_weights_own(pools, demo_config):
    """``train.grad_reduce: bf16`` (bf16-pure, the demo layout with DP 2 on the LLM): no fp32
    main gradient anywhere, ``.grad`` is the bucket (autograd accumulates into it, the DP sum
    runs on it); the first step's loss is the fp32-reduced run's, the second within bf16
    rounding of the summed gradients."""
    bf16 = pools(4).run(_persistent_case, demo_config, "bf16-pure", "bf16")
    fp32 = pools(4).run(_persistent_case, demo_config, "bf16-pure", "fp32")
    for r, ref in zip(bf16, fp32):
        assert r["trained"] > 0 and r["same"] and r["in_buckets"] and r["grad_is_main"], r
        assert r["main_dtypes"] == ["torch.bfloat16"] and ref["main_dtypes"] == ["torch.float32"], (r, ref)
        assert r["losses"][0] == ref["losses"][0] and abs(r["losses"][1] - ref["losses"][1]) < 2e-2, (r, ref)

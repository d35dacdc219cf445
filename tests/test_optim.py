"""The one AdamW (``mimo.training.bucket_optim``) in each precision, world 1, no processes: fp32
is torch's AdamW bit for bit; bf16 is torch's AdamW on fp32 copies, the weights those rounded;
bf16-pure is torch's AdamW on the bf16 weights with the gradients rounded; state round trips
through the checkpoint's files continue exactly; state written by the optimizer classes before
the one AdamW loads and continues as those classes continued."""

import os
from contextlib import ExitStack

import pytest
import torch
from safetensors.torch import load_file

from mimo.training.bucket_optim import build_optimizers
from mimo.parallel.params import set_main_grad_
from mimo.training.optim import GradSync, TrainParam
from mimo.training.precision import PrecisionPolicy

SHAPES = [(7, 5), (3,), (4, 2), (6,), (5, 3)]  # matrices take weight decay, vectors do not: interleaved
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)
LEGACY = os.path.join(os.path.dirname(__file__), "data", "optim_state_before_one_adamw")


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _optimizer(ps, precision, bucket_numel=40, offload=False):
    """The run's optimizer of the module ``m`` holding ``ps`` (several buckets of 40 elements,
    each mixing decayed and undecayed parameters), its gradients zero."""
    policy = PrecisionPolicy.named(precision)
    tps = [TrainParam("m", str(i), p, None, True, p.dim() >= 2) for i, p in enumerate(ps)]
    sync = GradSync(tps, policy, bucket_numel)
    sync.zero_grad()
    return build_optimizers(tps, sync.module_buckets(), {"m": LR}, {"m": WD}, policy=policy, offload=offload)["m"]


def _torch_adamw(ps, **kw):
    groups = [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=1e-8, **kw)


def _grads(k):
    g = torch.Generator().manual_seed(100 + k)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _step(opt, ps, k):
    """Step ``k`` (1-based) on its seeded gradients, left in the main gradients as a training
    step leaves them, at lr ``LR / k``."""
    for p, g in zip(ps, _grads(k)):
        set_main_grad_(p, g)
    opt.param_groups[0]["lr"] = LR / k
    opt.step()


def _torch_step(ref, ps, k, dtype=None):
    for p, g in zip(ps, _grads(k)):
        p.grad = g.to(p.device, dtype or p.dtype)
    for group in ref.param_groups:
        group["lr"] = LR / k
    ref.step()


def _state(opt) -> dict[str, torch.Tensor]:
    """Every state tensor by ``{name}.{field}`` (the checkpoint's pieces)."""
    return opt.state_pieces(lambda t: t.clone(), lambda p: True)[0]


def _part(ps):
    """The checkpoint's view of the parameters ``ps`` (names ``0``, ``1``, ...: one module, world 1)."""
    from mimo.parallel.params import param_table
    from mimo.training.checkpoint import _Part

    return _Part("m", param_table(torch.nn.ParameterList(ps)))


def _save(opt, ps, directory) -> None:
    """``ps`` and ``opt``'s state written as a checkpoint writes them."""
    from mimo.training.checkpoint import _write_part

    os.makedirs(directory, exist_ok=True)
    _write_part(_part(ps), opt, str(directory), 0, 0)


def _load(opt, ps, directory) -> None:
    """``ps`` and ``opt``'s state read back from a checkpoint folder by the checkpoint's reader."""
    from mimo.training.checkpoint import _Files, _read_state, _read_weights
    from mimo.training.reshard import StoredModule

    with ExitStack() as stack:
        files = _Files(str(directory), stack)
        names = sorted(f for f in os.listdir(directory) if f.startswith("m-rank"))
        stored = StoredModule(str(directory), names, "m", files.get)
        _read_weights(_part(ps), stored)
        _read_state(_part(ps), opt, stored, str(directory))


@pytest.mark.parametrize("kernel", ["default", "foreach"])
def test_fp32_equals_torch_adamw(kernel, tmp_path):
    """fp32: torch's AdamW's weights and moments, bit for bit, the lr changing every step and
    the state saved and loaded midway into a fresh optimizer; the weights are updated in place
    (no master copy) and the parameters stay views of the bucket buffers."""
    a, b = _params(torch.float32), _params(torch.float32)
    ref = _torch_adamw(a, **({"foreach": True} if kernel == "foreach" else {}))
    opt = _optimizer(b, "fp32")
    assert len(opt.states) == 2 and all(s.master is s.own for s in opt.states)
    for k in range(1, 7):
        _torch_step(ref, a, k)
        _step(opt, b, k)
        if k == 3:
            _save(opt, b, tmp_path)
            b = _params(torch.float32, seed=9)
            opt = _optimizer(b, "fp32")
            _load(opt, b, tmp_path)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), k
    state = _state(opt)
    for i, p in enumerate(a):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[p][key].reshape(-1), state[f"{i}.{key}"]), (i, key)
    assert {float(s.step) for s in opt.states} == {6.0}


def test_bf16_is_adamw_on_fp32_masters():
    """bf16 (fp32 masters): the masters are torch's AdamW on fp32 copies with the fp32 main
    gradients, the weights those masters rounded."""
    a, b = _params(torch.float32), _params(torch.bfloat16)
    for x, y in zip(a, b):
        x.data.copy_(y.float())
    ref, opt = _torch_adamw(a, foreach=True), _optimizer(b, "bf16")
    for k in range(1, 5):
        _torch_step(ref, a, k)
        _step(opt, b, k)
    state = _state(opt)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(state[f"{i}.master"], x.detach().reshape(-1)), i
        assert torch.equal(y.detach(), x.detach().to(torch.bfloat16)), i
        assert state[f"{i}.exp_avg"].dtype == torch.float32


def test_bf16_keeps_updates_that_rounding_would_lose():
    """lr 1e-4 on weights of 1.0 moves less than half a bf16 step: bf16-pure never moves, the
    master does, and the weight is the master rounded."""
    w_pure, w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    pure, opt = _optimizer([w_pure], "bf16-pure"), _optimizer([w], "bf16")
    for o, p in ((pure, w_pure), (opt, w)):
        o.param_groups[0].update(lr=1e-4, weight_decay=0.0)
        for _ in range(100):
            set_main_grad_(p, torch.ones(p.shape))
            o.step()
    assert torch.equal(w_pure, torch.ones(4, dtype=torch.bfloat16))
    master = opt.states[0].master
    assert master.dtype == torch.float32 and abs(master[0].item() - (1 - 100e-4)) < 1e-5
    assert torch.equal(w.detach(), master.to(torch.bfloat16))


def test_bf16_pure_is_adamw_on_bf16_weights():
    """bf16-pure: torch's AdamW on the bf16 weights with the main gradients rounded to bf16 and
    bf16 moments, bit for bit."""
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    ref, opt = _torch_adamw(a, foreach=True), _optimizer(b, "bf16-pure")
    for k in range(1, 5):
        _torch_step(ref, a, k, torch.bfloat16)
        _step(opt, b, k)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), k
    state = _state(opt)
    for i, p in enumerate(a):
        assert state[f"{i}.exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(ref.state[p]["exp_avg_sq"].reshape(-1), state[f"{i}.exp_avg_sq"])


@pytest.mark.parametrize("precision, state_bytes", [("fp32", 8), ("bf16", 12), ("bf16-pure", 4)])
def test_state_bytes_per_parameter(precision, state_bytes):
    """Optimizer memory beside the weights and main gradients: fp32 two fp32 moments (the
    weights are updated in place); bf16 fp32 masters and moments; bf16-pure two bf16 moments."""
    ps = _params(PrecisionPolicy.named(precision).params)
    opt = _optimizer(ps, precision, bucket_numel=1 << 20)  # one bucket: no padding
    assert opt.state_bytes() == state_bytes * sum(p.numel() for p in ps)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_resume_continues_exactly(precision, tmp_path):
    """Saved after 3 steps and loaded into a fresh optimizer and fresh weights, 3 more steps give
    the weights and state of 6 uninterrupted steps, bit for bit."""
    dtype = PrecisionPolicy.named(precision).params
    a, b = _params(dtype), _params(dtype)
    whole, first = _optimizer(a, precision), _optimizer(b, precision)
    for k in range(1, 7):
        _step(whole, a, k)
    for k in range(1, 4):
        _step(first, b, k)
    _save(first, b, tmp_path)
    c = _params(dtype, seed=5)
    second = _optimizer(c, precision)
    _load(second, c, tmp_path)
    for k in range(4, 7):
        _step(second, c, k)
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    want, got = _state(whole), _state(second)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_state_of_another_precision_loads(tmp_path):
    """bf16-pure state into a bf16 run: the masters are the stored weights, the moments the
    stored ones widened."""
    ps = _params(torch.bfloat16)
    pure = _optimizer(ps, "bf16-pure")
    _step(pure, ps, 1)
    _save(pure, ps, tmp_path)
    qs = _params(torch.bfloat16, seed=3)
    opt = _optimizer(qs, "bf16")
    _load(opt, qs, tmp_path)
    was, now = _state(pure), _state(opt)
    for i, p in enumerate(ps):
        assert torch.equal(now[f"{i}.master"], p.detach().float().reshape(-1))
        assert torch.equal(now[f"{i}.exp_avg"], was[f"{i}.exp_avg"].float())


def test_weights_loaded_after_the_optimizer_was_built_are_its_start():
    """``train.init_from`` loads weights after the optimizer is built, without state: the fp32
    masters (bf16) and the host copies (offload) start from those weights, not the ones before."""
    for precision, offload in (("bf16", False), ("fp32", True)):
        dtype = PrecisionPolicy.named(precision).params
        a, b = _params(dtype), _params(dtype, seed=4)
        ref, opt = _optimizer(a, precision), _optimizer(b, precision, offload=offload)
        with torch.no_grad():
            for x, y in zip(a, b):
                y.copy_(x)
        _step(ref, a, 1)
        _step(opt, b, 1)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), precision


@pytest.mark.parametrize("case", sorted(os.listdir(LEGACY)))
def test_state_written_by_the_classes_before_loads_and_continues_as_they_did(case):
    """``tests/data/optim_state_before_one_adamw/<case>``: the weights and optimizer-state files
    that mimo's optimizer classes before the one AdamW wrote after 3 steps of ``_step``'s
    gradients and lrs (AdamW: fp32 and bf16-pure; MasterWeightAdamW: bf16; BucketAdamW: fp32 and
    bf16, whole buckets, masters of fp32 weights included), and their weights and state after 2
    more steps (``after-2-more-steps``). Loaded into the one AdamW of that precision, 2 more steps
    give the same, bit for bit."""
    precision = case.rsplit("-", 1)[0]
    ps = _params(PrecisionPolicy.named(precision).params, seed=7)
    opt = _optimizer(ps, precision)
    _load(opt, ps, os.path.join(LEGACY, case))
    for k in (4, 5):
        _step(opt, ps, k)
    want, got = load_file(os.path.join(LEGACY, case, "after-2-more-steps.safetensors")), _state(opt)
    for i, p in enumerate(ps):
        assert torch.equal(want[str(i)], p.detach()), i
        for key in ("exp_avg", "exp_avg_sq") + (("master",) if precision == "bf16" else ()):
            assert torch.equal(want[f"{i}.{key}"], got[f"{i}.{key}"]), (i, key)


def _steps_of(opt, ps, steps: int, device: str, dtype=None) -> None:
    """Steps ``1 .. steps`` of the run's optimizer or torch's AdamW (``dtype``: torch's grads)."""
    for k in range(1, steps + 1):
        if isinstance(opt, torch.optim.AdamW):
            _torch_step(opt, ps, k, dtype)
        else:
            for p, g in zip(ps, _grads(k)):
                set_main_grad_(p, g.to(device))
            opt.param_groups[0]["lr"] = LR / k
            opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused CUDA kernel needs a GPU (the GPU machine runs it)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_the_fused_kernel_on_the_gpu_is_torch_adamw(precision):
    """On the GPU (mimo.parallel.adamw's kernel over the buckets' runs): the weights (and bf16's
    masters) after four steps meet the fp64 yardstick against an fp64 AdamW, within
    ``YARDSTICK_K`` times torch's fused AdamW's own error on the same run; the step counts live
    on the device."""
    from mimo.core.testing import YARDSTICK_K, rel_err

    dtype = PrecisionPolicy.named(precision).params
    start = _params(dtype)
    b = [torch.nn.Parameter(p.detach().cuda()) for p in start]
    opt = _optimizer(b, precision)
    assert all(s.fused and s.step.is_cuda for s in opt.states)
    wide = precision == "bf16"  # fp32 masters: torch steps fp32 copies, the weights are them rounded
    a = [torch.nn.Parameter(p.detach().cuda().float() if wide else p.detach().cuda().clone()) for p in start]
    r = [torch.nn.Parameter(p.detach().double()) for p in start]
    _steps_of(opt, b, 4, "cuda")
    _steps_of(_torch_adamw(a, fused=True), a, 4, "cuda", None if precision != "bf16-pure" else torch.bfloat16)
    _steps_of(_torch_adamw(r, foreach=False), r, 4, "cpu")
    got = _state(opt) if wide else {}
    for i, (x, y, z) in enumerate(zip(a, b, r)):
        mine = got[f"{i}.master"] if wide else y.detach().cpu()
        e1, err = rel_err(x.detach().cpu(), z.detach()), rel_err(mine, z.detach().reshape(mine.shape))
        assert err <= max(1e-7, YARDSTICK_K * e1), f"{precision} param {i}: {err:.2e} (torch fused {e1:.2e})"
        if wide:
            assert torch.equal(y.detach().cpu(), mine.view_as(y).to(y.dtype))

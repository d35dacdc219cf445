"""MasterWeightAdamW (train.precision bf16): AdamW's update on fp32 master weights; mimo's AdamW
(torch's, its lists kept between steps)."""

import copy
import os
from contextlib import ExitStack

import pytest
import torch

from mimo.core.errors import CheckpointError
from mimo.training.optim import AdamW, MasterWeightAdamW, PrecisionPolicy, TrainParam, build_optimizers


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (3,), (4, 2), (6,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _groups(ps):
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]


def _part(ps):
    """The checkpoint's view of the parameters ``ps`` (names ``0``, ``1``, ...: one module, world 1)."""
    from mimo.parallel.params import param_table
    from mimo.training.checkpoint import _Part

    return _Part("m", param_table(torch.nn.ParameterList(ps)))


def _save_state(opt, ps, directory) -> None:
    """``opt``'s state of ``ps`` written as a checkpoint writes it (its weights beside it)."""
    from mimo.training.checkpoint import _write_part

    os.makedirs(directory, exist_ok=True)
    _write_part(_part(ps), opt, str(directory), 0, 0)


def _load_state(opt, ps, directory) -> None:
    """``opt``'s state of ``ps`` read back from ``_save_state``'s files by the checkpoint's reader."""
    from mimo.training.checkpoint import _Files, _read_state
    from mimo.training.reshard import StoredModule

    with ExitStack() as stack:
        files = _Files(str(directory), stack)
        stored = StoredModule(str(directory), sorted(os.listdir(directory)), "m", files.get)
        _read_state(_part(ps), opt, stored, str(directory))


def _run(opt, ps, steps, seed=1, skip=()):
    """``steps`` steps with seeded gradients; ``skip``: (step, param index) pairs without a gradient."""
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        for j, p in enumerate(ps):
            grad = torch.randn(p.shape, generator=g)
            p.grad = None if (i, j) in skip else grad.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("skip", [(), ((2, 1), (4, 3))], ids=["every grad", "some missing"])
def test_equals_adamw_on_fp32_parameters(skip):
    """Whole groups go through the contiguous buffers, a missing gradient through the
    per-tensor path: both are AdamW's update, bit for bit."""
    a, b = _params(torch.float32), _params(torch.float32)
    ref = torch.optim.AdamW(_groups(a), lr=1e-2, betas=(0.9, 0.95), foreach=True)
    opt = MasterWeightAdamW(_groups(b), lr=1e-2, betas=(0.9, 0.95))
    _run(ref, a, 6, skip=skip)
    _run(opt, b, 6, skip=skip)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert {int(opt.state[p]["step"]) for p in b[:2]} == ({6} if not skip else {6, 5})
    assert (0 in opt._per_tensor) == bool(skip) and (1 in opt._per_tensor) == bool(skip)


def test_bf16_keeps_updates_that_rounding_would_lose():
    """lr 1e-4 on weights of 1.0 moves less than half a bf16 step: bf16 AdamW never moves,
    the master does, and the weight is the master rounded."""
    w_pure = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    pure = torch.optim.AdamW([w_pure], lr=1e-4, weight_decay=0.0)
    opt = MasterWeightAdamW([w], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        w_pure.grad = torch.ones(4, dtype=torch.bfloat16)
        w.grad = torch.ones(4, dtype=torch.bfloat16)
        pure.step()
        opt.step()
    assert torch.equal(w_pure, torch.ones(4, dtype=torch.bfloat16))
    master = opt.state[w]["master"]
    assert master.dtype == torch.float32 and abs(master[0].item() - (1 - 100e-4)) < 1e-5
    assert torch.equal(w.detach(), master.to(torch.bfloat16))


def test_state_dict_round_trip_continues_exactly(tmp_path):
    """Saved (through the checkpoint's optimizer file) after 3 steps and loaded into a fresh
    optimizer, 3 more steps give what 6 uninterrupted steps give; the state stays fp32."""
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    whole = MasterWeightAdamW(_groups(a), lr=1e-3)
    _run(whole, a, 6)
    first = MasterWeightAdamW(_groups(b), lr=1e-3)
    _run(first, b, 3)
    _save_state(first, b, tmp_path)
    c = [torch.nn.Parameter(torch.zeros_like(p)) for p in b]  # the weights come back from the masters
    second = MasterWeightAdamW(_groups(c), lr=1e-3)
    _load_state(second, c, tmp_path)
    assert all(second.state[p]["exp_avg"].dtype == torch.float32 for p in c)
    for x, y in zip(b, c):
        assert torch.equal(x, y)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # the gradients of steps 1-3, as _run drew them
        for p in c:
            torch.randn(p.shape, generator=g)
    for _ in range(3):
        for p in c:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        second.step()
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    for p, q in zip(a, c):
        assert torch.equal(whole.state[p]["master"], second.state[q]["master"])


def test_checkpoint_of_another_precision_is_refused(tmp_path):
    ps = _params(torch.bfloat16)
    pure = torch.optim.AdamW(_groups(ps), lr=1e-3)
    _run(pure, ps, 1)
    _save_state(pure, ps, tmp_path)
    with pytest.raises(CheckpointError, match="AdamW.*MasterWeightAdamW.*precision"):
        _load_state(MasterWeightAdamW(_groups(ps), lr=1e-3), ps, tmp_path)


@pytest.mark.parametrize("name, kind", [("fp32", AdamW), ("bf16", MasterWeightAdamW), ("bf16-pure", AdamW)])
def test_precision_picks_the_optimizer(name, kind):
    policy = PrecisionPolicy.named(name)
    ps = [TrainParam("m", f"p{i}", p, None, True) for i, p in enumerate(_params(policy.params))]
    opts = build_optimizers(ps, {"m": 1e-3}, {"m": 0.1}, policy=policy)
    assert type(opts["m"]) is kind
    state = PrecisionPolicy.named(name).optimizer_state
    _run(opts["m"], [p.param for p in ps], 1)
    assert all(v.dtype == state for st in opts["m"].state.values() for k, v in st.items() if k != "step")


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_listed_adamw_equals_torch_adamw(kernel, dtype, tmp_path, monkeypatch):
    """Steps on the kept lists are torch's AdamW steps, bit for bit: gradients kept in place
    (as the run's gradient buffers are) or new tensors every step (as bf16-pure's rounded ones),
    a gradient missing at one step (torch skips the parameter), the lr changed between steps,
    and a state saved and loaded midway (the lists are taken again from the loaded state)."""
    kw = {"fused": True} if kernel == "fused" else {"foreach": True}
    a, b = _params(dtype), _params(dtype)
    ref = torch.optim.AdamW(_groups(a), lr=1e-2, betas=(0.9, 0.95), **kw)
    opt = AdamW(_groups(b), lr=1e-2, betas=(0.9, 0.95), **kw)
    torch_steps = []  # the steps at which torch's own step ran for ``opt``
    torch_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: (torch_steps.append(i) if self is opt else None,
                                                                          torch_step(self, *a, **k))[1])
    kept = [torch.zeros_like(p) for p in b]  # b's gradients live in these at some steps
    g = torch.Generator().manual_seed(3)
    for i in range(9):
        for j, (p, q) in enumerate(zip(a, b)):
            grad = torch.randn(p.shape, generator=g).to(dtype)
            if (i, j) == (5, 2):
                p.grad = q.grad = None
            elif i in (1, 2, 6, 8):
                p.grad = grad
                q.grad = kept[j]
                kept[j].copy_(grad)
            else:
                p.grad, q.grad = grad, grad.clone()
        for o in (ref, opt):
            for group in o.param_groups:
                group["lr"] = 1e-2 / (1 + i)
        ref.step()
        opt.step()
        if i == 6:  # a state round trip through the checkpoint's optimizer file, into the same optimizer
            _save_state(opt, b, tmp_path)
            _load_state(opt, b, tmp_path)  # (new state tensors: lists kept from before would miss them)
        for x, y in zip(a, b):
            assert torch.equal(x, y), (i, kernel)
    for p, q in zip(a, b):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.state[p][k].cpu(), opt.state[q][k].cpu()), k
    # torch's own step: the first, the one with a gradient missing, the next (its lists were not
    # taken then), and the first after the load; the kept lists elsewhere
    assert torch_steps == [0, 5, 6, 7]

"""FlexAttention over packed samples (``train.attention: flex``, ``mimo.llm.attention``): the
function ``exact_attention`` computes (causal within each ``cu_seqlens`` segment, the padding
segment its own, GQA, the scale), under the fp64 yardstick (``mimo.core.testing``): an error
against the fp64 exact run of at most max(floor, k x the fp32 exact run's own); one block mask
per pack for every layer of a stage; the config key.

Torch's FlexAttention has no CPU backward (it refuses one): on the CPU the forwards run its
compiled kernel, and gradients run torch's unfused ``flex_attention`` (``unfused_flex``: the
same mask_mod and BlockMask, the scores materialised, a backward of its own); the compiled
kernels' backward is the CUDA test's.

Inductor's CPU flex template (torch 2.14) fails to build a flex graph compiled again (another
layout, a one-block pack: dynamo specialises size 1) at another pack length than the first
graph's. So the compiled CPU forwards here first meet a new layout at one length (``T``) and
span more than one 128-token mask block; CUDA's kernels are another template.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import mimo.llm.attention as attention
from mimo.compose.config import config_from_dict
from mimo.compose.model import MimoModel
from mimo.core.errors import ConfigError
from mimo.core.testing import Yardstick, rel_err
from mimo.llm.attention import document_block_mask, exact_attention, flex_attention_packed, packed_attention
from mimo.llm.context import SeqContext
from mimo.llm.model import LLMStage
from mimo.llm.verify import pack_samples

LENS = [5, 130, 1, 67, 300]  # ragged, a sample of 1; a 300-token sample holds whole 128-blocks (full blocks)
PAD = 13  # the trailing padding segment
T = sum(LENS) + PAD  # 516, not a multiple of 128
SCALE = 0.3
FLOOR = 1e-7  # the yardstick's floor (of relative errors: k x e1 rules above it)


def pack(lens=LENS, pad=PAD, heads=4, kv_heads=2, dim=16, seed=0):
    """A context with its block mask, fp64 q, k, v ``[T, heads, dim]`` and an output cotangent."""
    ctx = SeqContext.from_seqlens([*lens, pad] if pad else lens)
    ctx.block_mask = document_block_mask(ctx)
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens) + pad
    q, k, v, cot = (torch.randn(t, h, dim, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads))
    return ctx, q, k, v, cot


def run(attend, q, k, v, ctx, cot=None, scale=SCALE) -> dict[str, torch.Tensor]:
    """The output and, with ``cot``, the gradients of q, k and v."""
    if cot is None:
        with torch.no_grad():
            return {"out": attend(q, k, v, ctx, scale)}
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = attend(q, k, v, ctx, scale)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), cot.to(out.dtype))
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def against_exact(attend, ctx, q, k, v, cot=None) -> Yardstick:
    """``attend`` in fp32 against ``exact_attention`` in fp32 and fp64 on the same values."""
    f32 = [x.float() for x in (q, k, v)]
    ys = Yardstick(FLOOR)
    ys.check_all(run(attend, *f32, ctx, cot), run(exact_attention, *f32, ctx, cot), run(exact_attention, q, k, v, ctx, cot))
    return ys


def counted_flex(monkeypatch, unfused: bool) -> list:
    """The compiled ``flex_attention``, or torch's unfused one (its CPU backward let through:
    module doc), counting its calls (their query shapes) in the list returned."""
    if unfused:
        monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)  # (the refusal)
    kernel, calls = attention._compiled_flex(), []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        if not unfused:
            return kernel(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            return torch_flex.flex_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "_compiled_flex", lambda: counted)
    return calls


@pytest.fixture
def unfused_flex(monkeypatch):
    return counted_flex(monkeypatch, unfused=True)


# ---------------------------------------------------------------- the kernel against exact


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_compiled_flex_forward_matches_exact(kv_heads):
    """``packed_attention(impl="flex")`` on a pack with its block mask: the compiled CPU kernel."""
    ctx, q, k, v, _ = pack(kv_heads=kv_heads)
    against_exact(lambda *a: packed_attention(*a, impl="flex"), ctx, q, k, v).assert_ok("flex forward")


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_flex_gradients_match_exact(kv_heads, unfused_flex):
    """Output and q / k / v gradients through ``flex_attention_packed`` (the unfused kernel)."""
    ctx, q, k, v, cot = pack(kv_heads=kv_heads, seed=1)
    against_exact(flex_attention_packed, ctx, q, k, v, cot).assert_ok("flex output and q / k / v gradients")
    assert len(unfused_flex) == 1  # (the fp32 and fp64 references are exact_attention)


def test_a_mask_without_the_document_condition_fails_the_check(unfused_flex):
    """The check can fail: a causal mask over the whole pack (no same-document condition) lets
    every sample see the ones before it, far past the yardstick (the unfused kernel: the mask's
    function is what differs)."""
    ctx, q, k, v, _ = pack(seed=2)
    t = q.shape[0]
    causal = torch_flex.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, t, t, device="cpu")
    ys = against_exact(flex_attention_packed, replace(ctx, block_mask=causal), q, k, v)
    assert not ys.ok and ys.worst(1)[0].err > 0.1, ys.message()
    against_exact(flex_attention_packed, ctx, q, k, v).assert_ok("the same pack with its document mask")


def test_new_pack_lengths_compile_nothing():
    """The flex kernel is compiled for dynamic lengths: after one pack, packs of other lengths
    (more than one mask block each) reuse its graph (the compiled mask builder's: the CUDA test)."""
    for i, (lens, pad) in enumerate(((LENS, PAD), ([5, 130, 1, 67], 9), ([1000, 3], 0), ([129], 2))):
        if i == 1:  # (the first pack compiled the kernel if no test before did: at T, module doc)
            before = counters["stats"]["unique_graphs"]
        ctx, q, k, v, _ = pack(lens, pad, seed=3)
        against_exact(flex_attention_packed, ctx, q, k, v).assert_ok(f"flex at {sum(lens) + pad} tokens")
    assert counters["stats"]["unique_graphs"] == before


def test_flex_inside_a_compiled_layer_matches_exact_without_recompiling():
    """As in a layer under ``train.compile`` (dynamic lengths): dynamo traces ``flex_attention``
    into the caller's graph, the block mask read from the ``SeqContext``; after the first pack,
    packs of new lengths compile nothing: one graph (one cache entry) for all. (aot_eager: the
    CPU's inductor flex template cannot take a transposed view as its query; the CUDA test runs
    inductor.)

    The backend's count is taken after the first pack, not asserted as 1: compiling this
    function (``scale`` a float argument, symbolic under ``dynamic=True``) calls the backend
    twice for one graph when dynamo restarts its analysis to specialise ``scale``
    (``TensorifyScalarRestartAnalysis``), and once only when an earlier compile in the process
    left that specialisation in dynamo's ``TensorifyState`` (which ``reset`` clears): test order.
    A layer under ``train.compile`` has the scale as a constant, not an argument."""
    torch._dynamo.reset()  # what earlier tests compiled must not count (or guard) here
    backend = CompileCounterWithBackend("aot_eager")
    layer = torch.compile(flex_attention_packed, backend=backend, dynamic=True)
    for i, (lens, pad) in enumerate(((LENS, PAD), ([90, 90, 90], 7), ([700, 33], 4))):  # 516, 277, 737 tokens
        if i == 1:
            warm = backend.frame_count  # (1 or 2: docstring)
        ctx, q, k, v, _ = pack(lens, pad, seed=4)
        against_exact(layer, ctx, q, k, v).assert_ok(f"compiled flex at {sum(lens) + pad} tokens")
    assert backend.frame_count == warm, "a new pack length compiled again (TORCH_LOGS=recompiles says which guard)"
    assert len(_debug_get_cache_entry_list(flex_attention_packed.__code__)) == 1


def test_flex_without_a_mask_takes_autos_path():
    """No block mask in the context (CP, a generation cache): ``impl="flex"`` runs auto's path,
    on the CPU the exact one."""
    ctx, q, k, v, _ = pack(seed=5)
    ctx = replace(ctx, block_mask=None)
    got = packed_attention(q.float(), k.float(), v.float(), ctx, SCALE, impl="flex")
    assert torch.equal(got, exact_attention(q.float(), k.float(), v.float(), ctx, SCALE))


# ---------------------------------------------------------------- a stage built from a config


ARCH = dict(pattern="*-*-", hidden=32, heads=4, kv_heads=2, head_dim=16, vocab=61, ffn=40, max_seq_len=512,
            qk_norm=True, qkv_bias=True)


def llm_config(*overrides: str):
    raw = {"world_size": 1, "modules": {"language": {"kind": "hybrid", "arch": dict(ARCH)}},
           "data": {"source": "synthetic", "tokens_per_microbatch": 512, "max_sample_tokens": 256}}
    return config_from_dict(raw, list(overrides))


def loss_and_grads(stage: LLMStage, batch, grads: bool) -> dict[str, torch.Tensor]:
    with torch.set_grad_enabled(grads):
        loss = stage.token_losses(stage(batch), batch).sum() / batch.num_loss_tokens
    if not grads:
        return {"loss": loss}
    names, params = zip(*stage.named_parameters())
    return {"loss": loss, **dict(zip(names, torch.autograd.grad(loss, params)))}


def test_llm_with_train_attention_flex_matches_exact(monkeypatch):
    """``train.attention: flex`` reaches every attention layer of the stage ``MimoModel``
    builds, whose context carries one block mask a pack (none under a generation cache); its
    loss (compiled CPU kernel) and its gradients (unfused flex) are ``exact``'s."""
    flex = MimoModel(llm_config("train.attention=flex"), 0).llm.module
    exact = MimoModel(llm_config("train.attention=exact"), 0).llm.module
    ref64 = LLMStage(flex.arch).double()
    ref64.load_full_(exact.full_state())
    assert {layer.impl for layer in flex.modules() if isinstance(layer, attention.Attention)} == {"flex"}
    assert exact.flex_masks is False and ref64.flex_masks is False
    gen = torch.Generator().manual_seed(6)
    batch = pack_samples([torch.randint(0, ARCH["vocab"], (n,), generator=gen) for n in LENS], pad_multiple=T // 4)
    assert batch.num_tokens == T  # (module doc: its layout is new to the compiled kernel)
    assert flex.context(batch).block_mask is not None and flex.context(batch, cache=object()).block_mask is None
    for grads in (False, True):  # the loss by the compiled kernel, then loss and gradients by the unfused one
        calls = counted_flex(monkeypatch, unfused=grads)
        ys = Yardstick(FLOOR)
        ys.check_all(loss_and_grads(flex, batch, grads), loss_and_grads(exact, batch, grads), loss_and_grads(ref64, batch, grads))
        ys.assert_ok(f"flex stage, {'loss and gradients' if grads else 'loss'}")
        assert calls == [(1, ARCH["heads"], T, ARCH["head_dim"])] * 2  # each attention layer, flex's stage only
        monkeypatch.undo()


# ---------------------------------------------------------------- config


def test_train_attention_config_key():
    assert llm_config().train.attention == "auto"
    for kind in ("auto", "exact", "flex"):
        assert llm_config(f"train.attention={kind}").train.attention == kind
    assert llm_config("train.attention=varlen", "train.precision=bf16").train.attention == "varlen"
    cases = {
        "flash": "train.attention: must be 'auto', 'varlen', 'exact' or 'flex'",
        "varlen": "train.attention: varlen (flash attention) takes bf16; train.precision is fp32",
    }
    for kind, message in cases.items():
        with pytest.raises(ConfigError) as info:
            llm_config(f"train.attention={kind}")
        assert any(p.startswith(message) for p in info.value.problems), info.value.problems
    with pytest.raises(ConfigError) as info:
        llm_config("world_size=2", "modules.language.parallel={cp: 2}", "train.attention=flex")
    assert info.value.problems == ["train.attention: flex has no context-parallel path; modules.language.parallel.cp "
                                   "is 2 (use auto, or cp: 1)"]
    llm_config("world_size=2", "modules.language.parallel={cp: 2}", "train.attention=exact")
    # training needs flex's backward, which torch has on the GPU only: a clear error before any build
    from mimo.core.errors import MimoError
    from mimo.training.run import build_run

    with pytest.raises(MimoError, match="flex trains on a GPU only"):
        build_run(llm_config("train.attention=flex"), 0)


# ---------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
@pytest.mark.parametrize("where", ["compiled wrapper", "inside torch.compile"])
def test_bf16_flex_matches_exact_on_cuda(where):
    """Two documents (T = 1,033, not a multiple of 128), head dim 128, GQA 8 / 2, bf16: flex's
    CUDA kernels forward and backward against exact attention in fp32 on the same bf16 values,
    as the compiled wrapper (eager layers) and traced into a compiled caller (``train.compile``);
    a pack of another length compiles nothing."""
    fn = flex_attention_packed if where == "compiled wrapper" else torch.compile(flex_attention_packed, dynamic=True)
    for i, lens in enumerate(([700, 333], [1500, 260])):
        ctx = SeqContext.from_seqlens(lens, device="cuda")
        ctx.block_mask = document_block_mask(ctx)
        gen = torch.Generator().manual_seed(30 + i)
        q, k, v, cot = (torch.randn(sum(lens), h, 128, generator=gen).cuda().bfloat16() for h in (8, 2, 2, 8))
        if i == 1:
            before = counters["stats"]["unique_graphs"]
        got = run(fn, q, k, v, ctx, cot, scale=128 ** -0.5)
        want = run(exact_attention, q.float(), k.float(), v.float(), ctx, cot.float(), scale=128 ** -0.5)
        for key in want:
            assert rel_err(got[key].float(), want[key]) < 2e-2, key  # bf16 inputs, outputs and gradients
    assert counters["stats"]["unique_graphs"] == before

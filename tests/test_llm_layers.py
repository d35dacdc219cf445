"""LLM layers in one process: packed sequences behave exactly like samples run alone,
attention is causal, norms / RoPE match Hugging Face, the layer registry and the loss."""

from __future__ import annotations

import pytest
import torch

from mimo.core.errors import MimoError
from mimo.llm.attention import exact_attention, packed_attention, varlen_attention
from mimo.llm.blocks import build_layer, layer_builder
from mimo.llm.config import HybridArch, RopeScaling
from mimo.llm.context import SeqContext
from mimo.llm.model import LLMStage, count_loss_tokens
from mimo.llm.pattern import LayerSpec
from mimo.llm.rope import RopeConfig, inv_freq
from mimo.llm.verify import pack_samples
from mimo.core.testing import assert_close, rel_err

TOL = 1e-5
LENS = [5, 1, 9, 3, 12]  # ragged, with a sample of length 1


def small_arch(**kw) -> HybridArch:
    base = dict(pattern="*-*-", hidden=32, heads=4, kv_heads=2, head_dim=12, vocab=61, ffn=40,
                qk_norm=True, qkv_bias=True, o_bias=True, rope_theta=500.0)
    base.update(kw)
    return HybridArch(**base)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (norm weights 1 + noise, biases noise), so no path hides."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def model(arch: HybridArch, seed: int = 0) -> LLMStage:
    m = LLMStage(arch)
    randomize_(m, seed)
    return m


def samples(gen: torch.Generator, vocab: int, lens=LENS) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lens]


# ---------------------------------------------------------------- packed == unpacked


@pytest.mark.parametrize("tied", [False, True])
def test_packed_equals_unpacked_outputs_and_grads(tied):
    arch = small_arch(tie_embeddings=tied)
    m = model(arch, seed=1)
    toks = samples(torch.Generator().manual_seed(2), arch.vocab)
    packed = pack_samples(toks)

    logits = m(packed)
    loss = m.token_losses(logits, packed).sum()
    loss.backward()
    grads_packed = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()

    cu = packed.cu_seqlens.tolist()
    for i, t in enumerate(toks):
        alone = pack_samples([t])
        logits_i = m(alone)
        assert_close(logits[cu[i] : cu[i + 1]], logits_i, TOL, f"logits of sample {i}")
        m.token_losses(logits_i, alone).sum().backward()  # grads accumulate over samples
    assert_close({n: p.grad for n, p in m.named_parameters()}, grads_packed, TOL, "param grads")


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_layer_input_grads_per_sample(kind):
    """Each layer alone: outputs and input gradients of the pack equal those of each sample."""
    arch = small_arch()
    layer = build_layer(arch, LayerSpec(0, kind))
    randomize_(layer, 3)
    gen = torch.Generator().manual_seed(4)
    ctx = SeqContext.from_seqlens(LENS)
    h = torch.randn(sum(LENS), arch.hidden, generator=gen, requires_grad=True)
    cot = torch.randn(sum(LENS), arch.hidden, generator=gen)
    out = layer(h, ctx)
    (gh,) = torch.autograd.grad(out, h, cot)
    cu = ctx.cu_seqlens.tolist()
    for i, n in enumerate(LENS):
        s, e = cu[i], cu[i + 1]
        hi = h[s:e].detach().clone().requires_grad_(True)
        oi = layer(hi, SeqContext.from_seqlens([n]))
        (gi,) = torch.autograd.grad(oi, hi, cot[s:e])
        assert_close(out[s:e], oi, TOL, f"{kind} output {i}")
        assert_close(gh[s:e], gi, TOL, f"{kind} input grad {i}")


def test_perturbing_one_sample_changes_no_other():
    arch = small_arch()
    m = model(arch, seed=5)
    gen = torch.Generator().manual_seed(6)
    toks = samples(gen, arch.vocab)
    base = m(pack_samples(toks)).detach()
    cu = pack_samples(toks).cu_seqlens.tolist()
    for victim in range(len(toks)):
        changed = [t.clone() for t in toks]
        changed[victim] = (changed[victim] + 1 + torch.randint(0, arch.vocab - 1, changed[victim].shape, generator=gen)) % arch.vocab
        out = m(pack_samples(changed)).detach()
        for i in range(len(toks)):
            s, e = cu[i], cu[i + 1]
            if i == victim:
                assert rel_err(out[s:e], base[s:e]) > 1e-3, "the perturbed sample itself must change"
            else:
                assert torch.equal(out[s:e], base[s:e]), f"sample {i} changed when sample {victim} did"


def _causality_probe(attend, device="cpu", dtype=torch.float32, tol=0.0):
    """Perturb the key/value at one position: outputs before it (and in other samples) stay."""
    gen = torch.Generator().manual_seed(7)
    lens = [6, 1, 11]
    ctx = SeqContext.from_seqlens(lens, device=device)
    t = sum(lens)
    q = torch.randn(t, 4, 16, generator=gen).to(device, dtype)
    k = torch.randn(t, 2, 16, generator=gen).to(device, dtype)
    v = torch.randn(t, 2, 16, generator=gen).to(device, dtype)
    base = attend(q, k, v, ctx, 0.25).float()
    for pos in (0, 3, 6, 9, 16):
        k2, v2 = k.clone(), v.clone()
        k2[pos] += 3.0
        v2[pos] += 3.0
        out = attend(q, k2, v2, ctx, 0.25).float()
        seg = int(torch.searchsorted(ctx.cu_seqlens.cpu(), torch.tensor(pos, dtype=torch.int32), right=True)) - 1
        start, end = ctx.cu_seqlens[seg].item(), ctx.cu_seqlens[seg + 1].item()
        untouched = torch.ones(t, dtype=torch.bool)
        untouched[pos:end] = False  # only positions >= pos of the same sample may see it
        assert (out[untouched] - base[untouched]).abs().max().item() <= tol, f"position {pos} leaked"
        assert (out[pos:end] - base[pos:end]).abs().max().item() > 1e-2


def test_attention_is_causal_exact_path():
    _causality_probe(exact_attention)
    _causality_probe(lambda *a: packed_attention(*a, impl="auto"))  # CPU fp32: the exact path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen fast path needs CUDA")
def test_attention_is_causal_varlen_path_and_matches_exact():
    _causality_probe(varlen_attention, "cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    ctx = SeqContext.from_seqlens([37, 1, 90, 5], device="cuda")
    t = 133
    q, k, v = (torch.randn(t, h, 64, generator=gen).cuda().bfloat16() for h in (8, 2, 2))
    fast = varlen_attention(q, k, v, ctx, 0.125)
    exact = exact_attention(q.float(), k.float(), v.float(), ctx, 0.125)
    assert rel_err(fast.float(), exact) < 2e-2  # bf16 inputs and kernel


FAST_PATH_ARCHS = {  # attention; MLA (+), whose v is narrower (64), then wider (128), than q / k's 96
    "attention": dict(head_dim=64, kv_heads=2),
    **{f"mla v{v}": dict(pattern="+-+-", mla_q_lora_rank=96, mla_kv_lora_rank=64, mla_qk_rope_head_dim=32,
                         mla_qk_nope_head_dim=64, mla_v_head_dim=v) for v in (64, 128)},
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen fast path needs CUDA")
@pytest.mark.parametrize("case", list(FAST_PATH_ARCHS))
def test_bf16_model_on_the_fast_path_matches_fp32_exact(case):
    """The model in bf16 on the GPU's varlen kernel against the fp32 model on the exact path on
    the CPU; MLA pads the narrower of v or q / k with zero channels for the kernel's one head size
    (the same comparison on the CPU's exact path in bf16: 1.3e-2)."""
    arch = small_arch(hidden=256, heads=8, ffn=512, vocab=1000, **FAST_PATH_ARCHS[case])
    ref = model(arch, seed=20)
    fast = LLMStage(arch).cuda().bfloat16()
    fast.load_full_(ref.full_state())
    batch = pack_samples(samples(torch.Generator().manual_seed(21), arch.vocab, [300, 1, 77, 512]))
    want = ref(batch)
    got = fast(batch.to("cuda")).float().cpu()
    assert rel_err(got, want) < 2e-2


def test_attention_is_causal_through_the_model():
    arch = small_arch()
    m = model(arch, seed=9)
    toks = samples(torch.Generator().manual_seed(10), arch.vocab, [15])
    base = m(pack_samples(toks)).detach()
    for pos in (0, 7, 14):
        changed = toks[0].clone()
        changed[pos] = (changed[pos] + 1) % arch.vocab
        out = m(pack_samples([changed])).detach()
        assert torch.equal(out[:pos], base[:pos])
        assert rel_err(out[pos:], base[pos:]) > 1e-4


# ---------------------------------------------------------------- pieces against Hugging Face


def test_rmsnorm_and_rope_match_hugging_face():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    from mimo.llm.norm import RMSNorm

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 24, generator=gen)
    ours, theirs = RMSNorm(24, 1e-6), LlamaRMSNorm(24, eps=1e-6)
    with torch.no_grad():
        w = 1 + 0.1 * torch.randn(24, generator=gen)
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    assert torch.equal(ours(x), theirs(x))

    scalings = [None, RopeScaling("linear", 4.0), RopeScaling("llama3", 8.0, 1.0, 4.0, 64)]
    for scaling in scalings:
        rope = {"rope_type": "default", "rope_theta": 5000.0}
        if scaling is not None:
            rope = {"rope_theta": 5000.0, "rope_type": scaling.type, "factor": scaling.factor}
            if scaling.type == "llama3":
                rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
        cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=rope)
        hf = LlamaRotaryEmbedding(cfg)
        assert torch.equal(inv_freq(RopeConfig(16, 5000.0, scaling)), hf.inv_freq), scaling


# ---------------------------------------------------------------- registry, MLP variants, loss


@pytest.mark.parametrize("act", ["relu2", "gelu"])
def test_other_mlp_activations_pack_exactly(act):
    arch = small_arch(mlp_act=act, mlp_bias=True)
    layer = build_layer(arch, LayerSpec(1, "mlp"))
    randomize_(layer, 12)
    ctx = SeqContext.from_seqlens(LENS)
    h = torch.randn(sum(LENS), arch.hidden, generator=torch.Generator().manual_seed(13))
    x = layer.norm(h)
    assert layer.up_proj.weight.shape == (arch.ffn, arch.hidden)  # one part: no gate
    up = torch.nn.functional.linear(x, layer.up_proj.weight, layer.up_proj.bias)
    a = torch.relu(up) ** 2 if act == "relu2" else torch.nn.functional.gelu(up)
    want = h + torch.nn.functional.linear(a, layer.down_proj.weight, layer.down_proj.bias)
    assert_close(layer(h, ctx), want, TOL)


def test_registry_seams(monkeypatch):
    from mimo.llm import blocks

    arch = small_arch(pattern="*-")
    with pytest.raises(MimoError, match="not available"):
        layer_builder("conv")
    with pytest.raises(ValueError, match="unknown layer kind"):
        blocks.register_layer("conv", lambda *a: None)
    # a provider module is imported on first use and its builder found by name
    monkeypatch.setitem(blocks.PROVIDERS, "gdn", ("mimo.llm.mlp", "build_mlp"))
    monkeypatch.delitem(blocks._REGISTRY, "gdn", raising=False)
    monkeypatch.setattr(blocks, "_REGISTRY", dict(blocks._REGISTRY))
    assert isinstance(build_layer(arch, LayerSpec(0, "gdn")), torch.nn.Module)
    monkeypatch.setitem(blocks.PROVIDERS, "gdn", ("mimo.llm.no_such_module", "build"))
    monkeypatch.setattr(blocks, "_REGISTRY", {k: v for k, v in blocks._REGISTRY.items() if k != "gdn"})
    with pytest.raises(MimoError, match="'gdn' .* not available"):
        build_layer(arch, LayerSpec(0, "gdn"))


def test_loss_normaliser_makes_gradients_split_invariant():
    """Two packs with the global loss-token count give the gradients of one pack of all samples."""
    arch = small_arch()
    m = model(arch, seed=14)
    toks = samples(torch.Generator().manual_seed(15), arch.vocab)
    whole = pack_samples(toks)
    n = count_loss_tokens(whole)
    assert n == sum(len(t) - 1 for t in toks)
    m.loss(m(whole), whole, n).backward()
    want = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    for part in (toks[:2], toks[2:]):
        b = pack_samples(part)
        m.loss(m(b), b, n).backward()
    assert_close({k: p.grad for k, p in m.named_parameters()}, want, TOL)


def test_image_rows_are_scattered_and_get_gradients():
    arch = small_arch()
    m = model(arch, seed=16)
    gen = torch.Generator().manual_seed(17)
    toks = samples(gen, arch.vocab)
    batch = pack_samples(toks)
    slots = torch.tensor([1, 2, 6, 10, 11, 12, 29])  # ascending positions inside the pack
    batch.image_slots["<image>"] = slots
    batch.validate()
    rows = torch.randn(len(slots), arch.hidden, generator=gen, requires_grad=True)
    h = m.embed_tokens(batch, {"<image>": rows})
    assert torch.equal(h[slots], rows)
    others = torch.ones(batch.num_tokens, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(h[others], m.embed(batch.tokens)[others])
    m.loss(m(batch, image_rows={"<image>": rows}), batch, 10).backward()
    assert rows.grad is not None and rows.grad.abs().sum() > 0
    with pytest.raises(MimoError, match="image rows"):
        m.embed_tokens(batch, {"<image>": rows[:3]})


def test_tied_single_stage_head_reads_the_embedding():
    arch = small_arch(tie_embeddings=True)
    m = model(arch, seed=18)
    assert not hasattr(m, "head") and "embed.weight" in m.param_table()
    batch = pack_samples(samples(torch.Generator().manual_seed(19), arch.vocab))
    x = m.norm(m.layers["3"](m.layers["2"](m.layers["1"](m.layers["0"](m.embed(batch.tokens), m.context(batch)), m.context(batch)), m.context(batch)), m.context(batch)))
    assert_close(m(batch), x @ m.embed.weight.T, TOL)


def test_arch_fields_from_yaml_dicts():
    from mimo.core.errors import ConfigError
    from mimo.llm.config import LLMModuleConfig
    from mimo.core.schema import from_dict

    arch = {"pattern": "*-*-", "hidden": 32, "heads": 4, "vocab": 50}
    c = from_dict(LLMModuleConfig, {"kind": "hybrid", "arch": {**arch, "attention_bias": True, "o_bias": False,
                                                                "mlp_act": "gelu", "rope_scaling": {"type": "llama3", "factor": 8}}})
    assert (c.arch.qkv_bias, c.arch.o_bias, c.arch.mlp_act, c.arch.rope_scaling.factor) == (True, False, "gelu", 8.0)
    with pytest.raises(ConfigError, match="arch.rope_scaling.factor: must be > 0"):
        from_dict(LLMModuleConfig, {"kind": "hybrid", "arch": {**arch, "rope_scaling": {"type": "linear", "factor": 0}}})


# ---------------------------------------------------------------- the GEMM seam


@pytest.mark.parametrize("tied", [True, False])
def test_every_matrix_product_goes_through_the_gemm_seam(monkeypatch, tied):
    """A stage of every layer kind, forward and backward: each projection weight (and the
    head, tied or not) is multiplied in ``mimo.parallel.gemm.linear``, once per use, and
    ``F.linear`` is never called outside it."""
    import torch.nn.functional as F

    from mimo.parallel import gemm

    arch = small_arch(pattern="*-M-G-", tie_embeddings=tied, mamba_head_dim=8, mamba_state=8, mamba_chunk=8,
                      gdn_heads=2, gdn_v_heads=4, gdn_chunk=8)
    m = model(arch, seed=22)
    batch = pack_samples(samples(torch.Generator().manual_seed(23), arch.vocab))
    want = m(batch).detach()

    real_linear, inside, seen = F.linear, [False], []

    def seam(x, w, b=None, recipe=gemm.DEFAULT_RECIPE):
        seen.append(w)
        inside[0] = True
        try:
            return real_linear(x, w, b)
        finally:
            inside[0] = False

    def guarded(*args, **kwargs):
        assert inside[0], "F.linear called outside mimo.parallel.gemm.linear"
        return real_linear(*args, **kwargs)

    monkeypatch.setattr(gemm, "linear", seam)
    monkeypatch.setattr(F, "linear", guarded)
    logits = m(batch)
    m.loss(logits, batch, count_loss_tokens(batch)).backward()
    assert torch.equal(logits.detach(), want)
    # every weight that multiplies activations: 2-d, not a depthwise conv [C, K], not a lookup table
    weights = {n: p for n, p in m.named_parameters() if p.dim() == 2 and "conv" not in n and n != "embed.weight"}
    if tied:
        weights["embed.weight"] = m.embed.weight
    # attention: qkv, o; MLP: up, down; Mamba-2: z|x|dt, B|C, out; GDN: in, out; the head
    assert len(weights) == 2 + 2 * 3 + 3 + 2 + 1
    assert len(seen) == len(weights)
    assert {id(w) for w in seen} == {id(w) for w in weights.values()}, sorted(
        n for n, w in weights.items() if all(w is not s for s in seen))


def test_compiled_layer_on_the_exact_path_does_not_recompile_per_pack():
    """``exact_attention`` loops over the pack's lengths read on the host; a compiled layer calls
    it untraced (``torch.compiler.disable``), so after the first packs, packs with new lengths
    and new segment counts compile nothing (traced, each new segment count was a new graph: the
    fp32 GPU run of tests/test_native_data.py stalled on it)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    arch = HybridArch(pattern="*", hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=50)
    layer = build_layer(arch, LayerSpec(0, "attention"))
    layer.impl = "exact"
    layer.compile(dynamic=True)
    packs = ([5, 9], [7, 3, 11], [20], [4, 4, 4, 4], [13, 2], [30, 1], [6, 6, 6, 1, 1], [17, 9, 2, 2], [25])
    for i, lens in enumerate(packs):
        if i == 3:  # (static first compile, then the dynamic one)
            warm = counters["stats"]["unique_graphs"]
        x = torch.randn(sum(lens), 64, requires_grad=True)
        layer(x, SeqContext.from_seqlens(lens)).sum().backward()
    assert counters["stats"]["unique_graphs"] == warm

"""Qwen3-Next / Qwen3.5 layers (issue 48): the zero-centred RMSNorm and the gated attention with
partial rotary, against transformers' own modules on random weights.

* ``norm_zero_centred``: ``RMSNorm(zero_centred=True)`` equals ``Qwen3NextRMSNorm`` /
  ``Qwen3_5RMSNorm`` bit for bit in fp32 and bf16 (forward and gradients), where loading ``1 + w``
  into the ordinary norm does not in bf16; in fp64 it stays fp64 (transformers' casts to fp32,
  so there it is checked against the formula in fp64 and against transformers to fp32 accuracy).
* ``attn_output_gate`` + ``rotary_fraction``: mimo's attention layer (pre-norm, fused q|gate, k,
  v, zero-centred QK-norm, GQA, partial rotary, 1-D RoPE or Qwen3.5's M-RoPE) on a THD pack with
  several samples equals transformers' ``input_layernorm`` + ``Qwen3NextAttention`` /
  ``Qwen3_5Attention`` + residual run on each sample alone: outputs, input and every weight
  gradient, in fp32 and fp64. Weights map by explicit rules (``_to_ours``): ``qkv.weight`` is
  ``[q_proj; k_proj; v_proj]`` (q_proj's rows kept in their per-head [query | gate] order).
  In fp64 transformers' norms are run in fp64 (their ``.float()`` would cap it at fp32).
* TP: the gated attention at tp 2 (with and without SP) equals tp 1, per-head and full QK-norm;
  a whole model with every option at tp 2 x pp 2 trains a step as one process does.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mimo.core.errors import LayoutError
from mimo.core.testing import rel_err
from mimo.llm.attention import Attention, AttentionConfig
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch, MoEArch
from mimo.llm.context import SeqContext
from mimo.llm.model import LLMStage
from mimo.llm.norm import RMSNorm, ShardedRMSNorm
from mimo.llm.pattern import LayerSpec
from mimo.llm.rope import RopeConfig

from sequence_mixer_checks import check_pattern_trains_a_step_at_tp2_pp2, check_tp_equals_one_process

from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextAttention, Qwen3NextRMSNorm,
                                                               Qwen3NextRotaryEmbedding)

TOL = {torch.float32: 2e-6, torch.float64: 1e-12}
LENS = [7, 1, 12, 4]  # a pack of four samples, one of length 1
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS = 48, 6, 2, 16, 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp64_norm_forward(self, x):  # transformers' zero-centred norm without its cast to fp32
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.to(xf.dtype))
    return out.type_as(x)


# ---------------------------------------------------------------- zero-centred RMSNorm
@pytest.mark.parametrize("hf_norm", [Qwen3NextRMSNorm, Qwen3_5RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_centred_norm_is_hugging_face_bit_for_bit(hf_norm, dtype):
    g = _gen(1)
    x0 = (3 * torch.randn(5, 9, 64, generator=g)).to(dtype)
    w = (0.3 * torch.randn(64, generator=g)).to(dtype)
    ours, theirs = RMSNorm(64, EPS, zero_centred=True).to(dtype), hf_norm(64, eps=EPS).to(dtype)
    assert torch.equal(ours.weight, torch.zeros(64, dtype=dtype))  # its init scales by 1, as theirs
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    xo, xt = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    yo, yt = ours(xo), theirs(xt)
    assert yo.dtype == yt.dtype == dtype and torch.equal(yo, yt)
    dy = torch.randn(yo.shape, generator=g).to(dtype)
    yo.backward(dy)
    yt.backward(dy)
    assert torch.equal(xo.grad, xt.grad) and torch.equal(ours.weight.grad, theirs.weight.grad)
    if dtype == torch.bfloat16:  # why the norm has its own path: 1 + w in the ordinary norm is not it
        plain = RMSNorm(64, EPS).to(dtype)
        with torch.no_grad():
            plain.weight.copy_(1 + w)
        differ = (plain(x0) != yt).float().mean().item()
        assert differ > 0.05, differ


def test_zero_centred_norm_fp64_and_sharded():
    g = _gen(2)
    x = torch.randn(11, 32, generator=g, dtype=torch.float64)
    w = 0.3 * torch.randn(32, generator=g, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w)
    for norm in (RMSNorm(32, EPS, zero_centred=True), ShardedRMSNorm(32, EPS, zero_centred=True)):
        norm = norm.double()
        assert torch.equal(norm.weight, torch.zeros_like(norm.weight))
        with torch.no_grad():
            norm.weight.copy_(w)
        y = norm(x)
        assert y.dtype == torch.float64 and rel_err(y, want) < 1e-15, type(norm)
        hf = Qwen3NextRMSNorm(32, eps=EPS).double()  # transformers computes this in fp32
        with torch.no_grad():
            hf.weight.copy_(w)
        assert rel_err(y, hf(x)) < 1e-6
    # the ordinary norm is untouched: ones, Llama's order
    plain = RMSNorm(32, EPS)
    assert torch.equal(plain.weight, torch.ones(32)) and not plain.zero_centred
    plain.weight.data.fill_(0.5)
    plain.init_weights()
    assert torch.equal(plain.weight, torch.ones(32))
    zc = RMSNorm(32, EPS, zero_centred=True)
    zc.weight.data.fill_(0.5)
    zc.init_weights()
    assert torch.equal(zc.weight, torch.zeros(32))
    assert torch.equal(zc.param_init("weight")(torch.empty(32), None), torch.zeros(32))


# ---------------------------------------------------------------- gated attention vs transformers
VARIANTS = {
    # name: (family, rotary_fraction, mrope_section)
    "next-quarter": ("next", 0.25, None),
    "next-half": ("next", 0.5, None),
    "next-full": ("next", 1.0, None),
    "3.5-mrope-3/8": ("3.5", 0.375, [1, 1, 1]),  # rotary 6 of 16 channels: 3 frequencies
    "3.5-mrope-3/4": ("3.5", 0.75, [3, 2, 1]),  # 6 frequencies, width's 3 * 1 cut short as HF cuts it
    "3.5-mrope-full": ("3.5", 1.0, [4, 2, 2]),
}


def _hf_layer(family: str, fraction: float, mrope, dtype):
    rope = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": fraction}
    common = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  rms_norm_eps=EPS, attention_bias=False, num_hidden_layers=1)
    if family == "next":
        cfg = Qwen3NextConfig(**common, rope_parameters=rope, layer_types=["full_attention"])
        attn, norm, rot = Qwen3NextAttention(cfg, 0), Qwen3NextRMSNorm(HIDDEN, eps=EPS), Qwen3NextRotaryEmbedding(cfg)
    else:
        rope.update(mrope_section=mrope, mrope_interleaved=True)
        cfg = Qwen3_5TextConfig(**common, rope_parameters=rope, layer_types=["full_attention"])
        attn, norm, rot = Qwen3_5Attention(cfg, 0), Qwen3_5RMSNorm(HIDDEN, eps=EPS), Qwen3_5TextRotaryEmbedding(cfg)
    cfg._attn_implementation = "sdpa"  # eager takes its softmax in fp32, capping an fp64 run
    assert rot.inv_freq.numel() * 2 == int(HEAD_DIM * fraction)
    g = _gen(3)
    with torch.no_grad():
        for p in (*attn.parameters(), *norm.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return attn.to(dtype), norm.to(dtype), rot


def _hf_run(attn, norm, rot, h, pos3):
    """``h + attn(norm(h))`` on one sample ([1, L, D]), causal by an explicit mask."""
    n = h.shape[1]
    mask = torch.full((n, n), float("-inf"), dtype=h.dtype).triu(1)[None, None]
    pos = pos3[0][None] if isinstance(rot, Qwen3NextRotaryEmbedding) else pos3[:, None]
    cos, sin = rot(h, pos)
    out, _ = attn(norm(h), (cos, sin), mask)
    return h + out


def _to_ours(attn, norm) -> dict[str, torch.Tensor]:
    return {
        "norm.weight": norm.weight,
        "qkv.weight": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        "q_norm.weight": attn.q_norm.weight, "k_norm.weight": attn.k_norm.weight,
        "o_proj.weight": attn.o_proj.weight,
    }


def _arch(fraction: float, mrope, **kw) -> HybridArch:
    return HybridArch(pattern="*", hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, vocab=11,
                      qk_norm=True, norm_eps=EPS, rope_theta=1000.0, norm_zero_centred=True, attn_output_gate=True,
                      rotary_fraction=fraction, mrope_section=mrope, **kw)


def _positions_3d(g) -> torch.Tensor:
    """Per sample: (time, height, width) positions that differ per axis (an image-like run)."""
    out = []
    for n in LENS:
        t = torch.arange(n)
        out.append(torch.stack([t, t // 2 + torch.randint(0, 3, (n,), generator=g), t % 3 + 5]))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gated_attention_equals_hugging_face_per_sample(variant, dtype, monkeypatch):
    family, fraction, mrope = VARIANTS[variant]
    if dtype == torch.float64:
        monkeypatch.setattr(Qwen3NextRMSNorm, "forward", _fp64_norm_forward)
        monkeypatch.setattr(Qwen3_5RMSNorm, "forward", _fp64_norm_forward)
    attn, norm, rot = _hf_layer(family, fraction, mrope, dtype)
    arch = _arch(fraction, mrope if family == "3.5" else None)
    assert arch.validate("arch") == []
    ours = build_layer(arch, LayerSpec(0, "attention"))
    cfg = ours.cfg
    assert cfg.output_gate and cfg.norm_zero_centred and cfg.rope.head_dim == int(HEAD_DIM * fraction)
    ours = ours.to(dtype)
    with torch.no_grad():
        params = dict(ours.named_parameters())
        for name, w in _to_ours(attn, norm).items():
            params[name].copy_(w)
    g = _gen(4)
    seq = SeqContext.from_seqlens(LENS)
    pos3 = _positions_3d(g) if family == "3.5" else seq.positions.expand(3, -1)
    if family == "3.5":
        seq.positions_3d = pos3
    h0 = torch.randn(sum(LENS), HIDDEN, generator=g, dtype=dtype)
    dy = torch.randn(sum(LENS), HIDDEN, generator=g, dtype=dtype)
    h = h0.clone().requires_grad_(True)
    y = ours(h, seq)
    y.backward(dy)
    # transformers, each sample alone
    hs, ys = [], []
    cu = seq.cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        hi = h0[s:e][None].clone().requires_grad_(True)
        yi = _hf_run(attn, norm, rot, hi, pos3[:, s:e])
        yi.backward(dy[s:e][None])
        hs.append(hi.grad[0])
        ys.append(yi[0].detach())
    tol = TOL[dtype]
    assert rel_err(y - h0, torch.cat(ys) - h0) < tol
    assert rel_err(h.grad, torch.cat(hs)) < tol
    want_grads = dict(zip(_to_ours(attn, norm), _grads(attn, norm)))
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, want_grads[name]) < tol, name


def _grads(attn, norm):
    return [norm.weight.grad, torch.cat([attn.q_proj.weight.grad, attn.k_proj.weight.grad, attn.v_proj.weight.grad]),
            attn.q_norm.weight.grad, attn.k_norm.weight.grad, attn.o_proj.weight.grad]


def test_defaults_build_todays_attention():
    """No new option set: the same modules, weights and parameter shapes as before (ones, q of heads * hd)."""
    arch = HybridArch(pattern="*-", hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, vocab=11, qk_norm=True)
    assert (arch.norm_zero_centred, arch.attn_output_gate, arch.rotary_fraction) == (False, False, 1.0)
    cfg = AttentionConfig.from_arch(arch)
    assert cfg.rope == RopeConfig.from_arch(arch) and not cfg.output_gate and not cfg.norm_zero_centred
    stage = LLMStage(arch)
    stage.init_weights(0)
    norms = [m for m in stage.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 5 and all(not m.zero_centred and torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert stage.layers["0"].qkv.weight.shape == ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)


def test_every_llm_norm_is_zero_centred_when_asked():
    arch = HybridArch(pattern="*G-E", hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=11, qk_norm=True,
                      norm_zero_centred=True, gdn_heads=2, gdn_v_heads=4, gdn_head_dim=8, gdn_v_head_dim=8,
                      moe=MoEArch(experts=4, topk=2, ffn=16))
    assert arch.validate("arch") == []
    stage = LLMStage(arch)
    stage.init_weights(0)
    pre = [stage.layers[i].norm for i in ("0", "1", "2", "3")] + [stage.norm, stage.layers["0"].q_norm, stage.layers["0"].k_norm]
    assert all(isinstance(m, RMSNorm) and m.zero_centred and torch.equal(m.weight, torch.zeros_like(m.weight)) for m in pre)
    # the GDN's gated output norm is not one of them (transformers' Qwen3NextRMSNormGated: ones)
    others = [m for m in stage.modules() if isinstance(m, RMSNorm) and all(m is not p for p in pre)]
    assert all(not m.zero_centred for m in others)
    # the zero-centred pre-norm is the layer's pre-norm, not a stray copy
    x = torch.randn(9, 32)
    seq = SeqContext.from_seqlens([4, 5])
    with torch.no_grad():
        stage.layers["2"].norm.weight.fill_(-1.0)  # scales by 0: the MLP adds nothing
    assert torch.equal(stage.layers["2"](x, seq), x)


def test_config_validation():
    ok = _arch(0.25, None)
    assert ok.validate("arch") == [] and ok.rotary_dim == 4
    bad = {
        "must be even and >= 2": dict(rotary_fraction=0.1875),  # 3 channels
        "partial rotary needs rope: true": dict(rotary_fraction=0.5, rope=False),
        "summing to rotary_dim / 2 = 4 / 2": dict(mrope_section=[2, 2, 2]),
    }
    for message, change in bad.items():
        kw = dict(fraction=change.pop("rotary_fraction", 0.25), mrope=change.pop("mrope_section", None))
        problems = _arch(kw["fraction"], kw["mrope"], **change).validate("arch")
        assert any(message in p for p in problems), (message, problems)
    for frac in (0.0, 1.5):
        assert any("must be in (0, 1]" in p for p in _arch(frac, None).validate("arch"))
    assert _arch(0.5, [2, 1, 1]).validate("arch") == []
    # full rotary keeps today's message
    assert any("summing to head_dim / 2" in p for p in _arch(1.0, [2, 1, 1]).validate("arch"))
    with pytest.raises(LayoutError):
        Attention(AttentionConfig(hidden=32, heads=4, kv_heads=2, head_dim=8, rope=RopeConfig(10)))


# ---------------------------------------------------------------- tensor parallelism
def _tp_cfg(qk_norm_full: bool) -> AttentionConfig:
    return AttentionConfig(hidden=32, heads=4, kv_heads=2, head_dim=8, rope=RopeConfig(4, 1000.0), qk_norm=True,
                           qk_norm_full=qk_norm_full, output_gate=True, norm_zero_centred=True)


@pytest.mark.parametrize("qk_norm_full", [False, True], ids=["head-qk-norm", "full-qk-norm"])
def test_gated_attention_tp2_equals_one_process(pools, qk_norm_full):
    """tp 2 (and tp 2 with SP) against tp 1: outputs, input grads, every full gradient, init."""
    check_tp_equals_one_process(pools, functools.partial(Attention, _tp_cfg(qk_norm_full)))


@pytest.mark.parametrize("sp", [False, True])
def test_model_with_every_option_trains_a_step_at_tp2_pp2(pools, sp):
    arch = HybridArch(pattern="*G-*-", hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=37, qk_norm=True,
                      norm_zero_centred=True, attn_output_gate=True, rotary_fraction=0.5,
                      gdn_heads=2, gdn_v_heads=4, gdn_head_dim=8, gdn_v_head_dim=8, gdn_chunk=8)
    check_pattern_trains_a_step_at_tp2_pp2(pools, arch, Attention, sp)


# ---------------------------------------------------------------- generation cache
def _greedy(stage: LLMStage, prompts: list[list[int]], steps: int, cached: bool) -> tuple[list, list]:
    """Greedy tokens and each step's last-position logits, with the cache or re-running whole packs
    (as tests/test_eval_cache.py's ``greedy``, without samples leaving)."""
    from mimo.data.pack import PackItem, pack
    from mimo.llm.cache import GenerationCache, decode_pack

    seqs, rows, logits = [list(p) for p in prompts], list(range(len(prompts))), []
    cache = GenerationCache(extra=2) if cached else None
    for _ in range(steps):
        if cache is not None and cache.decoding:
            batch = decode_pack([s[-1] for s in seqs], [len(s) - 1 for s in seqs], rows, 1, False, 0)
            last = rows
        else:
            batch = pack([PackItem(i, s, [False] * len(s), {}) for i, s in enumerate(seqs)], {}, 1, 1, False, 0)
            last = (batch.cu_seqlens[1:len(seqs) + 1] - 1).tolist()
        out = stage(batch, cache=cache)[last, :stage.arch.vocab]
        logits.append(out)
        for j, s in enumerate(seqs):
            s.append(int(out[j].argmax()))
        if cache is not None:
            cache.keep(rows)
    return seqs, logits


def test_cached_greedy_equals_whole_sequence_greedy():
    """The gate and partial rotary in a decode step (one token a row against the cache)."""
    arch = HybridArch(pattern="*-*-", hidden=24, heads=6, kv_heads=2, head_dim=8, vocab=50, ffn=32, init_std=0.5,
                      qk_norm=True, norm_zero_centred=True, attn_output_gate=True, rotary_fraction=0.5)
    stage = LLMStage(arch)
    stage.init_weights(3)
    g = _gen(5)
    prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (13, 1, 6)]
    with torch.no_grad():
        ref, ref_logits = _greedy(stage, prompts, 6, False)
        got, got_logits = _greedy(stage, prompts, 6, True)
    assert got == ref
    assert max(rel_err(a, b) for a, b in zip(got_logits, ref_logits)) <= 1e-5


def test_export_refuses_the_new_keys_until_a_family_maps_them():
    """No Hugging Face family mimo exports takes these layers yet: export names each key rather
    than writing a model transformers would load wrongly."""
    from mimo.core.errors import MimoError
    from mimo.llm import hf
    from mimo.llm.config import HybridArch

    arch = HybridArch(pattern="*-*-", hidden=64, heads=4, vocab=100, kv_heads=2, qk_norm=True,
                      attn_output_gate=True, norm_zero_centred=True, rotary_fraction=0.5)
    with pytest.raises(MimoError) as err:
        hf.decoder_config_from_arch(arch, "qwen3")
    for key in ("norm_zero_centred", "attn_output_gate", "rotary_fraction"):
        assert f"arch.{key}" in str(err.value)

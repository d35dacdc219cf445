"""Multi-head latent attention (``+``, ``mimo.llm.mla``) against transformers' DeepSeek-V3 attention
and against itself at tp 2.

- One process: our layer with the weights of a random ``DeepseekV3Attention`` (and a random
  pre-norm, Hugging Face's ``DeepseekV3RMSNorm``) on a THD pack of three ragged samples equals
  ``h + attention(norm(h))`` run by transformers on each sample alone (its own position ids):
  outputs, input gradients and every weight gradient, with and without ``q_lora_rank``, with
  biases, and with YaRN scaling (attention factor 1 and not 1). Judged by the fp64 yardstick
  (docs/design.md §9.7): transformers in fp32 and in fp64 (its fp32 casts kept fp64) are the two
  references.
- Tensor parallel: tp 2 with and without sequence parallelism, 3 heads a rank, on real gloo
  groups, against the one-process layer (fp32 and fp64 references from the same full weights);
  gradients read after ``reduce_partial_grads`` (training's once-per-step sum of partial ones).
- Config: the MLA fields are required only with '+', named in the errors; yarn only with MLA;
  missing sizes named (context parallelism: tests/test_cp.py; generation caches: tests/test_eval_cache.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from mimo.core.errors import ConfigError
from mimo.core.testing import Yardstick, fp64_kept
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch, LLMModuleConfig, RopeScaling
from mimo.llm.context import SeqContext
from mimo.llm.mla import MLA, MLAConfig, mla_softmax_scale, yarn_inv_freq
from mimo.llm.pattern import LayerSpec
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelConfig
from mimo.parallel.params import full_tensors, load_full_, param_table, reduce_partial_grads

from sequence_mixer_checks import check_pattern_trains_a_step_at_tp2_pp2  # noqa: E402 (tests/ is on sys.path)
from tp_cases import seeded, tp_group  # noqa: E402

HIDDEN = 64
SEQLENS = [7, 3, 12]  # ragged; 22 tokens, divisible by tp 2 for sequence parallelism
DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=12, v_head_dim=10)  # v != qk (28)
YARN = dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=64)
CASES = {
    "q_lora": dict(q_lora_rank=24),
    "no_q_lora_bias": dict(q_lora_rank=None, attention_bias=True),
    "yarn": dict(q_lora_rank=24, rope=YARN),
    # attention_factor = mscale(4, 1) / mscale(4, 0.5) != 1: cos / sin scaled as well
    "yarn_attention_factor_no_q_lora": dict(q_lora_rank=None, rope={**YARN, "mscale_all_dim": 0.5}),
}


def _hf_config(heads: int, q_lora_rank, rope: dict | None = None, attention_bias: bool = False):
    rope = {"rope_type": "default", **(rope or {}), "rope_theta": 10000.0}
    cfg = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=q_lora_rank,
        rope_parameters=rope, rope_interleave=True, attention_bias=attention_bias, max_position_embeddings=256,
        rms_norm_eps=1e-6, vocab_size=32, num_hidden_layers=1, **DIMS,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _arch(cfg) -> HybridArch:
    """Our arch of a transformers DeepSeek-V3 config (the MLA fields, rope, biases)."""
    p = cfg.rope_parameters
    scaling = None
    if p["rope_type"] == "yarn":
        scaling = RopeScaling("yarn", p["factor"], original_max_position_embeddings=p["original_max_position_embeddings"],
                              mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"))
    return HybridArch(
        pattern="+", hidden=cfg.hidden_size, heads=cfg.num_attention_heads, vocab=cfg.vocab_size, norm_eps=cfg.rms_norm_eps,
        rope_theta=p["rope_theta"], rope_scaling=scaling, attention_bias=cfg.attention_bias,
        mla_q_lora_rank=cfg.q_lora_rank, mla_kv_lora_rank=cfg.kv_lora_rank, mla_qk_rope_head_dim=cfg.qk_rope_head_dim,
        mla_qk_nope_head_dim=cfg.qk_nope_head_dim, mla_v_head_dim=cfg.v_head_dim,
    )


def _full_weights(cfg, seed: int, attention=None) -> dict[str, torch.Tensor]:
    """Random full tensors by our names (= Hugging Face's attention names, plus the pre-norm's):
    projections ~ N(0, 1/in), norms 1 + N(0, 0.3^2), biases N(0, 0.1^2). ``attention``: the
    transformers attention module of the config (DeepSeek-V3's)."""
    attn = (attention or hf_ds.DeepseekV3Attention)(cfg, 0)
    g = seeded(seed, "weights")
    out = {"norm.weight": 1 + 0.3 * torch.randn(HIDDEN, generator=g)}
    for name, p in attn.named_parameters():
        if name.endswith(("layernorm.weight", "k_norm.weight")):
            out[name] = 1 + 0.3 * torch.randn(p.shape, generator=g)
        elif name.endswith("bias"):
            out[name] = 0.1 * torch.randn(p.shape, generator=g)
        else:
            out[name] = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
    return out


def _data(seed: int, dtype=torch.float32):
    g = seeded(seed, "data")
    t = sum(SEQLENS)
    return torch.randn(t, HIDDEN, generator=g, dtype=dtype), torch.randn(t, HIDDEN, generator=g, dtype=dtype)


V3_CLASSES = (hf_ds.DeepseekV3Attention, hf_ds.DeepseekV3RMSNorm, hf_ds.DeepseekV3RotaryEmbedding)


def _hf_modules(cfg, weights: dict, dtype, classes=V3_CLASSES):
    """transformers' (attention, pre-norm, rotary) of ``classes`` with ``weights``, in ``dtype``."""
    attention, rms_norm, rotary_embedding = classes
    attn, norm, rotary = attention(cfg, 0), rms_norm(HIDDEN, eps=cfg.rms_norm_eps), rotary_embedding(cfg)
    with torch.no_grad():
        norm.weight.copy_(weights["norm.weight"])
        for name, p in attn.named_parameters():
            p.copy_(weights[name])
    return attn.to(dtype), norm.to(dtype), rotary.to(dtype)


def _causal(n: int, dtype) -> torch.Tensor:
    return torch.full((n, n), float("-inf"), dtype=dtype).triu(1)[None, None]


def _hf_run(cfg, weights: dict, x0: torch.Tensor, dy: torch.Tensor, dtype, classes=V3_CLASSES,
            causal_mask: bool = False) -> dict[str, torch.Tensor]:
    """transformers, each sample alone: ``h + attn(norm(h))``; outputs, input and weight gradients
    (of the parameters that take one). ``causal_mask``: pass the sample's causal mask (DeepSeek-V3.2's
    indexer reads it), else none (the attention's own causal kernels)."""
    attn, norm, rotary = _hf_modules(cfg, weights, dtype, classes)
    ys, dxs = [], []
    cu = SeqContext.from_seqlens(SEQLENS).cu_seqlens.tolist()
    with fp64_kept() if dtype == torch.float64 else torch.enable_grad():
        for s, e in zip(cu[:-1], cu[1:]):
            h = x0[s:e].to(dtype)[None].requires_grad_(True)
            pos = torch.arange(e - s)[None]
            mask = _causal(e - s, dtype) if causal_mask else None
            y = h + attn(norm(h), rotary(h, pos), attention_mask=mask)[0]
            y.backward(dy[s:e].to(dtype)[None])
            ys.append(y[0].detach())
            dxs.append(h.grad[0])
    out = {"y": torch.cat(ys), "dx": torch.cat(dxs), "grad:norm.weight": norm.weight.grad}
    out.update({f"grad:{n}": p.grad for n, p in attn.named_parameters() if p.grad is not None})
    return out


def _ours(layer: MLA, x0: torch.Tensor, dy: torch.Tensor, sp_rank: tuple[int, int] | None = None,
          loss_norm: float | None = None) -> dict:
    """Our layer on the pack (``sp_rank``: (tp, rank), this rank's token block; ``loss_norm``: a
    training forward's, which aux losses join); partial gradients summed over TP, gradients
    gathered to full tensors."""
    seq = SeqContext.from_seqlens(SEQLENS, device=x0.device)
    seq.loss_norm = loss_norm
    part = (lambda v: v.chunk(sp_rank[0])[sp_rank[1]]) if sp_rank else (lambda v: v)
    table = param_table(layer)
    layer.zero_grad()
    x = part(x0).clone().requires_grad_(True)
    y = layer(x, seq)
    y.backward(part(dy))
    reduce_partial_grads(table)
    out = {"y": y.detach(), "dx": x.grad}
    out.update({f"grad:{n}": g for n, g in full_tensors(table, grads=True).items()})
    return out


# --------------------------------------------------------------------------- one process vs transformers
@pytest.mark.parametrize("case", list(CASES))
def test_mla_equals_transformers_per_sample(case):
    cfg = _hf_config(4, **CASES[case])
    weights = _full_weights(cfg, seed=1)
    x0, dy = _data(2)
    ref32 = _hf_run(cfg, weights, x0, dy, torch.float32)
    ref64 = _hf_run(cfg, weights, x0, dy, torch.float64)

    layer = build_layer(_arch(cfg), LayerSpec(0, "mla"))
    assert isinstance(layer, MLA)
    load_full_(param_table(layer), weights)
    got = _ours(layer, x0, dy)
    assert set(got) == set(ref64), sorted(set(got) ^ set(ref64))
    ys = Yardstick(1e-5)
    ys.check_all(got, ref32, ref64)
    ys.assert_ok(case)
    # the scale and frequencies are transformers' own numbers
    attn = hf_ds.DeepseekV3Attention(cfg, 0)
    assert layer.softmax_scale == attn.scaling
    if cfg.rope_parameters["rope_type"] == "yarn":
        want_freq, want_factor = transformers.modeling_rope_utils._compute_yarn_parameters(cfg)
        freq, factor = yarn_inv_freq(cfg.qk_rope_head_dim, 10000.0, layer.cfg.rope_scaling)
        assert torch.equal(freq, want_freq) and factor == want_factor
        assert (factor != 1.0) == (case == "yarn_attention_factor_no_q_lora")


# --------------------------------------------------------------------------- tensor parallel
TP, TP_HEADS = 2, 6  # 3 heads a rank
TP_CASES = {"q_lora_yarn": dict(q_lora_rank=24, rope=YARN), "no_q_lora_bias": dict(q_lora_rank=None, attention_bias=True)}


def _tp_case(seed: int) -> dict:
    """On each rank of a 2-rank pool: every TP case, sp off and on, against the one-process layer
    in fp32 and fp64: {"measures": [...], "placements": ..., "init_exact": ...}."""
    group, rank = tp_group(TP)
    measures, partial, init_exact = [], {}, {}
    x0, dy = _data(seed)
    for name, kw in TP_CASES.items():
        cfg = _hf_config(TP_HEADS, **kw)
        arch, weights = _arch(cfg), _full_weights(cfg, seed)
        refs = {}
        for dtype in (torch.float32, torch.float64):
            one = MLA(MLAConfig.from_arch(arch)).to(dtype)
            load_full_(param_table(one), weights)
            refs[dtype] = _ours(one, x0.to(dtype), dy.to(dtype))
        one = MLA(MLAConfig.from_arch(arch))
        one.init_weights(seed, std=0.1, out_std=0.05)
        for sp in (False, True):
            layer = MLA(MLAConfig.from_arch(arch), ParallelContext.for_tp(group, sequence_parallel=sp))
            layer.init_weights(seed, std=0.1, out_std=0.05)  # layout-independent init
            init_full, init_one = full_tensors(param_table(layer)), full_tensors(param_table(one))
            init_exact[f"{name},sp={sp}"] = all(torch.equal(init_full[n], init_one[n]) for n in init_one)
            table = param_table(layer)
            partial[f"{name},sp={sp}"] = sorted(n for n, info in table.items() if info.placement.partial)
            load_full_(table, weights)
            got = _ours(layer, x0, dy, (TP, rank) if sp else None)
            part = (lambda v: v.chunk(TP)[rank]) if sp else (lambda v: v)
            ys = Yardstick(1e-5)
            for k in refs[torch.float64]:
                want32, want64 = refs[torch.float32][k], refs[torch.float64][k]
                if k in ("y", "dx"):
                    want32, want64 = part(want32), part(want64)
                ys.check(f"{name},sp={sp}/{k}", got[k], want32, want64)
            measures += [m.as_dict() for m in ys.measures]
    return {"measures": measures, "partial": partial, "init_exact": init_exact, "heads_local": layer.heads_local}


def test_tp2_with_and_without_sequence_parallel_equals_one_process(pools):
    results = pools(TP).run(_tp_case, 31)
    ys = Yardstick(1e-5)
    for rank, res in enumerate(results):
        ys.extend(res["measures"], prefix=f"rank{rank}:")
    ys.assert_ok("MLA at tp 2")
    for rank, res in enumerate(results):
        assert res["heads_local"] == TP_HEADS // TP
        assert all(res["init_exact"].values()), res["init_exact"]
        # replicated down projections and latent norms: partial gradients exactly under SP
        assert res["partial"]["q_lora_yarn,sp=False"] == []
        assert res["partial"]["q_lora_yarn,sp=True"] == [
            "kv_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "norm.weight", "q_a_layernorm.weight", "q_a_proj.weight"]
        assert res["partial"]["no_q_lora_bias,sp=True"] == [
            "kv_a_layernorm.weight", "kv_a_proj_with_mqa.bias", "kv_a_proj_with_mqa.weight", "norm.weight", "o_proj.bias"]
    names = {m.name.partition(":")[2] for m in ys.measures}
    for case in TP_CASES:
        for sp in (False, True):
            assert {f"{case},sp={sp}/{k}" for k in ("y", "dx", "grad:kv_b_proj.weight", "grad:o_proj.weight")} <= names
    assert "q_lora_yarn,sp=True/grad:q_a_proj.weight" in names and "no_q_lora_bias,sp=True/grad:q_proj.weight" in names


@pytest.mark.parametrize("sp", [False, True])
def test_pattern_trains_a_step_at_tp2_pp2(pools, sp):
    """'+' through the registry, the stage's init, the pipeline and the partial-gradient sum."""
    arch = HybridArch(pattern="+-+-", hidden=HIDDEN, heads=TP_HEADS, vocab=64, mla_q_lora_rank=24,
                      rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=64, mscale=1.0,
                                               mscale_all_dim=1.0), **{f"mla_{k}": v for k, v in DIMS.items()})
    assert arch.validate("arch") == []
    check_pattern_trains_a_step_at_tp2_pp2(pools, arch, MLA, sp)


# --------------------------------------------------------------------------- config and refusals
def _validate(**kw) -> list[str]:
    base = dict(pattern="+-", hidden=64, heads=4, vocab=32)
    return HybridArch(**{**base, **kw}).validate("arch")


def test_mla_fields_required_only_with_plus():
    assert _validate(pattern="*-") == []
    problems = _validate()
    assert len(problems) == 1 and "arch.mla_kv_lora_rank" in problems[0] and "'+' at position 1" in problems[0]
    for n in ("mla_qk_rope_head_dim", "mla_qk_nope_head_dim", "mla_v_head_dim"):
        assert n in problems[0]
    dims = {f"mla_{k}": v for k, v in DIMS.items()}
    assert _validate(**dims) == []
    assert any("mla_qk_rope_head_dim: must be even" in p for p in _validate(**{**dims, "mla_qk_rope_head_dim": 7}))
    assert any("arch.mla_q_lora_rank: must be >= 1" in p for p in _validate(**dims, mla_q_lora_rank=0))
    assert any("arch.rope:" in p for p in _validate(**dims, rope=False))
    yarn = RopeScaling("yarn", 4.0, mscale=1.0, mscale_all_dim=1.0)
    assert _validate(**dims, rope_scaling=yarn) == []
    assert any("yarn is built for MLA layers" in p for p in _validate(**dims, pattern="+*-", rope_scaling=yarn))
    assert any("a yarn field" in p for p in RopeScaling("linear", 2.0, mscale=1.0).validate("arch.rope_scaling"))
    # cp taken (tests/test_cp.py runs MLA over cp 2-4), tp must divide heads
    arch = HybridArch(pattern="+-", hidden=64, heads=6, vocab=32, **dims)
    assert LLMModuleConfig("hybrid", arch, parallel=ParallelConfig(cp=2)).validate("llm") == []
    tp = LLMModuleConfig("hybrid", arch, parallel=ParallelConfig(tp=4)).validate("llm")
    assert any("arch.heads=6" in p for p in tp)


def test_missing_sizes_named():
    with pytest.raises(ConfigError, match="mla_kv_lora_rank"):
        MLAConfig.from_arch(HybridArch(pattern="+", hidden=64, heads=4, vocab=32))


def test_softmax_scale_formula():
    cfg = MLAConfig(64, 4, None, 16, 16, 12, 10, rope_scaling=RopeScaling("yarn", 40.0, mscale=1.0, mscale_all_dim=1.0))
    m = 0.1 * 1.0 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1.0
    assert abs(mla_softmax_scale(cfg) - 28 ** -0.5 * m * m) < 1e-15
    assert mla_softmax_scale(MLAConfig(64, 4, None, 16, 16, 12, 10)) == 28 ** -0.5

"""DeepSeek sparse attention (``D``, ``mimo.llm.dsa``) against transformers' DeepSeek-V3.2 attention,
against an independent reference of the indexer's KL loss, and against itself at tp 2.

- One process: our layer with the weights of a random ``DeepseekV32Attention`` (indexer included)
  and a random pre-norm, on a THD pack of three ragged samples, equals ``h + attention(norm(h))``
  run by transformers on each sample alone (its causal mask, its own positions): outputs, input
  gradients and every weight gradient of the attention (transformers' indexer computes no
  gradient), with an ``index_topk`` below the longest sample (the selection prunes) and with
  YaRN scaling. fp64 yardstick (docs/design.md §9.7).
- The indexer's KL loss (a training forward): its value and the indexer weights' gradients equal
  a reference written from the V3.2 report's formula over transformers' own modules (eager
  attention's probabilities, the indexer's projections), fp64; in the dense warm-up the layer is
  MLA exactly and the KL spans every causal key.
- Tensor parallel: tp 2 with and without sequence parallelism (3 heads a rank, the indexer
  replicated), KL on, against the one-process layer; the indexer's gradients complete (not
  partial) on every rank.
- Context parallelism: tests/test_cp.py (kind 'D'); Hugging Face import / export / verify-llm:
  tests/test_llm_hf_deepseek_v3.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32

from mimo.core.testing import Yardstick, fp64_kept, rel_err
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch, LLMModuleConfig
from mimo.llm.context import SeqContext
from mimo.llm.dsa import DSA, IndexerConfig, select_keys, set_dsa_training
from mimo.llm.mla import MLA, MLAConfig
from mimo.llm.pattern import LayerSpec
from mimo.parallel.context import ParallelContext
from mimo.parallel.params import load_full_, param_table

from test_llm_mla import (HIDDEN, SEQLENS, _arch as mla_arch, _causal, _data, _full_weights as mla_full_weights,  # noqa: E402
                          _hf_modules as mla_hf_modules, _hf_run as mla_hf_run, _ours as mla_ours)
from tp_cases import tp_group  # noqa: E402 (tests/ is on sys.path)

TOPK = 4  # below 7 and 12: the selection prunes
DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, q_lora_rank=24)
INDEX = dict(index_topk=TOPK, index_n_heads=16, index_head_dim=16)  # 16 heads: no score ties at the top-k edge
YARN = dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.5, original_max_position_embeddings=64)
LOSS_NORM = 10.0


def _hf_config(heads: int, rope: dict | None = None):
    rope = {"rope_type": "default", **(rope or {}), "rope_theta": 10000.0}
    cfg = transformers.DeepseekV32Config(
        hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=heads, rope_parameters=rope,
        max_position_embeddings=256, rms_norm_eps=1e-6, vocab_size=32, num_hidden_layers=1, **DIMS, **INDEX)
    cfg._attn_implementation = "eager"
    return cfg


def _arch(cfg) -> HybridArch:
    return dataclasses.replace(mla_arch(cfg), pattern="D", mla_q_lora_rank=cfg.q_lora_rank, dsa_index_topk=cfg.index_topk,
                               dsa_index_heads=cfg.index_n_heads, dsa_index_head_dim=cfg.index_head_dim)


def _full_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    return mla_full_weights(cfg, seed, hf_v32.DeepseekV32Attention)


V32_CLASSES = (hf_v32.DeepseekV32Attention, hf_v32.DeepseekV32RMSNorm, hf_v32.DeepseekV32RotaryEmbedding)


def _hf_modules(cfg, weights: dict, dtype):
    return mla_hf_modules(cfg, weights, dtype, V32_CLASSES)


def _hf_run(cfg, weights: dict, x0: torch.Tensor, dy: torch.Tensor, dtype) -> dict[str, torch.Tensor]:
    """transformers, each sample alone, its causal mask passed (the indexer reads it); the
    indexer's weights take no gradient there (transformers runs it without)."""
    return mla_hf_run(cfg, weights, x0, dy, dtype, V32_CLASSES, causal_mask=True)


def _ours(layer: DSA, x0, dy, sp_rank=None, loss_norm=None, indexer_grads: bool = False) -> dict:
    out = mla_ours(layer, x0, dy, sp_rank, loss_norm)
    return out if indexer_grads else {k: v for k, v in out.items() if not k.startswith("grad:indexer.")}


# --------------------------------------------------------------------------- one process vs transformers
@pytest.mark.parametrize("rope", [None, YARN], ids=["default", "yarn"])
def test_dsa_equals_transformers_per_sample(rope):
    cfg = _hf_config(4, rope)
    weights = _full_weights(cfg, seed=1)
    x0, dy = _data(2)
    ref32 = _hf_run(cfg, weights, x0, dy, torch.float32)
    ref64 = _hf_run(cfg, weights, x0, dy, torch.float64)
    layer = build_layer(_arch(cfg), LayerSpec(0, "dsa"))
    assert isinstance(layer, DSA)
    load_full_(param_table(layer), weights)
    got = _ours(layer, x0, dy)
    assert set(got) == set(ref64), sorted(set(got) ^ set(ref64))
    ys = Yardstick(1e-5)
    ys.check_all(got, ref32, ref64)
    ys.assert_ok("DSA")
    # the selection prunes here: the same weights attending to every causal key give another output
    dense = build_layer(_arch(cfg), LayerSpec(0, "dsa"))
    load_full_(param_table(dense), weights)
    set_dsa_training(dense, warmup=True, kl_weight=1.0)
    assert (_ours(dense, x0, dy)["y"] - got["y"]).abs().max() > 1e-2


def test_selection_keeps_topk_of_the_prefix_ties_to_the_earlier_key():
    scores = torch.tensor([[5.0, 1, 1, 1, 0], [0, 2, 2, 9, 2]])
    allowed = torch.tensor([[True, True, True, False, False], [True] * 5])
    assert select_keys(scores, allowed, 2).tolist() == [[True, True, False, False, False],
                                                        [False, True, False, True, False]]
    assert select_keys(scores, allowed, 9).tolist() == allowed.tolist()  # fewer keys than topk: all of them


# --------------------------------------------------------------------------- the indexer's KL loss
def _reference_kl(cfg, weights: dict, x0: torch.Tensor, warmup: bool):
    """The V3.2 report's loss over transformers' own modules, fp64: per sample, eager attention's
    probabilities (with the sparse mask, or causal only in the warm-up) summed over heads and
    L1-normalised; the index scores from the indexer's projections (its inputs detached); KL over
    the attended keys, summed over queries. (loss, gradients of the indexer's weights)."""
    attn, norm, rotary = _hf_modules(cfg, weights, torch.float64)
    ix = attn.indexer
    total = torch.zeros((), dtype=torch.float64)
    cu = SeqContext.from_seqlens(SEQLENS).cu_seqlens.tolist()
    with fp64_kept():
        for s, e in zip(cu[:-1], cu[1:]):
            n = e - s
            h = x0[s:e].to(torch.float64)[None]
            pos = torch.arange(n)[None]
            cos, sin = rotary(h, pos)
            x = norm(h).detach()
            if warmup:  # transformers with an index_topk that keeps everything
                ix.index_topk = 10 ** 6
            _, probs = attn(x, (cos, sin), attention_mask=_causal(n, torch.float64), position_ids=pos)
            ix.index_topk = cfg.index_topk
            ql = attn.q_a_layernorm(attn.q_a_proj(x)).detach()
            r = cfg.qk_rope_head_dim
            q = ix.wq_b(ql).view(1, n, ix.n_heads, ix.head_dim)
            k = ix.k_norm(ix.wk(x))[:, :, None]
            q_rot, k_rot = hf_v32.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
            q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)[:, :, 0]
            scores = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.softmax_scale)
            index = torch.einsum("bsh,bsht->bst", ix.weights_proj(x) * ix.n_heads ** -0.5, scores)[0]
            p = probs[0].detach().sum(0)
            p = p / p.sum(-1, keepdim=True)
            kept = p > 0
            logq = torch.log_softmax(index.masked_fill(~kept, float("-inf")), -1)
            total = total + torch.where(kept, p * (torch.log(p.clamp_min(1e-300)) - logq), 0.0).sum()
    total.backward()
    return total.detach(), {f"indexer.{n}": p.grad for n, p in ix.named_parameters()}


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
def test_indexer_kl_equals_the_reports_formula(warmup):
    cfg = _hf_config(4, YARN)
    weights = _full_weights(cfg, seed=3)
    x0, _ = _data(4, torch.float64)
    want, want_grads = _reference_kl(cfg, weights, x0, warmup)
    layer = build_layer(_arch(cfg), LayerSpec(0, "dsa")).to(torch.float64)
    load_full_(param_table(layer), {k: v.double() for k, v in weights.items()})
    set_dsa_training(layer, warmup=warmup, kl_weight=0.5)
    seq = SeqContext.from_seqlens(SEQLENS)
    seq.loss_norm = LOSS_NORM
    y = layer(x0, seq)
    (0 * y).sum().backward()  # only the attached KL reaches the indexer
    # (eager attention's softmax runs in fp32 even in the fp64 model: the reference's probabilities
    # carry fp32 rounding, ~1e-8 relative)
    assert abs(float(layer.kl_sum / want) - 1) < 1e-6, (float(layer.kl_sum), float(want))
    for name, g in want_grads.items():
        ours = dict(layer.named_parameters())[name].grad
        err = float((ours - g * 0.5 / LOSS_NORM).norm() / (g * 0.5 / LOSS_NORM).norm())
        assert err < 1e-5, (name, err)
    # the indexer's inputs are detached: its loss sends no gradient into the model
    assert all(p.grad is None or not p.grad.any() for n, p in layer.named_parameters() if not n.startswith("indexer."))
    if warmup:  # the warm-up trains the indexer only, and attends as MLA does
        assert {n for n, p in layer.named_parameters() if p.requires_grad} == set(want_grads)
        mla = MLA(MLAConfig.from_arch(_arch(cfg))).to(torch.float64)
        load_full_(param_table(mla), {k: v.double() for k, v in weights.items() if not k.startswith("indexer.")})
        mla.impl = "exact"
        assert torch.allclose(mla(x0, SeqContext.from_seqlens(SEQLENS)), y, rtol=1e-12, atol=1e-12)


def test_no_kl_outside_a_training_forward():
    cfg = _hf_config(4)
    layer = build_layer(_arch(cfg), LayerSpec(0, "dsa"))
    load_full_(param_table(layer), _full_weights(cfg, 5))
    x0, dy = _data(6)
    got = _ours(layer, x0, dy, indexer_grads=True)  # loss_norm None: an eval / verification forward
    assert all(got[f"grad:indexer.{n}"] is None or not got[f"grad:indexer.{n}"].any()
               for n, _ in layer.indexer.named_parameters())


# --------------------------------------------------------------------------- tensor parallel
TP, TP_HEADS = 2, 6  # 3 heads a rank


def _tp_case(seed: int) -> dict:
    group, rank = tp_group(TP)
    cfg = _hf_config(TP_HEADS, YARN)
    arch, weights = _arch(cfg), _full_weights(cfg, seed)
    x0, dy = _data(seed)
    refs = {}
    for dtype in (torch.float32, torch.float64):
        one = DSA(MLAConfig.from_arch(arch), IndexerConfig.from_arch(arch)).to(dtype)
        load_full_(param_table(one), {k: v.to(dtype) for k, v in weights.items()})
        refs[dtype] = _ours(one, x0.to(dtype), dy.to(dtype), loss_norm=LOSS_NORM, indexer_grads=True)
    measures, partial, fp8_errs = [], {}, {}
    one = DSA(MLAConfig.from_arch(arch), IndexerConfig.from_arch(arch))
    load_full_(param_table(one), weights)
    one.fp8_index = True
    ref_fp8 = _ours(one, x0, dy, loss_norm=LOSS_NORM, indexer_grads=True)
    for sp in (False, True):
        layer = DSA(MLAConfig.from_arch(arch), IndexerConfig.from_arch(arch), ParallelContext.for_tp(group, sequence_parallel=sp))
        table = param_table(layer)
        partial[sp] = sorted(n for n, info in table.items() if info.placement.partial and n.startswith("indexer."))
        load_full_(table, weights)
        got = _ours(layer, x0, dy, (TP, rank) if sp else None, loss_norm=LOSS_NORM, indexer_grads=True)
        part = (lambda v: v.chunk(TP)[rank]) if sp else (lambda v: v)
        ys = Yardstick(1e-5)
        for k in refs[torch.float64]:
            want32, want64 = refs[torch.float32][k], refs[torch.float64][k]
            if k in ("y", "dx"):
                want32, want64 = part(want32), part(want64)
            ys.check(f"sp={sp}/{k}", got[k], want32, want64)
        measures += [m.as_dict() for m in ys.measures]
        # FP8 index scoring: every rank rounds the same indexer inputs as one process does
        layer.fp8_index = True
        got = _ours(layer, x0, dy, (TP, rank) if sp else None, loss_norm=LOSS_NORM, indexer_grads=True)
        fp8_errs[sp] = max(rel_err(got[k], part(v) if k in ("y", "dx") else v) for k, v in ref_fp8.items())
    return {"measures": measures, "partial": partial, "fp8_errs": fp8_errs}


def test_tp2_with_and_without_sequence_parallel_equals_one_process(pools):
    results = pools(TP).run(_tp_case, 7)
    ys = Yardstick(1e-5)
    for rank, res in enumerate(results):
        ys.extend(res["measures"], prefix=f"rank{rank}:")
        assert res["partial"] == {False: [], True: []}  # every rank computes the indexer whole
        assert max(res["fp8_errs"].values()) < 1e-5, res["fp8_errs"]
    ys.assert_ok("DSA at tp 2")
    names = {m.name.partition(":")[2] for m in ys.measures}
    assert {f"sp={sp}/grad:indexer.{n}" for sp in (False, True) for n in ("wq_b.weight", "wk.weight", "k_norm.bias")} <= names


# --------------------------------------------------------------------------- config
def test_dsa_fields_required_with_D_and_warmup_only_with_D():
    base = dict(pattern="D-", hidden=64, heads=4, vocab=32, **{f"mla_{k}": v for k, v in DIMS.items()})
    problems = HybridArch(**base).validate("arch")
    assert any("dsa_index_topk" in p and "'D'" in p for p in problems), problems
    ok = HybridArch(**base, dsa_index_topk=4, dsa_index_heads=2, dsa_index_head_dim=8)
    assert ok.validate("arch") == []
    narrow = HybridArch(**base, dsa_index_topk=4, dsa_index_heads=2, dsa_index_head_dim=4)
    assert any("dsa_index_head_dim" in p and "at least" in p for p in narrow.validate("arch"))
    no_q = HybridArch(**{**base, "mla_q_lora_rank": None}, dsa_index_topk=4, dsa_index_heads=2, dsa_index_head_dim=8)
    assert any("mla_q_lora_rank" in p for p in no_q.validate("arch"))
    mla = HybridArch(**{**base, "pattern": "+-"})
    cfg = LLMModuleConfig(kind="hybrid", arch=mla)
    cfg.dsa.warmup = True
    assert any("dsa.warmup" in p and "'D'" in p for p in cfg.validate("modules.language"))


def test_mla_lora_targets_adapt_dsa_layers():
    """q_a / q_b / kv_a / kv_b (MLA's projections) adapt a D layer's: a DSA layer is an MLA layer;
    the indexer takes none (it trains on its KL loss alone)."""
    from mimo.llm.model import LLMStage, LORA_TARGETS
    from mimo.parallel.lora import attach_targets
    from mimo.parallel.lora_config import LoraSpec

    arch = dataclasses.replace(_arch(_hf_config(4)), pattern="D-D-", ffn=32)
    stage = LLMStage(arch)
    paths = attach_targets(stage, LoraSpec(4, 8.0), 0, LORA_TARGETS, ["q_a", "q_b", "kv_a", "kv_b"], "modules.language.lora")
    assert sorted(paths) == sorted(f"layers.{i}.{p}" for i in (0, 2)
                                   for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")), paths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_dsa_on_the_gpu_equals_the_cpu():
    """The layer on CUDA (fp32, no TF32) gives the CPU's outputs and gradients, the KL included;
    in bf16 it runs (finite) and keeps min(index_topk, prefix) keys per query, as on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _hf_config(4, YARN)
    weights = _full_weights(cfg, seed=8)
    x0, dy = _data(9)
    layers = {}
    for device in ("cpu", "cuda"):
        layer = build_layer(_arch(cfg), LayerSpec(0, "dsa")).to(device)
        load_full_(param_table(layer), weights)
        layers[device] = layer
    got = {d: _ours(layers[d], x0.to(d), dy.to(d), loss_norm=LOSS_NORM, indexer_grads=True) for d in layers}
    for k, want in got["cpu"].items():
        assert rel_err(got["cuda"][k].cpu(), want) < 1e-5, k
    assert rel_err(layers["cuda"].kl_sum.cpu(), layers["cpu"].kl_sum) < 1e-5
    bf16 = layers["cuda"].to(torch.bfloat16)
    out = _ours(bf16, x0.cuda().bfloat16(), dy.cuda().bfloat16(), loss_norm=LOSS_NORM, indexer_grads=True)
    assert all(v is None or torch.isfinite(v).all() for v in out.values())
    scores = torch.randn(12, 12, device="cuda")
    allowed = torch.ones(12, 12, dtype=torch.bool, device="cuda").tril()
    kept = select_keys(scores, allowed, TOPK)
    assert kept.sum(-1).tolist() == [min(TOPK, i + 1) for i in range(12)]


def test_fp8_index_scoring_is_v32s():
    """FP8 scoring: the normalised Hadamard rotation is orthogonal (scores unchanged without the
    rounding); each row rounded to e4m3 at amax -> 448, as a per-row loop does; the layer's
    indexer reads the rounded values (its selection and KL change), its gradient straight
    through; on by default where the layer's products are FP8; a head size not a power of two is
    a clear error there."""
    from mimo.core.errors import MimoError
    from mimo.llm.dsa import fp8_rounded, hadamard, index_scores

    h = hadamard(16, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
    g = torch.Generator().manual_seed(4)
    q, k, w = torch.randn(5, 3, 16, generator=g), torch.randn(7, 16, generator=g), torch.randn(5, 3, generator=g)
    assert torch.allclose(index_scores(q @ h.float(), k @ h.float(), w, 0.25), index_scores(q, k, w, 0.25), atol=1e-5)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    want = torch.stack([(r * (448 / r.abs().max())).to(torch.float8_e4m3fn).float() * (r.abs().max() / 448) for r in x.detach()])
    got = fp8_rounded(x)
    assert torch.allclose(got, want, rtol=1e-6) and not torch.equal(got, x.detach())
    got.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight through
    with pytest.raises(MimoError, match="power of two"):
        hadamard(12)

    cfg = _hf_config(4)
    layer = build_layer(_arch(cfg), LayerSpec(0, "dsa"))
    load_full_(param_table(layer), _full_weights(cfg, 3))
    x0, dy = _data(4)
    plain = _ours(layer, x0, dy, loss_norm=LOSS_NORM, indexer_grads=True)
    kl_plain = layer.kl_sum
    layer.fp8_index = True
    fp8 = _ours(layer, x0, dy, loss_norm=LOSS_NORM, indexer_grads=True)
    assert layer.kl_sum != kl_plain and rel_err(fp8["grad:indexer.wk.weight"], plain["grad:indexer.wk.weight"]) > 1e-4
    assert rel_err(fp8["grad:indexer.wk.weight"], plain["grad:indexer.wk.weight"]) < 0.5  # the same loss, rounded inputs
    from mimo.parallel.fp8 import apply_fp8

    layer.fp8_index = None
    apply_fp8(layer, "rowwise", ParallelContext.for_tp())
    on = _ours(layer, x0, dy, loss_norm=LOSS_NORM, indexer_grads=True)
    assert layer.kl_sum != kl_plain and on["grad:indexer.wk.weight"] is not None
    narrow = build_layer(dataclasses.replace(_arch(cfg), dsa_index_head_dim=24), LayerSpec(0, "dsa"))
    narrow.fp8_index = True
    with pytest.raises(MimoError, match="power of two"):
        _ours(narrow, x0, dy)


def test_generation_runs_without_a_cache_with_dsa_layers():
    """eval / generate keep no cache where the LLM has D layers (their indexer keys are not
    cached): every round runs the whole forward, which the DSA layer takes."""
    from pathlib import Path

    from mimo.compose.config import load_config
    from mimo.training.evaluation import generation_cache

    example = str(Path(__file__).resolve().parents[1] / "configs" / "examples" / "deepseek-v3-moe.yaml")
    assert generation_cache(load_config(example, []))
    dsa = ["modules.language.arch.pattern=D-DEDE", "modules.language.arch.dsa_index_topk=8",
           "modules.language.arch.dsa_index_heads=4", "modules.language.arch.dsa_index_head_dim=16"]
    assert not generation_cache(load_config(example, dsa))

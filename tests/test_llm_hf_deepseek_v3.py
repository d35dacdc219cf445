"""Hugging Face DeepSeek-V3 import / export and ``mimo verify-llm`` (a small random
``DeepseekV3ForCausalLM``: MLA with and without a q low-rank, a dense first layer, then MoE layers
with sigmoid scores, e_score_correction_bias, group-limited routing, routed_scaling_factor and a
shared expert; YaRN RoPE in one case)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import yaml

from mimo.core.errors import MimoError
from mimo.core.testing import Yardstick, rel_err
from mimo.llm import hf_deepseek_v3 as ds
from mimo.llm.config import MTPArch
from mimo.llm.hf import (HFCheckpoint, export_hf_state, hf_model_type, load_hf_checkpoint, read_config_json,
                         save_hf_checkpoint, with_checkpoint_mtp)
from mimo.llm.model import LLMStage
from mimo.llm.router import Router
from mimo.llm.verify import pack_samples, random_samples, randomize_, verify_llm

# 6 heads (3 a rank at tp 2), v_head_dim 12 != qk 24; 6 experts in 2 routing groups of which a
# token's 2 experts come from the best one; one dense decoder layer, then two MoE ones
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             first_k_dense_replace=1, num_attention_heads=6, num_key_value_heads=6, q_lora_rank=24, kv_lora_rank=32,
             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=6, n_shared_experts=1,
             num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=256)
# a full q projection, 3 heads (odd), attention biases, no renormalisation of the gates
NO_Q_LORA = dict(SMALL, q_lora_rank=None, num_attention_heads=3, num_key_value_heads=3, attention_bias=True,
                 norm_topk_prob=False)
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                 original_max_position_embeddings=64)
# YaRN (max_position_embeddings = factor x original), no q low-rank, two shared experts, tied head
YARN = dict(SMALL, q_lora_rank=None, rope_parameters=YARN_ROPE, n_shared_experts=2, tie_word_embeddings=True)
# DeepSeek-V3.2 (DeepseekV32Config): every attention layer DSA, an index_topk below the longer
# samples' lengths (the selection prunes), 16 index heads (no score ties at the top-k edge)
V32 = dict(SMALL, v32=True, index_topk=5, index_n_heads=16, index_head_dim=16)
CONFIGS = {"small": SMALL, "no_q_lora": NO_Q_LORA, "yarn": YARN, "v32": V32}
PATTERNS = {"small": "+-+E+E", "no_q_lora": "+-+E+E", "yarn": "+-+E+E", "v32": "D-DEDE"}


def hf_config(v32: bool = False, **kw):
    import transformers

    return (transformers.DeepseekV32Config if v32 else transformers.DeepseekV3Config)(**kw)


@torch.no_grad()
def hf_model(kw: dict, seed: int = 0):
    """A random DeepSeek-V3 where every path shows: ``randomize_``d weights and a non-zero
    e_score_correction_bias (it changes many tokens' experts: test_router_matches_transformers).
    Eager attention and experts, as verify-llm runs it (also in fp64)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(**kw), attn_implementation="eager",
                                                          experts_implementation="eager").eval()
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


def worst_err(model, stage, vocab: int, seed: int = 2) -> float:
    """Largest per-sample relative error of our packed logits against the model's."""
    toks = random_samples(vocab, 6, 20, torch.Generator().manual_seed(seed))
    batch = pack_samples(toks)
    with torch.no_grad():
        ours = stage.gather_logits(stage.eval()(batch))
        ref = [model(input_ids=t[None]).logits[0] for t in toks]
    cu = batch.cu_seqlens.tolist()
    return max(rel_err(ours[cu[i] : cu[i + 1]], r) for i, r in enumerate(ref))


def our_state(stage: LLMStage) -> dict:
    return {**stage.full_state(), **{n: b for n, b in stage.named_buffers() if n.endswith(ds.BUFFERS)}}


# ---------------------------------------------------------------- import / export


@pytest.mark.parametrize("name,naming", [("small", "save_pretrained"), ("no_q_lora", "state_dict"),
                                         ("v32", "save_pretrained"),
                                         ("yarn", "state_dict")])
def test_import_matches_and_export_reproduces_state_dict(tmp_path, name, naming):
    """save_pretrained writes per-expert tensors, export the state_dict's fused ones: import
    reads both; our packed logits match Hugging Face's per sample; export is its state dict
    tensor for tensor (in its order, the buffer included), and from_pretrained loads what we write."""
    import transformers

    model = hf_model(CONFIGS[name])
    if naming == "save_pretrained":
        model.save_pretrained(tmp_path)
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in HFCheckpoint(str(tmp_path)).keys())
    else:
        save_hf_checkpoint(str(tmp_path), model.state_dict(), model.config.to_dict())
    arch = ds.arch_from_hf_config(read_config_json(str(tmp_path / "config.json")))
    assert arch.pattern == PATTERNS[name] and hf_model_type(arch) == model.config.model_type
    stage = LLMStage(arch)
    load_hf_checkpoint(stage, str(tmp_path))
    err = worst_err(model, stage, arch.vocab)
    assert err < 1e-5, err

    exported = export_hf_state(our_state(stage), arch)
    theirs = model.state_dict()
    assert list(exported) == list(theirs)
    assert all(torch.equal(exported[k], theirs[k]) for k in theirs)

    save_hf_checkpoint(str(tmp_path / "ours"), exported, ds.hf_config_from_arch(arch))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).state_dict()
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)


@torch.no_grad()
def mtp_module(model, seed: int = 7):
    """DeepSeek's MTP module (one, at model.layers.{num_hidden_layers}) for ``model``: a random
    transformers DeepseekV3DecoderLayer of that index (an MoE layer, past first_k_dense_replace),
    random enorm / hnorm / eh_proj / shared_head.norm, and the copies of the embedding and head.
    Returns (its checkpoint tensors, in the order export writes them; the layer; the norms and eh_proj)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer

    cfg = model.config
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    if cfg.model_type == "deepseek_v32":  # its layer n (past mlp_layer_types: an MoE one, as DeepSeek's MTP)
        cfg = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": n + 1, "mlp_layer_types": None, "layer_types": None})
    layer = (DeepseekV32DecoderLayer if cfg.model_type == "deepseek_v32" else DeepseekV3DecoderLayer)(cfg, n).eval()
    randomize_(layer, seed)
    parts = torch.nn.ModuleDict({"enorm": DeepseekV3RMSNorm(d, cfg.rms_norm_eps),
                                 "hnorm": DeepseekV3RMSNorm(d, cfg.rms_norm_eps),
                                 "eh_proj": torch.nn.Linear(2 * d, d, bias=False),
                                 "shared_head_norm": DeepseekV3RMSNorm(d, cfg.rms_norm_eps)})
    randomize_(parts, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_routed_experts, generator=gen))
    at = f"model.layers.{n}."
    out = {at + "embed_tokens.weight": model.model.embed_tokens.weight.clone(),
           at + "enorm.weight": parts["enorm"].weight.clone(), at + "hnorm.weight": parts["hnorm"].weight.clone(),
           at + "eh_proj.weight": parts["eh_proj"].weight.clone()}
    out.update({at + k: v.clone() for k, v in layer.state_dict().items()})
    out[at + "shared_head.norm.weight"] = parts["shared_head_norm"].weight.clone()
    out[at + "shared_head.head.weight"] = model.lm_head.weight.clone()
    return out, layer, parts


def per_expert(state: dict) -> dict:
    """Fused experts split into a published checkpoint's per-expert tensors."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            f = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k[: -len("gate_up_proj")] + f"{e}.gate_proj.weight"] = v[e, :f].clone()
                out[k[: -len("gate_up_proj")] + f"{e}.up_proj.weight"] = v[e, f:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k[: -len("down_proj")] + f"{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    return out


def mtp_stage(path) -> LLMStage:
    ckpt = HFCheckpoint(str(path))
    arch = ds.with_checkpoint_mtp(ds.arch_from_hf_config(ckpt.config), ckpt.keys())
    stage = LLMStage(arch)
    load_hf_checkpoint(stage, str(path))
    return stage.eval()


@pytest.mark.parametrize("name,naming", [("small", "state_dict"), ("small", "per_expert"), ("v32", "state_dict")])
def test_mtp_layers_import_and_export_under_their_names(tmp_path, name, naming):
    """A checkpoint with DeepSeek's MTP layer (model.layers.3: enorm, hnorm, eh_proj, an MoE
    decoder layer, shared_head, the embedding / head copies; fused or per-expert) gives
    arch.mtp (depth 1, '+E'), loads, and exports back tensor for tensor under the same names
    (the copies written, the MTP router's expert bias included), num_nextn_predict_layers 1.
    DeepSeek-V3.2's: its MTP layer's attention DSA, the indexer's tensors included ('DE')."""
    model = hf_model(CONFIGS[name])
    block = "DE" if name == "v32" else "+E"
    mtp, _, _ = mtp_module(model)
    theirs = {**model.state_dict(), **mtp}
    save_hf_checkpoint(str(tmp_path), theirs if naming == "state_dict" else per_expert(theirs),
                       dict(model.config.to_dict(), num_nextn_predict_layers=1))
    stage = mtp_stage(tmp_path)
    arch = stage.arch
    assert arch.mtp == MTPArch(depth=1, pattern=block)
    assert with_checkpoint_mtp(arch, theirs).mtp == arch.mtp  # (mimo.llm.hf's, which import-hf writes, takes DeepSeek's)
    if naming == "state_dict":  # mimo import-hf: the modules section it writes has the MTP block
        from mimo.commands.import_hf import describe_causal_lm

        describe_causal_lm(str(tmp_path), str(tmp_path / "modules.yaml"))
        written = yaml.safe_load((tmp_path / "modules.yaml").read_text())["modules"]["language"]["arch"]
        assert written["mtp"]["depth"] == 1 and written["mtp"]["pattern"] == block
    assert dict(stage.named_parameters())["mtp.0.fc.weight"].shape == (64, 128)
    exported = export_hf_state(our_state(stage), arch)
    assert list(exported) == list(theirs)
    assert [k for k in theirs if not torch.equal(exported[k], theirs[k])] == []
    cfg = ds.hf_config_from_arch(arch)
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["first_k_dense_replace"] == 1
    assert ds.arch_from_hf_config(cfg) == dataclasses.replace(arch, mtp=None)  # config alone: no mtp, as Qwen's


def test_mtp_forward_equals_deepseek_mtp():
    """Our imported MTP (depth 1) on a pack of samples: its logits at every position and its
    loss equal DeepSeek's MTP computation written out per sample with transformers' layers
    (vLLM's deepseek_mtp.py): eh_proj(cat(enorm(embed(token t + 1)), hnorm(h))), the MTP
    DeepseekV3DecoderLayer, shared_head.norm, shared_head.head; h the main model's final-normed
    hidden state. fp32 against the fp32 / fp64 references (yardstick)."""
    import copy

    import torch.nn.functional as F

    from mimo.llm.mtp import shift_in_samples

    model = hf_model(SMALL)
    mtp, layer, parts = mtp_module(model)
    state = {**model.state_dict(), **mtp}
    arch = ds.with_checkpoint_mtp(ds.arch_from_hf_config(model.config.to_dict()), state)
    stage = LLMStage(arch).eval()
    from mimo.llm.hf import import_hf_state_

    import_hf_state_(stage, *ds.checkpoint_view(arch, state, {k: tuple(v.shape) for k, v in state.items()},
                                                state.__getitem__)[::-1])
    toks = random_samples(arch.vocab, 5, 20, torch.Generator().manual_seed(6))
    batch = pack_samples(toks)
    with torch.no_grad():
        seq = stage.context(batch)
        h_TD = stage.norm(stage._layers(stage._embed(batch, {}), seq))
        ahead_T = shift_in_samples(batch.tokens, 1, batch.cu_seqlens, 0)
        ours = stage.logits(stage.mtp.depths[0](stage._mtp_embed(ahead_T), h_TD, seq))
        (loss,) = stage.mtp_losses(h_TD, batch)

    def reference(dtype):
        m, blk, p = (copy.deepcopy(x).to(dtype) for x in (model, layer, parts))
        logits, total = [], 0.0
        with torch.no_grad():
            for t in toks:
                n = t.numel()
                h = m.model(input_ids=t[None]).last_hidden_state  # final-normed, what the head reads
                ahead = torch.cat([t[1:], torch.zeros(1, dtype=torch.long)])  # token t + 1 (none past the end)
                x = p["eh_proj"](torch.cat([p["enorm"](m.model.embed_tokens(ahead[None])), p["hnorm"](h)], -1))
                pos = torch.arange(n)[None]
                causal = torch.full((n, n), float("-inf"), dtype=dtype).triu(1)[None, None]
                x = blk(x, attention_mask=causal, position_ids=pos, position_embeddings=m.model.rotary_emb(x, pos))
                out = m.lm_head(p["shared_head_norm"](x))[0]  # shared_head.head = lm_head (a copy)
                logits.append(out)
                total += float(F.cross_entropy(out[: n - 2].double(), t[2:], reduction="sum")) if n > 2 else 0.0
        return torch.cat(logits), total

    (ref32, loss32), (ref64, loss64) = reference(torch.float32), reference(torch.float64)
    ys = Yardstick(1e-5)
    ys.check("mtp logits", ours, ref32, ref64)
    f64 = lambda x: torch.tensor(float(x), dtype=torch.float64)  # noqa: E731
    ys.check("mtp loss", f64(loss), f64(loss32), f64(loss64))
    assert ys.ok, ys.summary(5)
    assert loss64 > 0 and rel_err(ours, ref64) > 0  # (a real comparison: not bit-equal by accident)


@pytest.mark.parametrize("copy_name", ["shared_head.head.weight", "embed_tokens.weight"])
def test_mtp_copies_that_differ_are_clear_errors(tmp_path, copy_name):
    """The MTP layer's copy of the head (or embedding) differs from the model's: a MimoError
    naming the copy (our MTP shares the model's)."""
    model = hf_model(SMALL)
    mtp, _, _ = mtp_module(model)
    mtp[f"model.layers.3.{copy_name}"] = mtp[f"model.layers.3.{copy_name}"] + 1e-3
    save_hf_checkpoint(str(tmp_path), {**model.state_dict(), **mtp}, model.config.to_dict())
    with pytest.raises(MimoError, match=f"tensor 'model.layers.3.{copy_name}' differs from"):
        mtp_stage(tmp_path)


def test_export_maps_mtp_blocks_and_refuses_others():
    """'+-' MTP after dense-only layers: first_k_dense_replace past the MTP layers (DeepSeek's rule
    makes layer L + k MoE otherwise); a '+-' MTP after MoE layers, or another block, is refused."""
    dense = ds.arch_from_hf_config(hf_config(**dict(SMALL, first_k_dense_replace=3)).to_dict())
    assert dense.pattern == "+-+-+-"
    cfg = ds.hf_config_from_arch(dataclasses.replace(dense, mtp=MTPArch(depth=2, pattern="+-")))
    assert (cfg["num_nextn_predict_layers"], cfg["first_k_dense_replace"], cfg["num_hidden_layers"]) == (2, 5, 3)
    moe = ds.arch_from_hf_config(hf_config(**SMALL).to_dict())
    for mtp, message in ((MTPArch(pattern="+-"), r"MoE \('\+E'\) in a model with MoE layers"),
                         (MTPArch(), r"block is '\*E'"), (MTPArch(pattern="+E+E"), "block is")):
        with pytest.raises(MimoError, match=message):
            ds.hf_config_from_arch(dataclasses.replace(moe, mtp=mtp))


def test_mtp_layers_of_a_checkpoint_without_arch_mtp_are_not_loaded(tmp_path, caplog):
    """A model without arch.mtp loads a checkpoint with DeepSeek's MTP layer (per-expert
    tensors included), warning that its mtp.* tensors are not loaded (as Qwen's), and computes
    the main model's logits."""
    model = hf_model(SMALL)
    mtp, _, _ = mtp_module(model)
    save_hf_checkpoint(str(tmp_path), per_expert({**model.state_dict(), **mtp}),
                       dict(model.config.to_dict(), num_nextn_predict_layers=1))
    arch = ds.arch_from_hf_config(read_config_json(str(tmp_path / "config.json")))
    assert arch.mtp is None and with_checkpoint_mtp(arch, HFCheckpoint(str(tmp_path)).keys()).mtp is not None
    stage = LLMStage(arch)
    with caplog.at_level(logging.WARNING):
        load_hf_checkpoint(stage, str(tmp_path))
    assert "mtp.* tensors (multi-token prediction) are not loaded: arch.mtp is not set" in caplog.text
    assert worst_err(model, stage, arch.vocab) < 1e-5


def test_router_matches_transformers():
    """Our router (imported weight and expert_bias) on transformers' DeepseekV3TopkRouter's own
    logits: the same experts and gates; the correction bias changes many tokens' experts; at
    exact ties ours takes the lowest index."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = hf_config(**SMALL)
    arch = ds.arch_from_hf_config(cfg.to_dict())
    gate = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(5)
    x_TD = torch.randn(256, arch.hidden, generator=gen)
    router = Router(arch.hidden, arch.moe)
    with torch.no_grad():
        gate.weight.copy_(2 * torch.randn(gate.weight.shape, generator=gen) / arch.hidden ** 0.5)
        gate.e_score_correction_bias.copy_(0.3 * torch.randn(6, generator=gen))
        router.weight.copy_(gate.weight)
        router.expert_bias.copy_(gate.e_score_correction_bias)
        logits_hf, w_hf, idx_hf = gate(x_TD)
        torch.testing.assert_close(router.logits(x_TD), logits_hf, rtol=0, atol=0)
        ours = router.route(logits_hf, None)
        bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        _, _, idx_unbiased = gate(x_TD)
        gate.e_score_correction_bias.copy_(bias)
    same = lambda a, b: (a.sort(-1).values == b.sort(-1).values).all(-1)  # noqa: E731
    assert (~same(idx_hf, idx_unbiased)).sum() >= 16
    assert same(ours.idx_TK, idx_hf).all()
    order_hf, order_ours = idx_hf.argsort(-1), ours.idx_TK.argsort(-1)
    torch.testing.assert_close(ours.gate_TK.gather(1, order_ours), w_hf.gather(1, order_hf), rtol=1e-6, atol=1e-7)
    assert float(w_hf.sum(-1).min()) == pytest.approx(2.5, rel=1e-6)  # renormalised, times routed_scaling_factor

    # exact ties (equal logits, no bias): ours keeps the lowest indices of the best group
    router.expert_bias.zero_()
    tied = router.route(torch.zeros(2, 6), None)
    assert tied.idx_TK.tolist() == [[0, 1], [0, 1]]


# ---------------------------------------------------------------- verify-llm


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoint directories (save_pretrained: per-expert names) of the random models."""
    root = tmp_path_factory.mktemp("deepseek-v3")
    out = {}
    for name, kw in CONFIGS.items():
        hf_model(kw).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("name,tp", [("no_q_lora", 1), ("small", 2), ("yarn", 2), ("v32", 1), ("v32", 2)])
def test_verify_llm(pools, checkpoints, name, tp):
    report = verify_llm(checkpoints[name], pools(2), from_checkpoint=True, tp=tp, samples=5, max_len=20, seed=3)
    assert report["ok"], report
    assert report["export_exact"] and report["model_type"] == ("deepseek_v32" if name == "v32" else "deepseek_v3")


@pytest.mark.parametrize("name,tp", [("small", 1), ("small", 2), ("v32", 2)])
def test_verify_llm_at_ep2(pools, checkpoints, name, tp):
    """Expert parallelism (verify-llm --ep 2: two data-parallel ranks each with its own pack,
    three experts a rank, tokens dispatched between them; at tp 2 the experts' inner size split
    too): every sample's logits and the loss within the yardstick of transformers, and the
    export of the gathered state exact."""
    report = verify_llm(checkpoints[name], pools(2 * tp), from_checkpoint=True, tp=tp, ep=2, samples=6, max_len=20, seed=4)
    assert report["ok"], report
    assert report["export_exact"] and report["ep"] == 2


# ---------------------------------------------------------------- config and errors


def test_config_round_trip_and_defaults():
    """arch -> config.json -> arch is the identity (YaRN included); DeepseekV3Config reads our
    config; our defaults are DeepseekV3Config's; an older config (rope_scaling with type,
    top-level rope_theta) reads the same; q_lora_rank null is a full q projection."""
    import transformers

    for kw in CONFIGS.values():
        arch = ds.arch_from_hf_config(hf_config(**kw).to_dict())
        cfg = ds.hf_config_from_arch(arch)
        assert ds.arch_from_hf_config(cfg) == arch
        theirs = hf_config(v32=kw.get("v32", False), **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
        assert ds.arch_from_hf_config(theirs) == arch
    yarn = ds.arch_from_hf_config(hf_config(**YARN).to_dict())
    assert (yarn.rope_scaling.type, yarn.rope_scaling.factor, yarn.rope_scaling.mscale_all_dim) == ("yarn", 4.0, 1.0)
    assert yarn.mla_q_lora_rank is None and yarn.tie_embeddings and yarn.moe.shared_ffn == 64
    legacy = {k: v for k, v in ds.hf_config_from_arch(yarn).items() if k != "rope_parameters"}
    legacy.update(rope_theta=10000.0, rope_scaling={"type": "yarn", **{k: v for k, v in YARN_ROPE.items()
                                                                        if k not in ("rope_type", "rope_theta")}})
    assert ds.arch_from_hf_config(legacy) == yarn
    fields = {f.name: f.default for f in dataclasses.fields(transformers.DeepseekV3Config)}
    assert {k: fields[k] for k in ds.DEFAULTS} == ds.DEFAULTS
    small = ds.arch_from_hf_config(hf_config(**SMALL).to_dict())
    assert (small.moe.expert_bias, small.moe.norm_eps, small.moe.scale, small.moe.groups, small.moe.group_topk,
            small.qkv_bias, small.mla_q_lora_rank) == (True, 1e-20, 2.5, 2, 1, False, 24)


@pytest.mark.parametrize("change,message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(topk_method="group_limited_greedy"), "topk_method 'group_limited_greedy'"),
    (dict(ep_size=2), "ep_size 2"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2"),
    (dict(n_group=4), "n_group=4"),
    (dict(topk_group=3), "topk_group=3"),
    (dict(n_shared_experts=0), "n_shared_experts"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), "rope_type 'llama3'"),
])
def test_unsupported_configs_are_clear_errors(change, message):
    with pytest.raises(MimoError, match=message):
        ds.arch_from_hf_config(dict(hf_config(**SMALL).to_dict(), **change))


def test_export_rejects_what_deepseek_v3_cannot_hold():
    arch = ds.arch_from_hf_config(hf_config(**SMALL).to_dict())
    for change, message in ((dict(mtp=MTPArch()), "arch.mtp's block is '\\*E'"),
                            (dict(moe=dataclasses.replace(arch.moe, score="softmax")), "arch.moe.score"),
                            (dict(moe=dataclasses.replace(arch.moe, shared_ffn=48)), "arch.moe.shared_ffn"),
                            (dict(pattern="+-+E+-"), "dense layer after an MoE one"),
                            (dict(pattern="*-+E"), "'\\*-\\+E' pairs its layers otherwise")):
        with pytest.raises(MimoError, match=message):
            ds.hf_config_from_arch(dataclasses.replace(arch, **change))


def test_misfit_checkpoint_names_the_tensor(tmp_path, misfits_named):
    """A missing latent norm, a wrong q_b_proj, a missing expert and a misfit per-expert tensor:
    one MimoError naming the checkpoint's tensor."""
    model = hf_model(SMALL)
    arch = ds.arch_from_hf_config(model.config.to_dict())
    good = model.state_dict()
    cases = {
        "model.layers.1.self_attn.kv_a_layernorm.weight": lambda s: s.pop("model.layers.1.self_attn.kv_a_layernorm.weight"),
        "model.layers.2.self_attn.q_b_proj.weight": lambda s: s.update(
            {"model.layers.2.self_attn.q_b_proj.weight": torch.zeros(72, 24)}),
        "expert 3": lambda s: [s.pop("model.layers.1.mlp.experts.down_proj")] and s.update(
            {f"model.layers.1.mlp.experts.{e}.down_proj.weight": torch.zeros(64, 32) for e in (0, 1, 2, 4, 5)}),
        "model.layers.2.mlp.experts.4.up_proj.weight": lambda s: [s.pop("model.layers.2.mlp.experts.gate_up_proj")] and s.update(
            {f"model.layers.2.mlp.experts.{e}.{p}.weight": torch.zeros(16 if (e, p) == (4, "up_proj") else 32, 64)
             for e in range(6) for p in ("gate_proj", "up_proj")}),
    }
    misfits_named(tmp_path, good, model.config.to_dict(), arch, cases)


def test_verify_hf_takes_a_deepseek_directory(checkpoints, capsys):
    """``mimo verify-hf DIR`` on a causal LM (here DeepSeek-V3.2 at ep 2) runs verify-llm's check
    on the directory's weights and answers as verify-hf."""
    import json

    from mimo.commands.cli import main

    assert main(["verify-hf", checkpoints["v32"], "--ep", "2", "--seed", "5"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["command"] == "verify-hf" and report["ok"] and report["export_exact"]
    assert (report["model_type"], report["ep"]) == ("deepseek_v32", 2)

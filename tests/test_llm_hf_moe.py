"""Hugging Face import / export of MoE causal LMs (small random Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mimo.core.errors import MimoError
from mimo.llm.hf import (
    HF_FAMILIES,
    HFCheckpoint,
    arch_from_hf_config,
    export_hf_state,
    hf_config_from_arch,
    hf_model_type,
    hf_name_map,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from mimo.llm.model import LLMStage
from mimo.llm.verify import pack_samples, randomize_, verify_llm

# sizes that are multiples of 8 (the grouped-GEMM kernel's alignment), F = 16 split over tp 2
SMALL = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts_per_tok=2)
MODELS = {
    # layer 1 dense (mlp_only_layers): the pattern *E*-
    "qwen3_moe": ("Qwen3MoeConfig", dict(SMALL, intermediate_size=24, moe_intermediate_size=16, num_experts=8,
                                         head_dim=8, mlp_only_layers=[1], tie_word_embeddings=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(SMALL, intermediate_size=24, moe_intermediate_size=16, num_experts=8,
                                         shared_expert_intermediate_size=24, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(SMALL, intermediate_size=16, num_local_experts=8)),
    "olmoe": ("OlmoeConfig", dict(SMALL, intermediate_size=16, num_experts=8, attention_bias=True, eos_token_id=None,
                                  pad_token_id=None)),
}


def hf_config(name: str):
    import transformers

    cls, kw = MODELS[name]
    return getattr(transformers, cls)(**kw)


def hf_model(name: str, seed: int = 0):
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32,
                                                          experts_implementation="eager")
    randomize_(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe-configs")
    out = {}
    for name in MODELS:
        hf_config(name).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


# ---------------------------------------------------------------- verify-llm at tp 1 and 2


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2])
def test_verify_llm(pools, config_dirs, name, tp):
    """Logits of ragged packed samples and the loss against Hugging Face (fp64 yardstick), the
    export equal to the state dict bit for bit; the weights go through save_pretrained's
    per-expert names."""
    report = verify_llm(config_dirs[name], pools(2), from_checkpoint=False, tp=tp, samples=5, max_len=16, seed=3)
    assert report["ok"] and report["export_exact"], report
    assert report["yardstick"]["checked"] == len(report["samples"]) + 1


# ---------------------------------------------------------------- one process


def _logits_match(stage: LLMStage, model, vocab: int) -> float:
    toks = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (1, 9, 13)]
    ours = stage(pack_samples(toks)).detach()
    cu = [0, 1, 10, 23]
    worst = 0.0
    with torch.no_grad():
        for i, t in enumerate(toks):
            want = model(input_ids=t[None]).logits[0]
            worst = max(worst, float(torch.linalg.vector_norm(ours[cu[i]:cu[i + 1]] - want) / torch.linalg.vector_norm(want)))
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_import_export_both_namings(tmp_path, name):
    """save_pretrained's per-expert checkpoint imports to Hugging Face's logits; our export has
    the state dict's names, order and values; written out (fused names) it imports to the same
    weights and loads into transformers as they are."""
    import transformers

    model = hf_model(name, seed=1)
    theirs = model.state_dict()
    model.save_pretrained(tmp_path / "legacy")
    keys = load_file(tmp_path / "legacy" / "model.safetensors").keys()
    assert any(".experts.0." in k for k in keys) and not any(k.endswith("gate_up_proj") for k in keys)
    arch = arch_from_hf_config(json.loads((tmp_path / "legacy" / "config.json").read_text()))
    assert hf_model_type(arch) == name
    stage = LLMStage(arch)
    load_hf_checkpoint(stage, str(tmp_path / "legacy"))
    assert _logits_match(stage, model, arch.vocab) <= 1e-5

    exported = export_hf_state(stage.full_state(), arch)
    assert list(exported) == list(theirs)
    assert all(torch.equal(exported[k], theirs[k]) for k in theirs)

    save_hf_checkpoint(str(tmp_path / "fused"), exported, hf_config_from_arch(arch))
    fused = LLMStage(arch)
    load_hf_checkpoint(fused, str(tmp_path / "fused"))
    legacy_state, fused_state = stage.full_state(), fused.full_state()
    assert all(torch.equal(fused_state[k], legacy_state[k]) for k in legacy_state)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fused", dtype=torch.float32)
    assert all(torch.equal(again.state_dict()[k], theirs[k]) for k in theirs)


def test_config_round_trip_and_names():
    for name in MODELS:
        cfg = hf_config(name).to_dict()
        arch = arch_from_hf_config(cfg)
        assert arch_from_hf_config(hf_config_from_arch(arch, name)) == arch
        assert arch.moe.aux_loss.kind == "none" and arch.moe.norm_eps == 0
    qwen3 = arch_from_hf_config(hf_config("qwen3_moe").to_dict())
    assert (qwen3.pattern, qwen3.ffn, qwen3.moe.ffn, qwen3.moe.norm_topk) == ("*E*-", 24, 16, False)
    assert hf_name_map(qwen3)["layers.1.experts.up_proj"] == ("model.layers.0.mlp.experts.gate_up_proj",)
    qwen2 = arch_from_hf_config(hf_config("qwen2_moe").to_dict())
    assert (qwen2.moe.shared_ffn, qwen2.moe.shared_gate, qwen2.qkv_bias, qwen2.o_bias) == (24, True, True, False)
    assert hf_name_map(qwen2)["layers.3.shared.up_proj"] == tuple(f"model.layers.1.mlp.shared_expert.{p}_proj.weight"
                                                                  for p in ("gate", "up"))
    mixtral = arch_from_hf_config(hf_config("mixtral").to_dict())
    assert (mixtral.moe.experts, mixtral.moe.ffn, mixtral.moe.norm_topk, mixtral.qkv_bias) == (8, 16, True, False)
    olmoe = arch_from_hf_config(hf_config("olmoe").to_dict())
    assert (olmoe.qk_norm, olmoe.qk_norm_full, olmoe.moe.norm_topk, olmoe.o_bias) == (True, True, False, True)


def test_unsupported_configs_are_clear_errors():
    for name, change, message in [
        ("mixtral", {"sliding_window": 8}, "sliding_window=8 < max_position_embeddings"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
    ]:
        with pytest.raises(MimoError, match=message):
            arch_from_hf_config({**hf_config(name).to_dict(), **change})
    mixtral = arch_from_hf_config(hf_config("mixtral").to_dict())
    mixtral.moe.norm_topk = False
    with pytest.raises(MimoError, match="arch.moe.norm_topk is False, mixtral needs True"):
        hf_config_from_arch(mixtral, "mixtral")
    mixtral.moe.score = "sigmoid"
    with pytest.raises(MimoError, match="no Hugging Face family fits") as e:
        hf_model_type(mixtral)
    # each family's reason once, a reason shared by families once with their names
    text = str(e.value)
    assert "arch.moe.score is 'sigmoid', mixtral needs 'softmax'" in text
    for name in HF_FAMILIES:
        assert text.count(f" {name}:") + text.count(f" {name},") == 1, (name, text)
    hybrid = copy.deepcopy(mixtral)
    hybrid.pattern = "M*EM*E"
    with pytest.raises(MimoError) as e:
        hf_model_type(hybrid)
    assert str(e.value).count("the pattern 'M*EM*E' is not") == 1


def _legacy_checkpoint(tmp_path, name: str, edit) -> str:
    model = hf_model(name, seed=2)
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = dict(load_file(path))
    edit(state)
    os.remove(path)
    save_file(state, path, metadata={"format": "pt"})
    return str(tmp_path)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.layers.0.mlp.experts.3.up_proj.weight"),
     r"no tensor model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight \(expert 3 of 'model\.layers\.0\.mlp\.experts\.gate_up_proj'"),
    (lambda s: s.update({"model.layers.1.mlp.experts.5.down_proj.weight": torch.zeros(32, 8)}),
     r"tensor 'model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight' has shape \(32, 8\), unlike expert 0's \(32, 16\)"),
    (lambda s: [s.pop(k) for k in list(s) if ".experts.7." in k and "layers.1" in k],
     r"tensor 'model\.layers\.1\.mlp\.experts\.gate_up_proj' has shape \(7, 32, 32\), but the model's "
     r"'layers\.3\.experts\.up_proj' \(dim 1 0:16, part 1 of 2\) \| 'layers\.3\.experts\.up_proj' \(dim 1 16:32, part 2 of 2\) "
     r"needs \(8, 32, 32\)"),
    (lambda s: s.pop("model.layers.0.mlp.gate.weight"), r"no tensor 'model\.layers\.0\.mlp\.gate\.weight'"),
], ids=["missing-expert", "misshaped-expert", "fewer-experts", "no-router"])
def test_misfit_expert_tensors_are_named(tmp_path, edit, message):
    path = _legacy_checkpoint(tmp_path, "qwen2_moe", edit)
    stage = LLMStage(arch_from_hf_config(HFCheckpoint(path).config))
    with pytest.raises(MimoError, match=message):
        load_hf_checkpoint(stage, path)


def test_mixtral_legacy_names(tmp_path):
    """Mixtral's save_pretrained names: block_sparse_moe.gate, experts.{e}.w1 / w3 / w2."""
    path = _legacy_checkpoint(tmp_path, "mixtral", lambda s: None)
    keys = set(HFCheckpoint(path).keys())
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys and "model.layers.0.block_sparse_moe.experts.0.w3.weight" in keys
    stage = LLMStage(arch_from_hf_config(HFCheckpoint(path).config))
    load_hf_checkpoint(stage, path)
    state = load_file(os.path.join(path, "model.safetensors"))
    up = stage.full_state()["layers.1.experts.up_proj"]
    assert torch.equal(up[2, :16], state["model.layers.0.block_sparse_moe.experts.2.w1.weight"])
    assert torch.equal(up[2, 16:], state["model.layers.0.block_sparse_moe.experts.2.w3.weight"])


# ---------------------------------------------------------------- OLMoE's QK-norm over TP: gradients


def olmoe_grads_case(path: str, tp: int, batch) -> dict | None:
    """Full gradients of the OLMoE import at tp (ranks 0..tp-1), after one backward."""
    import torch.distributed as dist

    from mimo.llm.model import build_stage, count_loss_tokens
    from mimo.llm.stage_runner import run_pipeline
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid
    from mimo.parallel.params import reduce_partial_grads

    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": 1, "pp": 1})
    stage = build_stage(arch_from_hf_config(HFCheckpoint(path).config), ParallelContext(grid, dist.get_rank(), grid.registry))
    if stage is None:
        return None
    load_hf_checkpoint(stage, path)
    run_pipeline(stage, grid, batch, num_loss_tokens=count_loss_tokens(batch), backward=True)
    reduce_partial_grads(stage.param_table())
    grads = stage.full_grads()
    return grads if stage.tp_rank == 0 else None


def test_olmoe_full_qk_norm_gradients_at_tp2(pools, tmp_path):
    """The all-reduced sum of squares of the full-width QK-norm differentiates like one process."""
    hf_model("olmoe", seed=5).save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(7)
    batch = pack_samples([torch.randint(0, 61, (n,), generator=gen) for n in (9, 1, 14)])
    one, two = ([r for r in pools(2).run(olmoe_grads_case, str(tmp_path), tp, batch) if r is not None][0] for tp in (1, 2))
    for name in ("layers.0.q_norm.weight", "layers.0.k_norm.weight", "layers.0.qkv.weight", "embed.weight"):
        assert torch.linalg.vector_norm(two[name] - one[name]) <= 1e-5 * torch.linalg.vector_norm(one[name]), name

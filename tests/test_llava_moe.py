"""LLaVA with a MoE text model (issue 21, point 7): ``LlavaConfig(text_config=Qwen3MoeConfig(...))``.

Import / export are exact: the model's own state dict (fused ``mlp.experts.gate_up_proj`` /
``down_proj``) and the per-expert ``experts.{e}.gate_proj`` names that ``save_pretrained`` and
older checkpoints store both import, and export writes the model's state dict bit for bit.
``mimo import-hf-llava --config`` (tower data parallel, the LLM's experts split over tp 2) then
``mimo export-hf`` gives back a directory ``LlavaForConditionalGeneration`` loads as the source.
Whole-model parity at world 1 against ``LlavaForConditionalGeneration`` with eager experts, the
dense parity test's data and procedure (``test_hf_llava``): loss and every gradient <= 1e-5;
aux-loss coefficient 0 on both sides (Hugging Face adds its balancing loss only with
``output_router_logits``; mimo's aux losses are checked against formulas in ``test_moe``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from mimo.commands.cli import main
from mimo.commands.hf_llava import NAMINGS, export_llava_grads, export_llava_state, import_llava_state, llava_arch, llava_modules, load_llava, save_llava
from mimo.core.testing import rel_err

from test_hf_llava import (
    CONVERSATIONS, IMAGE_TOKEN_ID, VOCAB, _hf_batch, _images, _mimo_step, assert_same_state, hf_model,
    make_tokenizer, write_parity_case, write_shards,
)

TOL = 1e-5
VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              image_size=32, patch_size=8)
MOE = dict(vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5, hidden_size=48, num_attention_heads=4,
           num_key_value_heads=2, head_dim=12, router_aux_loss_coef=0.0, output_router_logits=False)
TEXT = {
    # 6 experts, top 2 renormalised, QK-norm, GQA: the parity case
    "qwen3-moe": dict(model_type="qwen3_moe", num_hidden_layers=2, intermediate_size=80, moe_intermediate_size=24,
                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, **MOE),
    # a dense layer among the MoE ones (mlp_only_layers), gates not renormalised
    "qwen3-moe-dense-layer": dict(model_type="qwen3_moe", num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16,
                                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], **MOE),
    # a shared expert scaled by sigmoid(shared_expert_gate), q/k/v biases
    "qwen2-moe-shared": dict(model_type="qwen2_moe", num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=16,
                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, **MOE),
}


def llava_moe_config(case: str) -> dict:
    import transformers

    return transformers.LlavaConfig(vision_config=VISION, text_config=TEXT[case], image_token_id=IMAGE_TOKEN_ID,
                                    vision_feature_layer=-2, vision_feature_select_strategy="default").to_dict()


def per_expert_names(state: dict) -> dict:
    """The fused expert tensors as per-expert ``experts.{e}.gate_proj / up_proj / down_proj.weight``."""
    out = {}
    for k, v in state.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            base, f = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = v[e, :f].clone(), v[e, f:].clone()
        elif k.endswith(".mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------- import / export


@pytest.mark.parametrize("case", list(TEXT))
@pytest.mark.parametrize("experts", ["fused", "per-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_export_is_exact(case, experts, dtype):
    config = llava_moe_config(case)
    state = {k: v.to(dtype) for k, v in hf_model(config).state_dict().items()}
    source = per_expert_names(state) if experts == "per-expert" else state
    w = import_llava_state(source, config)
    assert w.naming is NAMINGS["current"] and w.arch.llm.moe is not None
    assert_same_state(export_llava_state(w), state)  # the model's own names, order and dtypes


def test_import_maps_experts_where_they_belong():
    config = llava_moe_config("qwen3-moe-dense-layer")
    state = hf_model(config).state_dict()
    arch = llava_arch(config).llm
    assert arch.pattern == "*E*-*E" and (arch.moe.experts, arch.moe.topk, arch.moe.ffn, arch.moe.norm_topk) == (4, 2, 16, False)
    w = import_llava_state(per_expert_names(state), config)
    up, down = w.llm["layers.5.experts.up_proj"], w.llm["layers.5.experts.down_proj"]  # HF layer 2's MoE
    fused = state["model.language_model.layers.2.mlp.experts.gate_up_proj"]
    assert up.shape == (4, 32, 48) and torch.equal(up, fused) and torch.equal(down, state["model.language_model.layers.2.mlp.experts.down_proj"])
    assert torch.equal(w.llm["layers.5.router.weight"], state["model.language_model.layers.2.mlp.gate.weight"])
    gate, _ = w.llm["layers.3.up_proj.weight"].chunk(2)  # the dense layer in between
    assert torch.equal(gate, state["model.language_model.layers.1.mlp.gate_proj.weight"])
    shared = import_llava_state(hf_model(llava_moe_config("qwen2-moe-shared")).state_dict(), llava_moe_config("qwen2-moe-shared"))
    assert shared.arch.llm.moe.shared_ffn == 32 and shared.arch.llm.moe.shared_gate


def test_save_pretrained_directory_round_trip(tmp_path, capsys):
    """transformers' own writer stores the experts per expert (legacy LLaVA prefixes): import reads
    them, export -> ``save_llava`` loads back as the source model, no key missing or unexpected."""
    from transformers import LlavaForConditionalGeneration

    config = llava_moe_config("qwen3-moe")
    model = hf_model(config)
    model.save_pretrained(tmp_path / "src")
    w = load_llava(str(tmp_path / "src"))
    assert w.naming is NAMINGS["legacy"]
    save_llava(str(tmp_path / "back"), export_llava_state(w), config)
    back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "back", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_same_state(back.state_dict(), model.state_dict())
    # the command without --config checks every tensor from the file headers
    assert main(["import-hf-llava", str(tmp_path / "src")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["naming"] == "legacy" and result["modules"]["language"]["arch"]["moe"]["experts"] == 6


def test_import_hf_llava_then_export_hf(tmp_path, capsys):
    """``import-hf-llava --config`` at a layout (tower dp 2, the LLM tp 2: each expert's inner size
    split over TP) -> ``export-hf`` of that checkpoint: the source's state dict exactly; ``--llm-only``
    loads as ``Qwen3MoeForCausalLM`` with the language model's tensors."""
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    config = llava_moe_config("qwen3-moe")
    model = hf_model(config, seed=3)
    model.save_pretrained(tmp_path / "llava")
    make_tokenizer(str(tmp_path / "tokenizer"))
    rng = np.random.default_rng(0)
    write_shards(str(tmp_path / "train-000000.tar"), [(t, _images(rng, n, 32)) for t, n in CONVERSATIONS[:2]])
    modules = llava_modules(config)
    modules["vision"]["parallel"] = {"tp": 1, "dp": 2}
    modules["language"]["parallel"] = {"tp": 2, "dp": 1}
    path = tmp_path / "mimo.yaml"
    path.write_text(yaml.safe_dump({
        "world_size": 2, "modules": modules,
        "data": {"shards": str(tmp_path / "train-000000.tar"), "tokenizer": str(tmp_path / "tokenizer"), "template": "chatml",
                 "max_sample_tokens": 512},
        "train": {"checkpoint": {"dir": str(tmp_path / "ckpt")}},
    }))
    assert main(["import-hf-llava", str(tmp_path / "llava"), "--config", str(path), "--out", str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    assert main(["export-hf", str(tmp_path / "imported"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["architecture"] == "LlavaForConditionalGeneration"
    back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_same_state(back.state_dict(), model.state_dict())  # the tower's unused last block from the source
    assert main(["export-hf", str(tmp_path / "imported"), "--out", str(tmp_path / "hf-llm"), "--llm-only"]) == 0
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-llm")
    assert type(lm).__name__ == "Qwen3MoeForCausalLM"
    want = {k: v for k, v in model.state_dict().items() if k.startswith("model.language_model.") or k == "lm_head.weight"}
    in_llava = {k if k == "lm_head.weight" else "model.language_model." + k[len("model."):]: v for k, v in lm.state_dict().items()}
    assert_same_state(in_llava, want)


# --------------------------------------------------------------------------- whole-model parity


@pytest.fixture(scope="module")
def parity_setup(tmp_path_factory):
    """The dense parity test's conversations and images, a Qwen3-MoE LLaVA saved by transformers."""
    return write_parity_case(tmp_path_factory.mktemp("qwen3-moe"), llava_moe_config("qwen3-moe"))


def _hf_forward(setup):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(setup["root"] / "llava"), attn_implementation="eager",
                                                          experts_implementation="eager", dtype=torch.float32)
    assert model.config.text_config.output_router_logits is False and model.config.text_config.router_aux_loss_coef == 0.0
    batch, labels = _hf_batch(setup)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                labels=labels)
    return model, out, labels


def test_whole_model_parity_with_hugging_face(pools, parity_setup):
    setup = parity_setup
    mimo = pools(1).run(_mimo_step, setup["mimo_config"], str(setup["root"] / "llava"))[0]
    assert sorted(i for mb in mimo["microbatches"] for i in mb) == list(range(len(CONVERSATIONS)))
    assert len(mimo["microbatches"]) == 2 and all(mimo["microbatches"])
    model, out, labels = _hf_forward(setup)
    out.loss.backward()
    assert mimo["loss_tokens"] == int((labels[:, 1:] != -100).sum())
    assert abs(mimo["loss"] - out.loss.item()) / out.loss.item() <= TOL

    w = import_llava_state(model.state_dict(), setup["config"])
    mapped = export_llava_grads(w, mimo["grads"]["vision"], mimo["grads"]["language"])
    want = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}
    errs = {}
    for name, g in want.items():
        if name.endswith("k_proj.bias"):  # exactly 0 (softmax ignores q.b_k): rounding noise against the key weights, as in test_hf_llava
            scale = torch.linalg.vector_norm(want[name.replace("k_proj.bias", "k_proj.weight")].double()).item() or 1.0
            errs[name] = torch.linalg.vector_norm((mapped[name] - g).double()).item() / scale
        else:
            errs[name] = rel_err(mapped[name], g)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
    # teeth: every layer's router and every expert of its stack got a gradient (6 experts, top 2, ~200 tokens)
    for j in range(2):
        mlp = model.model.language_model.layers[j].mlp
        assert torch.linalg.vector_norm(mlp.gate.weight.grad) > 0
        assert (torch.linalg.vector_norm(mlp.experts.down_proj.grad.flatten(1), dim=1) > 0).all()


def test_parity_would_catch_routing_bugs(parity_setup):
    """What the parity test compares depends on the routing: top-1 instead of top-2, or gates not
    renormalised, move the loss and the experts' and router's gradients by more than the tolerance."""
    setup = parity_setup
    model, out, labels = _hf_forward(setup)
    batch, _ = _hf_batch(setup)
    layers = model.model.language_model.layers
    watched = [p for layer in layers for p in (layer.mlp.gate.weight, layer.mlp.experts.down_proj)]
    base_loss, base_grads = out.loss.item(), torch.autograd.grad(out.loss, watched)
    for attr, bug in (("top_k", 1), ("norm_topk_prob", False)):
        for layer in layers:
            setattr(layer.mlp.gate, attr, bug)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                     labels=labels).loss
        grads = torch.autograd.grad(loss, watched)
        assert abs(loss.item() - base_loss) / base_loss > 2 * TOL, (attr, loss.item(), base_loss)
        assert min(rel_err(g, b) for g, b in zip(grads, base_grads)) > 100 * TOL, attr
        for layer in layers:
            setattr(layer.mlp.gate, attr, {"top_k": 2, "norm_topk_prob": True}[attr])

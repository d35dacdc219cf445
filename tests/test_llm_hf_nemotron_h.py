"""Hugging Face Nemotron-H import / export and ``mimo verify-llm`` (a small random
``NemotronHForCausalLM``: Mamba-2, attention without RoPE, relu2 MLP, MoE with sigmoid scores,
groups, e_score_correction_bias, a shared expert and latent projections)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mimo.core.errors import MimoError
from mimo.core.testing import rel_err
from mimo.llm import hf_nemotron_h as nh
from mimo.llm.hf import HFCheckpoint, export_hf_state, load_hf_checkpoint, read_config_json, save_hf_checkpoint
from mimo.llm.model import LLMStage
from mimo.llm.router import Router
from mimo.llm.verify import pack_samples, random_samples, randomize_, verify_llm

# sizes multiples of 8 (torch._grouped_mm); n_groups 2 (B, C split over tp 2), 8 experts in 2
# routing groups of which a token's 2 experts come from the best one; chunk 8 < the samples
SMALL = dict(vocab_size=96, hidden_size=64, hybrid_override_pattern="ME*E-", num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
             ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=2,
             topk_group=1, routed_scaling_factor=2.5)
# B, C replicated over tp 2 (one group), MLP biases, no MoE; dt floored at 1e-3 (SMALL: the default
# time_step_limit (0, inf), no floor)
PLAIN = dict(SMALL, hybrid_override_pattern="M-*M", n_groups=1, mlp_bias=True, time_step_limit=(1e-3, float("inf")))


def hf_config(**kw):
    import transformers

    return transformers.NemotronHConfig(**kw)


@torch.no_grad()
def hf_model(kw: dict, seed: int = 0):
    """A random Nemotron-H where every path shows: ``randomize_``d weights, a non-zero
    e_score_correction_bias, and two Mamba heads whose dt sits near 1e-4: below PLAIN's floor
    time_step_limit[0] = 1e-3 (the clamp decides), above SMALL's 0 (no clamp, as transformers >= 5.25)."""
    import transformers

    model = transformers.NemotronHForCausalLM(hf_config(**kw)).eval()
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            layer.mixer.dt_bias[:2] = -9.0  # softplus(dt) ~ 1e-4: PLAIN's floor 1e-3 decides, SMALL has none
    return model


def save_state_dict_names(model, path) -> None:
    """A checkpoint under ``state_dict`` names (``model.``, fused experts), as export writes."""
    save_hf_checkpoint(str(path), model.state_dict(), model.config.to_dict())


def packed_logits(stage: LLMStage, toks):
    batch = pack_samples(toks)
    with torch.no_grad():
        out = stage.gather_logits(stage.eval()(batch))
    cu = batch.cu_seqlens.tolist()
    return [out[cu[i] : cu[i + 1]] for i in range(len(toks))]


def worst_err(model, stage, vocab: int, seed: int = 2) -> float:
    """Largest per-sample relative error of our packed logits against the model's, sample by sample."""
    toks = random_samples(vocab, 6, 20, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = [model(input_ids=t[None]).logits[0] for t in toks]
    return max(rel_err(a, b) for a, b in zip(packed_logits(stage, toks), ref))


# ---------------------------------------------------------------- import / export


@pytest.mark.parametrize("naming", ["save_pretrained", "state_dict"])
def test_import_matches_and_export_reproduces_state_dict(tmp_path, naming):
    """save_pretrained writes backbone. and per-expert names, export the state_dict's: import
    reads both; our packed logits match Hugging Face's per sample; export is its state dict bit
    for bit, and from_pretrained loads what we write."""
    import transformers

    model = hf_model(SMALL)
    if naming == "save_pretrained":
        model.save_pretrained(tmp_path)
        keys = HFCheckpoint(str(tmp_path)).keys()
        assert any(k.startswith("backbone.") for k in keys) and any(".experts.0.up_proj.weight" in k for k in keys)
    else:
        save_state_dict_names(model, tmp_path)
    arch = nh.arch_from_hf_config(read_config_json(str(tmp_path / "config.json")))
    stage = LLMStage(arch)
    load_hf_checkpoint(stage, str(tmp_path))
    assert worst_err(model, stage, arch.vocab) < 1e-5

    state = {**stage.full_state(), **{n: b for n, b in stage.named_buffers() if n.endswith(nh.BUFFERS)}}
    exported = export_hf_state(state, arch)
    theirs = model.state_dict()
    assert list(exported) == list(theirs)
    assert all(torch.equal(exported[k], theirs[k]) for k in theirs)

    save_hf_checkpoint(str(tmp_path / "ours"), exported, nh.hf_config_from_arch(arch))
    back = transformers.NemotronHForCausalLM.from_pretrained(str(tmp_path / "ours")).state_dict()
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)


def test_correction_bias_changes_routing():
    """e_score_correction_bias steers selection: with it, Hugging Face's router picks other
    experts than without, and ours (expert_bias imported) picks exactly Hugging Face's."""
    model = hf_model(SMALL)
    arch = nh.arch_from_hf_config(model.config.to_dict())
    gate = model.model.layers[1].mixer.gate
    x_TD = torch.randn(64, arch.hidden, generator=torch.Generator().manual_seed(5))
    router = Router(arch.hidden, arch.moe)
    with torch.no_grad():
        router.weight.copy_(gate.weight)
        router.expert_bias.copy_(gate.e_score_correction_bias)
        _, w_hf, idx_hf = gate(x_TD)
        ours = router.route(router.logits(x_TD), None)
        bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        _, _, idx_unbiased = gate(x_TD)
        gate.e_score_correction_bias.copy_(bias)
    same = lambda a, b: (a.sort(-1).values == b.sort(-1).values).all(-1)  # noqa: E731
    assert (~same(idx_hf, idx_unbiased)).sum() >= 8  # the bias changes many tokens' experts
    assert same(ours.idx_TK, idx_hf).all()
    order_hf, order_ours = idx_hf.argsort(-1), ours.idx_TK.argsort(-1)
    torch.testing.assert_close(ours.gate_TK.gather(1, order_ours), w_hf.gather(1, order_hf), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- verify-llm


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoint directories of the two random models (non-zero correction bias, tiny dt: PLAIN's clamped)."""
    root = tmp_path_factory.mktemp("nemotron-h")
    out = {}
    for name, kw in (("small", SMALL), ("plain", PLAIN)):
        hf_model(kw).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("name,tp", [("small", 1), ("small", 2), ("plain", 2)])
def test_verify_llm(pools, checkpoints, name, tp):
    report = verify_llm(checkpoints[name], pools(2), from_checkpoint=True, tp=tp, samples=5, max_len=20, seed=3)
    assert report["ok"], report
    assert report["export_exact"] and report["model_type"] == "nemotron_h"


def test_verify_llm_random_init(pools, tmp_path):
    """From config.json alone (verify-llm's random weights, saved with save_pretrained)."""
    hf_config(**SMALL).save_pretrained(tmp_path)
    report = verify_llm(str(tmp_path), pools(2), from_checkpoint=False, tp=2, samples=4, max_len=16, seed=1)
    assert report["ok"] and report["export_exact"], report


# ---------------------------------------------------------------- config and errors


def test_config_round_trip_and_defaults():
    """arch -> config.json -> arch is the identity; NemotronHConfig reads our config; our
    defaults are NemotronHConfig's; older key spellings read the same; dt's floor is
    time_step_limit[0] (0 by default), not time_step_min."""
    import transformers

    arch = nh.arch_from_hf_config(hf_config(**SMALL).to_dict())
    assert (arch.rope, arch.tie_embeddings, arch.mamba_dt_min, arch.moe.expert_bias, arch.moe.norm_eps) == (
        False, False, 0.0, True, 1e-20)
    assert nh.arch_from_hf_config(hf_config(**PLAIN).to_dict()).mamba_dt_min == 1e-3
    assert nh.arch_from_hf_config(hf_config(**SMALL, time_step_min=0.01).to_dict()).mamba_dt_min == 0.0
    cfg = nh.hf_config_from_arch(arch)
    assert nh.arch_from_hf_config(cfg) == arch
    assert nh.arch_from_hf_config(transformers.NemotronHConfig(**{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()) == arch
    fields = {f.name: f.default for f in dataclasses.fields(transformers.NemotronHConfig)}
    assert {k: fields[k] for k in nh.DEFAULTS} == nh.DEFAULTS
    legacy = {k: v for k, v in cfg.items() if k not in nh.LEGACY_KEYS and k != "layers_block_type"}
    legacy.update({nh.LEGACY_KEYS[k]: cfg[k] for k in nh.LEGACY_KEYS})
    assert nh.arch_from_hf_config(legacy) == arch
    assert nh.arch_from_hf_config(hf_config(**SMALL, tie_word_embeddings=True).to_dict()).tie_embeddings is False


@pytest.mark.parametrize("change,message", [
    (dict(use_bias=True), "use_bias"),
    (dict(use_conv_bias=False), "use_conv_bias"),
    (dict(mlp_bias=True), "mlp_bias: true with MoE layers"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu'"),
    (dict(time_step_limit=[0.0, 0.1]), "time_step_limit"),
])
def test_unsupported_configs_are_clear_errors(change, message):
    with pytest.raises(MimoError, match=message):
        nh.arch_from_hf_config(dict(hf_config(**SMALL).to_dict(), **change))


def test_export_rejects_what_nemotron_h_cannot_hold():
    arch = nh.arch_from_hf_config(hf_config(**SMALL).to_dict())
    for change, message in ((dict(rope=True), "arch.rope: false"),
                            (dict(moe=dataclasses.replace(arch.moe, score="softmax")), "arch.moe.score")):
        with pytest.raises(MimoError, match=message):
            nh.hf_config_from_arch(dataclasses.replace(arch, **change))


def test_misfit_checkpoint_names_the_tensor(tmp_path, misfits_named):
    """A wrong in_proj (split into our tensors on import), a missing expert, an extra tensor:
    one MimoError naming the checkpoint's tensor."""
    model = hf_model(SMALL)
    arch = nh.arch_from_hf_config(model.config.to_dict())
    good = model.state_dict()
    cases = {
        "model.layers.0.mixer.in_proj.weight": lambda s: s.update({"model.layers.0.mixer.in_proj.weight": torch.zeros(327, 64)}),
        "for expert 3": lambda s: [s.pop("model.layers.1.mixer.experts.up_proj")] and s.update(
            {f"model.layers.1.mixer.experts.{e}.up_proj.weight": torch.zeros(32, 32) for e in (0, 1, 2, 4)}),
        "model.layers.3.mixer.gate.e_score_correction_bias": lambda s: s.pop("model.layers.3.mixer.gate.e_score_correction_bias"),
        "model.layers.9.norm.weight": lambda s: s.update({"model.layers.9.norm.weight": torch.ones(64)}),
    }
    misfits_named(tmp_path, good, model.config.to_dict(), arch, cases)

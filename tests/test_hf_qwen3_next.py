"""Hugging Face ``Qwen3NextForCausalLM`` (``model_type`` qwen3_next; issue 48 item 3) through
``mimo.llm.hf``'s qwen3_next family: config.json -> arch (layer pattern from ``layer_types`` and
``mlp_only_layers``, zero-centred norms, gated attention with partial rotary, GDN head counts, MoE
with a gated shared expert and ``norm_topk_prob``), the checkpoint imported as ``init: {hf: DIR}``
does (``load_hf_checkpoint``), exported as ``mimo export-hf --llm-only`` writes it
(``export_hf_state`` + ``save_hf_checkpoint``), and transformers loading the result.

The model is tiny and random (``randomize_``: routers with clear margins) with odd head counts
(3 query heads over 1 kv head, 3 GDN key heads over 9 value heads), a linear / full mix that is
not 3:1, a dense layer among MoE ones, a shared expert and a partial rotary factor of 0.5.
Logits: our model on one THD pack of all samples against transformers run on each sample alone
(its torch GDN fallback ignores packed boundaries), by the fp64 yardstick (transformers also in
fp64, its casts to fp32 kept fp64 while it runs: ``fp64_kept``).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from mimo.core.errors import MimoError
from mimo.core.testing import Yardstick, fp64_kept
from mimo.llm import hf
from mimo.llm.model import LLMStage
from mimo.llm.verify import pack_samples, randomize_, verify_llm


from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention", "linear_attention"]
SMALL = dict(vocab_size=53, hidden_size=32, intermediate_size=40, num_hidden_layers=5, num_attention_heads=3,
             num_key_value_heads=1, head_dim=8, linear_num_key_heads=3, linear_num_value_heads=9,
             linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=3, num_experts=5,
             num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=16,
             norm_topk_prob=True, layer_types=LAYER_TYPES, mlp_only_layers=[2], rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
CASES = {"renorm": {}, "no-renorm-tied": dict(norm_topk_prob=False, tie_word_embeddings=True, attention_bias=True)}
LENS = [9, 1, 70, 4]  # one of length 1, one over transformers' GDN chunk of 64


def _config(case: str) -> Qwen3NextConfig:
    return Qwen3NextConfig(**{**SMALL, **CASES[case]})


def _model(case: str, seed: int = 0) -> Qwen3NextForCausalLM:
    """Random weights; eager attention and experts (the plainest paths, which also run in fp64)."""
    model = AutoModelForCausalLM.from_config(_config(case), dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager")
    randomize_(model, seed)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """(case, transformers' model, its save_pretrained directory)."""
    model = _model(request.param)
    path = tmp_path_factory.mktemp(f"qwen3-next-{request.param}")
    model.save_pretrained(path)
    return request.param, model, str(path)


def test_config_gives_the_arch(saved):
    case, model, path = saved
    arch = hf.arch_from_hf_config(hf.read_config_json(f"{path}/config.json"))
    assert arch.validate("arch") == []
    assert arch.pattern == "GE*E G-*EGE".replace(" ", "")
    assert (arch.heads, arch.kv_heads, arch.head_dim, arch.rotary_fraction) == (3, 1, 8, 0.5)
    assert (arch.gdn_heads, arch.gdn_v_heads, arch.gdn_head_dim, arch.gdn_v_head_dim, arch.conv_kernel) == (3, 9, 8, 4, 3)
    assert arch.norm_zero_centred and arch.attn_output_gate and arch.qk_norm and not arch.qk_norm_full
    m = arch.moe
    assert (m.experts, m.topk, m.ffn, m.shared_ffn, m.shared_gate, m.score) == (5, 2, 12, 16, True, "softmax")
    assert m.norm_topk == (case == "renorm") and arch.tie_embeddings == (case != "renorm")
    assert hf.hf_model_type(arch) == "qwen3_next"
    again = hf.arch_from_hf_config(hf.hf_config_from_arch(arch))
    assert again == arch


def _imported(path: str) -> LLMStage:
    """The checkpoint as ``init: {hf: DIR}`` loads it (one process)."""
    arch = hf.arch_from_hf_config(hf.read_config_json(f"{path}/config.json"))
    torch.manual_seed(0)
    stage = LLMStage(arch)
    hf.load_hf_checkpoint(stage, path)
    return stage


def test_import_export_gives_back_every_tensor(saved, tmp_path):
    """import -> export (``export-hf --llm-only``'s writer) -> transformers loads it as
    Qwen3NextForCausalLM with every tensor bit-equal."""
    _, model, path = saved
    stage = _imported(path)
    arch = stage.arch
    out = tmp_path / "exported"
    hf.save_hf_checkpoint(str(out), hf.export_hf_state(stage.full_state(), arch), hf.hf_config_from_arch(arch))
    back = Qwen3NextForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(back).__name__ == "Qwen3NextForCausalLM" and back.config.layer_types == LAYER_TYPES
    theirs, ours = model.state_dict(), back.state_dict()
    assert list(ours) == list(theirs)
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    # the export's own state dict, in transformers' order (the grouped GDN projections joined)
    assert list(hf.export_hf_state(stage.full_state(), arch)) == list(theirs)


def assert_logits_match_per_sample(stage: LLMStage, model, lens=LENS) -> None:
    """The stage's logits on one pack of samples of ``lens`` tokens equal ``model``'s run on each
    sample alone (its GDN ignores packed boundaries), by the yardstick against its fp64 run."""
    gen = torch.Generator().manual_seed(5)
    toks = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lens]
    batch = pack_samples(toks)
    with torch.no_grad():
        logits = stage(batch)[:, : stage.arch.vocab]
        ref = [model(input_ids=t[None]).logits[0] for t in toks]
        model64 = copy.deepcopy(model).double()
        with fp64_kept():
            ref64 = [model64(input_ids=t[None]).logits[0] for t in toks]
    assert ref64[0].dtype == torch.float64
    ys = Yardstick(1e-5)
    cu = batch.cu_seqlens.tolist()
    for i in range(len(toks)):
        ys.check(f"logits of sample {i}", logits[cu[i] : cu[i + 1]], ref[i], ref64[i])
    assert ys.ok, ys.summary(5)


def test_logits_equal_transformers_per_sample(saved):
    _, model, path = saved
    assert_logits_match_per_sample(_imported(path).eval(), model)


def test_import_hf_command_and_export_hf_llm_only(pools, saved, tmp_path, capsys):
    """``mimo import-hf DIR --yaml``: the LLM's modules section (a valid config); ``--config --out``:
    a mimo checkpoint; ``mimo export-hf --llm-only``: transformers loads it as Qwen3NextForCausalLM
    with every tensor of the source."""
    import yaml

    from mimo.commands.cli import main
    from mimo.commands.export_hf import export_hf
    from mimo.commands.import_hf import causal_lm_to_checkpoint
    from mimo.compose.config import config_from_dict

    _, model, path = saved
    assert main(["import-hf", path, "--yaml", str(tmp_path / "modules.yaml")]) == 0
    modules = yaml.safe_load((tmp_path / "modules.yaml").read_text())["modules"]
    raw = {"world_size": 1, "modules": modules, "data": {"source": "synthetic", "max_sample_tokens": 256}}
    config = config_from_dict(raw)
    assert config.llm.arch == hf.arch_from_hf_config(hf.read_config_json(f"{path}/config.json")) and config.llm.init.hf == path
    modules["language"].pop("init")  # the conversion loads the directory whatever the config's init says
    (tmp_path / "mimo.yaml").write_text(yaml.safe_dump(raw))
    result = causal_lm_to_checkpoint(path, str(tmp_path / "mimo.yaml"), [], str(tmp_path / "ckpt"), pool=pools(1))
    exported = export_hf(result["out"], str(tmp_path / "hf"), llm_only=True)
    assert exported["architecture"] == "Qwen3NextForCausalLM"
    back = Qwen3NextForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    theirs, ours = model.state_dict(), back.state_dict()
    assert list(ours) == list(theirs) and [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    capsys.readouterr()


EVEN = dict(num_attention_heads=6, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=6)


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_llm(pools, tmp_path, tp):
    """``mimo verify-llm`` (the plain-LLM verify; ``verify-hf`` is Qwen3-VL's) takes the family; at
    tp 2 with head counts tp divides (attention and GDN heads split)."""
    Qwen3NextConfig(**{**SMALL, **(EVEN if tp == 2 else {})}).save_pretrained(tmp_path)
    report = verify_llm(str(tmp_path), pools(2), from_checkpoint=False, tp=tp, samples=4, max_len=20, seed=3)
    assert report["ok"] and report["export_exact"], report


def test_what_export_refuses():
    arch = hf.arch_from_hf_config(_config("renorm").to_dict())
    for change, says in ((dict(norm_zero_centred=False), "norm_zero_centred"), (dict(qk_norm=False), "QK-norm"),
                         (dict(pattern="G-*"), re.escape("'G' or '*' then '-' or 'E'"))):
        bad = copy.deepcopy(arch)
        for k, v in change.items():
            setattr(bad, k, v)
        with pytest.raises(MimoError, match=says):
            hf.hf_config_from_arch(bad, "qwen3_next")
    plain = hf.arch_from_hf_config({"model_type": "qwen3", **{k: v for k, v in SMALL.items() if not k.startswith("linear")}})
    assert hf.hf_model_type(plain) == "qwen3"  # the families do not overlap
    plain.norm_zero_centred = True  # Qwen3-Next's norms: not Qwen3's
    with pytest.raises(MimoError, match="qwen3_next takes it"):
        hf.hf_config_from_arch(plain, "qwen3")

"""Hugging Face Qwen3.5 and Qwen3.5-MoE (issue 48 item 3): the VLMs ``Qwen3_5ForConditionalGeneration``
/ ``Qwen3_5MoeForConditionalGeneration`` and their text-only forms ``Qwen3_5ForCausalLM``
(``qwen3_5_text``) / ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe_text``), through ``mimo.llm.hf``'s
qwen3_5 families, the Qwen3-VL path of ``mimo import-hf`` / ``export-hf`` and ``mimo verify-hf``.

Tiny random models built with transformers' config classes: 5 decoder layers of types linear,
full, full, linear, linear (not 3:1), partial rotary 0.5, M-RoPE sections [1, 2, 1] (not the
default), split GDN projections. "Odd" sizes: 3 query heads over 1 kv head, 3 GDN key heads over 9
value heads, 3 vision heads; "even" ones (tp 2 divides them): 4 / 2, 2 / 6 and 2. The MoE: 4
experts (top 2) in every layer, a shared expert and its sigmoid gate, a tied head.

* Text forms (odd sizes): config.json -> arch -> config.json; ``init: {hf: DIR}`` import ->
  export bit-equal through ``from_pretrained``; logits per sample equal transformers' in fp32 by
  the fp64 yardstick (max(1e-5, 4x transformers' own fp32 error)); ``mimo import-hf`` and
  ``export-hf --llm-only``; ``verify-llm`` at tp 1 and tp 2 (even sizes).
* VLMs: the modules section of ``import-hf --yaml`` (a tower without deepstack, an LLM with
  M-RoPE and no deepstack); import -> mimo checkpoint (dense at world 1, MoE at tp 2) -> export
  -> ``from_pretrained`` of the same class, every tensor equal; ``verify-hf`` (images of two
  sizes, a video, text; logits, loss, every gradient) dense (odd, with weights) at tp 1, MoE
  (even) at tp 2 and ep 2.
* Planted bugs (vision tokens at 1-D positions, a GDN layer's q / k rows swapped) fail verify-hf
  by over 100x its bound (measured: thousands).
* Errors: a configured arch unlike the checkpoint's names the field; export refuses what a
  family cannot hold; ``--ep`` of a dense model.

Gradients of a Gated DeltaNet model in fp32 carry noise near 1e-4 that transformers' and mimo's
chunked delta rules amplify by different factors (one up to several times the other; measured
while writing this: mimo in fp64 against transformers in fp64 within ~1e-6 on every gradient), so
``verify-hf`` bounds them with its floor ``GDN_GRAD_FLOOR`` (5e-4: the amplification depends on the
CPU's kernels, AVX-512 ones doubling it) and everything else at its
default ``tol`` (the fp64 run kept fp64: ``fp64_kept``); the tests run it at its defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch
import yaml

from mimo.commands.cli import main
from mimo.core.errors import MimoError
from mimo.llm import hf
from mimo.llm.verify import randomize_, verify_llm

from test_hf_qwen3_next import _imported, assert_logits_match_per_sample

import transformers

LAYER_TYPES = ["linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention"]
ROPE = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 2, 1],
        "mrope_interleaved": True}
ODD = dict(num_attention_heads=3, num_key_value_heads=1, linear_num_key_heads=3, linear_num_value_heads=9)
EVEN = dict(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=6)
TEXT = dict(vocab_size=67, hidden_size=32, num_hidden_layers=5, head_dim=16, linear_key_head_dim=8,
            linear_value_head_dim=4, linear_conv_kernel_dim=3, layer_types=LAYER_TYPES, rms_norm_eps=1e-6,
            max_position_embeddings=1024, rope_parameters=ROPE)
DENSE = dict(TEXT, intermediate_size=40)
MOE = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=16)
VISION = dict(depth=2, hidden_size=24, intermediate_size=20, out_hidden_size=32, spatial_merge_size=2,
              num_position_embeddings=16, patch_size=4, temporal_patch_size=2)
IDS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=58, vision_end_token_id=59)
TEXT_MODELS = {  # name: (config class, text config, tied)
    "dense": ("Qwen3_5TextConfig", dict(DENSE, **ODD), False),
    "moe": ("Qwen3_5MoeTextConfig", dict(MOE, **ODD), True),
}
VLMS = {  # name: (config class, text config, vision heads, tied, world size (= tp) of the import)
    "dense": ("Qwen3_5Config", dict(DENSE, **ODD), 3, False, 1),
    "moe": ("Qwen3_5MoeConfig", dict(MOE, **EVEN), 2, True, 2),
}
ARCH = {"dense": ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
        "moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")}
PATTERN = {"dense": "G-*-*-G-G-", "moe": "GE*E*EGEGE"}
SOURCE_FILES = {"tokenizer_config.json": '{"model_max_length": 1024}'}
LENS = [9, 1, 70, 4]  # one of length 1, one over transformers' GDN chunk of 64


def _text_config(name: str, **changes):
    cls, text, tied = TEXT_MODELS[name]
    return getattr(transformers, cls)(**{**text, **changes}, tie_word_embeddings=tied)


def _vlm_config(name: str):
    cls, text, heads, tied, _ = VLMS[name]
    return getattr(transformers, cls)(text_config=text, vision_config=dict(VISION, num_heads=heads),
                                      tie_word_embeddings=tied, **IDS)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """{name: (transformers' causal LM, its save_pretrained directory)}: random weights
    (``randomize_``: routers with clear margins), eager attention and experts."""
    out = {}
    for name in TEXT_MODELS:
        model = transformers.AutoModelForCausalLM.from_config(
            _text_config(name), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
        randomize_(model, 0)
        path = str(tmp_path_factory.mktemp(f"qwen3_5-text-{name}"))
        model.save_pretrained(path)
        out[name] = (model.eval(), path)
    return out


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    """{name: directory}: each VLM with random weights (``randomize_vlm_``) saved by transformers
    beside a tokenizer file; "moe config": the MoE's config.json alone (verify-hf draws weights)."""
    from mimo.commands.verify_hf import randomize_vlm_

    out = {}
    for name in VLMS:
        model = getattr(transformers, ARCH[name][1])(_vlm_config(name))
        randomize_vlm_(model, 3)
        out[name] = str(tmp_path_factory.mktemp(f"qwen3_5-vlm-{name}"))
        model.save_pretrained(out[name])
        for file, text in SOURCE_FILES.items():
            with open(os.path.join(out[name], file), "w") as f:
                f.write(text)
    out["moe config"] = str(tmp_path_factory.mktemp("qwen3_5-vlm-moe-config"))
    _vlm_config("moe").save_pretrained(out["moe config"])
    return out


def _same_tensors(want: dict, got: dict) -> None:
    assert list(got) == list(want)
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, unequal[:5]


# ---------------------------------------------------------------- the text forms


@pytest.mark.parametrize("name", list(TEXT_MODELS))
def test_config_gives_the_arch(texts, name):
    _, path = texts[name]
    arch = hf.arch_from_hf_config(hf.read_config_json(f"{path}/config.json"))
    assert arch.validate("arch") == [] and arch.pattern == PATTERN[name]
    assert (arch.heads, arch.kv_heads, arch.head_dim, arch.rotary_fraction) == (3, 1, 16, 0.5)
    assert arch.mrope_section == [1, 2, 1]
    assert (arch.gdn_heads, arch.gdn_v_heads, arch.gdn_head_dim, arch.gdn_v_head_dim) == (3, 9, 8, 4)
    assert arch.conv_kernel == 3
    assert arch.norm_zero_centred and arch.attn_output_gate and arch.qk_norm and not arch.deepstack_layers
    if name == "moe":
        m = arch.moe
        assert (m.experts, m.topk, m.ffn, m.shared_ffn, m.shared_gate, m.norm_topk) == (4, 2, 12, 16, True, True)
        assert arch.tie_embeddings
    assert hf.hf_model_type(arch) == f"qwen3_5{'_moe' if name == 'moe' else ''}_text"
    cfg = hf.hf_config_from_arch(arch)
    assert cfg["architectures"] == [ARCH[name][0]] and hf.arch_from_hf_config(cfg) == arch
    # every key written is one of transformers' config class (it would keep any other as a stray attribute)
    cls = getattr(transformers, TEXT_MODELS[name][0])
    assert set(cfg) - {"model_type"} <= {f.name for f in dataclasses.fields(cls)}
    assert cls(**{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()["rope_parameters"] == ROPE
    # transformers' defaults where a key is missing: mrope [11, 11, 10], partial rotary 0.25
    bare = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    default = hf.arch_from_hf_config({**bare, "head_dim": 256})
    assert (default.mrope_section, default.rotary_fraction) == ([11, 11, 10], 0.25)


@pytest.mark.parametrize("name", list(TEXT_MODELS))
def test_import_export_gives_back_every_tensor(texts, name, tmp_path):
    model, path = texts[name]
    stage = _imported(path)
    arch = stage.arch
    hf.save_hf_checkpoint(str(tmp_path), hf.export_hf_state(stage.full_state(), arch), hf.hf_config_from_arch(arch))
    cls = getattr(transformers, ARCH[name][0])
    back = cls.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(back) is cls and back.config.layer_types == LAYER_TYPES
    _same_tensors(model.state_dict(), back.state_dict())
    assert list(hf.export_hf_state(stage.full_state(), arch)) == list(model.state_dict())


@pytest.mark.parametrize("name", list(TEXT_MODELS))
def test_logits_equal_transformers_per_sample(texts, name):
    model, path = texts[name]
    assert_logits_match_per_sample(_imported(path).eval(), model, LENS)


def test_import_hf_command_and_export_hf_llm_only(pools, texts, tmp_path, capsys):
    """``mimo import-hf DIR --yaml``: one hybrid module; ``--config --out``: a mimo checkpoint;
    ``export-hf --llm-only``: transformers loads it with every tensor of the source."""
    from mimo.commands.export_hf import export_hf
    from mimo.commands.import_hf import causal_lm_to_checkpoint
    from mimo.compose.config import config_from_dict

    model, path = texts["moe"]
    assert main(["import-hf", path, "--yaml", str(tmp_path / "modules.yaml")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["architecture"] == "Qwen3_5MoeForCausalLM"
    modules = yaml.safe_load((tmp_path / "modules.yaml").read_text())["modules"]
    raw = {"world_size": 1, "modules": modules, "data": {"source": "synthetic", "max_sample_tokens": 256}}
    assert config_from_dict(raw).llm.arch == hf.arch_from_hf_config(hf.read_config_json(f"{path}/config.json"))
    (tmp_path / "mimo.yaml").write_text(yaml.safe_dump(raw))
    result = causal_lm_to_checkpoint(path, str(tmp_path / "mimo.yaml"), [], str(tmp_path / "ckpt"), pool=pools(1))
    exported = export_hf(result["out"], str(tmp_path / "hf"), llm_only=True)
    assert exported["architecture"] == "Qwen3_5MoeForCausalLM"
    back = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    _same_tensors(model.state_dict(), back.state_dict())
    capsys.readouterr()


@pytest.mark.parametrize("name,tp", [("dense", 1), ("moe", 2)])
def test_verify_llm(pools, tmp_path, name, tp):
    """``mimo verify-llm`` (the causal-LM verify) takes the text forms; at tp 2 with even head counts."""
    _text_config(name, **(EVEN if tp == 2 else {})).save_pretrained(tmp_path)
    report = verify_llm(str(tmp_path), pools(2), from_checkpoint=False, tp=tp, samples=4, max_len=20, seed=3)
    assert report["ok"] and report["export_exact"], report


# ---------------------------------------------------------------- the VLMs


def _modules(path: str, tmp_path, capsys) -> dict:
    out = tmp_path / "modules.yaml"
    assert main(["import-hf", path, "--yaml", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["modules"] == yaml.safe_load(out.read_text())["modules"]
    return result


def _raw(modules: dict, world: int = 1) -> dict:
    return {"world_size": world, "modules": modules, "data": {"source": "synthetic", "max_sample_tokens": 256}}


@pytest.mark.parametrize("name", list(VLMS))
def test_vlm_modules_have_no_deepstack_and_m_rope(vlms, name, tmp_path, capsys):
    from mimo.compose.config import config_from_dict
    from mimo.encoders.config import Qwen3VisionArch

    result = _modules(vlms[name], tmp_path, capsys)
    assert result["architecture"] == ARCH[name][1] and result["ok"]
    config = config_from_dict(_raw(result["modules"]))
    vision, llm = config.modules["vision"].arch, config.llm.arch
    assert vision.deepstack_layers == [] and vision.heads == VLMS[name][2] and vision.out_hidden == llm.hidden
    assert llm.deepstack_layers == [] and llm.mrope_section == [1, 2, 1] and llm.pattern == PATTERN[name]
    assert hf.hf_model_type(llm) == f"qwen3_5{'_moe' if name == 'moe' else ''}_text"
    # a deepstack key in a Qwen3.5 vision config changes nothing (transformers drops the mergers)
    with open(os.path.join(vlms[name], "config.json")) as f:
        whole = json.load(f)
    whole["vision_config"]["deepstack_visual_indexes"] = [0]
    assert Qwen3VisionArch.from_hf_config(whole) == vision and hf.qwen3_vl_arch(whole) == llm


@pytest.mark.parametrize("name", list(VLMS))
def test_vlm_import_export_round_trip_is_exact(pools, vlms, name, tmp_path, capsys):
    from mimo.commands.export_hf import export_hf
    from mimo.commands.hf_qwen3_vl import import_to_checkpoint

    path, world = vlms[name], VLMS[name][4]
    modules = _modules(path, tmp_path, capsys)["modules"]
    for m in modules.values():
        m["parallel"] = {"tp": world, "dp": 1}
        m.pop("init")  # the conversion loads the directory whatever the config's init says
    (tmp_path / "mimo.yaml").write_text(yaml.safe_dump(_raw(modules, world)))
    result = import_to_checkpoint(path, str(tmp_path / "mimo.yaml"), [], str(tmp_path / "ckpt"), pool=pools(world))
    assert result["architecture"] == ARCH[name][1]
    exported = export_hf(result["out"], str(tmp_path / "hf"))
    assert exported["architecture"] == ARCH[name][1] and exported["token_ids_from"] == path
    cls = getattr(transformers, ARCH[name][1])
    source, back = cls.from_pretrained(path), cls.from_pretrained(str(tmp_path / "hf"))
    assert type(back) is cls and back.config.to_dict()["vision_config"] == source.config.to_dict()["vision_config"]
    assert "deepstack_visual_indexes" not in json.loads((tmp_path / "hf" / "config.json").read_text())["vision_config"]
    _same_tensors(source.state_dict(), back.state_dict())
    if name == "dense":  # --llm-only: Qwen3.5's language model is a causal LM of its own
        exported = export_hf(result["out"], str(tmp_path / "llm"), llm_only=True)
        assert exported["architecture"] == "Qwen3_5ForCausalLM"
        llm = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path / "llm"))
        want = {k.replace("model.language_model.", "model."): v for k, v in source.state_dict().items()
                if not k.startswith("model.visual.")}
        _same_tensors(want, llm.state_dict())


VERIFY = {"dense tp1 (weights)": ("dense", 1, 1), "moe tp1 (weights)": ("moe", 1, 1), "moe tp2": ("moe config", 2, 1),
          "moe ep2": ("moe config", 1, 2)}  # (the dense model's 3 heads do not split over tp 2)


@pytest.mark.parametrize("case", list(VERIFY))
def test_verify_hf(pools, vlms, case):
    from mimo.commands.verify_hf import verify_hf

    name, tp, ep = VERIFY[case]
    r = verify_hf(vlms[name], pools(2), tp=tp, ep=ep, seed=1)
    assert r["ok"], json.dumps(r["yardstick"], indent=1)
    assert (r["tol"], r["grad_tol"]) == (1e-5, 5e-4)
    assert r["architecture"] == ARCH[name.split()[0]][1] and r["labels_agree"] and r["grads_checked"] > 60
    images, video = r["samples"][1]["image_grids"], r["samples"][0]["video_grids"]
    assert len(images) == 2 and images[0] != images[1] and video[0][0] == 2
    assert r["tightest"]["logits"]["bound"] == max(1e-5, 4 * r["tightest"]["logits"]["one_process_fp32_vs_fp64"])
    assert r["max_logits_rel_err"] > 0 and r["max_grad_rel_err"] > 0


def swapped_gdn_q_k(vlm):
    """The first Gated DeltaNet layer's q and k rows of ``in_proj_weight`` swapped (at tp 1), as a
    wrong split of ``in_proj_qkv`` would load them."""
    arch = vlm.stage.arch
    w = next(p for n, p in vlm.stage.named_parameters() if n.endswith("mixer.in_proj_weight"))
    dq = arch.gdn_heads * arch.gdn_head_dim
    with torch.no_grad():
        q = w[:dq].clone()
        w[:dq] = w[dq : 2 * dq]
        w[dq : 2 * dq] = q


@pytest.mark.parametrize("mutation", ["1-D positions", "swapped GDN q / k"])
def test_planted_bugs_fail(pools, vlms, mutation):
    """With its GDN gradient floor verify-hf still fails a wrong M-RoPE or GDN mapping by far."""
    from mimo.commands.verify_hf import verify_hf

    from test_verify_hf import one_d_positions

    mutate = {"1-D positions": one_d_positions, "swapped GDN q / k": swapped_gdn_q_k}[mutation]
    r = verify_hf(vlms["dense"], pools(2), seed=1, mutate=mutate)
    worst = r["yardstick"]["worst"][0]
    ratio = worst["err_vs_fp64"] / worst["bound"]
    print(f"{mutation}: {worst['name']} {worst['err_vs_fp64']:.2e} = {ratio:.0f}x its bound")
    assert not r["ok"] and ratio > 100, worst


# ---------------------------------------------------------------- errors


def test_a_config_unlike_the_checkpoint_names_the_field(vlms, texts, tmp_path, capsys):
    from mimo.commands.hf_qwen3_vl import check_fits
    from mimo.commands.import_hf import causal_lm_to_checkpoint
    from mimo.compose.config import config_from_dict

    modules = _modules(vlms["dense"], tmp_path, capsys)["modules"]
    modules["language"]["arch"]["mrope_section"] = [2, 1, 1]
    with pytest.raises(MimoError, match=r"arch\.mrope_section=\[2, 1, 1\] differs from the checkpoint's config\.json"):
        check_fits(config_from_dict(_raw(modules)), vlms["dense"])
    for key, value in (("rotary_fraction", 1.0), ("norm_zero_centred", False)):  # same shapes, another model
        changed = {**modules, "language": {**modules["language"], "arch": {**modules["language"]["arch"],
                                                                        "mrope_section": [1, 2, 1], key: value}}}
        if key == "rotary_fraction":
            changed["language"]["arch"]["mrope_section"] = [2, 4, 2]  # (sums to half the whole head)
        with pytest.raises(MimoError, match=rf"arch\.{key}={value!r} differs from the checkpoint's config\.json"):
            check_fits(config_from_dict(_raw(changed)), vlms["dense"])
    _, path = texts["dense"]
    assert main(["import-hf", path, "--yaml", str(tmp_path / "text.yaml")]) == 0
    text = yaml.safe_load((tmp_path / "text.yaml").read_text())["modules"]
    text["language"]["arch"]["gdn_v_heads"] = 3
    (tmp_path / "mimo.yaml").write_text(yaml.safe_dump(_raw(text)))
    with pytest.raises(MimoError, match=r"arch\.gdn_v_heads is 3, the checkpoint's 9"):
        causal_lm_to_checkpoint(path, str(tmp_path / "mimo.yaml"), [], str(tmp_path / "ckpt"))
    capsys.readouterr()


def test_what_export_refuses(texts):
    from mimo.encoders.config import Qwen3VisionArch

    dense = hf.arch_from_hf_config(hf.read_config_json(f"{texts['dense'][1]}/config.json"))
    moe = hf.arch_from_hf_config(hf.read_config_json(f"{texts['moe'][1]}/config.json"))
    cases = [(dense, dict(deepstack_layers=[1]), "qwen3_5_text", "qwen3_5_text has no deepstack"),
             (dense, dict(mrope_section=None), "qwen3_5_text", "qwen3_5_text has M-RoPE"),
             (moe, dict(pattern="GE*-*EGEGE"), "qwen3_5_moe_text", "every qwen3_5_moe_text decoder layer is MoE"),
             (moe, dict(norm_zero_centred=False), "qwen3_5_moe_text", "needs arch.norm_zero_centred")]
    for arch, change, model_type, says in cases:
        bad = copy.deepcopy(arch)
        for k, v in change.items():
            setattr(bad, k, v)
        with pytest.raises(MimoError, match=says):
            hf.hf_config_from_arch(bad, model_type)
    one_d = copy.deepcopy(dense)
    one_d.mrope_section = None
    assert hf.hf_model_type(one_d) == "qwen3_next"  # 1-D RoPE: Qwen3-Next's (the families do not overlap)
    tower = Qwen3VisionArch.from_hf_config(dict(VISION, num_heads=3, deepstack_visual_indexes=[0]))
    with pytest.raises(MimoError, match="Qwen3.5's vision tower has no deepstack"):
        tower.to_hf_config(deepstack=False)


def test_verify_hf_refuses_ep_of_a_dense_model(vlms, capsys):
    assert main(["verify-hf", vlms["dense"], "--ep", "2"]) == 2
    assert "qwen3_5 has no experts" in capsys.readouterr().err

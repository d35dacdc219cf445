"""``mimo import-hf`` / ``mimo export-hf`` of Hugging Face Qwen3-VL and Qwen3-VL-MoE (issue 47
item 5, part): the ``kind: qwen3_vl`` encoder in configs and in ``MimoModel``, and what the run
commands say about it on synthetic data (which draws fixed-size images only).

* Two tiny random models built with transformers' config classes and ``save_pretrained``: a dense
  Qwen3-VL (3 vision heads, deepstack after vision blocks 0 and 2 — not the default indices —,
  mrope sections [4, 2, 2]) and a Qwen3-VL-MoE (3 experts, decoder layer 1 dense, tied head;
  2 vision heads so that tp 2 divides them).
* ``import-hf DIR --yaml``: the modules section validates as a config and describes the
  checkpoint (the tower's arch, the LLM's with its deepstack and M-RoPE).
* ``import-hf DIR --config --out``: the dense one at world 1, the MoE at world 2 with tp 2 for both
  modules; ``export-hf`` of that checkpoint; transformers' ``from_pretrained`` loads the same
  class with every tensor equal to the source (``torch.equal``), the token ids and the
  tokenizer / processor files of the source directory carried over.
* ``import-hf`` of a LLaVA directory runs the LLaVA path; an unsupported architecture, a
  deepstack width the LLM does not take and a tower arch other than the checkpoint's are clear
  errors; ``train`` (a real subprocess), ``verify-train``, ``eval``, ``generate``,
  ``inspect-data``, ``prepare-data`` and ``check-config`` on a qwen3_vl config with synthetic
  data stop with the one ConfigError (exit 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from mimo.commands.cli import main
from mimo.core.errors import ConfigError, MimoError

from test_hf_llava import hf_model, llava_config

VISION = dict(depth=3, hidden_size=24, intermediate_size=20, num_heads=3, out_hidden_size=40, spatial_merge_size=2,
              deepstack_visual_indexes=[0, 2], num_position_embeddings=16, patch_size=4, temporal_patch_size=2)
TEXT = dict(vocab_size=67, hidden_size=40, intermediate_size=36, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2], mrope_interleaved=True))
TOKENS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=58, vision_end_token_id=59)
MODELS = {  # name: (model class, config class, vision, text, top level, world size / tp of the import)
    "dense": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", VISION, TEXT, {}, 1),
    "moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", dict(VISION, num_heads=2),
            dict(TEXT, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=12, mlp_only_layers=[1]),
            {"tie_word_embeddings": True}, 2),
}
PROCESSOR = {"patch_size": 4, "size": {"shortest_edge": 1024, "longest_edge": 65536}, "image_mean": [0.4, 0.5, 0.6],
             "image_std": [0.2, 0.3, 0.25]}
VIDEO_PROCESSOR = {"fps": 2, "min_frames": 4, "max_frames": 64, "size": {"shortest_edge": 4096, "longest_edge": 1048576}}
SOURCE_FILES = {"tokenizer_config.json": '{"model_max_length": 1024}', "preprocessor_config.json": json.dumps(PROCESSOR),
                "video_preprocessor_config.json": json.dumps(VIDEO_PROCESSOR)}
ONE_LINE = "kind qwen3_vl (native resolution) cannot take data.source: synthetic"


def _build(name: str, root) -> str:
    """The model ``name`` with random weights (every tensor drawn, biases too), saved by
    transformers into ``root/name`` beside a tokenizer / processor file or two."""
    import transformers

    cls, cfg_cls, vision, text, top, _ = MODELS[name]
    cfg = getattr(transformers, cfg_cls)(vision_config=vision, text_config=text, **TOKENS, **top)
    torch.manual_seed(len(name))
    model = getattr(transformers, cls)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    path = str(root / name)
    model.save_pretrained(path)
    for file, text_ in SOURCE_FILES.items():
        with open(os.path.join(path, file), "w") as f:
            f.write(text_)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl")
    return {name: _build(name, root) for name in MODELS}


def _modules(path: str, tmp_path, capsys) -> dict:
    out = tmp_path / "modules.yaml"
    assert main(["import-hf", path, "--yaml", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["command"] == "import-hf" and result["modules"] == yaml.safe_load(out.read_text())["modules"]
    return result


def _raw(modules: dict, world: int = 1) -> dict:
    return {"world_size": world, "modules": modules, "data": {"source": "synthetic", "max_sample_tokens": 256}}


# ---------------------------------------------------------------- import-hf DIR --yaml


@pytest.mark.parametrize("name", list(MODELS))
def test_modules_section_validates_and_describes_the_checkpoint(sources, name, tmp_path, capsys):
    from mimo.compose.config import config_from_dict
    from mimo.encoders.config import Qwen3VisionArch
    from mimo.llm.hf import qwen3_vl_arch

    path = sources[name]
    result = _modules(path, tmp_path, capsys)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert result["architecture"] == MODELS[name][0] and result["ok"]
    config = config_from_dict(_raw(result["modules"]))
    vision, llm = config.modules["vision"], config.llm
    assert vision.kind == "qwen3_vl" and vision.native and vision.placeholder == "<|image_pad|>"
    # the data path cuts images as the checkpoint's processor does
    assert result["modules"]["vision"]["image"] == {"min_pixels": 1024, "max_pixels": 65536, "mean": [0.4, 0.5, 0.6],
                                                    "std": [0.2, 0.3, 0.25]}
    # and videos as its video processor does
    assert result["modules"]["vision"]["video"] == {"fps": 2.0, "min_frames": 4, "max_frames": 64, "min_pixels": 4096,
                                                    "max_pixels": 1048576}
    assert vision.video.max_pixels == 1048576 and vision.video_placeholder == "<|video_pad|>"
    assert vision.init.hf == path and llm.init.hf == path
    assert vision.arch == Qwen3VisionArch.from_hf_config(hf) and vision.arch.deepstack_layers == [0, 2]
    assert llm.arch == qwen3_vl_arch(hf) and llm.arch.deepstack_layers == [1, 3] and llm.arch.mrope_section == [4, 2, 2]
    assert (llm.arch.moe is not None) == (name == "moe")
    assert list(config.encoders) == ["vision"]
    assert config.trainable_problems() == [f"modules.vision: {ONE_LINE}" + config.trainable_problems()[0].split(ONE_LINE)[1]]


# ---------------------------------------------------------------- import -> checkpoint -> export -> transformers


@pytest.mark.parametrize("name", list(MODELS))
def test_import_export_round_trip_is_exact(pools, sources, name, tmp_path, capsys):
    """The checkpoint at the layout, exported, loads in transformers as the same class with every
    tensor of the source; config token ids and the source's tokenizer / processor files carried."""
    import transformers

    from mimo.commands.export_hf import export_hf
    from mimo.commands.hf_qwen3_vl import import_to_checkpoint

    path, world = sources[name], MODELS[name][5]
    modules = _modules(path, tmp_path, capsys)["modules"]
    for m in modules.values():
        m["parallel"] = {"tp": world, "dp": 1}
        m.pop("init")  # the conversion loads the directory whatever the config's init says
    config_path = tmp_path / "mimo.yaml"
    config_path.write_text(yaml.safe_dump(_raw(modules, world)))
    result = import_to_checkpoint(path, str(config_path), [], str(tmp_path / "ckpt"), pool=pools(world))
    assert result["layout"]["modules"]["vision"]["tp"] == world and result["layout"]["modules"]["language"]["tp"] == world
    out = tmp_path / "hf"
    exported = export_hf(result["out"], str(out), max_shard_bytes=40_000)  # several shards
    assert exported["architecture"] == MODELS[name][0] and exported["token_ids_from"] == path
    assert "model.safetensors.index.json" in exported["files"]
    for file, text in SOURCE_FILES.items():
        assert (out / file).read_text() == text
    cls = getattr(transformers, MODELS[name][0])
    source, back = cls.from_pretrained(path), cls.from_pretrained(str(out))
    assert type(back) is cls
    with open(out / "config.json") as f:
        written = json.load(f)
    assert all(written[k] == v for k, v in TOKENS.items()) and written["architectures"] == [MODELS[name][0]]
    want, got = source.state_dict(), back.state_dict()
    assert list(got) == list(want)
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, unequal[:5]
    if name == "dense":  # --llm-only: no causal LM of Qwen3-VL's text model in transformers
        assert main(["export-hf", result["out"], "--out", str(tmp_path / "llm"), "--llm-only"]) == 2
        assert "Hugging Face has no causal LM of Qwen3-VL's language model" in capsys.readouterr().err
        # without a source directory recorded, the token ids are missing: a clear error
        meta_path = os.path.join(result["out"], "meta.json")
        with open(meta_path) as f:
            meta = json.load(f)
        meta["config"]["modules"]["vision"]["init"]["hf"] = meta["config"]["modules"]["language"]["init"]["hf"] = None
        with open(meta_path, "w") as f:
            json.dump({**meta, "imported_from": None}, f)
        assert main(["export-hf", result["out"], "--out", str(tmp_path / "again")]) == 2
        err = capsys.readouterr().err
        assert "needs the image_token_id, video_token_id, vision_start_token_id, vision_end_token_id" in err, err


# ---------------------------------------------------------------- LLaVA, errors


def test_import_hf_of_a_llava_directory_runs_the_llava_path(tmp_path, capsys):
    from mimo.commands.hf_llava import llava_modules

    config = llava_config("clip-2-default-untied")
    hf_model(config).save_pretrained(tmp_path / "llava")
    result = _modules(str(tmp_path / "llava"), tmp_path, capsys)
    assert result["architecture"] == "LlavaForConditionalGeneration" and result["naming"]
    want = llava_modules(config)
    assert {k: {n: v for n, v in m.items() if n != "init"} for k, m in result["modules"].items()} == want


def test_unsupported_architecture_and_misfits_are_clear_errors(sources, tmp_path, capsys):
    from mimo.commands.hf_qwen3_vl import check_fits
    from mimo.compose.config import config_from_dict

    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    assert main(["import-hf", str(bert)]) == 2
    err = capsys.readouterr().err
    assert "'BertModel'" in err and "LlavaForConditionalGeneration, Qwen3VLForConditionalGeneration, " \
                                    "Qwen3VLMoeForConditionalGeneration" in err, err
    modules = _modules(sources["dense"], tmp_path, capsys)["modules"]
    # the LLM takes one deepstack level, the tower gives two
    modules["language"]["arch"]["deepstack_layers"] = [1]
    with pytest.raises(ConfigError) as e:
        config_from_dict(_raw(modules))
    assert e.value.problems == [
        "modules.vision.arch: the tower's rows are out_hidden * (1 + len(deepstack_layers)) = 40 * 3 = 120 wide, but "
        "modules.language.arch takes hidden * (1 + len(deepstack_layers)) = 40 * 2 = 80 (out_hidden must be the LLM's "
        "hidden, and both need as many deepstack levels)"]
    # a tower arch other than the checkpoint's: named before any process starts
    modules["language"]["arch"]["deepstack_layers"] = [1, 3]
    modules["vision"]["arch"]["act"] = "gelu"
    with pytest.raises(MimoError, match=r"arch\.act is 'gelu' in the config but 'gelu_pytorch_tanh' in checkpoint"):
        check_fits(config_from_dict(_raw(modules)), sources["dense"])


def test_run_commands_stop_with_the_one_config_error(sources, tmp_path, capsys):
    modules = _modules(sources["dense"], tmp_path, capsys)["modules"]
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(_raw(modules)))
    for argv in (["verify-train", str(path)], ["eval", str(path)], ["generate", str(path), "--prompt", "hi"],
                 ["inspect-data", str(path)], ["prepare-data", str(path)], ["check-config", str(path)]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        errors = json.loads(captured.out.strip().splitlines()[-1])["errors"]
        assert len(errors) == 1 and errors[0].startswith(f"modules.vision: {ONE_LINE} ("), (argv, errors)
    assert "init.hf modules.vision: ok (qwen3_vl's vision tower, 3 blocks, 2 deepstack levels)" in captured.out
    assert "init.hf modules.language: ok" in captured.out
    proc = subprocess.run([sys.executable, "-m", "mimo", "train", str(path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [errors[0]] and "Traceback" not in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["errors"] == errors

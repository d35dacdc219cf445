"""``mimo check-config`` loads what the config names without starting ranks (issue 53, part 3):
``init.hf`` checkpoints of another family or other sizes, a tokenizer folder without a tokenizer,
and a placeholder typo that would drop every conversation each fail with exit status 2 and a
message naming the cause; the demo config passes with a line per check
(``mimo.compose.preflight.check_inputs``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mimo.commands.cli import main
from mimo.core.errors import DataError, MimoError

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PATTERN = "modules.language.arch.pattern='*-*-'"  # the demo LLM as a 2-layer Llama (its sizes as they are)
CLIP_ARCH = ["modules.vision.arch.act=quick_gelu", "modules.vision.arch.pre_norm=true"]  # the demo tower as CLIP's


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    """configs/demo.yaml over 200 fresh demo samples in two shards (no index: check-config needs none)."""
    from mimo.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("demo")
    make_demo_data(str(root / "data"), train_samples=200, heldout_samples=1, shard_size=100)
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["data"].update(shards=str(root / "data" / "train-{000000..000001}.tar"), tokenizer=str(root / "data" / "tokenizer"))
    cfg["train"]["checkpoint"]["dir"] = str(root / "ckpt")
    cfg["eval"]["shards"] = str(root / "data" / "heldout-{000000..000000}.tar")
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def check(capsys, *argv: str) -> tuple[int, str, str, dict]:
    rc = main(["check-config", *argv])
    out, err = capsys.readouterr()
    return rc, out, err, json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny Hugging Face checkpoints (config.json + model.safetensors): a Llama that fits the demo
    LLM as a 2-layer Llama, the same with vocab 300, a CLIP tower that fits the demo tower as
    CLIP's, and a GPT-2 (a family mimo does not import)."""
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("hf")
    out = {}
    torch.manual_seed(0)
    for name, vocab in (("llama", 261), ("llama-vocab300", 300)):
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                       rms_norm_eps=1e-5)
        transformers.LlamaForCausalLM(cfg).save_pretrained(root / name)
        out[name] = str(root / name)
    clip = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         image_size=32, patch_size=8)
    transformers.CLIPVisionModel(clip).save_pretrained(root / "clip")
    out["clip"] = str(root / "clip")
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
                                                  "n_layer": 2, "n_head": 4, "vocab_size": 261}))
    save_file({"transformer.wte.weight": np.zeros((261, 64), np.float32)}, str(gpt2 / "model.safetensors"))
    out["gpt2"] = str(gpt2)
    return out


def test_the_demo_config_passes_with_a_line_per_check(demo, capsys):
    rc, out, err, result = check(capsys, demo)
    assert rc == 0, err
    assert "tokenizer: ok (261 tokens, template chatml" in out, out
    assert "shards: 200 sampled from 2 shard(s), 0.0% would be dropped" in out, out
    shards = result["inputs"]["shards"]
    assert (shards["sampled"], shards["dropped"], shards["stray_placeholder"]) == (200, 0, None)
    assert result["inputs"]["tokenizer"]["ok"] and result["inputs"]["init_hf"] == {}


def test_a_placeholder_typo_names_the_placeholder_the_samples_use(demo, capsys):
    rc, out, err, result = check(capsys, demo, "modules.vision.placeholder=<img>")
    assert rc == 2 and result["ok"] is False
    assert "shards: FAILED" in out
    (problem,) = result["errors"]
    assert problem.startswith("data.shards: ") and "would be dropped, more than data.max_skipped_fraction=0.01" in problem
    assert "the samples' text uses '<image>'" in problem
    assert "no encoder has that placeholder: modules.vision.placeholder is '<img>'" in problem
    assert "placeholder and image counts differ" in problem and "Traceback" not in err


def test_a_tokenizer_folder_without_a_tokenizer_names_the_files_expected(demo, tmp_path, capsys):
    from mimo.data.tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text("{}")  # e.g. a model folder named as the tokenizer
    rc, _, err, result = check(capsys, demo, f"data.tokenizer={tmp_path}")
    assert rc == 2
    (problem,) = result["errors"]
    assert problem.startswith(f"data.tokenizer: '{tmp_path}' holds no tokenizer: expected tokenizer.json"), problem
    assert "it holds config.json" in problem and "sentencepiece" not in err.lower()
    with pytest.raises(DataError, match="holds no tokenizer: expected tokenizer.json"):  # the late path says the same
        load_tokenizer(str(tmp_path))


def test_init_hf_of_another_model_type(demo, checkpoints, capsys):
    rc, out, err, result = check(capsys, demo, LLAMA_PATTERN, f"modules.language.init.hf={checkpoints['gpt2']}",
                                 f"modules.vision.init.hf={checkpoints['llama']}")
    assert rc == 2 and "init.hf modules.language: FAILED" in out
    language, vision = result["errors"]  # both reported at once
    assert language.startswith("modules.language.init.hf: ") and checkpoints["gpt2"] in language
    assert "model_type 'gpt2' is not supported; supported: llama" in language, language
    assert vision.startswith("modules.vision.init.hf: ") and checkpoints["llama"] in vision
    assert "model_type 'llama' is not a supported vision tower" in vision, vision


def test_init_hf_of_other_sizes_names_what_differs(demo, checkpoints, capsys):
    from mimo.compose.config import load_config
    from mimo.llm.hf import load_hf_checkpoint
    from mimo.llm.model import LLMStage

    overrides = [LLAMA_PATTERN, f"modules.language.init.hf={checkpoints['llama-vocab300']}", *CLIP_ARCH,
                 "modules.vision.arch.mlp=96", f"modules.vision.init.hf={checkpoints['clip']}"]
    rc, _, err, result = check(capsys, demo, *overrides)
    assert rc == 2
    language, vision = result["errors"]
    assert language.startswith(f"modules.language.init.hf: '{checkpoints['llama-vocab300']}': ")
    assert "tensor 'model.embed_tokens.weight' has shape (300, 64)" in language
    assert "arch.vocab is 261, the checkpoint's 300" in language, language
    assert vision.startswith("modules.vision.init.hf: ") and checkpoints["clip"] in vision
    assert "the config expects (96, 64)" in vision, vision
    # the late check on every rank is the same function: the same message
    arch = load_config(demo, overrides[:1]).llm.arch
    with pytest.raises(MimoError, match="arch.vocab is 261, the checkpoint's 300"):
        load_hf_checkpoint(LLMStage(arch), checkpoints["llama-vocab300"])


def test_init_hf_that_fits_passes(demo, checkpoints, capsys):
    rc, out, err, result = check(capsys, demo, LLAMA_PATTERN, f"modules.language.init.hf={checkpoints['llama']}", *CLIP_ARCH,
                                 f"modules.vision.init.hf={checkpoints['clip']}")
    assert rc == 0, err
    assert "init.hf modules.language: ok (llama, 2 layers)" in out and "init.hf modules.vision: ok (clip, 2 layers)" in out, out
    assert result["inputs"]["init_hf"]["language"]["model_type"] == "llama"


def test_the_torch_free_tokenizer_counts_tokens_as_the_pipeline_does(demo):
    """check-config tokenizes sample shards with ``FileTokenizer`` (no transformers): the same
    token counts and image positions as the pipeline's Hugging Face tokenizer."""
    from mimo.compose.config import load_config
    from mimo.compose.data_spec import text_spec
    from mimo.data.index import index_sample
    from mimo.data.shards import read_files, scan_shard
    from mimo.data.text import TextEncoder
    from mimo.data.tokenizer import FileTokenizer, load_tokenizer

    config = load_config(demo)
    rows = {e.placeholder: e.rows_per_image for e in config.encoders.values()}
    spec = text_spec(config)
    shard = config.data.shards.replace("{000000..000001}", "000000")
    ours = TextEncoder(FileTokenizer(config.data.tokenizer), config.data.template, rows)
    theirs = TextEncoder(load_tokenizer(config.data.tokenizer), config.data.template, rows)
    locations, _ = scan_shard(shard, limit=40)
    assert len(locations) == 40
    for loc in locations:
        files = read_files(shard, loc)
        assert index_sample(files, ours, spec) == index_sample(files, theirs, spec)

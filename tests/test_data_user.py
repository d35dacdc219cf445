"""A user's own data (issue 20, points 4, 7, 12), each through the command line on tmp data:
the tokenizer checked against the config before anything starts, ``data.template: tokenizer``,
``data.index_dir`` and index names, and what prepare-data / inspect-data report."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from mimo.commands.cli import main

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
DEFAULT_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
# a chat template whose {% generation %} block marks the assistant's text and end marker (the
# labels); {{ '\n' }} after block tags: Hugging Face renders with trim_blocks
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|im_start|>user{{ '\n' }}{{ m['content'] }}<|im_end|>{{ '\n' }}"
    "{% else %}<|im_start|>assistant{{ '\n' }}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\n' }}"
    "{% endif %}{% endfor %}"
)
NO_GENERATION_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
ANSWERS = ["red", "tan", "sky", "big", "odd", "new"]  # one length: every sample has the same token count


def make_tokenizer(path, specials=SPECIALS, extra: int = 0, chat_template: str | None = None, **named) -> None:
    """A byte-level tokenizer (256 byte tokens + ``specials`` + ``extra`` added tokens, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials) + [f"<extra_{i}>" for i in range(extra)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **(named or DEFAULT_SPECIALS))
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))


def _png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_shard(path, samples: list[dict]) -> None:
    """``samples``: webdataset records without their key (keys are 000000, 000001, ...)."""
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for i, record in enumerate(samples):
            sink.write({"__key__": f"{i:06d}", **record})


def qa(answer: str, seed: int, question: str = "Colour?") -> dict:
    conv = [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]
    return {"png": _png(seed), "json": json.dumps({"conversations": conv}).encode()}


def write_config(root, shards: str, tokenizer: str, vocab: int = 261, **data) -> str:
    cfg = {
        "world_size": 1,
        "modules": {
            "vision": {"kind": "vit", "arch": {"image_size": 32, "patch": 8, "hidden": 32, "layers": 1, "heads": 2, "mlp": 64},
                       "projector": {"kind": "mlp2x_gelu"}, "placeholder": "<image>", "feature_layer": -1,
                       "parallel": {"tp": 1, "dp": 1}},
            "language": {"kind": "hybrid", "arch": {"pattern": "*-", "hidden": 32, "heads": 2, "kv_heads": 1, "vocab": vocab,
                                                    "max_seq_len": 512},
                         "parallel": {"tp": 1, "dp": 1}},
        },
        "data": {"shards": shards, "tokenizer": tokenizer, "template": "chatml", "tokens_per_microbatch": 512,
                 "max_sample_tokens": 256, "workers": 1, **data},
        "train": {"steps": 1, "checkpoint": {"dir": str(root / "ckpt")}},
    }
    path = root / f"config-{len(list(root.glob('config-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str, dict]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err, json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A shard of six same-length image questions, and the default tokenizer."""
    root = tmp_path_factory.mktemp("data")
    write_shard(root / "qa-000000.tar", [qa(a, i) for i, a in enumerate(ANSWERS)])
    make_tokenizer(root / "tokenizer")
    return root


# ---------------------------------------------------------------- point 4: the tokenizer against the config


def test_vocab_smaller_than_the_tokenizer_is_an_error_before_anything_starts(tmp_path, shards, capsys):
    make_tokenizer(tmp_path / "tok400", extra=400 - 256 - len(SPECIALS))
    small = write_config(tmp_path, str(shards / "qa-000000.tar"), str(tmp_path / "tok400"), vocab=300)
    for command in ("check-config", "train"):  # train: refused before any rank starts
        rc, _, err, result = run(capsys, command, small)
        assert rc == 2 and result["ok"] is False
        assert "modules.language.arch.vocab: 300 is less than the tokenizer's 400 tokens" in err, err
        assert "Traceback" not in err
    fits = write_config(tmp_path, str(shards / "qa-000000.tar"), str(tmp_path / "tok400"), vocab=400)
    # the check reads the tokenizer without transformers: check-config still never imports torch
    code = (f"import sys; from mimo.commands.cli import main; rc = main(['check-config', {fits!r}]); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules, 'check-config imported torch'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_tokenizer_without_eos_is_an_error(tmp_path, shards, capsys):
    make_tokenizer(tmp_path / "noeos", bos_token="<s>", pad_token="<pad>")
    rc, _, err, _ = run(capsys, "check-config", write_config(tmp_path, str(shards / "qa-000000.tar"), str(tmp_path / "noeos"), template="plain"))
    assert rc == 2 and "has no eos_token; template 'plain' ends every answer with it" in err, err
    # nothing to pad with and no token for the image positions: an error, not id 0
    make_tokenizer(tmp_path / "nothing", bos_token="<s>")
    rc, _, err, _ = run(capsys, "check-config", write_config(tmp_path, str(shards / "qa-000000.tar"), str(tmp_path / "nothing")))
    assert rc == 2 and "has neither a pad_token nor an eos_token" in err, err


def test_chatml_needs_its_markers_as_single_tokens(tmp_path, shards, capsys):
    make_tokenizer(tmp_path / "nochatml", specials=["<pad>", "<s>", "</s>"])
    rc, _, err, _ = run(capsys, "check-config", write_config(tmp_path, str(shards / "qa-000000.tar"), str(tmp_path / "nochatml")))
    assert rc == 2
    assert "template 'chatml' needs '<|im_start|>' as one token" in err and "'<|im_end|>' as one token" in err, err


def test_template_tokenizer_uses_the_chat_template_and_its_generation_marks(tmp_path, shards, capsys):
    from transformers import AutoTokenizer

    from mimo.data.text import TextEncoder, Turn
    from mimo.data.tokenizer import facts_of, read_facts

    shard = str(shards / "qa-000000.tar")
    make_tokenizer(tmp_path / "plain")  # no chat template
    rc, _, err, _ = run(capsys, "check-config", write_config(tmp_path, shard, str(tmp_path / "plain"), template="tokenizer"))
    assert rc == 2 and "the tokenizer has no chat_template" in err, err
    make_tokenizer(tmp_path / "nogen", chat_template=NO_GENERATION_TEMPLATE)
    rc, _, err, _ = run(capsys, "check-config", write_config(tmp_path, shard, str(tmp_path / "nogen"), template="tokenizer"))
    assert rc == 2 and "has no {% generation %}" in err, err

    tok_dir = tmp_path / "chat"
    make_tokenizer(tok_dir, specials=[*SPECIALS, "<image>"], chat_template=CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    assert read_facts(str(tok_dir)) == facts_of(tokenizer)  # the torch-free check reads what the pipeline loads
    config = write_config(tmp_path, shard, str(tok_dir), vocab=len(tokenizer), template="tokenizer")
    rc, _, err, result = run(capsys, "prepare-data", config)
    assert rc == 0 and result["usable"] == len(ANSWERS), err
    rc, out, _, result = run(capsys, "inspect-data", config, "--batches", "1")
    assert rc == 0
    sample = result["sample"]
    answer = ANSWERS[int(sample["key"])]
    # the template's own text, its generation block (answer and end marker) the only labels
    assert sample["text"] == f"<s><|im_start|>user\n{{<image> x 16}}\nColour?<|im_end|>\n<|im_start|>assistant\n[[{answer}<|im_end|>]]\n"
    assert sample["label_tokens"] == len(answer) + 1 and sample["text"] in out.replace("\n  ", "\n")

    # exactly Hugging Face's apply_chat_template(..., return_assistant_tokens_mask=True)
    turns = [Turn("human", "What is 2 plus 3?"), Turn("gpt", "5"), Turn("human", "Sure?"), Turn("gpt", "yes")]
    hf = tokenizer.apply_chat_template([{"role": "user" if t.role == "human" else "assistant", "content": t.text} for t in turns],
                                       tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ours = TextEncoder(tokenizer, "tokenizer", {"<image>": 16}).encode(turns, 0)
    assert ours.tokens == hf["input_ids"] and [int(t) for t in ours.target] == hf["assistant_masks"]
    # image positions carry the placeholder's own token when the tokenizer has it
    with_image = TextEncoder(tokenizer, "tokenizer", {"<image>": 16}).encode([Turn("human", "<image>\nHi"), Turn("gpt", "ok")], 1)
    start = with_image.image_starts["<image>"][0]
    assert with_image.tokens[start : start + 16] == [tokenizer.convert_tokens_to_ids("<image>")] * 16
    # eval stops generating at what the generation block puts after the answer, here <|im_end|>
    from mimo.compose.config import load_config
    from mimo.training.evaluation import end_marker

    assert end_marker(load_config(config), tokenizer) == ("<|im_end|>", tokenizer.convert_tokens_to_ids("<|im_end|>"))


# ---------------------------------------------------------------- point 7: where the index lives, and its name


def _as_user_without_write_access(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """``python -m mimo ...`` unable to write to read-only folders (as root: without CAP_DAC_OVERRIDE)."""
    prefix = ["setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override"] if os.geteuid() == 0 else []
    return subprocess.run([*prefix, sys.executable, "-m", "mimo", *argv], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_read_only_shards_with_index_dir(tmp_path, shards):
    data = tmp_path / "readonly"
    data.mkdir()
    shutil.copy(shards / "qa-000000.tar", data)
    os.chmod(data, 0o555)
    try:
        config = write_config(tmp_path, str(data / "qa-000000.tar"), str(shards / "tokenizer"))
        proc = _as_user_without_write_access(["prepare-data", config], tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "is not writable" in proc.stderr and "set data.index_dir to a writable folder" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        proc = _as_user_without_write_access(["prepare-data", config, f"data.index_dir={tmp_path / 'indexes'}"], tmp_path)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["status"] == "built" and os.path.dirname(result["index"]) == str(tmp_path / "indexes")
        assert os.path.isfile(result["index"]) and os.listdir(data) == ["qa-000000.tar"]
    finally:
        os.chmod(data, 0o755)


def test_switching_template_keeps_both_indexes(tmp_path, shards, capsys):
    shard = str(tmp_path / "qa-000000.tar")
    shutil.copy(shards / "qa-000000.tar", shard)
    chatml = write_config(tmp_path, shard, str(shards / "tokenizer"), template="chatml")
    plain = write_config(tmp_path, shard, str(shards / "tokenizer"), template="plain")
    first = run(capsys, "prepare-data", chatml)[3]
    second = run(capsys, "prepare-data", plain)[3]
    assert (first["status"], second["status"]) == ("built", "built") and first["index"] != second["index"]
    assert run(capsys, "prepare-data", chatml)[3]["status"] == "loaded"  # not rebuilt over by plain's
    assert run(capsys, "prepare-data", plain)[3]["status"] == "loaded"
    assert os.path.isfile(first["index"]) and os.path.isfile(second["index"])


def test_a_brace_list_gives_a_short_index_name(tmp_path, shards, capsys):
    for name in ("train-000000", "train-000003", "broken-000000"):
        shutil.copy(shards / "qa-000000.tar", tmp_path / f"{name}.tar")
    pattern = str(tmp_path / "{train-000000,train-000003,broken-000000}.tar")
    result = run(capsys, "prepare-data", write_config(tmp_path, pattern, str(shards / "tokenizer")))[3]
    name = os.path.basename(result["index"])
    assert result["samples"] == 3 * len(ANSWERS) and os.path.dirname(result["index"]) == str(tmp_path)
    assert name.startswith("shards.chatml-") and name.endswith(".mimo-index.json") and len(name) < 40, name
    # a numeric range keeps its readable name
    ranged = run(capsys, "prepare-data", write_config(tmp_path, str(tmp_path / "train-{000000..000000}.tar"), str(shards / "tokenizer")))[3]
    assert os.path.basename(ranged["index"]).startswith("train-000000..000000.chatml-")


# ---------------------------------------------------------------- point 12: what prepare-data and inspect-data report


def test_inspect_data_shows_a_decoded_sample_and_the_right_padding(tmp_path, shards, capsys):
    from mimo.compose.config import load_config

    config = write_config(tmp_path, str(shards / "qa-000000.tar"), str(shards / "tokenizer"))
    run(capsys, "prepare-data", config)
    from mimo.compose.inputs import ensure_index

    length = ensure_index(load_config(config))[0].entries[0].tokens  # every sample has this many
    budget = 2 * length + length // 2  # two samples fit per microbatch, half a sample's room stays empty
    rc, out, err, result = run(capsys, "inspect-data", config, f"data.tokens_per_microbatch={budget}", f"data.max_sample_tokens={length}",
                               "--batches", "2")
    assert rc == 0, err
    want = 1 - 2 * length / budget
    assert abs(result["padding_fraction"] - want) < 1e-6 and result["padding_fraction"] > 0.15
    assert result["capacity_per_dp_rank"] == budget and result["mean_tokens_per_dp_rank"] == 2 * length
    assert f"padding {100 * want:.2f}% (mean {2 * length:.1f} of {budget} tokens per LLM DP rank" in out, out
    sample = result["sample"]
    answer = ANSWERS[int(sample["key"])]
    assert sample["text"] == f"<s><|im_start|>user\n{{<image> x 16}}\nColour?<|im_end|>\n<|im_start|>assistant\n[[{answer}<|im_end|>]]\n"
    assert sample["image_positions"] == {"<image>": [[7, 23]]} and sample["label_tokens"] == len(answer) + 1
    assert f"first sample {sample['shard']}:{sample['key']}" in out and "label tokens: 4 at" in out and "<image> at 7..22" in out


@pytest.mark.parametrize("sp", [False, True])
def test_inspect_data_reports_each_bridges_bytes_per_microbatch(capsys, sp):
    """inspect-data's bytes per microbatch of the bridge, from the plans training runs for every
    rank: non-colocated (tower dp 2 -> LLM tp 2 dp 2, fp32), every image row crosses once each
    way, and without sequence parallelism the LLM's TP pair's finishing all-gather receives each
    row once more (the minimum verify-bridge names: rows x width, plus the all-gather)."""
    from mimo.compose.config import load_config
    from mimo.compose.inputs import bridge_width

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "examples", "noncolocated.yaml")
    overrides = [f"modules.language.parallel.sequence_parallel={str(sp).lower()}"]
    rc, out, err, result = run(capsys, "inspect-data", config, *overrides, "--batches", "1")
    assert rc == 0, err
    bridge = result["bridges"]["vision"]
    width = bridge_width(load_config(config, overrides), "vision")
    values = result["image_rows"] * width
    assert result["image_rows"] > 0 and bridge["bytes_per_value"] == 4
    assert bridge["backward_bytes_per_microbatch"] == [4 * values]
    assert bridge["forward_bytes_per_microbatch"] == [4 * values * (1 if sp else 2)]
    assert "bridge vision: " in out and " MiB forward" in out


def test_prepare_data_names_too_long_samples_and_counts_empty_captions(tmp_path, shards, capsys):
    caption = lambda text, seed: {"png": _png(seed), "txt": text.encode()}  # noqa: E731
    empty_answer = {"json": json.dumps({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": " "}]}).encode()}
    write_shard(tmp_path / "mixed-000000.tar", [qa("red", 0), caption("a long caption " * 30, 1), caption("  ", 2), empty_answer,
                                                caption("a red square", 3)])
    rc, out, _, result = run(capsys, "prepare-data", write_config(tmp_path, str(tmp_path / "mixed-000000.tar"), str(shards / "tokenizer")))
    assert rc == 0
    assert result["skipped"] == {"too long": 1, "empty caption": 1, "empty answer": 1} and result["usable"] == 2
    assert f"too long: {tmp_path / 'mixed-000000.tar'}:000001: " in out and "> data.max_sample_tokens=256" in out, out
    assert result["too_long"][0]["key"] == "000001" and result["too_long"][0]["tokens"] > 256
    assert f"bad: {tmp_path / 'mixed-000000.tar'}:000002: empty caption" in out

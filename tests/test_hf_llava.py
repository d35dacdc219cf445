"""Hugging Face LLaVA: import / export of both key namings, the config builder, and whole-model
parity at world 1 against ``LlavaForConditionalGeneration``.

The parity reference is built the way Hugging Face users build it: a ``LlavaProcessor`` (a
tokenizer made here in-process, a ``CLIPImageProcessor``, a chat template whose
``{% generation %}`` block marks the assistant's tokens), labels masked to those tokens with
``return_assistant_tokens_mask``, HF's mean over the batch's label tokens. mimo's side reads
the same conversations and images from WebDataset shards through its own data path (index,
plan, tokenization and placeholder expansion, packing into PackedBatch over two microbatches)
and runs its training step at world 1; loss and every parameter's gradient (mapped back to HF
names) must agree to 1e-5.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import yaml

from mimo.core.errors import MimoError
from mimo.commands.hf_llava import (
    NAMINGS,
    export_llava_grads,
    export_llava_state,
    import_llava_state,
    llava_arch,
    llava_modules,
    load_llava,
    save_llava,
)
from mimo.core.testing import rel_err

TOL = 1e-5
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<image>"]
IMAGE_TOKEN_ID = SPECIALS.index("<image>")
VOCAB = 270  # the tokenizer's 262 ids and a few unused rows
# mimo's 'chatml' template, written as a Hugging Face chat template; the assistant's text and
# its end marker are the generation (label) tokens. {{ '\n' }}: HF renders with trim_blocks.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|im_start|>user{{ '\n' }}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{{ '\n' }}{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>{{ '\n' }}"
    "{% else %}<|im_start|>assistant{{ '\n' }}"
    "{% generation %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}<|im_end|>{% endgeneration %}{{ '\n' }}"
    "{% endif %}{% endfor %}"
)

# (turns, images): human turns start with their images' placeholders, as LLaVA data does
CONVERSATIONS = [
    ([("human", "<image>\nWhat colour is the shape?"), ("gpt", "red")], 1),
    ([("human", "What is 2 plus 3?"), ("gpt", "5")], 0),
    ([("human", "<image>\n<image>\nAre the two shapes the same colour?"), ("gpt", "no"), ("human", "Sure?"), ("gpt", "yes, sure")], 2),
    ([("human", "<image>\nDescribe the picture."), ("gpt", "a blue square at the top left of a dark background")], 1),
    ([("human", "<image>\nWhere is it?"), ("gpt", "bottom right")], 1),
    ([("human", "<image>\n<image>\nWhich is larger?"), ("gpt", "the first")], 2),
    ([("human", "Say hi."), ("gpt", "hi")], 0),
]

CASES = {
    # llava-1.5's choices: hidden_states[-2], [CLS] dropped, quick_gelu CLIP, untied head, GQA
    "clip-2-default-untied": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8),
        text=dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        top=dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    ),
    # the last block's output, [CLS] kept, exact-GELU CLIP, tied embeddings, plain MHA
    "clip-1-full-tied": dict(
        vision=dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4,
                    hidden_act="gelu"),
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, tie_word_embeddings=True),
        top=dict(vision_feature_layer=-1, vision_feature_select_strategy="full", tie_word_embeddings=True),
    ),
    # a SigLIP tower (no [CLS], patch bias, tanh GELU, post-norm unused) and a Qwen2 LLM (q/k/v biases)
    "siglip-2-full-qwen2": dict(
        vision_type="siglip_vision_model", text_type="qwen2",
        vision=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=24, patch_size=6),
        text=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        top=dict(vision_feature_layer=-2, vision_feature_select_strategy="full"),
    ),
}


def llava_config(case: str) -> dict:
    import transformers

    c = CASES[case]
    cfg = transformers.LlavaConfig(
        vision_config={"model_type": c.get("vision_type", "clip_vision_model"), **c["vision"]},
        text_config={"model_type": c.get("text_type", "llama"), "vocab_size": VOCAB, "max_position_embeddings": 512,
                     "rms_norm_eps": 1e-5, **c["text"]},
        image_token_id=IMAGE_TOKEN_ID, **c["top"],
    )
    return cfg.to_dict()


def hf_model(config: dict, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlavaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    return transformers.LlavaForConditionalGeneration._from_config(cfg, attn_implementation="eager").float()


def legacy_names(state: dict) -> dict:
    """The current names as published llava-1.5 checkpoints spell them."""
    out = {}
    for k, v in state.items():
        if k == "lm_head.weight":
            k = "language_model.lm_head.weight"
        elif k.startswith("model.language_model."):
            k = "language_model.model." + k[len("model.language_model."):]
        elif k.startswith("model.vision_tower."):
            rest = k[len("model.vision_tower."):]
            k = "vision_tower.vision_model." + (rest[len("vision_model."):] if rest.startswith("vision_model.") else rest)
        elif k.startswith("model.multi_modal_projector."):
            k = k[len("model."):]
        out[k] = v
    return out


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


# --------------------------------------------------------------------------- import / export


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("naming", ["current", "legacy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_export_is_exact(case, naming, dtype):
    config = llava_config(case)
    state = {k: v.to(dtype) for k, v in hf_model(config).state_dict().items()}
    if naming == "legacy":
        state = legacy_names(state)
    w = import_llava_state(state, config)
    assert w.naming is NAMINGS[naming]
    assert_same_state(export_llava_state(w), state)


def test_import_maps_each_part_where_it_belongs():
    config = llava_config("clip-2-default-untied")
    state = hf_model(config).state_dict()
    w = import_llava_state(state, config)
    qkv = w.vision.tower["blocks.1.attn.qkv.weight"].chunk(3)  # fused q | k | v
    for i, x in enumerate("qkv"):
        assert torch.equal(qkv[i], state[f"model.vision_tower.encoder.layers.1.self_attn.{x}_proj.weight"])
    assert torch.equal(w.vision.tower["cls_token"], state["model.vision_tower.embeddings.class_embedding"])
    assert torch.equal(w.projector.tower["linear_2.weight"], state["model.multi_modal_projector.linear_2.weight"])
    gate, up = w.llm["layers.3.up_proj.weight"].chunk(2)  # fused gate | up
    assert torch.equal(gate, state["model.language_model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(up, state["model.language_model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(w.llm["layers.2.norm.weight"], state["model.language_model.layers.1.input_layernorm.weight"])
    assert torch.equal(w.llm["head.weight"], state["lm_head.weight"])
    assert torch.equal(w.llm["embed.weight"], state["model.language_model.embed_tokens.weight"])


def test_export_writes_trained_tensors():
    config = llava_config("clip-1-full-tied")
    state = hf_model(config).state_dict()
    w = import_llava_state(state, config)
    new_embed = torch.randn_like(w.llm["embed.weight"])
    new_fc = torch.randn_like(w.vision.tower["blocks.0.mlp.fc1.weight"])
    new_proj = torch.randn_like(w.projector.tower["linear_1.bias"])
    out = export_llava_state(w, tower={"blocks.0.mlp.fc1.weight": new_fc}, projector={"linear_1.bias": new_proj},
                             llm={"embed.weight": new_embed})
    assert torch.equal(out["model.language_model.embed_tokens.weight"], new_embed)
    assert torch.equal(out["lm_head.weight"], new_embed)  # tied: the head follows the embedding
    assert torch.equal(out["model.vision_tower.encoder.layers.0.mlp.fc1.weight"], new_fc)
    assert torch.equal(out["model.multi_modal_projector.linear_1.bias"], new_proj)
    with pytest.raises(MimoError, match="'embed.weight' has shape"):
        export_llava_state(w, llm={"embed.weight": new_embed[:-1]})


@pytest.mark.parametrize("writer", ["transformers", "current", "legacy"])
def test_checkpoint_directory_round_trip(tmp_path, writer):
    from safetensors.torch import load_file

    config = llava_config("clip-1-full-tied")
    model = hf_model(config)
    if writer == "transformers":  # its own writer: legacy names, tied head not stored (transformers 5)
        model.save_pretrained(tmp_path)
    else:
        state = model.state_dict()
        save_llava(str(tmp_path), legacy_names(state) if writer == "legacy" else state, config)
    want = load_file(tmp_path / "model.safetensors")
    assert not any(k.endswith("lm_head.weight") for k in want)  # tied: stored once
    w = load_llava(str(tmp_path))
    if writer != "transformers":
        assert w.naming is NAMINGS[writer]
    assert_same_state(export_llava_state(w), want)


@pytest.mark.parametrize("writer", ["transformers", "current"])
@pytest.mark.parametrize("case", ["clip-2-default-untied", "clip-1-full-tied"])
def test_module_init_hf_reads_a_llava_checkpoint(tmp_path, writer, case):
    """``init: {hf: DIR}`` of the vision module and of the LLM accept a LLaVA directory: each
    takes its own part (the projector has no such key)."""
    from mimo.encoders.hf_import import import_hf
    from mimo.encoders.weights import materialize
    from mimo.llm.hf import load_hf_checkpoint
    from mimo.llm.model import LLMStage

    config = llava_config(case)
    model = hf_model(config)
    if writer == "transformers":
        model.save_pretrained(tmp_path)
    else:
        save_llava(str(tmp_path), model.state_dict(), config)
    w = load_llava(str(tmp_path))
    stage = LLMStage(w.arch.llm)
    load_hf_checkpoint(stage, str(tmp_path))
    got = stage.full_state()
    assert set(got) == set(w.llm) and all(torch.equal(got[k], w.llm[k]) for k in got)
    tower = import_hf(str(tmp_path), w.arch.vision).tower  # left in the file: read here whole
    assert set(tower) == set(w.vision.tower) and all(torch.equal(materialize(tower[k]), w.vision.tower[k]) for k in tower)
    if writer == "current":  # a misfit language model names its LLaVA key and both shapes
        state = model.state_dict()
        key = "model.language_model.layers.0.mlp.up_proj.weight"
        want = tuple(state[key].shape)
        state[key] = torch.zeros(want[0] + 1, want[1])
        save_llava(str(tmp_path / "misfit"), state, config)
        with pytest.raises(MimoError) as e:
            load_hf_checkpoint(LLMStage(w.arch.llm), str(tmp_path / "misfit"))
        assert f"{key!r} has shape {(want[0] + 1, want[1])}" in str(e.value) and f"needs {want}" in str(e.value), str(e.value)


@pytest.mark.parametrize("naming", ["current", "legacy"])
@pytest.mark.parametrize("part,key_current,shape", [
    ("vision", "model.vision_tower.encoder.layers.1.mlp.fc1.weight", (65, 32)),
    ("vision", "model.vision_tower.embeddings.position_embedding.weight", (17, 31)),
    ("projector", "model.multi_modal_projector.linear_1.weight", (48, 31)),
    ("llm", "model.language_model.layers.1.self_attn.k_proj.weight", (48, 48)),
    ("llm", "lm_head.weight", (VOCAB + 1, 48)),
])
def test_misfit_checkpoint_names_the_key_and_both_shapes(naming, part, key_current, shape):
    config = llava_config("clip-2-default-untied")
    state = hf_model(config).state_dict()
    want_shape = tuple(state[key_current].shape)
    state[key_current] = torch.zeros(shape)
    if naming == "legacy":
        state = legacy_names(state)
    key = [k for k in legacy_names({key_current: None})][0] if naming == "legacy" else key_current
    with pytest.raises(MimoError) as e:
        import_llava_state(state, config)
    msg = str(e.value)
    assert repr(key) in msg and str(shape) in msg and str(want_shape) in msg, msg


def test_structural_problems_are_clear_errors():
    config = llava_config("clip-2-default-untied")
    state = hf_model(config).state_dict()
    mixed = dict(state)
    mixed["language_model.model.norm.weight"] = mixed.pop("model.language_model.norm.weight")
    with pytest.raises(MimoError, match="mixes current LLaVA names"):
        import_llava_state(mixed, config)
    with pytest.raises(MimoError, match="not a LLaVA state dict"):
        import_llava_state({"model.layers.0.mlp.up_proj.weight": torch.zeros(2)}, config)
    stray = {**state, "model.something_else.weight": torch.zeros(2)}
    with pytest.raises(MimoError, match="'model.something_else.weight' belongs to no LLaVA part"):
        import_llava_state(stray, config)
    missing = dict(state)
    del missing["model.language_model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(MimoError, match="no tensor 'model.language_model.layers.1.mlp.down_proj.weight'"):
        import_llava_state(missing, config)
    extra_layer = {**state, "model.language_model.layers.2.input_layernorm.weight": torch.ones(48)}
    with pytest.raises(MimoError, match="layers.2.input_layernorm.weight"):
        import_llava_state(extra_layer, config)
    with pytest.raises(MimoError, match="'llava'"):
        import_llava_state(state, {**config, "model_type": "llama"})


def test_config_builder():
    config = llava_config("clip-2-default-untied")
    arch = llava_arch(config)
    assert (arch.family, arch.feature_layer, arch.drop_class_token, arch.image_token_id) == ("clip", -2, True, IMAGE_TOKEN_ID)
    assert (arch.vision.hidden, arch.vision.layers, arch.vision.act, arch.vision.pre_norm) == (32, 3, "quick_gelu", True)
    assert (arch.llm.pattern, arch.llm.hidden, arch.llm.kv_heads, arch.llm.vocab, arch.llm.tie_embeddings) == ("*-*-", 48, 2, VOCAB, False)
    tied = llava_arch(llava_config("clip-1-full-tied"))
    assert (tied.feature_layer, tied.drop_class_token, tied.llm.tie_embeddings, tied.vision.act) == (-1, False, True, "gelu")
    # a llava-1.5 config.json leaves most sizes to Hugging Face's defaults
    old = {"model_type": "llava", "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
           "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768},
           "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32064},
           "image_token_index": 32000, "vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
    old_arch = llava_arch(old)
    assert (old_arch.llm.hidden, old_arch.llm.pattern.count("*"), old_arch.llm.vocab) == (4096, 32, 32064)
    assert old_arch.vision.patches_per_image == 576
    # the modules section validates as a mimo config
    from mimo.compose.config import config_from_dict

    cfg = config_from_dict({"world_size": 1, "modules": llava_modules(config), "data": {"source": "synthetic", "max_sample_tokens": 512}})
    assert cfg.encoders["vision"].rows_per_image == 16 and cfg.llm.arch == arch.llm
    bad = {**config, "vision_feature_layer": [-2, -1]}
    with pytest.raises(MimoError, match="several feature layers"):
        llava_arch(bad)
    with pytest.raises(MimoError, match="mlp2x_gelu"):
        llava_arch({**config, "projector_hidden_act": "relu"})
    siglip = llava_config("siglip-2-full-qwen2")
    with pytest.raises(MimoError, match="no \\[CLS\\] row"):
        llava_arch({**siglip, "vision_feature_select_strategy": "default"})


def test_import_hf_llava_command(tmp_path, capsys):
    from mimo.commands.cli import main
    from mimo.compose.config import config_from_dict

    config = llava_config("clip-2-default-untied")
    model = hf_model(config)
    model.save_pretrained(tmp_path / "llava")
    out = tmp_path / "modules.yaml"
    assert main(["import-hf-llava", str(tmp_path / "llava"), "--yaml", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["tensors"] == len(model.state_dict()) and result["projector_loaded"] is False
    modules = yaml.safe_load(out.read_text())["modules"]
    assert modules["vision"]["init"]["hf"] == str(tmp_path / "llava") and modules["language"]["init"]["hf"] == str(tmp_path / "llava")
    cfg = config_from_dict({"world_size": 1, "modules": modules, "data": {"source": "synthetic", "max_sample_tokens": 512}})
    assert cfg.llm.arch == llava_arch(config).llm
    # a misfit checkpoint: exit 2, the key and both shapes, no traceback
    state = model.state_dict()
    state["model.multi_modal_projector.linear_2.bias"] = torch.zeros(47)
    save_llava(str(tmp_path / "misfit"), state, config)
    assert main(["import-hf-llava", str(tmp_path / "misfit")]) == 2
    err = capsys.readouterr().err
    assert "'model.multi_modal_projector.linear_2.bias' has shape (47,), the config expects (48,)" in err, err
    assert main(["import-hf-llava", str(tmp_path / "nowhere")]) == 2


def _full_params_from(config_path: str, checkpoint: str) -> dict:
    """On a pool: a model at the config's layout loaded from a mimo checkpoint; the full
    tensors each module's reporting rank (tp = dp = 0) holds."""
    import torch.distributed as dist

    from mimo.training.checkpoint import load_checkpoint
    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel

    model = MimoModel(load_config(config_path), dist.get_rank())
    load_checkpoint(model, checkpoint, rng=False)
    full = model.full_params()  # collective over each TP group
    grids = {part.name: part.grid for part in model.parts}
    return {name: t for name, t in full.items() if all(v == 0 for k, v in grids[name].coords(model.rank).items() if k != "pp")}


def test_import_to_a_mimo_checkpoint_at_a_layout(pools, tmp_path, capsys):
    """``--config``: the LLaVA weights become a mimo checkpoint at the config's layout (here
    the tower data-parallel, the LLM tensor-parallel on 2 ranks), projector included."""
    from mimo.commands.cli import main

    config = llava_config("clip-2-default-untied")
    hf_model(config).save_pretrained(tmp_path / "llava")
    modules = llava_modules(config)
    modules["vision"]["parallel"] = {"tp": 1, "dp": 2}
    modules["language"]["parallel"] = {"tp": 2, "dp": 1}
    path = tmp_path / "mimo.yaml"
    path.write_text(yaml.safe_dump({"world_size": 2, "modules": modules, "data": {"source": "synthetic", "max_sample_tokens": 512}}))
    out = tmp_path / "converted"
    assert main(["import-hf-llava", str(tmp_path / "llava"), "--config", str(path), "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["out"] == str(out / "step-00000000")
    per_rank = pools(2).run(_full_params_from, str(path), result["out"])
    got = {name: t for r in per_rank for name, t in r.items()}
    w = load_llava(str(tmp_path / "llava"))
    runs = {k: v for k, v in w.vision.tower.items() if not k.startswith(("blocks.2.", "norm."))}  # hidden_states[-2] of 3 blocks
    want = {"vision": {**{f"tower.{k}": v for k, v in runs.items()}, **{f"projector.{k}": v for k, v in w.projector.tower.items()}},
            "language": w.llm}
    for module in want:
        assert set(got[module]) == set(want[module]), module
        for k, t in want[module].items():
            assert torch.equal(got[module][k], t), (module, k)
    # a config that does not fit fails before any process starts: exit 2 with the reason
    bad = tmp_path / "bad.yaml"
    modules["language"]["arch"]["norm_eps"] = 1e-3
    bad.write_text(yaml.safe_dump({"world_size": 2, "modules": modules, "data": {"source": "synthetic", "max_sample_tokens": 512}}))
    assert main(["import-hf-llava", str(tmp_path / "llava"), "--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "arch.norm_eps is 0.001" in capsys.readouterr().err
    assert main(["import-hf-llava", str(tmp_path / "llava"), "--config", str(path)]) == 2  # no --out


# --------------------------------------------------------------------------- whole-model parity


def _images(rng: np.random.Generator, n: int, size: int):
    from PIL import Image

    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_tokenizer(path: str):
    """A byte-level tokenizer with the chat and image specials, saved like a hub tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   extra_special_tokens={"image_token": "<image>"})
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    fast.save_pretrained(path)


def write_shards(path: str, samples) -> None:
    """mimo's data: LLaVA-style json conversations with their PNG images."""
    import webdataset as wds

    with wds.TarWriter(path) as sink:
        for i, (turns, images) in enumerate(samples):
            conv = [{"from": role, "value": text} for role, text in turns]
            record = {"__key__": f"{i:06d}", "json": json.dumps({"conversations": conv}).encode()}
            if len(images) == 1:
                record["png"] = _png(images[0])
            for j, img in enumerate(images if len(images) > 1 else []):
                record[f"{j}.png"] = _png(img)
            sink.write(record)


def hf_messages(turns, images) -> list[dict]:
    """The same conversation as Hugging Face chat messages (images as content items)."""
    out, pending = [], list(images)
    for role, text in turns:
        if role == "gpt":
            out.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
            continue
        content = []
        while text.startswith("<image>\n"):
            content.append({"type": "image", "image": pending.pop(0)})
            text = text[len("<image>\n"):]
        out.append({"role": "user", "content": content + [{"type": "text", "text": text}]})
    assert not pending
    return out


def hf_processor(tokenizer_dir: str, config: dict):
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    vision = config["vision_config"]
    size = vision["image_size"]
    return LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        patch_size=vision["patch_size"],
        vision_feature_select_strategy=config["vision_feature_select_strategy"],
        num_additional_image_tokens=1 if vision["model_type"] == "clip_vision_model" else 0,  # CLIP's [CLS]
        chat_template=CHAT_TEMPLATE,
    )


def _choose_microbatches(config_path: str, samples: int, micro_batches: int) -> int:
    """A tokens_per_microbatch whose first step holds every sample exactly once."""
    from mimo.compose.config import load_config
    from mimo.data.plan import DataPlan
    from mimo.compose.inputs import ensure_index

    config = load_config(config_path)
    index, _ = ensure_index(config)
    lengths = [e.tokens for e in index.entries]
    for tpm in range(max(lengths), sum(lengths) + 1):
        plan = DataPlan(index, tpm, max(lengths), config.data.seed, config.data.shuffle)
        ids = [s.id for mb in plan.step(1, micro_batches) for s in mb]
        if sorted(ids) == list(range(samples)) and all(plan.step(1, micro_batches)):
            return tpm
    raise AssertionError("no tokens_per_microbatch splits the samples into one step")


def write_parity_case(root, config: dict) -> dict:
    """The parity conversations and images as a shard, the tokenizer, ``config``'s random LLaVA
    saved by transformers, and a world-1 mimo config that takes all samples in one step of two
    microbatches: {config, samples, root, mimo_config}."""
    size = config["vision_config"]["image_size"]
    rng = np.random.default_rng(0)
    samples = [(turns, _images(rng, n, size)) for turns, n in CONVERSATIONS]
    make_tokenizer(str(root / "tokenizer"))
    write_shards(str(root / "train-000000.tar"), samples)
    hf_model(config, seed=1).save_pretrained(root / "llava")
    raw = {
        "world_size": 1,
        "modules": llava_modules(config),
        "data": {"shards": str(root / "train-000000.tar"), "tokenizer": str(root / "tokenizer"), "template": "chatml",
                 "tokens_per_microbatch": 512, "max_sample_tokens": 512, "workers": 1},
        "train": {"micro_batches": 2, "steps": 1, "precision": "fp32", "grad_clip": None, "checkpoint": {"dir": str(root / "ckpt")}},
    }
    path = root / "mimo.yaml"
    path.write_text(yaml.safe_dump(raw))
    raw["data"]["tokens_per_microbatch"] = _choose_microbatches(str(path), len(samples), 2)
    raw["data"]["max_sample_tokens"] = min(512, raw["data"]["tokens_per_microbatch"])
    path.write_text(yaml.safe_dump(raw))
    return {"config": config, "samples": samples, "root": root, "mimo_config": str(path)}


@pytest.fixture(scope="module", params=list(CASES))
def parity_setup(request, tmp_path_factory):
    case = request.param
    return {"case": case, **write_parity_case(tmp_path_factory.mktemp(case), llava_config(case))}


def _mimo_step(config_path: str, checkpoint: str) -> dict:
    """On a one-rank pool: mimo's own step (data pipeline, PackedBatch, MimoModel) on the
    imported LLaVA weights; loss, loss tokens, the step's samples, every gradient before clipping."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.commands.hf_llava import load_llava_
    from mimo.training.precision import PrecisionPolicy
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config = load_config(config_path)
    run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
    load_llava_(run.model, load_llava(checkpoint))
    got = {}
    result = train_step(run.model, run.pipeline, 1, run.optimizers, on_grads=lambda model, norm: got.update(grads=model.full_grads()))
    ids = [[s.id for s in mb] for mb in run.pipeline.plan.step(1, config.train.micro_batches)]
    run.close()
    return {"loss": result.loss, "loss_tokens": result.loss_tokens, "grads": got["grads"], "microbatches": ids}


def _load_error(config_path: str, checkpoint: str, overrides: list[str]) -> str:
    """On a one-rank pool: the message of loading the checkpoint into a model that does not fit."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.commands.hf_llava import load_llava_
    from mimo.compose.model import MimoModel

    model = MimoModel(load_config(config_path, overrides), dist.get_rank())
    try:
        load_llava_(model, load_llava(checkpoint))
    except MimoError as e:
        return str(e)
    return "loaded"


def test_a_model_that_does_not_fit_is_a_clear_error(pools, parity_setup):
    cfg, ckpt = parity_setup["mimo_config"], str(parity_setup["root"] / "llava")
    pool = pools(1)
    msg = pool.run(_load_error, cfg, ckpt, ["modules.language.arch.ffn=72"])[0]
    assert "'layers.1.up_proj.weight' has shape" in msg and "needs (144," in msg, msg  # gate | up: 2 x ffn rows
    msg = pool.run(_load_error, cfg, ckpt, ["modules.language.arch.norm_eps=0.001"])[0]
    assert "modules.language.arch.norm_eps is 0.001" in msg, msg
    msg = pool.run(_load_error, cfg, ckpt, ["modules.vision.arch.mlp=24"])[0]
    assert "modules.vision.arch" in msg and "vision tower" in msg, msg
    assert pool.run(_load_error, cfg, ckpt, [])[0] == "loaded"


def _hf_batch(setup):
    proc = hf_processor(str(setup["root"] / "tokenizer"), setup["config"])
    conversations = [hf_messages(turns, images) for turns, images in setup["samples"]]
    batch = proc.apply_chat_template(conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     return_tensors="pt", processor_kwargs={"padding": True})
    labels = batch["input_ids"].masked_fill(batch["assistant_masks"] == 0, -100)
    return batch, labels


def test_whole_model_parity_with_hugging_face(pools, parity_setup):
    from transformers import LlavaForConditionalGeneration

    from mimo.compose.config import load_config

    setup = parity_setup
    ckpt = str(setup["root"] / "llava")
    mimo = pools(1).run(_mimo_step, setup["mimo_config"], ckpt)[0]
    assert sorted(i for mb in mimo["microbatches"] for i in mb) == list(range(len(CONVERSATIONS)))
    assert len(mimo["microbatches"]) == 2 and all(mimo["microbatches"])

    model = LlavaForConditionalGeneration.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float32)
    batch, labels = _hf_batch(setup)
    assert (batch["input_ids"] == IMAGE_TOKEN_ID).sum() == sum(len(im) for _, im in setup["samples"]) * (
        load_config(setup["mimo_config"]).encoders["vision"].rows_per_image)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                labels=labels)
    out.loss.backward()

    # label masking: the same tokens carry the loss (HF shifts labels by one inside the loss)
    assert mimo["loss_tokens"] == int((labels[:, 1:] != -100).sum())
    assert abs(mimo["loss"] - out.loss.item()) / out.loss.item() <= TOL

    w = import_llava_state(model.state_dict(), setup["config"])  # the names of model.named_parameters()
    mapped = export_llava_grads(w, mimo["grads"]["vision"], mimo["grads"]["language"])
    want = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}
    errs = {}
    for name, g in want.items():
        if name.endswith("k_proj.bias"):
            # scores shift by q.b_k for every key alike, which softmax ignores: the exact gradient
            # is 0 and both sides hold rounding noise; measure it against the layer's key weights
            scale = torch.linalg.vector_norm(want[name.replace("k_proj.bias", "k_proj.weight")].double()).item() or 1.0  # 1.0: an unused layer, both 0
            errs[name] = torch.linalg.vector_norm((mapped[name] - g).double()).item() / scale
        else:
            errs[name] = rel_err(mapped[name], g)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
    # the comparison has teeth: real gradients everywhere it should
    assert torch.linalg.vector_norm(model.model.multi_modal_projector.linear_1.weight.grad) > 0
    assert torch.linalg.vector_norm(model.model.vision_tower.embeddings.patch_embedding.weight.grad) > 0


def test_parity_would_catch_scatter_and_normalisation_bugs(parity_setup):
    """What the parity test compares is sensitive: per-sample loss averaging (instead of the
    batch's per-token mean) changes the loss, and two samples' images exchanged change the loss
    and the projector's gradient, by more than the tolerance."""
    from transformers import LlavaForConditionalGeneration

    setup = parity_setup
    model = LlavaForConditionalGeneration.from_pretrained(str(setup["root"] / "llava"), attn_implementation="eager",
                                                          dtype=torch.float32)
    batch, labels = _hf_batch(setup)
    args = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    out = model(**args, pixel_values=batch["pixel_values"])
    with torch.no_grad():
        tok = torch.nn.functional.cross_entropy(out.logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none", ignore_index=-100)
        counts = (labels[:, 1:] != -100).sum(1)
        assert torch.allclose(tok.sum() / counts.sum(), out.loss, rtol=1e-6)  # HF: the batch's per-token mean
        per_sample = (tok.sum(1) / counts).mean()
        assert abs(per_sample - out.loss) / out.loss > 10 * TOL
    projector = model.model.multi_modal_projector.linear_1.weight
    grad = torch.autograd.grad(out.loss, projector)[0]
    swapped = batch["pixel_values"][[1, 0, *range(2, batch["pixel_values"].shape[0])]]  # two samples' images exchanged
    out_swapped = model(**args, pixel_values=swapped)
    assert abs(out_swapped.loss.item() - out.loss.item()) / out.loss.item() > 2 * TOL
    assert rel_err(torch.autograd.grad(out_swapped.loss, projector)[0], grad) > 100 * TOL


def test_pixels_match_the_hugging_face_processor(parity_setup):
    """mimo's image preprocessing gives the processor's pixel values (CLIP mean / std)."""
    from mimo.compose.config import load_config
    from mimo.data.images import preprocess
    from mimo.compose.inputs import image_spec

    setup = parity_setup
    spec = image_spec(load_config(setup["mimo_config"]).encoders["vision"])
    images = [im for _, ims in setup["samples"] for im in ims]
    proc = hf_processor(str(setup["root"] / "tokenizer"), setup["config"])
    want = proc.image_processor(images, return_tensors="pt")["pixel_values"]
    got = torch.stack([preprocess(im, spec) for im in images])
    assert rel_err(got, want) <= 1e-6

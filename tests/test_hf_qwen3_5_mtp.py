"""Qwen3.5's multi-token prediction weights (``mtp.*``, issue 48 item 2) through import and export.

transformers has no MTP module (it drops ``mtp.*`` on load), so the tests write one as serving
engines read it: ``fc`` over [embedding | hidden], zero-centred ``pre_fc_norm_embedding`` /
``pre_fc_norm_hidden``, one full-attention decoder layer of transformers' own class (MoE for
Qwen3.5-MoE), ``norm``; the head is the model's. On tiny random Qwen3.5 and Qwen3.5-MoE models
(text; the MoE also as a VLM):

* ``import-hf`` gives ``arch.mtp`` where the checkpoint holds ``mtp.*`` (and none where it does
  not, whatever config.json says), and a checkpoint's ``mtp.*`` loaded into a model without MTP
  is said (a warning), not an error;
* the loaded MTP's losses equal the module above run by transformers' layers per sample, from
  the same main hidden states (fp64);
* import -> mimo checkpoint -> export keeps every ``mtp.*`` tensor under its name, bit-equal, and
  the config says ``mtp_num_hidden_layers: 1``; a family without MTP weights refuses arch.mtp.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from mimo.core.errors import MimoError
from mimo.llm import hf
from mimo.llm.config import MTPArch
from mimo.llm.model import LLMStage
from mimo.llm.verify import pack_samples, randomize_

from test_hf_qwen3_5 import ARCH, _modules, _raw, _same_tensors, _text_config, _vlm_config

import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as qd
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm

LENS = [9, 3, 17, 5]


class QwenMTP(nn.Module):
    """Qwen3.5's ``mtp.*`` module from transformers' layers (the state dict names of a checkpoint)."""

    def __init__(self, config):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        moe = hasattr(config, "num_experts")
        norm, layer = (qm.Qwen3_5MoeRMSNorm, qm.Qwen3_5MoeDecoderLayer) if moe else (qd.Qwen3_5RMSNorm, qd.Qwen3_5DecoderLayer)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm(d, eps=eps), norm(d, eps=eps)
        full = config.layer_types.index("full_attention")  # a layer index of full attention
        self.layers = nn.ModuleList([layer(config, full)])
        self.norm = norm(d, eps=eps)

    def forward(self, e, h, position_embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], -1))
        n = x.shape[1]
        causal = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        out = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=causal,
                             position_ids=torch.arange(n)[None])
        return self.norm(out[0] if isinstance(out, tuple) else out)


def _with_mtp(path: str, config, seed: int) -> dict[str, torch.Tensor]:
    """Write a random MTP module beside the checkpoint in ``path`` (mtp.safetensors, and
    ``mtp_num_hidden_layers`` in config.json, at the top or in text_config); its tensors."""
    torch.manual_seed(seed)
    mtp = QwenMTP(config).float()
    randomize_(mtp, seed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "norm" in name:  # zero-centred: away from the identity
                p.copy_(torch.randn_like(p) * 0.3)
    tensors = {f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, os.path.join(path, "mtp.safetensors"))
    cfg_file = os.path.join(path, "config.json")
    cfg = json.loads(open(cfg_file).read())
    (cfg.get("text_config") or cfg)["mtp_num_hidden_layers"] = 1
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    return tensors


@pytest.fixture(scope="module", params=["moe", "dense"])
def text_moe(request, tmp_path_factory):
    """A Qwen3.5(-MoE) causal LM (eager attention and experts), saved with an MTP module; (model,
    its MTP module, the directory)."""
    config = _text_config(request.param)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                                          experts_implementation="eager")
    randomize_(model, 0)
    path = str(tmp_path_factory.mktemp(f"qwen3_5-{request.param}-mtp"))
    model.save_pretrained(path)
    mtp_tensors = _with_mtp(path, model.config, 1)
    mtp = QwenMTP(model.config)
    mtp.load_state_dict({k[len("mtp."):]: v for k, v in mtp_tensors.items()})
    for layer in mtp.layers:  # the layer's attention and experts as the model's
        layer.config = model.config
    return model.eval(), mtp.eval(), path


def _stage(path: str) -> LLMStage:
    ckpt = hf.HFCheckpoint(path)
    arch = hf.with_checkpoint_mtp(hf.arch_from_hf_config(ckpt.config), ckpt.keys())
    stage = LLMStage(arch)
    hf.load_hf_checkpoint(stage, path)
    return stage.eval()


def test_mtp_losses_equal_transformers_layers(text_moe):
    model, mtp, path = text_moe
    stage = _stage(path).double()
    model, mtp = model.double(), mtp.double()
    moe = stage.arch.moe is not None
    assert stage.arch.mtp == MTPArch(depth=1) and stage.arch.mtp.block(stage.arch) == ("*E" if moe else "*-")
    gen = torch.Generator().manual_seed(4)
    toks = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in LENS]
    batch = pack_samples(toks)
    hidden, want = [], 0.0
    with torch.no_grad():
        for t in toks:
            n = t.numel()
            h = model.model(input_ids=t[None]).last_hidden_state  # the main model's, final-normed
            hidden.append(h[0])
            ahead = torch.cat([t[1:], torch.zeros(1, dtype=torch.long)])  # token t + 1 (none past the end)
            pos = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
            x = mtp(model.model.embed_tokens(ahead[None]), h, model.model.rotary_emb(h, pos))
            logits = model.lm_head(x)[0, : max(n - 2, 0)]
            want += float(F.cross_entropy(logits, t[2:], reduction="sum")) if n > 2 else 0.0
        (got,) = stage.mtp_losses(torch.cat(hidden), batch)
    assert want > 0
    assert float(got) == pytest.approx(want, rel=1e-6)  # (transformers' router softmax runs in fp32)


def test_describe_sets_mtp_only_where_the_checkpoint_has_it(text_moe, tmp_path, capsys, caplog):
    _, _, path = text_moe
    result = _modules(path, tmp_path, capsys)
    assert result["modules"]["language"]["arch"]["mtp"] == {"depth": 1, "loss_weight": 0.1, "pattern": None} or \
        result["modules"]["language"]["arch"]["mtp"]["depth"] == 1
    bare = tmp_path / "bare"  # the same config.json (mtp_num_hidden_layers: 1), no mtp.* file
    bare.mkdir()
    for f in os.listdir(path):
        if f != "mtp.safetensors":
            os.link(os.path.join(path, f), bare / f)
    assert "mtp" not in _modules(str(bare), tmp_path, capsys)["modules"]["language"]["arch"]
    ckpt = hf.HFCheckpoint(path)  # a model without MTP loads the rest and says what it leaves
    stage = LLMStage(hf.arch_from_hf_config(ckpt.config))
    with caplog.at_level(logging.WARNING, logger="mimo.llm.hf"):
        hf.load_hf_checkpoint(stage, path)
    assert "mtp.* tensors (multi-token prediction) are not loaded" in caplog.text


def test_text_round_trip_keeps_mtp(text_moe):
    _, _, path = text_moe
    stage = _stage(path)
    source = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            source.update(load_file(os.path.join(path, f)))
    back = hf.export_hf_state(stage.full_state(), stage.arch)
    assert sorted(k for k in back if k.startswith("mtp.")) == sorted(k for k in source if k.startswith("mtp."))
    mtp = sorted(k for k in back if k.startswith("mtp."))  # (the rest: test_hf_qwen3_5's round trips)
    _same_tensors({k: source[k] for k in mtp}, {k: back[k] for k in mtp})
    assert hf.hf_config_from_arch(stage.arch)["mtp_num_hidden_layers"] == 1


def test_vlm_round_trip_keeps_mtp(pools, tmp_path, capsys):
    """import-hf -> a mimo checkpoint at tp 2 -> export-hf: every tensor back under its name,
    mtp.* at the top level as Qwen3.5's checkpoints have them."""
    from mimo.commands.export_hf import export_hf
    from mimo.commands.hf_qwen3_vl import import_to_checkpoint
    from mimo.commands.verify_hf import randomize_vlm_

    model = transformers.Qwen3_5MoeForConditionalGeneration(_vlm_config("moe"))
    randomize_vlm_(model, 3)
    path = str(tmp_path / "src")
    model.save_pretrained(path)
    mtp = _with_mtp(path, model.config.text_config, 2)
    modules = _modules(path, tmp_path, capsys)["modules"]
    assert modules["language"]["arch"]["mtp"]["depth"] == 1
    for m in modules.values():
        m["parallel"] = {"tp": 2, "dp": 1}
        m.pop("init")
    (tmp_path / "mimo.yaml").write_text(yaml.safe_dump(_raw(modules, 2)))
    result = import_to_checkpoint(path, str(tmp_path / "mimo.yaml"), [], str(tmp_path / "ckpt"), pool=pools(2))
    out = tmp_path / "hf"
    assert export_hf(result["out"], str(out))["architecture"] == ARCH["moe"][1]
    back = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            back.update(load_file(str(out / f)))
    assert sorted(k for k in back if k.startswith("mtp.")) == sorted(mtp)
    _same_tensors(mtp, {k: back[k] for k in mtp})
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    cls = transformers.Qwen3_5MoeForConditionalGeneration  # transformers still loads it (and drops mtp.*)
    _same_tensors(model.state_dict(), cls.from_pretrained(str(out)).state_dict())


def test_families_without_mtp_weights_refuse_it():
    arch = hf.arch_from_hf_config(_text_config("moe").to_dict())
    bad = hf.with_checkpoint_mtp(arch, ["mtp.fc.weight"])
    assert hf.hf_config_from_arch(bad)["mtp_num_hidden_layers"] == 1
    bad.mtp.depth = 2
    with pytest.raises(MimoError, match="one depth"):
        hf.hf_config_from_arch(bad)
    llama = hf.arch_from_hf_config({"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 32,
                                    "num_hidden_layers": 2, "num_attention_heads": 2})
    with pytest.raises(MimoError, match="no multi-token prediction weights"):
        hf.hf_config_from_arch(hf.with_checkpoint_mtp(llama, ["mtp.fc.weight"]), "llama")

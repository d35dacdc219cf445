"""Hugging Face import / export and ``mimo verify-llm`` (small random Llama, Qwen2, Qwen3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mimo.core.errors import MimoError
from mimo.llm.config import HybridArch
from mimo.llm.hf import (
    HFCheckpoint,
    arch_from_hf_config,
    export_hf_state,
    hf_config_from_arch,
    hf_name_map,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from mimo.llm.model import LLMStage
from mimo.llm.verify import pack_samples, randomize_, verify_llm

SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "llama": ("LlamaConfig", dict(SMALL)),
    "llama_bias": ("LlamaConfig", dict(SMALL, attention_bias=True)),
    "qwen2": ("Qwen2Config", dict(SMALL)),
    "qwen3_tied": ("Qwen3Config", dict(SMALL, head_dim=12, tie_word_embeddings=True)),  # head_dim != 32/4
}


def hf_config(name: str):
    import transformers

    cls, kw = MODELS[name]
    return getattr(transformers, cls)(**kw)


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """Model directories holding only config.json (verify-llm initialises them randomly)."""
    root = tmp_path_factory.mktemp("hf-configs")
    out = {}
    for name in MODELS:
        hf_config(name).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def hf_model(name: str, seed: int = 0):
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


# ---------------------------------------------------------------- verify-llm

LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, True)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp,pp,sp", LAYOUTS, ids=[f"tp{t}-pp{p}{'-sp' if s else ''}" for t, p, s in LAYOUTS])
def test_verify_llm(pools, config_dirs, name, tp, pp, sp):
    report = verify_llm(config_dirs[name], pools(4), from_checkpoint=False, tp=tp, pp=pp, sequence_parallel=sp,
                        samples=5, max_len=16, seed=3)
    assert report["ok"], report
    assert report["export_exact"] and report["yardstick"]["checked"] == len(report["samples"]) + 1  # each sample's logits, the loss
    assert 1 in report["samples"]


def test_verify_llm_cli_checkpoint(tmp_path):
    """End to end through the command line, from a checkpoint directory."""
    ckpt = tmp_path / "ckpt"
    hf_model("qwen3_tied").save_pretrained(ckpt)
    run = subprocess.run([sys.executable, "-m", "mimo", "verify-llm", "--hf-checkpoint", str(ckpt), "--tp", "2"],
                         capture_output=True, text=True, timeout=600)
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0 and last["ok"] and not last["yardstick"]["failed"], run.stdout + run.stderr
    # a layout the model cannot take: a message and exit 2, before any process starts
    run = subprocess.run([sys.executable, "-m", "mimo", "verify-llm", "--hf-config", str(ckpt), "--tp", "3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "tp=3 must divide" in run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["ok"] is False


# ---------------------------------------------------------------- import reads only local slices


def sliced_import_case(path: str, tp: int, pp: int) -> dict | None:
    """Import ``path`` at tp x pp, counting what is read: (elements read, elements this rank's
    parameters hold, whole-tensor reads), and the stage's full state."""
    import torch.distributed as dist

    from mimo.llm.model import build_stage
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid

    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": 1, "pp": pp})
    stage = build_stage(arch_from_hf_config(HFCheckpoint(path).config), ParallelContext(grid, dist.get_rank(), grid.registry))
    if stage is None:
        return None
    read, whole = [0], [0]

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, index):
            t = self.inner[index]
            read[0] += t.numel()
            return t

    real_slice, real_get = HFCheckpoint.slice, HFCheckpoint.get
    HFCheckpoint.slice = lambda self, name: Counting(real_slice(self, name))
    HFCheckpoint.get = lambda self, name: whole.__setitem__(0, whole[0] + 1) or real_get(self, name)
    try:
        load_hf_checkpoint(stage, path)
    finally:
        HFCheckpoint.slice, HFCheckpoint.get = real_slice, real_get
    # what this rank holds, padding (a vocab not divisible by tp) left out
    held = sum(torch.Size([s.stop - s.start for s in full]).numel()
               for info in stage.param_table().values() for full, _ in info.placement.runs(info.sizes, info.coords))
    return {"read": read[0], "held": held, "local": sum(p.numel() for p in stage.parameters()),
            "whole": whole[0], "state": stage.full_state(), "tp_rank": stage.tp_rank}


@pytest.mark.parametrize("name", ["llama_bias", "qwen3_tied"])
def test_import_reads_only_this_ranks_slices(pools, tmp_path, name):
    model = hf_model(name, seed=4)
    model.save_pretrained(tmp_path)
    arch = arch_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    want = LLMStage(arch)
    load_hf_checkpoint(want, str(tmp_path))
    want = want.full_state()
    results = [r for r in pools(4).run(sliced_import_case, str(tmp_path), 2, 2) if r is not None]
    assert len(results) == 4
    for r in results:
        assert r["whole"] == 0 and r["read"] == r["held"] and r["held"] <= r["local"], {k: r[k] for k in ("read", "held", "local", "whole")}
        for k, t in r["state"].items():
            assert torch.equal(t, want[k]), k
    # two TP ranks read half of every sharded tensor each: together far less than two whole copies
    assert sum(r["read"] for r in results) < 2 * sum(t.numel() for t in want.values())


# ---------------------------------------------------------------- import / export in one process


@pytest.mark.parametrize("name", list(MODELS))
def test_import_matches_and_export_reproduces_state_dict(tmp_path, name):
    model = hf_model(name, seed=1)
    theirs = model.state_dict()
    model.save_pretrained(tmp_path)
    arch = arch_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    stage = LLMStage(arch)
    load_hf_checkpoint(stage, str(tmp_path))

    exported = export_hf_state(stage.full_state(), arch)
    assert list(exported) == list(theirs)  # same names, same order
    for k in theirs:
        assert torch.equal(exported[k], theirs[k]), k

    toks = [torch.randint(0, arch.vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (1, 9, 4)]
    ours = stage(pack_samples(toks)).detach()
    cu = [0, 1, 10, 14]
    with torch.no_grad():
        for i, t in enumerate(toks):
            want = model(input_ids=t[None]).logits[0]
            assert torch.linalg.vector_norm(ours[cu[i] : cu[i + 1]] - want) <= 1e-5 * torch.linalg.vector_norm(want)

    if name == "llama":  # the comparison is sensitive: a wrong RoPE base is far outside the tolerance
        wrong = LLMStage(HybridArch(**{**arch.__dict__, "rope_theta": 2 * arch.rope_theta}))
        load_hf_checkpoint(wrong, str(tmp_path))
        with torch.no_grad():
            want = model(input_ids=toks[1][None]).logits[0]
        assert torch.linalg.vector_norm(wrong(pack_samples(toks))[1:10] - want) > 1e-2 * torch.linalg.vector_norm(want)

    # and back: our export saved as a checkpoint loads into Hugging Face with the same weights
    out = tmp_path / "exported"
    save_hf_checkpoint(str(out), exported, hf_config_from_arch(arch, model.config.model_type))
    import transformers

    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.equal(again.state_dict()[k], theirs[k]) for k in theirs)


def test_config_round_trip():
    for name in MODELS:
        cfg = hf_config(name).to_dict()
        arch = arch_from_hf_config(cfg)
        assert arch_from_hf_config(hf_config_from_arch(arch, cfg["model_type"])) == arch
    qwen3 = arch_from_hf_config(hf_config("qwen3_tied").to_dict())
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.tie_embeddings, qwen3.pattern) == (12, True, True, "*-*-")
    qwen2 = arch_from_hf_config(hf_config("qwen2").to_dict())
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    assert hf_name_map(qwen2)["layers.3.down_proj.weight"] == ("model.layers.1.mlp.down_proj.weight",)
    # fused weights: Hugging Face's tensors concatenated along dim 0, in this order
    assert hf_name_map(qwen2)["layers.2.qkv.bias"] == tuple(f"model.layers.1.self_attn.{x}_proj.bias" for x in "qkv")
    assert hf_name_map(qwen2)["layers.3.up_proj.weight"] == ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")


def test_unsupported_configs_are_clear_errors():
    base = hf_config("llama").to_dict()
    for change, message in [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "RoPE type 'yarn'"),
    ]:
        with pytest.raises(MimoError, match=message):
            arch_from_hf_config({**base, **change})
    with pytest.raises(MimoError, match="pattern '\\*-M' is not"):
        hf_name_map(HybridArch(pattern="*-M", hidden=32, heads=4, vocab=61))


def test_misfit_checkpoint_names_the_first_bad_tensor(tmp_path):
    model = hf_model("llama_bias")
    model.save_pretrained(tmp_path)
    good = arch_from_hf_config(json.loads((tmp_path / "config.json").read_text()))

    wider = LLMStage(HybridArch(**{**good.__dict__, "ffn": 48}))
    with pytest.raises(MimoError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(40, 32\), but the model's "
                                        r"'layers\.1\.up_proj\.weight' \(rows 0:48, part 1 of 2\) needs \(48, 32\)"):
        load_hf_checkpoint(wider, str(tmp_path))
    unbiased = LLMStage(HybridArch(**{**good.__dict__, "qkv_bias": False, "o_bias": False}))
    with pytest.raises(MimoError, match=r"'model\.layers\.0\.self_attn\.k_proj\.bias' \(shape \(16,\)\) has no place in the model"):
        load_hf_checkpoint(unbiased, str(tmp_path))
    deeper = LLMStage(HybridArch(**{**good.__dict__, "pattern": "*-*-*-"}))
    with pytest.raises(MimoError, match=r"no tensor 'model\.layers\.2\.self_attn\.q_proj\.weight' \(the model's 'layers\.4\.qkv\.weight' "
                                        r"\(rows 0:32, part 1 of 3\), shape \(32, 32\)\)"):
        load_hf_checkpoint(deeper, str(tmp_path))

    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(MimoError, match="no \\*.safetensors"):
        HFCheckpoint(str(tmp_path))

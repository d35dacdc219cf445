"""``mimo export-hf`` and the verify commands on LLaVA directories.

Round trip per text model / tower pair (Llama + CLIP, Qwen2 + SigLIP): a tiny Hugging Face
LLaVA -> ``mimo import-hf-llava`` (vision and LLM tp 2, colocated on 2 ranks) -> ``mimo train``
(one step) -> ``mimo export-hf`` of the run directory -> ``LlavaForConditionalGeneration`` loads
it with no missing or unexpected key, and its logits on the step's own microbatch equal mimo's
forward of the trained checkpoint at its layout (the fp64 yardstick, tol 1e-5); ``--llm-only``
loads as ``AutoModelForCausalLM`` with the same language-model logits; the image processor
written beside it gives mimo's pixels. The same weights imported at tp 1 and tp 2 export to
byte-identical files. ``verify-encoder`` / ``verify-llm`` accept the exported LLaVA directory,
and one with a tensor removed is an exit 2 naming it.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
import yaml

from mimo.commands.cli import main
from mimo.core.testing import Yardstick, rel_err

from test_hf_llava import CONVERSATIONS, _images, hf_model, llava_config, llava_modules, make_tokenizer, write_shards

TOL = 1e-5
CASES = ["clip-2-default-untied", "siglip-2-full-qwen2"]  # llama + CLIP, qwen2 + SigLIP


def _write_config(root, config: dict, tp: int, name: str, init_from: str | None = None) -> str:
    modules = llava_modules(config)
    for m in modules.values():
        m["parallel"] = {"tp": tp, "dp": 1}
    raw = {
        "world_size": tp, "modules": modules,
        "data": {"shards": str(root / "train-000000.tar"), "tokenizer": str(root / "tokenizer"), "template": "chatml",
                 "tokens_per_microbatch": 512, "max_sample_tokens": 512, "workers": 1},
        "train": {"micro_batches": 1, "steps": 1, "lr": 1e-2, "precision": "fp32", "grad_clip": None,
                  "checkpoint": {"dir": str(root / name / "ckpt")}, "init_from": init_from},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


_BUILT: dict[str, dict] = {}


def llava_source(case: str, root) -> tuple[dict, list]:
    """The case's tiny LLaVA saved in ``root/llava``, a tokenizer and one shard of four samples
    beside it; (its config, the samples)."""
    config = llava_config(case)
    rng = np.random.default_rng(0)
    samples = [(turns, _images(rng, n, config["vision_config"]["image_size"])) for turns, n in CONVERSATIONS[:4]]
    make_tokenizer(str(root / "tokenizer"))
    write_shards(str(root / "train-000000.tar"), samples)
    hf_model(config, seed=1).save_pretrained(root / "llava")
    return config, samples


def _build(case: str, tmp_path_factory) -> dict:
    """The case's LLaVA, imported at tp 2, trained one step, exported (full and --llm-only); once per module."""
    if case in _BUILT:
        return _BUILT[case]
    root = tmp_path_factory.mktemp(case)
    config, samples = llava_source(case, root)
    imported = str(root / "imported")
    tp2 = _write_config(root, config, 2, "run", init_from=imported)
    assert main(["import-hf-llava", str(root / "llava"), "--config", tp2, "--out", imported]) == 0
    assert main(["train", tp2, "--run-dir", str(root / "run")]) == 0
    assert main(["export-hf", str(root / "run"), "--out", str(root / "hf")]) == 0  # a run directory: its latest
    assert main(["export-hf", str(root / "run" / "ckpt"), "--out", str(root / "hf-llm"), "--llm-only"]) == 0
    _BUILT[case] = {"case": case, "root": root, "config": config, "samples": samples, "mimo_config": tp2}
    return _BUILT[case]


@pytest.fixture(scope="module", params=CASES)
def trained(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_clip(tmp_path_factory):
    return _build(CASES[0], tmp_path_factory)


def _mimo_forward(config_path: str, checkpoint: str) -> dict | None:
    """On a 2-rank pool: the trained checkpoint at its own layout, forward of step 1's
    microbatch; rank 0 returns the pack, its pixels and the full-vocab logits."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.training.checkpoint import load_checkpoint
    from mimo.training.precision import PrecisionPolicy
    from mimo.training.run import build_run
    from mimo.training.schedule_run import forward_only, stage_runner

    run = build_run(load_config(config_path), dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
    try:
        load_checkpoint(run.model, checkpoint, rng=False)
        mb = run.pipeline.microbatch(0)
        logits = run.model.llm.module.gather_logits(forward_only(run.model, mb, stage_runner(run.model)))
    finally:
        run.close()
    if dist.get_rank() != 0:
        return None
    return {"pack": mb.pack, "pixels": mb.pixels["vision"], "logits": logits}


def _hf_inputs(mimo: dict, image_token_id: int) -> list[tuple[torch.Tensor, torch.Tensor | None, slice]]:
    """Per sample of the pack: input ids (image slots as the image token), its images, its rows."""
    pack = mimo["pack"]
    slots = pack.image_slots["<image>"]
    ids = pack.tokens.clone()
    ids[slots] = image_token_id
    rows = slots.numel() // mimo["pixels"].shape[0]
    cu, out, image = pack.cu_seqlens.tolist(), [], 0
    for i in range(len(pack.sample_ids)):
        lo, hi = cu[i], cu[i + 1]
        n = int(((slots >= lo) & (slots < hi)).sum()) // rows
        out.append((ids[lo:hi][None], mimo["pixels"][image:image + n] if n else None, slice(lo, hi)))
        image += n
    assert image == mimo["pixels"].shape[0]
    return out


def test_round_trip_logits_equal_mimo(pools, trained):
    from transformers import LlavaForConditionalGeneration

    hf_dir = trained["root"] / "hf"
    model, info = LlavaForConditionalGeneration.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32,
                                                                attn_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    model64 = copy.deepcopy(model).double()
    from mimo.training.checkpoint import latest_checkpoint

    step, ckpt = latest_checkpoint(str(trained["root"] / "run" / "ckpt"))
    assert step == 1
    mimo = pools(2).run(_mimo_forward, trained["mimo_config"], ckpt)[0]
    ys = Yardstick(TOL)
    worst = 0.0
    with torch.no_grad():
        for i, (ids, pixels, rows) in enumerate(_hf_inputs(mimo, model.config.image_token_id)):
            ref = model(input_ids=ids, pixel_values=pixels).logits[0]
            ref64 = model64(input_ids=ids, pixel_values=None if pixels is None else pixels.double()).logits[0]
            ys.check(f"logits of sample {i}", mimo["logits"][rows], ref, ref64)
            worst = max(worst, rel_err(mimo["logits"][rows], ref))
    assert ys.ok, ys.summary(3)
    assert worst <= TOL, worst
    # trained: the exported weights are not the imported ones
    from safetensors.torch import load_file

    before = load_file(trained["root"] / "llava" / "model.safetensors")
    after = load_file(hf_dir / "model.safetensors")
    key = next(k for k in before if k.endswith("multi_modal_projector.linear_1.weight"))  # the source's naming
    assert rel_err(after["model.multi_modal_projector.linear_1.weight"], before[key]) > 1e-3

    # --llm-only: the language model alone, as a causal LM, same logits on text
    from transformers import AutoModelForCausalLM

    lm, info = AutoModelForCausalLM.from_pretrained(trained["root"] / "hf-llm", local_files_only=True, dtype=torch.float32,
                                                    attn_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(lm).__name__ == ("Qwen2ForCausalLM" if "qwen2" in trained["case"] else "LlamaForCausalLM")
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert rel_err(lm(input_ids=ids).logits, model(input_ids=ids).logits) <= TOL


def test_tokenizer_and_processor_are_the_runs(trained):
    from transformers import AutoTokenizer, LlavaProcessor

    from mimo.compose.config import load_config
    from mimo.compose.inputs import image_spec
    from mimo.data.images import preprocess

    hf_dir = str(trained["root"] / "hf")
    original = AutoTokenizer.from_pretrained(str(trained["root"] / "tokenizer"))
    proc = LlavaProcessor.from_pretrained(hf_dir, local_files_only=True)
    assert proc.tokenizer.chat_template == original.chat_template and proc.tokenizer.get_vocab() == original.get_vocab()
    assert AutoTokenizer.from_pretrained(str(trained["root"] / "hf-llm")).chat_template == original.chat_template
    spec = image_spec(load_config(trained["mimo_config"]).encoders["vision"])
    images = [im for _, ims in trained["samples"] for im in ims]
    images.append(images[0].resize((2 * spec.size, spec.size)))  # centre-cropped the same way
    pre = json.loads((trained["root"] / "hf" / "preprocessor_config.json").read_text())  # also in the older layout
    assert (pre["image_mean"], pre["image_std"], pre["crop_size"]) == (list(spec.mean), list(spec.std), {"height": spec.size, "width": spec.size})
    want = torch.stack([preprocess(im, spec) for im in images])
    got = proc.image_processor(images, return_tensors="pt")["pixel_values"]
    assert rel_err(got, want) <= 1e-6
    # the processor expands <image> into as many tokens as mimo gives the LLM rows
    rows = load_config(trained["mimo_config"]).encoders["vision"].rows_per_image
    text = proc(text="<image>\nhi", images=images[:1], return_tensors="pt")
    assert int((text["input_ids"] == proc.tokenizer.convert_tokens_to_ids("<image>")).sum()) == rows


def _tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def tp1_and_tp2(llama_clip):
    """The Llama + CLIP LLaVA imported at tp 1 too; both imports exported."""
    root, config = llama_clip["root"], llama_clip["config"]
    tp1 = _write_config(root, config, 1, "tp1")
    assert main(["import-hf-llava", str(root / "llava"), "--config", tp1, "--out", str(root / "imported-tp1")]) == 0
    assert main(["export-hf", str(root / "imported-tp1"), "--out", str(root / "hf-tp1")]) == 0
    assert main(["export-hf", str(root / "imported" / "step-00000000"), "--out", str(root / "hf-tp2")]) == 0
    return root


def test_export_at_tp1_and_tp2_is_byte_identical(tp1_and_tp2):
    from transformers import LlavaForConditionalGeneration

    root = tp1_and_tp2
    a, b = _tensors(root / "hf-tp1"), _tensors(root / "hf-tp2")
    assert list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    files = sorted(os.listdir(root / "hf-tp1"))
    assert files == sorted(os.listdir(root / "hf-tp2"))
    for name in files:
        assert (root / "hf-tp1" / name).read_bytes() == (root / "hf-tp2" / name).read_bytes(), name
    # the untrained import exports the source LLaVA's weights exactly, the blocks mimo never runs included
    load = lambda d: LlavaForConditionalGeneration.from_pretrained(d, local_files_only=True).state_dict()  # noqa: E731
    want, got = load(root / "llava"), load(root / "hf-tp1")
    assert list(want) == list(got) and all(torch.equal(want[k], got[k]) for k in want)
    # sharded: Hugging Face's index layout, the same model
    assert main(["export-hf", str(root / "imported-tp1"), "--out", str(root / "hf-sharded"), "--max-shard-gib", "2e-5"]) == 0
    names = os.listdir(root / "hf-sharded")
    assert "model.safetensors.index.json" in names and sum(n.startswith("model-0") for n in names) > 2, names
    sharded = load(root / "hf-sharded")
    assert list(sharded) == list(got) and all(torch.equal(sharded[k], got[k]) for k in got)


def test_verify_commands_on_a_llava_directory(llama_clip, tmp_path, capsys):
    """The exported LLaVA: verify-encoder checks its tower, verify-llm its language model, each
    against a reference holding every one of the checkpoint's weights; a tensor missing from the
    tower (one mimo's import does not need) or renamed in the language model is exit 2 naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir = llama_clip["root"] / "hf"
    assert main(["verify-encoder", "--hf-checkpoint", str(hf_dir), "--tp", "2"]) == 0
    report = _last_json(capsys)
    assert report["ok"] and report["max_rel_err"] <= TOL, report
    assert main(["verify-llm", "--hf-checkpoint", str(hf_dir)]) == 0
    report = _last_json(capsys)
    assert report["ok"] and report["export_exact"] and report["max_rel_err"] <= TOL, report

    state = load_file(hf_dir / "model.safetensors")
    post_norm = next(k for k in state if k.endswith("post_layernorm.weight"))
    down = "model.language_model.layers.1.mlp.down_proj.weight"
    for edit, command, named in [
        (lambda s: s.pop(post_norm), "verify-encoder", f"missing {post_norm}"),
        (lambda s: s.update({down + "_renamed": s.pop(down)}), "verify-llm", repr(down)),
    ]:
        broken = tmp_path / command
        shutil.copytree(hf_dir, broken)
        changed = dict(state)
        edit(changed)
        save_file(changed, broken / "model.safetensors", metadata={"format": "pt"})
        assert main([command, "--hf-checkpoint", str(broken)]) == 2
        captured = capsys.readouterr()
        assert named in captured.err and "Traceback" not in captured.err, captured.err


def test_without_the_tower_source_unused_blocks_are_identity(tp1_and_tp2, tmp_path, capsys):
    """A run that records no Hugging Face tower (here: the tp 1 import with its source
    forgotten) exports the vision blocks mimo never runs as identity blocks: the same LLaVA
    output as the export with the source's blocks."""
    import shutil

    from transformers import LlavaForConditionalGeneration

    root = tp1_and_tp2
    ckpt = tmp_path / "step-00000000"
    shutil.copytree(root / "imported-tp1" / "step-00000000", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.pop("imported_from")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert main(["export-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert _last_json(capsys)["unused_vision_tensors_from"] == "identity blocks"
    got = _tensors(tmp_path / "hf")
    find = lambda end: next(t for k, t in got.items() if k.endswith(end))  # noqa: E731
    assert torch.equal(find("post_layernorm.weight"), torch.ones(32)) and not find("post_layernorm.bias").any()
    assert not find("encoder.layers.2.mlp.fc1.weight").any()  # feature layer -2 of 3: block 2 is never run
    load = lambda d: LlavaForConditionalGeneration.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()  # noqa: E731
    a, b = load(tmp_path / "hf"), load(root / "hf-tp1")
    ids = torch.tensor([[1, 3, *[a.config.image_token_id] * 16, 40, 41, 42]])
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(a(input_ids=ids, pixel_values=pixels).logits, b(input_ids=ids, pixel_values=pixels).logits) <= TOL
    # user errors: exit 2 naming what to fix, nothing written
    assert main(["export-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 2  # not empty
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["export-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    shard = next(ckpt.glob("language-rank*.model.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    assert main(["export-hf", str(ckpt), "--out", str(tmp_path / "x")]) == 2
    assert str(shard) in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_tokenizer_without_the_placeholder_gets_it_added(tmp_path):
    from mimo.commands.export_hf import image_token
    from mimo.core.errors import MimoError
    from mimo.data.demo import make_tokenizer as make_demo_tokenizer
    from mimo.data.text import load_tokenizer

    make_demo_tokenizer(str(tmp_path / "tok"))  # the demo's: no <image> token
    tok = load_tokenizer(str(tmp_path / "tok"))
    size = len(tok)
    assert image_token(tok, "<image>", size + 1) == (size, True)
    assert tok("a<image>b", add_special_tokens=False)["input_ids"][1] == size
    with pytest.raises(MimoError, match="outside the LLM's vocab"):
        image_token(load_tokenizer(str(tmp_path / "tok")), "<image>", size)
    assert image_token(tok, "<image>", size + 1) == (size, False)  # now its own token

"""A LoRA / DoRA run of a tiny Hugging Face LLaVA, exported for PEFT (``mimo export-hf --adapter``)
and merged (``--merge``).

Per case (Llama + CLIP with LoRA, Qwen2 + SigLIP with DoRA): the LLaVA is imported at tp 2
(``import-hf-llava``), a run with adapters on the LLM's q k v o gate up down and the tower's q v
starts from it (``train.init_from``: the base), trains two steps at tp 2 (equal to its
one-process run: verify-train's comparison), and is exported three ways. ``peft.PeftModel`` loads the adapter onto the exported base with nothing missing or
unexpected, and its logits on the step's microbatch equal mimo's forward of the LoRA checkpoint
(base from init_from, adapters from the checkpoint) at its layout (the fp64 yardstick, tol
1e-5), and, before the adapters load, the source LLaVA's (B = 0, DoRA's magnitudes taken from the
base init_from gave); the merged export's weights equal PEFT's ``merge_and_unload`` (1e-6) and its logits
mimo's; ``--llm-only --adapter`` loads onto the causal LM with the same text logits. A module's
``lora.init`` reads the exported directory back, at another layout, tensor for tensor, and refuses
an adapter of another rank, scale or DoRA setting, or other targets, by name. A Qwen3-VL with
DoRA on the tower's fused qkv exports and reads back the same way.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from mimo.commands.cli import main
from mimo.core.errors import MimoError
from mimo.core.testing import Yardstick, rel_err

from test_export_hf import _hf_inputs, llava_source
from test_hf_llava import llava_modules

peft = pytest.importorskip("peft")  # (a test extra: pip install -e '.[test]')

TOL = 1e-5
CASES = {"clip-2-default-untied": False, "siglip-2-full-qwen2": True}  # case -> DoRA


def _write_config(root, config: dict, dora: bool, imported: str) -> str:
    modules = llava_modules(config)
    for name, m in modules.items():
        m["parallel"] = {"tp": 2, "dp": 1}
        targets = ["q", "k", "v", "o", "gate", "up", "down"] if name == "language" else ["q", "v"]
        m["lora"] = {"rank": 4, "alpha": 8, "targets": targets, "dora": dora}
    raw = {
        "world_size": 2, "modules": modules,
        "data": {"shards": str(root / "train-000000.tar"), "tokenizer": str(root / "tokenizer"), "template": "chatml",
                 "tokens_per_microbatch": 512, "max_sample_tokens": 512, "workers": 1},
        "train": {"micro_batches": 1, "steps": 2, "lr": 3e-2, "precision": "fp32", "grad_clip": None,
                  "checkpoint": {"dir": str(root / "run" / "ckpt")}, "init_from": imported},
    }
    path = root / "lora.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    case, dora = request.param, CASES[request.param]
    root = tmp_path_factory.mktemp(case)
    config, _ = llava_source(case, root)
    imported = str(root / "imported")
    cfg = _write_config(root, config, dora, imported)
    assert main(["import-hf-llava", str(root / "llava"), "--config", cfg, "--out", imported]) == 0
    assert main(["train", cfg, "--run-dir", str(root / "run")]) == 0
    run = str(root / "run")
    assert main(["export-hf", run, "--out", str(root / "base"), "--adapter", str(root / "adapter")]) == 0
    assert main(["export-hf", run, "--out", str(root / "merged"), "--merge"]) == 0
    assert main(["export-hf", run, "--out", str(root / "base-llm"), "--adapter", str(root / "adapter-llm"), "--llm-only"]) == 0
    return {"case": case, "dora": dora, "root": root, "config": cfg, "imported": imported}


def _mimo_forward(config_path: str, init_from: str, checkpoint: str) -> dict | None:
    """On a 2-rank pool: the run as training left it (its base from init_from, its adapters from
    the checkpoint), forward of step 1's microbatch; rank 0 returns the pack, pixels, logits."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.training.checkpoint import load_checkpoint, resolve_checkpoint
    from mimo.training.precision import PrecisionPolicy
    from mimo.training.run import build_run
    from mimo.training.schedule_run import forward_only, stage_runner

    run = build_run(load_config(config_path), dist.get_rank(), policy=PrecisionPolicy.named("fp32"))
    try:
        mb = run.pipeline.microbatch(0)
        forward = lambda: run.model.llm.module.gather_logits(forward_only(run.model, mb, stage_runner(run.model)))  # noqa: E731
        load_checkpoint(run.model, resolve_checkpoint(init_from), rng=False, start=True)
        start = forward()  # B = 0, DoRA's magnitudes the loaded base's norms: the base itself
        load_checkpoint(run.model, checkpoint, rng=False)
        logits = forward()
    finally:
        run.close()
    if dist.get_rank() != 0:
        return None
    return {"pack": mb.pack, "pixels": mb.pixels["vision"], "logits": logits, "start": start}


def _load(cls, path):
    model, info = cls.from_pretrained(path, local_files_only=True, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _with_adapter(model, adapter: str):
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
    return model.eval()


def test_peft_adapter_and_merged_export_compute_what_mimo_does(pools, exported):
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    from mimo.training.checkpoint import latest_checkpoint

    root = exported["root"]
    conf = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert conf["use_dora"] == exported["dora"] and conf["r"] == 4 and conf["lora_alpha"] == 8
    # every adapted projection of both towers, one PEFT module each (q k v o gate up down: 7 per layer)
    text_layers = sum(1 for t in conf["target_modules"] if t.endswith("self_attn.q_proj") and "language_model" in t)
    assert text_layers > 0 and sum("language_model" in t for t in conf["target_modules"]) == 7 * text_layers
    assert any("vision_tower" in t and t.endswith("v_proj") for t in conf["target_modules"])
    assert not any("vision_tower" in t and t.endswith("k_proj") for t in conf["target_modules"])

    step, ckpt = latest_checkpoint(str(root / "run" / "ckpt"))
    assert step == 2
    mimo = pools(2).run(_mimo_forward, exported["config"], exported["imported"], ckpt)[0]

    base = _load(LlavaForConditionalGeneration, root / "base")
    plain = copy.deepcopy(base)
    tuned = _with_adapter(base, str(root / "adapter"))
    tuned64 = copy.deepcopy(tuned).double()
    merged = _load(LlavaForConditionalGeneration, root / "merged")
    source = _load(LlavaForConditionalGeneration, root / "llava")  # the base as imported
    ys = Yardstick(TOL)
    moved = 0.0
    with torch.no_grad():
        for i, (ids, pixels, rows) in enumerate(_hf_inputs(mimo, base.config.image_token_id)):
            ref = tuned(input_ids=ids, pixel_values=pixels).logits[0]
            ref64 = tuned64(input_ids=ids, pixel_values=None if pixels is None else pixels.double()).logits[0]
            ys.check(f"PEFT logits of sample {i}", mimo["logits"][rows], ref, ref64)
            ys.check(f"merged logits of sample {i}", merged(input_ids=ids, pixel_values=pixels).logits[0], ref, ref64)
            moved = max(moved, rel_err(plain(input_ids=ids, pixel_values=pixels).logits[0], ref))
            assert rel_err(mimo["start"][rows], source(input_ids=ids, pixel_values=pixels).logits[0]) <= TOL
    assert ys.ok, ys.summary(3)
    assert moved > 1e-3, "the adapters changed nothing: the check above could not fail"

    # --merge is base + adapter: PEFT's own merge of the adapter into the exported base
    unloaded = tuned.merge_and_unload().state_dict()
    for key, t in merged.state_dict().items():
        assert rel_err(t, unloaded[key]) <= 1e-6, key

    # --llm-only --adapter: the language model's adapters onto the causal LM
    lm = _with_adapter(_load(AutoModelForCausalLM, root / "base-llm"), str(root / "adapter-llm"))
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert rel_err(lm(input_ids=ids).logits, merged(input_ids=ids).logits) <= TOL
    conf_llm = json.loads((root / "adapter-llm" / "adapter_config.json").read_text())
    assert len(conf_llm["target_modules"]) == 7 * text_layers


def test_lora_run_of_the_hf_llava_equals_the_one_process_run(pools, exported, verify_layout):
    """The case's run (LoRA or DoRA on the imported Hugging Face LLaVA, both modules at tp 2, the
    base from train.init_from) against its one-process reference: mimo verify-train's
    comparison, fp64 yardstick, two steps; the compared gradients are the adapters'."""
    report = verify_layout(pools, exported["config"], [], 2, world=2)
    assert report["ok"], report["worst"]
    assert "lora" in report["worst"]["grads"] or "projector" in report["worst"]["grads"], report["worst"]


def test_export_of_a_lora_run_needs_adapter_or_merge(exported, tmp_path):
    run = str(exported["root"] / "run")
    with pytest.raises(MimoError, match="--adapter DIR"):
        from mimo.commands.export_hf import export_hf

        export_hf(run, str(tmp_path / "out"))
    assert main(["export-hf", run, "--out", str(tmp_path / "a"), "--adapter", str(tmp_path / "a")]) != 0


# ---------------------------------------------------------------- Qwen3-VL: a fused vision qkv


def _drawn_lora_checkpoint(config_path: str, out: str) -> str:
    """One rank: the config's model (base from init.hf), every adapter's B and DoRA magnitude drawn
    (as training would have moved them), saved as the run's checkpoint would be."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import save_checkpoint

    model = MimoModel(load_config(config_path), dist.get_rank())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for part in model.parts:
            for name, p in part.module.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
                elif name.endswith("lora_magnitude"):
                    p.mul_(1 + 0.2 * torch.rand(p.shape, generator=g))
    return save_checkpoint(model, {}, 3, out)


def test_qwen3_vl_adapter_on_the_fused_vision_qkv(pools, tmp_path, capsys):
    """A Qwen3-VL LoRA checkpoint (DoRA on the tower's fused qkv, proj, fc1, fc2 and the text
    model's projections) exports as an adapter PEFT loads onto the exported base with nothing
    missing; PEFT's logits equal the merged export's (tol 1e-5) and its merge_and_unload the
    merged weights (1e-6); ``lora.init`` of the directory gives back every adapter tensor exactly."""
    import transformers
    from test_import_hf_qwen3_vl import TOKENS, _build, _modules, _raw

    path = _build("dense", tmp_path)
    modules = _modules(path, tmp_path, capsys)["modules"]
    modules["vision"]["lora"] = {"rank": 3, "alpha": 6, "targets": ["qkv", "proj", "fc1", "fc2"], "dora": True}
    modules["language"]["lora"] = {"rank": 3, "alpha": 6, "targets": ["q", "k", "v", "o", "gate", "up", "down"], "dora": True}
    config_path = tmp_path / "lora.yaml"
    config_path.write_text(yaml.safe_dump(_raw(modules)))
    ckpt = pools(1).run(_drawn_lora_checkpoint, str(config_path), str(tmp_path / "ckpt"))[0]
    assert main(["export-hf", ckpt, "--out", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")]) == 0
    assert main(["export-hf", ckpt, "--out", str(tmp_path / "merged"), "--merge"]) == 0
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["use_dora"] and any(t.endswith("visual.blocks.0.attn.qkv") for t in conf["target_modules"])

    cls = transformers.Qwen3VLForConditionalGeneration
    tuned = _with_adapter(_load(cls, tmp_path / "base"), str(tmp_path / "adapter"))
    merged = _load(cls, tmp_path / "merged")
    plain = _load(cls, tmp_path / "base")
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=g)  # one 4x4-patch image (2 merged tokens per side)
    ids = torch.tensor([[1, 2, TOKENS["vision_start_token_id"], *[TOKENS["image_token_id"]] * 4,
                         TOKENS["vision_end_token_id"], 5, 6, 7]])
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]]),
                  mm_token_type_ids=(ids == TOKENS["image_token_id"]).to(torch.int32))
    with torch.no_grad():
        want = tuned(**inputs).logits
        assert rel_err(merged(**inputs).logits, want) <= TOL
        assert rel_err(plain(**inputs).logits, want) > 1e-3  # the adapters act: the check above can fail
    unloaded = tuned.merge_and_unload().state_dict()
    for key, t in merged.state_dict().items():
        assert rel_err(t, unloaded[key]) <= 1e-6, key
    # lora.init of that directory reads every adapter back as the checkpoint holds it
    adapter = str(tmp_path / "adapter")
    got = pools(1).run(_adapter_tensors, str(config_path), [f"modules.{m}.lora.init={adapter}" for m in ("language", "vision")])[0]
    want = _stored_adapters(ckpt)
    for module in ("language", "vision"):
        assert want[module] and set(got[module]) == set(want[module])
        assert all(torch.equal(got[module][n], t) for n, t in want[module].items())


# ---------------------------------------------------------------- lora.init: a PEFT adapter read back


def _adapter_tensors(config_path: str, overrides: list[str]) -> dict | None:
    """The model of the config (a lora.init among the overrides), its adapters' full tensors (rank 0)."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.parallel.lora import is_adapter_tensor

    model = MimoModel(load_config(config_path, overrides), dist.get_rank())
    full = model.full_params()
    if dist.get_rank() != 0:
        return None
    return {m: {n: t for n, t in tensors.items() if is_adapter_tensor(n)} for m, tensors in full.items()}


def _stored_adapters(checkpoint: str) -> dict:
    from mimo.commands.export_hf import gather_checkpoint
    from mimo.parallel.lora import is_adapter_tensor

    _, full = gather_checkpoint(checkpoint)
    return {m: {n: t for n, t in tensors.items() if is_adapter_tensor(n)} for m, tensors in full.items()}


def test_lora_init_reads_the_exported_adapter_back_exactly(pools, exported):
    """``lora.init`` of the exported PEFT directory, at another layout (the LLM tp 2, the tower data
    parallel): every adapter tensor of both modules equals the checkpoint's."""
    from mimo.training.checkpoint import latest_checkpoint

    root = exported["root"]
    _, ckpt = latest_checkpoint(str(root / "run" / "ckpt"))
    want = _stored_adapters(ckpt)
    adapter = str(root / "adapter")
    got = pools(2).run(_adapter_tensors, exported["config"], [
        f"modules.language.lora.init={adapter}", f"modules.vision.lora.init={adapter}",
        "modules.vision.parallel.tp=1", "modules.vision.parallel.dp=2"])[0]
    for module in ("language", "vision"):
        assert want[module] and set(got[module]) == set(want[module])
        unequal = [n for n, t in want[module].items() if not torch.equal(got[module][n], t)]
        assert not unequal, unequal[:3]


def test_lora_init_refuses_what_it_cannot_read_whole(exported, tmp_path):
    """Another rank or scale, DoRA on one side only, targets the adapter does not have or does
    not cover: each a MimoError naming it, before any weight is read into a model."""
    import dataclasses

    from mimo.compose.adapters import adapter_layout
    from mimo.compose.config import load_config
    from mimo.compose.peft import module_row_blocks, read_peft_adapter

    adapter = str(exported["root"] / "adapter")
    base = load_config(exported["config"]).llm

    def read(**changes):
        cfg = dataclasses.replace(base, lora=dataclasses.replace(base.lora, **changes))
        return read_peft_adapter(adapter, "language", adapter_layout(cfg, "language", True), module_row_blocks(cfg, True))

    assert len(read()) == (3 if exported["dora"] else 2) * 7 * 2  # 7 projections x 2 layers
    for changes, message in (({"rank": 2}, "rank 4 and alpha 8"), ({"alpha": 4.0}, "rank 4 and alpha 8"),
                             ({"dora": not exported["dora"]}, "use_dora"),
                             ({"targets": ["q", "k", "v", "o"]}, "which modules.language.lora.targets does not"),
                             ({"targets": ["q", "k", "v", "o", "gate", "up", "down", "gdn_out"]}, None)):
        if message is None:  # (a target the arch has nothing of: no adapter, nothing missing)
            read(**changes)
            continue
        with pytest.raises(MimoError, match=message):
            read(**changes)
    with pytest.raises(MimoError, match="not a PEFT adapter directory"):
        load_config(exported["config"], [f"modules.language.lora.init={tmp_path}"])


def test_preflight_reads_lora_init_whole(exported):
    """``check_inputs`` (check-config, train's launcher) reads each lora.init directory as the
    ranks will: the LLaVA adapter named by the LLM alone leaves its tower adapters unread, a
    problem naming them; named by both modules it reads whole; a mismatch is reported, not raised."""
    from mimo.compose.config import load_config
    from mimo.compose.preflight import check_inputs

    adapter = str(exported["root"] / "adapter")
    init = {m: f"modules.{m}.lora.init={adapter}" for m in ("language", "vision")}
    report = check_inputs(load_config(exported["config"], [init["language"]]), samples=0, raise_errors=False)
    assert len(report.problems) == 1 and "which no module of the run reads" in report.problems[0], report.problems
    assert "vision_tower" in report.problems[0] or "vision_model" in report.problems[0], report.problems[0]
    report = check_inputs(load_config(exported["config"], list(init.values())), samples=0, raise_errors=False)
    assert not report.problems and report.lora_init[os.path.realpath(adapter)]["ok"], report.as_dict()
    report = check_inputs(load_config(exported["config"], [*init.values(), "modules.vision.lora.rank=2"]), samples=0,
                          raise_errors=False)
    assert len(report.problems) == 1 and "modules.vision.lora says rank 2" in report.problems[0], report.problems


# ---------------------------------------------------------------- causal LMs: Gated DeltaNet, shared experts, Mamba-2


def _peft_equals_merged(root) -> tuple[dict, dict]:
    """The causal LM ``root/base`` with PEFT's ``root/adapter``: its logits equal ``root/merged``'s
    (1e-5) and not the base's, its merge_and_unload the merged weights (1e-6). Returns the base's
    and the merged model's states."""
    import transformers

    cls = transformers.AutoModelForCausalLM
    tuned = _with_adapter(_load(cls, root / "base"), str(root / "adapter"))
    merged, plain = _load(cls, root / "merged"), _load(cls, root / "base")
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        want = tuned(input_ids=ids).logits
        assert rel_err(merged(input_ids=ids).logits, want) <= TOL
        assert rel_err(plain(input_ids=ids).logits, want) > 1e-3
    unloaded = tuned.merge_and_unload().state_dict()
    merged_state = merged.state_dict()
    for key, t in merged_state.items():
        assert rel_err(t, unloaded[key]) <= 1e-6, key
    return plain.state_dict(), merged_state


def _qwen3_5_model(name: str = "dense"):
    import transformers
    from test_hf_qwen3_5 import _text_config, randomize_

    model = transformers.AutoModelForCausalLM.from_config(_text_config(name), dtype=torch.float32)
    randomize_(model, 0)
    return model


def _deepseek_v3_model():
    from test_llm_hf_deepseek_v3 import SMALL, hf_model

    return hf_model(SMALL)


def _nemotron_h_model():
    from test_llm_hf_nemotron_h import PLAIN, SMALL, hf_model

    return hf_model(dict(SMALL, hybrid_override_pattern="M-*M", mlp_bias=PLAIN["mlp_bias"]))


RECURRENT_LMS = {  # case -> (the model, lora.targets, the HF modules its recurrent layers' adapters land in)
    "qwen3.5 gdn_in": (_qwen3_5_model, ["gdn_in", "gdn_out", "q", "k", "v", "o", "gate", "up", "down"],
                       (".linear_attn.", {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"})),
    "qwen3.5-moe shared": (lambda: _qwen3_5_model("moe"), ["shared", "q", "o"],
                           (".shared_expert.", {"gate_proj", "up_proj", "down_proj"})),
    "deepseek-v3 mla": (lambda: _deepseek_v3_model(), ["q_a", "q_b", "kv_a", "kv_b", "o"],
                        (".self_attn.", {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"})),
    "nemotron-h mamba_in": (_nemotron_h_model, ["mamba_in", "q", "o", "up", "down"],
                            (".mixer.", {"in_proj", "q_proj", "o_proj", "up_proj", "down_proj"})),
}


@pytest.mark.parametrize("case", list(RECURRENT_LMS))
def test_peft_adapters_of_causal_lms(pools, tmp_path, capsys, case):
    """A Qwen3.5 causal LM with DoRA on the Gated DeltaNet input projection (gdn_in: four adapters
    on our fused weight, one per Hugging Face module in_proj_qkv / _z / _b / _a), its output
    projection and the attention / MLP ones, a Qwen3.5-MoE with DoRA on its shared experts (gate
    and up rows of our fused weight, the row-parallel down), a DeepSeek-V3 with DoRA on its
    multi-latent attention's five projections (PEFT reads gate / up / down_proj of a DeepSeek-V3 as
    expert parameters: --adapter refuses them there, by name), and a Nemotron-H with DoRA on the Mamba-2 input rows
    (mamba_in: one adapter on rows of two weights of ours, Hugging Face's one in_proj, whose row
    order z | x | B | C | dt is not ours): ``--llm-only --adapter`` loads into PEFT, its logits
    equal the merged export's (1e-5) and its merge_and_unload the merged weights (1e-6); read
    back by lora.init tensor for tensor. PEFT takes no adapter on a Mamba layer's out_proj:
    ``mamba_out`` exports merged, and ``--adapter`` says so."""
    make, targets, (where, hf_modules) = RECURRENT_LMS[case]
    model = make()
    path = str(tmp_path / "hf")
    model.save_pretrained(path)
    assert main(["import-hf", path, "--yaml", str(tmp_path / "modules.yaml")]) == 0
    capsys.readouterr()
    modules = yaml.safe_load((tmp_path / "modules.yaml").read_text())["modules"]
    (name, llm), = modules.items()
    llm["lora"] = {"rank": 2, "alpha": 5, "dora": True, "targets": targets}
    config_path = tmp_path / "lora.yaml"
    config_path.write_text(yaml.safe_dump({"world_size": 1, "modules": modules,
                                           "data": {"source": "synthetic", "max_sample_tokens": 256}}))
    ckpt = pools(1).run(_drawn_lora_checkpoint, str(config_path), str(tmp_path / "ckpt"))[0]
    for out, flags in (("base", ["--adapter", str(tmp_path / "adapter")]), ("merged", ["--merge"])):
        assert main(["export-hf", ckpt, "--out", str(tmp_path / out), "--llm-only", *flags]) == 0
    adapted = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert {t.rpartition(".")[2] for t in adapted if where in t} == hf_modules

    _peft_equals_merged(tmp_path)
    got = pools(1).run(_adapter_tensors, str(config_path), [f"modules.{name}.lora.init={tmp_path / 'adapter'}"])[0]
    want_adapters = _stored_adapters(ckpt)[name]
    assert want_adapters and set(got[name]) == set(want_adapters)
    assert all(torch.equal(got[name][n], t) for n, t in want_adapters.items())
    if "kv_a" in targets:
        llm["lora"]["targets"] = ["q_a", "shared"]
        config_path.write_text(yaml.safe_dump({"world_size": 1, "modules": modules,
                                               "data": {"source": "synthetic", "max_sample_tokens": 256}}))
        ckpt = pools(1).run(_drawn_lora_checkpoint, str(config_path), str(tmp_path / "ckpt-shared"))[0]
        with pytest.raises(MimoError, match="PEFT reads LoRA on modules named down_proj, gate, gate_proj, up_proj of a "
                                            "deepseek_v3 model as adapters on its experts"):
            from mimo.commands.export_hf import export_hf

            export_hf(ckpt, str(tmp_path / "base-shared"), llm_only=True, adapter=str(tmp_path / "adapter-shared"))
    if "mamba_in" in targets:
        llm["lora"]["targets"] = ["mamba_in", "mamba_out"]
        config_path.write_text(yaml.safe_dump({"world_size": 1, "modules": modules,
                                               "data": {"source": "synthetic", "max_sample_tokens": 256}}))
        ckpt = pools(1).run(_drawn_lora_checkpoint, str(config_path), str(tmp_path / "ckpt-out"))[0]
        with pytest.raises(MimoError, match="PEFT takes no LoRA on out_proj of a Mamba-based model"):
            from mimo.commands.export_hf import export_hf

            export_hf(ckpt, str(tmp_path / "base-out"), llm_only=True, adapter=str(tmp_path / "adapter-out"))
        assert not any(p.name.startswith(("base-out", "adapter-out")) for p in tmp_path.iterdir())
        assert main(["export-hf", ckpt, "--out", str(tmp_path / "merged-out"), "--llm-only", "--merge"]) == 0


# ---------------------------------------------------------------- experts: PEFT's adapters on parameters


def test_expert_adapters_export_for_peft_and_merged(pools, tmp_path):
    """Adapters on the routed experts (an A and B per expert on 3-D weights): ``--adapter`` writes
    them as PEFT's adapters on parameters (``target_parameters``: gate_up_proj and down_proj of
    each experts module, nested as PEFT nests them), beside LoRA on q and v; PEFT loads them onto
    the exported Qwen3-MoE, whose logits equal the merged export's (1e-5) and whose
    merge_and_unload equals its weights (1e-6); ``--merge`` moves the expert weights and q / v and
    nothing else of the base; lora.init reads the directory back tensor for tensor."""
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "examples" / "lora.yaml").read_text())
    raw["world_size"] = 1
    for m in raw["modules"].values():
        m["parallel"] = {"tp": 1, "dp": 1, "ranks": "0:1"}
    lang = raw["modules"]["language"]
    lang["arch"].update(pattern="*E*E", moe={"experts": 4, "topk": 2, "ffn": 32})
    lang["lora"].update(targets=["q", "v", "experts"], dropout=0.1)
    config_path = tmp_path / "moe.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    ckpt = pools(1).run(_drawn_lora_checkpoint, str(config_path), str(tmp_path / "ckpt"))[0]
    for out, flags in (("base", ["--adapter", str(tmp_path / "adapter")]), ("merged", ["--merge"])):
        assert main(["export-hf", ckpt, "--out", str(tmp_path / out), "--llm-only", *flags]) == 0
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(p.rpartition(".")[2] for p in conf["target_parameters"]) == ["down_proj"] * 2 + ["gate_up_proj"] * 2
    assert conf["lora_dropout"] == 0.0 and {t.rpartition(".")[2] for t in conf["target_modules"]} == {"q_proj", "v_proj"}

    base_state, merged_state = _peft_equals_merged(tmp_path)
    moved = {k for k, t in merged_state.items() if not torch.equal(t, base_state[k])}
    assert {k.rpartition(".")[2] if ".experts." in k else k.split(".")[-2] for k in moved} == {
        "gate_up_proj", "down_proj", "q_proj", "v_proj"}, sorted(moved)
    got = pools(1).run(_adapter_tensors, str(config_path), [f"modules.language.lora.init={tmp_path / 'adapter'}"])[0]
    want_adapters = _stored_adapters(ckpt)["language"]
    assert any(".experts.lora." in n for n in want_adapters) and set(got["language"]) == set(want_adapters)
    assert all(torch.equal(got["language"][n], t) for n, t in want_adapters.items())

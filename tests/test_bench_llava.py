"""bench/llava_step.py, bench/llava_moe_step.py and bench/step_sections.py stay runnable: their tiny models on the CPU,
with a stand-in anchor script in place of Hugging Face's (which needs a GPU), so that the
anchor search (every configuration tried, a failing one recorded, the fastest taken) and the
same-batch wiring are exercised."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"

# prints the anchor's JSON line; its speed depends on the attention chosen (argv[1], or ATTN for the
# MoE anchor); "flex_attention" fails as an implementation that does not run would
FAKE_ANCHOR = textwrap.dedent("""
    import json, os, sys
    attn = os.environ.get("ATTN", sys.argv[1])
    if attn == "flex_attention":
        sys.exit("RuntimeError: flex attention does not run here")
    speed = {"eager": 100.0, "sdpa": 300.0}[attn]
    b = int(os.environ.get("B", 8))
    print("loading...")
    print(json.dumps(dict(attn=attn, arg=sys.argv[1], batch=b, steps=int(os.environ["STEPS"]), step_s=b * 10 / speed,
                          real_tokens_per_s=speed, padded_fraction=0.25, model_tflops_per_s=1.0, peak_mem_gib=2.0)))
""")


# the padding-free anchor's stand-in (bench/hf_llava_packed.py's arguments: model, attention, experts)
FAKE_PACKED = textwrap.dedent("""
    import json, os, sys
    print(json.dumps(dict(arg=sys.argv[1:], batch=int(os.environ.get("B", 8)), steps=int(os.environ["STEPS"]), step_s=0.1,
                          real_tokens_per_s=500.0, padded_fraction=0.0, model_tflops_per_s=2.0, peak_mem_gib=1.0)))
""")


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_llava_moe_bench_searches_the_anchor_and_runs_mimo_at_its_batch(tmp_path, capsys):
    anchor = tmp_path / "anchor.py"
    anchor.write_text(FAKE_ANCHOR)
    configs = "grouped_mm+ATTN=eager,grouped_mm+ATTN=sdpa,grouped_mm+ATTN=flex_attention"  # the padded script's
    res = _load("llava_moe_step").main(["--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1", "--batch", "2",
                                        "--baseline", str(anchor), "--baseline-configs", configs])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(res))
    base = res["baseline"]
    # every configuration tried; the failing one recorded with its message; the fastest taken
    assert set(base["runs"]) == {"grouped_mm+ATTN=eager", "grouped_mm+ATTN=sdpa", "grouped_mm+ATTN=flex_attention"}
    assert "flex attention does not run" in base["runs"]["grouped_mm+ATTN=flex_attention"]["error"]
    assert base["config"] == "grouped_mm+ATTN=sdpa" and base["attn"] == "sdpa" and base["arg"] == "grouped_mm"
    assert base["runs"]["grouped_mm+ATTN=eager"]["real_tokens_per_s"] == 100.0
    # the same batch on both sides (--batch overrides the anchor's default B=4), the same step count
    assert base["batch"] == 2 and base["steps"] == 3 and res["samples_per_step"] == 2
    v = res["eager"]
    assert v["timed_steps"] == 2 and v["real_tokens_per_s"] > 0
    assert v["ratio_tokens_per_s"] == v["real_tokens_per_s"] / 300.0


def test_packed_configurations_run_the_padding_free_anchor(tmp_path, monkeypatch):
    """``packed:ATTN[:EXPERTS][+ENV]`` runs hf_llava_packed.py with the bench's model kind, the
    configuration's implementations and environment, and the bench's batch; the fastest run
    wins whichever script ran it. The default searches include packed configurations."""
    llava_step, moe = _load("llava_step"), _load("llava_moe_step")
    anchor, packed = tmp_path / "anchor.py", tmp_path / "packed.py"
    anchor.write_text(FAKE_ANCHOR)
    packed.write_text(FAKE_PACKED)
    monkeypatch.setattr(llava_step, "PACKED", packed)
    base = llava_step.search_baseline(anchor, 3, ["grouped_mm+ATTN=sdpa", "packed:flex_attention:grouped_mm+COMPILE=1"],
                                      ["B=2"], packed_model="moe")
    assert base["config"] == "packed:flex_attention:grouped_mm+COMPILE=1" and base["batch"] == 2 and base["steps"] == 3
    assert base["arg"] == ["moe", "flex_attention", "grouped_mm"]
    assert set(base["runs"]) == {"grouped_mm+ATTN=sdpa", "packed:flex_attention:grouped_mm+COMPILE=1"}
    assert "packed:sdpa" in llava_step.DENSE_BASELINE_CONFIGS.split(",")
    assert "packed:sdpa:grouped_mm+COMPILE=1" in moe.BASELINE_CONFIGS.split(",")


def test_the_padding_free_anchor_trains_what_the_padded_one_does():
    """hf_llava_packed.py's row (tiny models, fp32, SDPA, on the CPU): the batch's loss equals the
    padded batch's on the same weights and samples, and its length is the padded batch's real
    tokens. Without ``use_cache=False`` transformers drops the packed-sequence mask and the loss
    moves (the reason ``packed_loss`` passes it)."""
    import torch

    hf = _load("hf_llava_packed")
    for kind in ("dense", "moe"):
        torch.manual_seed(0)
        model, n_img, _ = hf.build(kind, "sdpa", "eager", tiny=True)
        texts, px = hf.draw(torch.Generator().manual_seed(1), 3, n_img, model.config.vision_config.image_size)
        ids, mask, labels = hf.padded(texts, n_img)
        row, pos, row_labels = hf.packed(texts, n_img)
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask, pixel_values=px, labels=labels).loss
            got = hf.packed_loss(model, row, pos, px, row_labels)
            cached = model(input_ids=row, position_ids=pos, pixel_values=px, labels=row_labels).loss
        assert row.shape[1] == int(mask.sum())
        assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want)), (kind, float(got), float(want))
        assert abs(float(cached) - float(want)) > 1e-4, kind


def test_llava_bench_tiny_without_anchor():
    res = _load("llava_step").main(["--tiny", "--no-baseline", "--device", "cpu", "--steps", "3", "--warmup", "1"])
    assert "baseline" not in res and res["samples_per_step"] == 8
    v = res["eager"]
    assert v["timed_steps"] == 2 and v["real_tokens_per_s"] > 0 and v["loss_first"] > 0


def test_step_sections_tiny_times_the_steps_parts(capsys):
    """Every part it wraps still exists in the step (a renamed one fails here, not on the GPU machine)."""
    res = _load("step_sections").main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(res))
    for mode in ("back_to_back", "waited"):
        parts = res[mode]["parts_ms_per_step"]
        assert {"run_schedule", "grad_norm", "clip_", "data", "llm.forward", "llm.backward", "encode_and_bridge"} <= set(parts)

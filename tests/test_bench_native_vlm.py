"""bench/native_vlm_step.py stays runnable: its ``--small`` preset on the CPU in fp32 (a few
seconds of steps), its JSON line's keys, both sides on the same real tokens, and transformers'
``Qwen3VLMoeForConditionalGeneration`` and mimo's import of the same weights giving the same loss
at step 1 (the anchor is the same model on the same data) and after the AdamW steps."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "native_vlm_step.py"
# flash_attention_2 cannot run here (not installed, or not on the CPU): reported beside sdpa, not taken
SMALL = ["--small", "--device", "cpu", "--steps", "3", "--warmup", "1", "--hf-attn", "sdpa,flash_attention_2"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_native_vlm_step", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_bench_native_vlm_small_on_cpu(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads on a shared CPU only contend
    try:
        result = _bench().main(SMALL)
    finally:
        torch.set_num_threads(threads)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result  # one JSON line, what main returns
    for key in ("device", "torch", "transformers", "precision", "batch", "model", "params_total", "params_llm_active",
                "samples_timed", "real_tokens_timed", "model_tflop_per_step", "hf", "hf_runs", "mimo", "mimo_variants",
                "ratio", "ratios", "same_real_tokens", "loss_step1"):
        assert key in result, key
    side_keys = ("step_s_median", "real_tokens_per_s", "real_tokens", "padding_fraction", "peak_mem_gib",
                 "model_tflops_per_s", "mfu", "loss_first", "loss_last", "graphs_compiled_in_timed_steps", "timed_steps")
    hf, mimo = result["hf"], result["mimo"]
    for side in (hf, mimo):
        for key in side_keys:
            assert key in side, key
        assert side["timed_steps"] == 2 and side["step_s_median"] > 0 and side["real_tokens_per_s"] > 0
    assert result["precision"] == "fp32" and result["device"] == "cpu" and result["samples_timed"] == 2 * 4
    assert hf["config"] == "sdpa+eager" and mimo["variant"] == "eager"
    assert "error" in result["hf_runs"]["flash_attention_2+eager"]
    # the same samples on both sides: real tokens and image rows counted by each side alike
    assert result["same_real_tokens"]
    assert mimo["real_tokens"] == hf["real_tokens"] == result["real_tokens_timed"] > 0
    assert mimo["image_tokens"] == hf["image_tokens"] == result["image_tokens_timed"] > 0
    assert hf["padding_fraction"] > 0 and mimo["padding_fraction"] == 0  # padded rows against one THD pack
    assert math.isclose(result["ratio"], mimo["real_tokens_per_s"] / hf["real_tokens_per_s"])
    # the same model: step 1 agrees (fp32), and so do the steps after it (the same AdamW)
    loss = result["loss_step1"]
    assert loss["rel_diff"] < 1e-3, loss
    assert abs(loss["hf"] - math.log(result["model"]["text"]["vocab"])) > 0.1  # weights at which the paths show
    for a, b in zip(mimo["losses"], hf["losses"]):
        assert abs(a - b) <= 1e-3 * abs(b), (mimo["losses"], hf["losses"])

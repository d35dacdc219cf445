"""bench/mla_hf.py stays runnable: a tiny layer on the CPU, its JSON line's keys, and mimo's MLA
equal to transformers' DeepseekV3Attention per sample in fp32 (the anchors that run on a CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "mla_hf.py"
TINY = ["--device", "cpu", "--small", "--tokens", "96", "--iters", "1", "--warmup", "0"]


def test_bench_mla_hf_runs_tiny_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("bench_mla_hf", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(TINY)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result  # one JSON line, what main returns
    for key in ("device", "torch", "transformers", "dtype", "tokens", "samples", "mimo_kernel", "best", "ratio", "ratios"):
        assert key in result, key
    for variant in ("mimo", "mimo_exact", "hf_sdpa_per_sample", "hf_sdpa_padded", "hf_eager_padded"):
        assert result[variant]["ms"] > 0, variant
    assert result["samples"] > 1 and result["best"].startswith("hf_") and result["ratio"] > 0
    assert result["rel_err"] < 1e-5 and result["rel_err_dx"] < 1e-5 and result["rel_err_grad"] < 1e-4, result

"""bench/gdn_hf.py stays runnable: a tiny layer on the CPU (a few seconds), its JSON line's keys,
and mimo's Qwen3.5 GDN equal to transformers' torch fallback per sample in fp32."""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "gdn_hf.py"
TINY = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--v-heads", "4", "--head-dim", "8", "--tokens", "200",
        "--iters", "1", "--warmup", "0"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gdn_hf", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_gdn_hf_runs_tiny_on_cpu(capsys):
    result = _bench().main(TINY)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result  # one JSON line, what main returns
    for key in ("device", "torch", "transformers", "dtype", "tokens", "samples", "mimo_rule", "mimo_conv", "hf_rule",
                "qwen3_5_over_plain", "ratio_per_sample", "ratio_padded"):
        assert key in result, key
    for variant in ("qwen3_5", "plain", "hf_per_sample", "hf_padded"):
        assert result[variant]["ms"] > 0, variant
    assert result["samples"] > 1 and result["dtype"] == "fp32" and result["mimo_rule"] == "torch_chunked"
    assert result["rel_err"] < 1e-4 and result["rel_err_dx"] < 1e-4 and result["rel_err_padded"] < 1e-4, result
    assert result["rel_err_grad"] < 1e-3, result  # a weight gradient sums over every token


def test_torch_fallback_puts_transformers_torch_functions_back():
    bench = _bench()
    modeling = bench.hf_modeling()
    before = {name: getattr(modeling, name) for name in bench.HF_KERNEL_FUNCS}
    with bench.torch_fallback(modeling):
        for name in bench.HF_KERNEL_FUNCS:
            fn = getattr(modeling, name)
            assert inspect.unwrap(fn) is fn and fn.__module__ == modeling.__name__, name
    assert all(getattr(modeling, name) is fn for name, fn in before.items())

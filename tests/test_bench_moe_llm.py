"""bench/moe_llm_step.py stays runnable: the tiny MoE LLM on the CPU beside a stand-in for the
torchtitan anchor (torchtitan is carried to the GPU machine only) that replays the documents as
the real anchor does (``synthetic_docs`` of ../shared/bench/torchtitan_moe_baseline.py: the
lengths of a microbatch, then each document's ids, from one generator), so that the two sides
must time the same documents for ``same_tokens`` to hold."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

STAND_IN = textwrap.dedent("""
    import argparse, json, torch
    build_config = active_params = None  # the model builders the dense anchor replaces


    def main(argv=None):
        p = argparse.ArgumentParser()
        for k in ("--docs", "--lo", "--hi", "--steps", "--warmup"):
            p.add_argument(k, type=int)
        p.add_argument("--device"); p.add_argument("--tiny", action="store_true")
        a = p.parse_args(argv)
        g = torch.Generator().manual_seed(1)
        lens = []
        for _ in range(a.steps + 2):
            ls = torch.randint(a.lo, a.hi + 1, (a.docs,), generator=g).tolist()
            lens.append(ls)
            [torch.randint(1, 512 - 2, (n,), generator=g) for n in ls]
        timed = lens[a.warmup:a.steps]
        tokens = sum(map(sum, timed)) / len(timed)
        print("compiling...")
        print(json.dumps(dict(side="torchtitan", real_tokens_per_step=tokens, step_s_median=0.5, real_tokens_per_s=tokens / 0.5,
                              tiny=a.tiny, model_builder=getattr(build_config, "__name__", None))))


    if __name__ == "__main__":
        main()
""")



@pytest.mark.parametrize("model", ["moe", "dense"])
def test_llm_bench_times_the_anchors_documents(tmp_path, capsys, monkeypatch, model):
    """Both models: the same documents on both sides; ``--model dense`` runs the dense anchor,
    which runs the MoE anchor's harness with torchtitan's dense Qwen3 builder swapped in."""
    anchor = tmp_path / "anchor.py"
    anchor.write_text(STAND_IN)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_moe_llm_step", BENCH / "moe_llm_step.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        # a rated peak on the CPU (1 TFLOP/s), so that both sides' MFU is computed
        monkeypatch.setattr("mimo.training.flops.device_peak_flops", lambda *a, **k: 1e12)
        res = bench.main(["--model", model, "--tiny", "--device", "cpu", "--steps", "4", "--warmup", "2", "--variants",
                          "eager", "--anchor", str(anchor)])
    finally:
        sys.path.remove(str(BENCH))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(res))
    assert res["torchtitan"]["tiny"] is True and res["model"] == model
    assert res["torchtitan"]["model_builder"] == ("build_dense_config" if model == "dense" else None)
    assert res["same_tokens"] is True, (res["mimo"]["real_tokens_per_step"], res["torchtitan"]["real_tokens_per_step"])
    v = res["mimo"]["eager"]
    assert v["timed_steps"] == 2 and v["loss_first"] > 0
    assert v["ratio_tokens_per_s"] == v["real_tokens_per_s"] / res["torchtitan"]["real_tokens_per_s"]
    tt = res["torchtitan"]  # its MFU at mimo's FLOPs per real token, against the same rated peak
    assert v["mfu"] > 0 and tt["mfu"] == tt["real_tokens_per_s"] * v["model_tflops_per_s"] / v["real_tokens_per_s"] / 1.0

"""The MoE example configs (issue 21, point 8) run as shipped.

``configs/examples/moe.yaml``: ``mimo demo --config`` runs end to end on it in test_demo's fast
mode (2 steps, a few held-out samples; the full run's held-out exact match, >= 0.9, is measured
by hand: 250 steps take minutes). ``configs/examples/nemotron-h.yaml`` (M, *, -, E; no RoPE;
tp 2) trains a few steps and exports as ``NemotronHForCausalLM``. ``configs/examples/deepseek-v3-moe.yaml``
(+, -, E; MLA with YaRN, group-limited sigmoid routing; tp 2 SP, ep 2) equals its one-process run,
trains and exports as ``DeepseekV3ForCausalLM``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from mimo.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "configs" / "examples"


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


FAST = ["train.steps=2", "train.checkpoint.every=1", "data.tokens_per_microbatch=1024", "eval.samples=8", "eval.max_new_tokens=4"]


def test_moe_demo_runs_end_to_end(tmp_path, monkeypatch, pools, mimo_here, lend_pools):
    """``mimo demo --config moe.yaml`` as from a shell in ``tmp_path``, its command line in this
    process (``mimo_here``), its training from nothing and its evaluation on the session's 4-rank
    pool (``lend_pools``; their output captured as fresh ranks' is)."""
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    with lend_pools(pools):
        proc = mimo_here("demo", "--config", str(EXAMPLES / "moe.yaml"), "--log-every", "1", *FAST)
    assert time.monotonic() - t0 < 400  # as a subprocess of it had
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1/2 | loss" in proc.stdout and "step 2/2 | loss" in proc.stdout and "held-out: loss" in proc.stdout
    result = last_json(proc)
    run_dir = Path(result["run_dir"])
    assert result["ok"] and result["steps"] == 2 and run_dir == tmp_path / "runs" / "moe"
    assert (run_dir / "config.yaml").read_text().count("expert_bias: true") == 1
    ev = result["eval"]
    assert ev["checkpoint_step"] == 2 and ev["samples"] == 8 and 0.0 <= ev["exact_match"] <= 1.0
    assert result["first_loss"] > 0 and result["final_loss"] > 0


def test_nemotron_h_example_trains_and_exports(tmp_path, capsys):
    """Three steps, then ``export-hf --llm-only``: a ``NemotronHForCausalLM`` with every tensor in
    place, the example's routing choices in its config and the trained expert bias as its
    ``e_score_correction_bias``."""
    from transformers import AutoModelForCausalLM

    from mimo.commands.export_hf import gather_checkpoint

    run = tmp_path / "run"
    assert main(["train", str(EXAMPLES / "nemotron-h.yaml"), "train.steps=3", f"train.checkpoint.dir={run / 'ckpt'}",
                 "--run-dir", str(run)]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    capsys.readouterr()
    assert main(["export-hf", str(run), "--out", str(tmp_path / "hf"), "--llm-only"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["architecture"] == "NemotronHForCausalLM"
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = model.config
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (8, 2, 4, 2, 2.5)
    _, full = gather_checkpoint(str(run / "ckpt" / "step-00000003"))
    for layer in (2, 5):  # the E layers of "M*EM-E", one Hugging Face layer each
        bias = model.state_dict()[f"model.layers.{layer}.mixer.gate.e_score_correction_bias"]
        assert torch.equal(bias, full["language"][f"layers.{layer}.router.expert_bias"])
        assert bias.abs().max() > 0  # moved by the once-per-step update (rate 1e-3)


CP2 = "modules.language.parallel={tp: 2, cp: 2, dp: 1, ep: 2, etp: 1, ranks: '0:4', sequence_parallel: true}"
# DeepSeek-V3.2: the same model with DSA layers (an index_topk well below the samples' lengths)
DSA = ["modules.language.arch.pattern=D-DEDE", "modules.language.arch.dsa_index_topk=16",
       "modules.language.arch.dsa_index_heads=4", "modules.language.arch.dsa_index_head_dim=12"]


@pytest.mark.parametrize("layout", ["as shipped", "cp2", "dsa", "dsa warm-up cp2"])
def test_deepseek_v3_example_equals_its_one_process_run(pools, verify_layout, layout):
    """``configs/examples/deepseek-v3-moe.yaml`` (MLA with YaRN, a dense first layer, sigmoid
    group-limited routing with the expert bias; the LLM tp 2 with SP and ep 2, the tower dp 4),
    and the LLM at tp 2 x cp 2 (every sample split over the CP ranks): two steps against the
    one-process run (verify-train's comparison, fp64 yardstick), MLA's and the experts'
    gradients among those compared. With DSA layers (V3.2): the sparse stage (the indexers on
    their KL loss) as shipped, and the dense warm-up (only the indexers train) at cp 2."""
    overrides = {"as shipped": [], "cp2": [CP2], "dsa": DSA,
                 "dsa warm-up cp2": [*DSA, CP2, "modules.language.dsa.warmup=true"]}[layout]
    report = verify_layout(pools, str(EXAMPLES / "deepseek-v3-moe.yaml"), overrides, 2)
    assert report["ok"], report["worst"]
    assert report["yardstick"]["checked"] > 100 and report["yardstick"]["failed"] == 0, report["yardstick"]


def test_deepseek_v3_example_trains_and_exports(tmp_path, capsys):
    """Two steps of the example, then ``export-hf --llm-only``: a ``DeepseekV3ForCausalLM`` that
    transformers loads with every tensor in place, the example's routing and MLA sizes in its
    config and the trained expert bias as each MoE layer's ``e_score_correction_bias``."""
    from transformers import AutoModelForCausalLM

    from mimo.commands.export_hf import gather_checkpoint

    run = tmp_path / "run"
    assert main(["train", str(EXAMPLES / "deepseek-v3-moe.yaml"), "train.steps=2", f"train.checkpoint.dir={run / 'ckpt'}",
                 "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["export-hf", str(run), "--out", str(tmp_path / "hf"), "--llm-only"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["architecture"] == "DeepseekV3ForCausalLM"
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = model.config
    assert (cfg.first_k_dense_replace, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
            cfg.routed_scaling_factor, cfg.q_lora_rank, cfg.kv_lora_rank) == (1, 8, 2, 4, 1, 2.5, 48, 32)
    _, full = gather_checkpoint(str(run / "ckpt" / "step-00000002"))
    for decoder_layer in (1, 2):  # "+-+E+E": our E layers 3 and 5
        bias = model.state_dict()[f"model.layers.{decoder_layer}.mlp.gate.e_score_correction_bias"]
        assert torch.equal(bias, full["language"][f"layers.{2 * decoder_layer + 1}.router.expert_bias"])
        assert bias.abs().max() > 0

"""Low-rank adapters on whole runs (issue 51): ``configs/examples/lora.yaml`` (LoRA on the LLM's
attention and MLP projections at tp 2, on the vision tower's q / v at dp 4, the projector trained
whole) against the one-process reference (``mimo verify-train``'s comparison, fp64 yardstick), in
LoRA and DoRA, with sequence parallelism, pipeline stages and the distributed optimizer, and DoRA on a
Gated DeltaNet layer's fused input projection (four adapters: q | k | v, z, b, a) and on a Mamba-2
layer's input rows (one adapter over two weights), and LoRA on the shared expert and the
routed experts (per-expert adapters split over tp, or over ep with their experts); a LoRA
checkpoint holds the adapters and what else trains, and resumes exactly; the counts that
metrics.jsonl reports; configuration errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors import safe_open

from mimo.compose.adapters import trainable_parameters
from mimo.compose.config import load_config
from mimo.core.errors import ConfigError, MimoError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "configs" / "examples" / "lora.yaml")
LANG, VIS = "modules.language.", "modules.vision."

MOE = [LANG + 'arch.pattern="*E*E"', LANG + "arch.moe={experts: 4, topk: 2, ffn: 32}", LANG + "lora.targets=[q, v, experts]"]
LAYOUTS = {
    "lora, llm tp2 sp dp2, vision dp4": [LANG + "parallel.sequence_parallel=true"],
    "dora, llm tp2 pp2, distributed optimizer, recompute": [
        LANG + "lora.dora=true", VIS + "lora.dora=true", LANG + "parallel={tp: 2, pp: 2, dp: 1, ranks: '0:4'}",
        "train.distributed_optimizer=true", "train.recompute=full"],
    "lora on experts, llm tp2 dp2 (experts split over tp)": [*MOE, LANG + "parallel.sequence_parallel=true"],
    "lora on experts, llm tp2 dp2, ep2 etp2": [*MOE, LANG + "parallel={tp: 2, dp: 2, ep: 2, etp: 2, ranks: '0:4'}"],
    "dora on multi-latent attention, llm tp2 sp dp2": [
        LANG + "arch.pattern=+-+-", *(f"{LANG}arch.mla_{k}={v}" for k, v in (
            ("q_lora_rank", 24), ("kv_lora_rank", 16), ("qk_rope_head_dim", 8), ("qk_nope_head_dim", 8), ("v_head_dim", 12))),
        LANG + "parallel.sequence_parallel=true", LANG + "lora.dora=true",
        LANG + "lora.targets=[q_a, q_b, kv_a, kv_b, o, gate, down]"],
    "lora on deepseek sparse attention's projections, llm tp2 dp2": [
        LANG + "arch.pattern=D-D-", *(f"{LANG}arch.mla_{k}={v}" for k, v in (
            ("q_lora_rank", 24), ("kv_lora_rank", 16), ("qk_rope_head_dim", 8), ("qk_nope_head_dim", 8), ("v_head_dim", 12))),
        *(f"{LANG}arch.dsa_{k}={v}" for k, v in (("index_topk", 8), ("index_heads", 4), ("index_head_dim", 8))),
        LANG + "lora.targets=[q_a, q_b, kv_a, kv_b, o]"],
    "lora on the gated shared expert and experts, llm tp2 sp dp2": [
        *MOE, LANG + "arch.moe={experts: 4, topk: 2, ffn: 32, shared_ffn: 24, shared_gate: true}",
        LANG + "lora.targets=[q, shared, experts]", LANG + "parallel.sequence_parallel=true"],
    "dora on gated deltanet in / out and mlp, llm tp2 dp2": [
        LANG + "arch.pattern=G-*-", LANG + "lora.dora=true", LANG + "lora.targets=[gdn_in, gdn_out, q, v, gate, down]"],
    "dora on mamba-2 in / out and attention, llm tp2 sp dp2": [
        LANG + "arch.pattern=M-*-", LANG + "arch.mamba_head_dim=16", LANG + "arch.mamba_state=8", LANG + "arch.mamba_groups=2",
        LANG + "parallel.sequence_parallel=true", LANG + "lora.dora=true", LANG + "lora.targets=[mamba_in, mamba_out, q, o]"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layouts_equal_one_process_reference(pools, name, verify_layout):
    report = verify_layout(pools, EXAMPLE, LAYOUTS[name], 3)
    assert report["ok"], report
    # the adapters are what trains (and the projector): the compared gradients name them
    assert "lora" in report["worst"]["grads"] or "projector" in report["worst"]["grads"], report["worst"]


def test_lora_checkpoint_holds_what_trains_and_resumes_exactly(pools, resume_case, tmp_path):
    got = pools(4).run(resume_case, EXAMPLE, [], str(tmp_path))
    for rank in got:
        assert rank["straight"] == rank["resumed"], rank
    step = tmp_path / "cut" / "step-00000004"
    names = {}
    for file in sorted(os.listdir(step)):
        if file.endswith(".model.safetensors"):
            with safe_open(str(step / file), "pt") as f:
                names.setdefault(file.split("-rank")[0], set()).update(f.keys())
    assert names["language"] and all(".lora." in n for n in names["language"]), sorted(names["language"])[:5]
    assert {n.split(".")[0] for n in names["vision"]} == {"tower", "projector"}
    assert all(".lora." in n for n in names["vision"] if n.startswith("tower.")), sorted(names["vision"])[:5]
    # export needs the base weights, which the checkpoint does not hold: a clear refusal
    from mimo.commands.export_hf import export_hf

    with pytest.raises(MimoError, match="LoRA checkpoint"):
        export_hf(str(step), str(tmp_path / "hf"))


def test_trainable_parameter_count_is_the_models(pools, tmp_path):
    config = load_config(EXAMPLE, ["world_size=1", LANG + "parallel={}", VIS + "parallel={}"])
    counted = trainable_parameters(config)
    from mimo.compose.model import MimoModel

    model = MimoModel(config, 0)
    built = {part.name: sum(p.numel() for p in part.module.parameters() if p.requires_grad) for part in model.parts}
    assert counted == built
    # at other layouts alike (the count is the one-process model's): the example's, a tp 2 tower
    assert trainable_parameters(load_config(EXAMPLE)) == counted
    assert trainable_parameters(load_config(EXAMPLE, [VIS + "parallel={tp: 2, dp: 2, ranks: '0:4'}"])) == counted
    full = load_config(EXAMPLE, ["world_size=1", LANG + "parallel={}", VIS + "parallel={tp: 1}", f"{LANG}lora=null", f"{VIS}lora=null"])
    assert trainable_parameters(full)["vision"] == sum(p.numel() for p in MimoModel(full, 0).part("vision").module.parameters())
    projector = sum(p.numel() for p in model.part("vision").module.projector.parameters())
    assert projector < counted["vision"] < projector + 10_000  # the projector and the tower's adapters only
    # r x (in + out) per adapter: q, k, v, o in each of 2 attention layers, gate, up, down in 2 MLPs
    r, D, q, kv, F = 8, 64, 4 * 16, 2 * 16, 128
    assert counted["language"] == 2 * r * ((D + q) + 2 * (D + kv) + (q + D)) + 2 * r * (3 * (D + F))


def test_lora_configuration_errors():
    with pytest.raises(ConfigError, match="frozen LLM"):
        load_config(EXAMPLE, [LANG + "freeze=true"])
    with pytest.raises(ConfigError, match="frozen tower"):
        load_config(EXAMPLE, [VIS + "freeze=[tower]"])
    with pytest.raises(ConfigError, match="rank"):
        load_config(EXAMPLE, [LANG + "lora.rank=0"])
    config = load_config(EXAMPLE, ["world_size=1", LANG + "parallel={}", VIS + "parallel={}", LANG + "lora.targets=[q, qkv]"])
    from mimo.compose.model import MimoModel

    with pytest.raises(ConfigError, match=r"modules.language.lora.targets: qkv not among"):
        MimoModel(config, 0)


def _bf16_fp8_lora_steps(config_path: str, overrides: list[str]) -> dict:
    """Two steps of the example at one process in bf16 with FP8 products: what is held in which
    dtype, what the optimizer holds, what moved."""
    import torch

    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    try:
        params = {f"{part.name}.{n}": p for part in run.model.parts for n, p in part.module.named_parameters()}
        before = {n: p.detach().clone() for n, p in params.items()}
        losses = [train_step(run.model, run.pipeline, step, run.optimizers, run.policy).loss for step in (1, 2)]
        held = set()
        for opt in run.optimizers.values():
            for group in getattr(opt, "param_groups", []):
                held |= {id(p) for p in group["params"]}
            for state in getattr(opt, "states", []):
                held |= {id(pc.param) for pc in state.pieces}
        return {"losses": losses,
                "dtypes": {str(p.dtype) for p in params.values()},
                "optimized": sorted(n for n, p in params.items() if id(p) in held),
                "trainable": sorted(n for n, p in params.items() if p.requires_grad),
                "moved": sorted(n for n, p in params.items() if not torch.equal(p.detach(), before[n]))}
    finally:
        run.close()


def test_bf16_base_and_fp8_products_with_adapters(pools):
    """``train.precision: bf16`` with ``train.fp8``: the frozen base is held in bf16 and never moves,
    the optimizer (fp32 masters and moments) holds the adapters and the projector only, and they
    train (finite losses, every adapter's B moved from zero)."""
    got = pools(1).run(_bf16_fp8_lora_steps, EXAMPLE, ["world_size=1", LANG + "parallel={}", VIS + "parallel={}",
                                                       "train.precision=bf16", "train.fp8={recipe: tensorwise}"])[0]
    assert all(0 < loss < 20 for loss in got["losses"]), got["losses"]
    assert got["dtypes"] == {"torch.bfloat16"}
    assert got["optimized"] == got["trainable"] and all(".lora." in n or "projector" in n for n in got["trainable"])
    assert set(got["moved"]) <= set(got["trainable"])
    assert {n for n in got["trainable"] if n.endswith("lora_B")} <= set(got["moved"])

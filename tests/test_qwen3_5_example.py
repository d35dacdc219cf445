"""``configs/examples/qwen3.5-moe.yaml`` (issue 48): a tiny Qwen3.5-MoE-style VLM at native
resolution on the demo data's native split.

* the index holds images of several grid sizes (native resolution, not one fixed size);
* the one-process run reports the MTP loss, and the routed experts' (every expert's), the shared
  expert's, the router's and Gated DeltaNet's gradients are nonzero;
* ``verify-train`` of the example at its shipped layout (world 4: the tower dp 2 on ranks 0-1;
  the LLM tp 2 with sequence parallelism on ranks 2-3, its experts etp 1 x ep 2) equals the
  one-process reference, losses (``mtp/loss`` too), gradients and weights, against the fp64
  yardstick, each MoE token crossing to its expert's rank once;
* colocated (world 2: the LLM on the tower's ranks 0-1) it equals the same reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mimo.compose.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "examples" / "qwen3.5-moe.yaml"
STEPS = 2


@pytest.fixture(scope="module")
def native(tmp_path_factory, write_native_example) -> str:
    """The example config over fresh demo data (its native split: 24 samples in one shard), its
    microbatches small (a few samples each)."""
    return write_native_example(EXAMPLE, tmp_path_factory.mktemp("qwen3_5"), 7, 24, tokens_per_microbatch=384,
                                max_sample_tokens=384)


def test_the_example_is_qwen3_5_shaped(native):
    config = load_config(native)  # the example's modules and layout (its data paths moved)
    tower, llm = config.encoders["vision"].arch, config.llm
    arch = llm.arch
    assert tower.deepstack_layers == [] and arch.deepstack_layers == []
    assert arch.pattern.count("G") == 3 * arch.pattern.count("*") and set(arch.pattern) == {"G", "*", "E"}
    assert arch.norm_zero_centred and arch.attn_output_gate and arch.qk_norm
    assert sum(arch.mrope_section) == arch.rotary_dim // 2 < arch.head_dim // 2
    assert arch.moe.shared_gate and arch.moe.shared_ffn and arch.moe.norm_topk and arch.moe.score == "softmax"
    assert arch.mtp is not None and arch.mtp.depth == 1 and arch.mtp.loss_weight == 0.1
    assert llm.parallel.cp == 1 and llm.expert_layout() == (1, 2)
    assert config.world_size == 4 and tower.out_hidden == arch.hidden
    rows = {r["module"]: r for r in config.layout_rows()}
    assert rows["language"]["ranks"] == "2:4" and rows["vision"]["ranks"] == "0:2"  # each on its own ranks


def test_the_index_holds_images_of_several_grids(native):
    """Native resolution: the split's images keep their own sizes, so their grids (and rows) differ."""
    from mimo.compose.inputs import ensure_index

    index = ensure_index(load_config(native))[0]
    grids = {tuple(g[1:]) for e in index.entries for g in e.image_grids.get("<image>", [])}
    rows = {n for e in index.entries for n in e.image_rows.get("<image>", [])}
    assert len(grids) >= 3 and len(rows) >= 3, (grids, rows)


@pytest.fixture(scope="module")
def one_process(pools, native):
    """The one-process runs (fp32, fp64) every layout below is compared with."""
    from mimo.commands.verify_train import references

    return references(pools(1), native, [], STEPS)


def test_the_reference_reports_mtp_and_trains_experts_and_gdn(native, one_process):
    """Step 1 of the one-process run: the MTP loss is reported, and every GDN mixer weight, the
    routed experts (each of them: every expert took tokens), the shared expert, its gate and the
    router have nonzero gradients, in the main layers and in the MTP block."""
    ref32, _ = one_process
    first = ref32[0]["steps"][0]
    assert 0 < first["mtp"]["mtp/loss"] < 10
    grads = first["grads"]["language"]
    arch = load_config(native).llm.arch
    layers = arch.layer_pattern().layers
    gdn = [s.index for s in layers if s.kind == "gdn"]
    moe = [s.index for s in layers if s.kind == "moe"]
    assert len(gdn) == 3 and len(moe) == 4
    mixer = ("in_proj_weight", "conv_weight", "dt_bias", "A_log", "norm_weight", "out_proj.weight")
    names = [f"layers.{i}.mixer.{n}" for i in gdn for n in mixer]
    expert_names = [f"{p}layers.{i}.experts.{n}" for p, idx in (("", moe), ("mtp.0.", [len(layers) + 1]))
                    for i in idx for n in ("up_proj", "down_proj")]
    names += [n.replace("experts.up_proj", part) for n in expert_names if n.endswith("up_proj")
              for part in ("router.weight", "shared.up_proj", "shared.down_proj", "shared.gate")]
    for name in names:
        assert grads[name].abs().sum() > 0, name
    for name in expert_names:
        g = grads[name]
        assert g.shape[0] == arch.moe.experts and bool((g.flatten(1).abs().sum(1) > 0).all()), name


@pytest.mark.parametrize("layout", ["non-colocated", "colocated"])
def test_verify_train_equals_one_process(pools, native, one_process, layout):
    """The whole run (tower DP blocks by cost, pixels routed per patch, bridges of variable rows,
    M-RoPE over partial rotary, gated attention, GDN, MoE with EP, MTP) equals the one-process run."""
    from mimo.commands.verify_train import compare, train_case

    overrides = {"colocated": ["world_size=2", "modules.language.parallel.ranks=0:2"], "non-colocated": []}[layout]
    ran = pools(2 if overrides else 4).run(train_case, native, overrides, STEPS, False)
    report = compare(ran, one_process[0], 1e-5, fp64=one_process[1])
    assert report["ok"], report
    assert all(0 < loss < 10 for loss in report["losses"])
    assert report["moe_dispatch"]["bytes_ratio"] == 1.0


DENSE = ["modules.language.arch.pattern='G-G-G-*-'", "modules.language.arch.moe=null", "modules.language.arch.ffn=96",
         "modules.language.parallel.ep=1", "modules.language.parallel.etp=null"]


def test_dense_qwen3_5_verify_train_equals_one_process(pools, native):
    """Dense Qwen3.5 (an MLP after every mixer, MTP attention + MLP) at the shipped two-module
    non-colocated layout: the tower dp 2, the LLM tp 2 with SP."""
    from mimo.commands.verify_train import compare, references, train_case

    ref32, ref64 = references(pools(1), native, DENSE, STEPS)
    ran = pools(4).run(train_case, native, DENSE, STEPS, False)
    report = compare(ran, ref32, 1e-5, fp64=ref64)
    assert report["ok"], report
    assert ref32[0]["steps"][0]["mtp"]["mtp/loss"] > 0
    grads = ref32[0]["steps"][0]["grads"]["language"]
    assert any(n.startswith("mtp.0.layers.9.up_proj") for n in grads) and "moe_dispatch" not in report

"""Activation recompute (``train.recompute``, ``mimo.parallel.recompute``).

* every layer kind (attention, MLP, Mamba-2, GDN, MoE) and a ViT block, ``selective`` and
  ``full``: the same outputs and gradients as without recompute, bit for bit, and fewer bytes kept
  for backward (full < selective < none);
* a recomputed MoE forward adds nothing twice to the step's accumulators (router token counts,
  aux-loss running counts) and its global aux loss reads back the running counts of its first
  forward (a recompute that read them again would change the gradient);
* ``mimo verify-train`` with each mode (the one-process reference runs without recompute), also
  with ``recompute_layers`` and per-module settings.
"""

from __future__ import annotations

import pytest
import torch

from mimo.llm.blocks import build_layer
from mimo.llm.config import AuxLoss, HybridArch, MoEArch
from mimo.llm.context import SeqContext
from mimo.parallel.recompute import checkpoint, set_selective

SEQLENS = [13, 1, 20, 6]


def arch(kind: str) -> HybridArch:
    moe = MoEArch(experts=4, topk=2, ffn=24, shared_ffn=8, expert_bias=True, aux_loss=AuxLoss("global", 0.5))
    return HybridArch(pattern=kind, hidden=16, heads=4, kv_heads=2, vocab=50, ffn=32, moe=moe, mamba_heads=2,
                      mamba_head_dim=8, mamba_state=4, mamba_chunk=8, gdn_heads=2, gdn_v_heads=2, gdn_head_dim=4,
                      gdn_v_head_dim=4, gdn_chunk=8)


def run(kind: str, mode: str, microbatches: int = 2):
    """Two microbatches through one layer (the MoE's running counts move between them)."""
    a = arch(kind)
    layer = build_layer(a, a.layer_pattern().layers[0])
    layer.init_weights(3, 0.3)
    set_selective(layer, mode == "selective")
    g = torch.Generator().manual_seed(1)
    # the storages one forward keeps (by address: a tensor saved twice counts once). Counted per
    # forward, while all of them are alive: across microbatches a freed storage's address can
    # come back for another, and the count would then depend on the allocator
    seen: dict[int, int] = {}
    kept = 0

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    outs = []
    for _ in range(microbatches):
        x = torch.randn(sum(SEQLENS), 16, generator=g).requires_grad_()
        seq = SeqContext.from_seqlens(SEQLENS)
        seq.loss_norm = 40.0
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = checkpoint(layer, x, seq) if mode == "full" else layer(x, seq)
        kept += sum(seen.values())
        (y * torch.randn(y.shape, generator=g)).sum().backward()
        outs += [y.detach(), x.grad]
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in layer.named_buffers()}
    return outs, grads, buffers, kept


@pytest.mark.parametrize("kind", ["*", "-", "M", "G", "E"])
def test_recomputed_layer_equals_the_plain_one(kind):
    plain = run(kind, "none")
    kept = {"none": plain[3]}
    for mode in ("selective", "full"):
        got = run(kind, mode)
        for a, b in zip(got[0], plain[0]):
            assert torch.equal(a, b), mode
        assert got[1].keys() == plain[1].keys() and all(torch.equal(got[1][n], plain[1][n]) for n in plain[1]), mode
        # nothing counted twice: router counts, aux-loss running counts
        assert all(torch.equal(got[2][n], plain[2][n]) for n in plain[2]), (mode, [n for n in plain[2]])
        kept[mode] = got[3]
    assert kept["full"] < kept["selective"] and kept["full"] < kept["none"], kept
    if kind in "*-E":  # (Mamba-2's and GDN's only selective piece is the pre-norm: in fp32 it keeps its input either way)
        assert kept["selective"] < kept["none"], kept


def test_moe_accumulators_really_count():
    """The check above would pass if nothing were ever counted: the plain run counts."""
    _, _, buffers, _ = run("E", "none")
    assert buffers["router.step_counts"].sum() == 2 * sum(SEQLENS) * 2  # 2 microbatches, top 2
    assert buffers["router.aux_tokens"] == 2 * sum(SEQLENS)


def test_selective_moe_keeps_no_permuted_rows():
    """The permuted rows (tokens x topk, ``[R, D]``) are gathered again in backward, not kept:
    selective keeps one fewer ``[R, D]`` storage than none (the experts' outputs, as big, stay)."""
    rows = sum(SEQLENS) * 2 * 16 * 4  # R x D fp32

    def kept_rd(mode):
        a = arch("E")
        layer = build_layer(a, a.layer_pattern().layers[0])
        layer.init_weights(3, 0.3)
        set_selective(layer, mode == "selective")
        sizes = {}

        def pack(t):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(torch.randn(sum(SEQLENS), 16, requires_grad=True), SeqContext.from_seqlens(SEQLENS))
        return sum(1 for n in sizes.values() if n == rows)

    assert kept_rd("selective") == kept_rd("none") - 1 >= 0


def test_vit_block_recompute_equals_plain():
    from mimo.encoders.config import VitArch
    from mimo.encoders.vit import VisionTransformer

    results = {}
    for mode in ("none", "selective", "full"):
        tower = VisionTransformer(VitArch(image_size=16, patch=8, hidden=16, layers=2, heads=2, mlp=32), -1)
        tower.init_weights(4)
        tower.set_recompute(mode, 1)  # the first block only
        pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
        y = tower(pixels)
        y.square().sum().backward()
        results[mode] = (y.detach(), {n: p.grad.clone() for n, p in tower.named_parameters()})
        assert [getattr(b, "recompute_full", False) for b in tower.blocks] == [mode == "full", False]
        assert tower.blocks[1].norm1.selective is False and tower.blocks[0].norm1.selective is (mode == "selective")
    for mode in ("selective", "full"):
        assert torch.equal(results[mode][0], results["none"][0])
        assert all(torch.equal(results[mode][1][n], g) for n, g in results["none"][1].items())


# ---------------------------------------------------------------- verify-train
STEPS = 2
LAYOUTS = {  # tests/configs/cp.yaml (every layer kind, MoE with expert bias), world 4
    "selective, llm tp2 dp2 sp": ["train.recompute=selective", "modules.language.parallel.cp=1",
                                  "modules.language.parallel.tp=2", "modules.language.parallel.sequence_parallel=true"],
    "full, global aux, cp2 dp2": ["train.recompute=full", "modules.language.arch.moe.aux_loss.kind=global"],
    "full on the first 2 LLM layers, vision selective": [
        "train.recompute=full", "train.recompute_layers=2", "modules.vision.recompute=selective",
        "modules.language.parallel.cp=1", "modules.language.parallel.dp=4"],
}


@pytest.fixture(scope="module")
def cp_config(tmp_path_factory, write_moe_configs):
    return write_moe_configs(tmp_path_factory.mktemp("recompute"), train_samples=120, seed=9, names=("cp",))["cp"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verify_train_with_recompute(pools, cp_config, name, verify_layout):
    report = verify_layout(pools, cp_config, LAYOUTS[name], STEPS)
    assert report["ok"], report

"""Multi-token prediction (``arch.mtp``, ``mimo.llm.mtp``).

* the MTP losses of a packed batch equal a hand-written per-sample reference (fp64): depth k at
  position t reads token t + k's embedding and predicts label t + k, inside t's sample only;
  Qwen's order [embedding | hidden] into ``fc``; depth 2 reads depth 1's normed output;
* a training forward adds ``loss_weight / depth * sum / loss_norm`` to the objective (the
  gradients of every parameter equal those of that sum) while the returned loss stays the main
  one; an eval forward runs no MTP;
* ``verify-train``: MTP at pp 2 (untied: the last stage's embedding copy; tied: the head's)
  and at tp 2 with sequence parallelism equals one process, losses (``mtp/loss`` too),
  gradients and weights, against the fp64 yardstick.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mimo.core.batch import PackedBatch
from mimo.llm.config import HybridArch, MoEArch, MTPArch
from mimo.llm.model import LLMStage
from mimo.llm.mtp import shift_in_samples

LANG = "modules.language."


def test_shift_stays_inside_samples():
    x = torch.arange(10)
    cu = torch.tensor([0, 4, 5, 10], dtype=torch.int32)
    assert shift_in_samples(x, 1, cu, -1).tolist() == [1, 2, 3, -1, -1, 6, 7, 8, 9, -1]
    assert shift_in_samples(x, 2, cu, -1).tolist() == [2, 3, -1, -1, -1, 7, 8, 9, -1, -1]


def _arch(depth: int, tied: bool = False) -> HybridArch:
    """Qwen3.5-like: GDN and gated attention with partial rotary, zero-centred norms, MoE with a
    gated shared expert; the MTP block attention + MoE."""
    return HybridArch(
        pattern="G-*E", hidden=24, heads=3, kv_heads=1, head_dim=8, vocab=37, ffn=40, qk_norm=True,
        gdn_heads=2, gdn_v_heads=2, gdn_head_dim=8, gdn_v_head_dim=8, tie_embeddings=tied,
        norm_zero_centred=True, attn_output_gate=True, rotary_fraction=0.5,
        moe=MoEArch(experts=4, topk=2, ffn=12, shared_ffn=16, shared_gate=True),
        mtp=MTPArch(depth=depth, loss_weight=0.3),
    )


def _pack(lengths: list[int], vocab: int, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (sum(lengths),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.full_like(tokens, 0)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    positions = torch.cat([torch.arange(n) for n in lengths])
    for a, n in zip(cu[:-1].tolist(), lengths):
        labels[a : a + n - 1] = tokens[a + 1 : a + n]
        mask[a : a + n - 1] = torch.rand(n - 1, generator=g) > 0.2  # some targets off (prompts)
    return PackedBatch(tokens=tokens, positions=positions, cu_seqlens=cu, labels=labels, loss_mask=mask)


def _stage(arch: HybridArch) -> LLMStage:
    torch.manual_seed(0)
    stage = LLMStage(arch).to(torch.float64)
    stage.init_weights(seed=3)
    with torch.no_grad():  # norms away from their identity: a swapped norm shows
        for name, p in stage.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return stage


def _main_hidden(stage: LLMStage, batch: PackedBatch) -> torch.Tensor:
    seq = stage.context(batch)
    return stage.norm(stage._layers(stage._embed(batch, {}), seq))


def _rms(x, w, eps):  # zero-centred RMSNorm, written out
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _reference(stage: LLMStage, batch: PackedBatch) -> list[float]:
    """Each depth's summed token losses, sample by sample (module doc)."""
    arch, eps = stage.arch, stage.arch.norm_eps
    embed = stage.embed.weight
    head = embed if arch.tie_embeddings else stage.head.weight
    sums = [0.0] * arch.mtp.depth
    cu = batch.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        one = PackedBatch(tokens=batch.tokens[a:b], positions=batch.positions[a:b],
                          cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32), labels=batch.labels[a:b],
                          loss_mask=batch.loss_mask[a:b])
        h, n, seq = _main_hidden(stage, one), b - a, stage.context(one)
        for k, depth in enumerate(stage.mtp.depths, start=1):
            ahead = torch.zeros(n, dtype=torch.long)
            ahead[: max(n - k, 0)] = one.tokens[k:]
            x = torch.cat([_rms(embed[ahead], depth.norm_embed.weight, eps), _rms(h, depth.norm_hidden.weight, eps)], -1)
            x = x @ depth.fc.weight.T
            for layer in depth.layers.values():
                x = layer(x, seq)
            h = _rms(x, depth.norm.weight, eps)
            logits = (h @ head.T)[: max(n - k, 0)]
            target, counts = one.labels[k:], one.loss_mask[k:]
            sums[k - 1] += float((F.cross_entropy(logits, target, reduction="none") * counts).sum())
    return sums


@pytest.mark.parametrize("depth,tied", [(1, False), (2, True)])
def test_mtp_losses_equal_the_hand_written_reference(depth, tied):
    stage = _stage(_arch(depth, tied))
    batch = _pack([7, 2, 11, 5], stage.arch.vocab)
    got = [float(x) for x in stage.mtp_losses(_main_hidden(stage, batch), batch)]
    want = _reference(stage, batch)
    assert all(w > 0 for w in want)
    assert got == pytest.approx(want, rel=1e-12)


def test_training_forward_attaches_the_weighted_mtp_loss():
    stage = _stage(_arch(2))
    batch = _pack([9, 4, 6], stage.arch.vocab, seed=1)
    n = float(batch.loss_mask.sum())
    stage.train()
    stage.forward(batch, loss_norm=n)  # (a first forward: sums_K accumulates, reset starts a step)
    stage.mtp.reset()
    main = stage.loss(stage.forward(batch, loss_norm=n), batch, n)
    main.backward()
    got = {k: p.grad.clone() for k, p in stage.named_parameters() if p.grad is not None}
    stage.zero_grad(set_to_none=True)
    h = _main_hidden(stage, batch)
    mtp = stage.mtp_losses(h, batch)
    want_loss = stage.loss(stage.logits(h), batch, n)
    (want_loss + 0.3 / 2 * sum(mtp) / n).backward()
    assert float(main) == pytest.approx(float(want_loss), rel=1e-12)  # the reported loss: the main one
    assert stage.mtp.sums_K.tolist() == pytest.approx([float(x) for x in mtp], rel=1e-12)
    for k, p in stage.named_parameters():
        assert k in got, k  # every parameter, the MTP heads' included, has a gradient
        torch.testing.assert_close(got[k], p.grad, rtol=1e-10, atol=1e-14)
    stage.zero_grad(set_to_none=True)
    stage.eval()
    stage.loss(stage.forward(batch), batch, n).backward()
    assert all(p.grad is None for k, p in stage.named_parameters() if k.startswith("mtp."))


# ---------------------------------------------------------------- layouts against one process

STEPS = 2
LAYOUTS = {  # tests/configs/moe_{pp,tp}.yaml (4 ranks) with MTP
    "pp2 dp2, untied, depth 2": ("moe_pp", [LANG + "arch.mtp={depth: 2, loss_weight: 0.5}"]),
    "pp2 dp2, tied": ("moe_pp", [LANG + "arch.mtp={depth: 1, loss_weight: 0.5}", LANG + "arch.tie_embeddings=true"]),
    "tp2 dp2 sp": ("moe_tp", [LANG + "arch.mtp={depth: 1, loss_weight: 0.5, pattern: '*-'}"]),
}


@pytest.fixture(scope="module")
def mtp_configs(tmp_path_factory, write_moe_configs):
    return write_moe_configs(tmp_path_factory.mktemp("mtp"), train_samples=60, seed=11)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verify_train_with_mtp(pools, mtp_configs, name):
    from mimo.commands.verify_train import compare, references, train_case

    config, overrides = LAYOUTS[name]
    config = mtp_configs[config]
    layout = pools(4).run(train_case, config, overrides, STEPS, False)
    ref32, ref64 = references(pools(1), config, overrides + ["train.schedule=simple"], STEPS)
    report = compare(layout, ref32, 1e-5, fp64=ref64)
    assert report["ok"], report
    first = ref32[0]["steps"][0]
    assert first["mtp"]["mtp/loss"] > 0 and all(s["mtp"] == first["mtp"] or s is first for s in [first])
    assert ("mtp/loss_depth2" in first["mtp"]) == ("depth: 2" in overrides[0])
    grads = first["grads"]["language"]
    assert any(n.startswith("mtp.0.fc") and g.abs().sum() > 0 for n, g in grads.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_mtp_training_forward_on_the_gpu_equals_the_cpu():
    """fp32, TF32 off: the attached objective's loss and every gradient alike on both devices."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        out = {}
        for device in ("cpu", "cuda"):
            stage = _stage(_arch(2)).to(device=device, dtype=torch.float32)
            batch = _pack([9, 4, 6, 13], stage.arch.vocab, seed=2)
            batch = PackedBatch(**{f: getattr(batch, f).to(device) for f in ("tokens", "positions", "cu_seqlens", "labels",
                                                                                "loss_mask")})
            n = float(batch.loss_mask.sum())
            stage.train()
            loss = stage.loss(stage.forward(batch, loss_norm=n), batch, n)
            loss.backward()
            out[device] = (float(loss), stage.mtp.sums_K.cpu(), {k: p.grad.cpu() for k, p in stage.named_parameters()})
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    (l0, s0, g0), (l1, s1, g1) = out["cpu"], out["cuda"]
    assert l1 == pytest.approx(l0, rel=1e-5)
    torch.testing.assert_close(s1, s0, rtol=1e-5, atol=0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=k)

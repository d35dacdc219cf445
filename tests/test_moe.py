"""The MoE layer (``mimo.llm.moe``) and MoE training.

* one process: the grouped-GEMM experts equal the ``experts_loop`` oracle; ``grouped_linear``
  equals a per-expert loop bit for bit (fp32, forward and backward) and its fp64 fallback;
  routing (lowest-index ties, Hugging Face's group-limited formula, expert bias for selection
  only, sigmoid / norm_topk / norm_eps / scale, padding routes nowhere, idle experts);
* TP over gloo (2 and 3 ranks, with and without sequence parallel, shared expert + gate,
  latent projections, aux losses): outputs and every gradient equal the one-process layer
  under the fp64 yardstick; identical experts on exact ties at every layout;
* ``torch.compile`` on a layer (bf16, and FP8 rowwise under ``eager`` and ``aot_eager``): no
  graph break, two graphs whatever the pack length, the eager layer bit for bit;
* ``mimo verify-train`` on tiny MoE LLaVAs (tests/configs/moe_*.yaml);
* the MoE cost of the automatic pipeline split, and arch.moe's config checks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mimo.core.testing import Yardstick, rel_err
from mimo.llm.config import AuxLoss, MoEArch
from mimo.llm.context import SeqContext
from mimo.llm.experts import experts_loop
from mimo.llm.moe import MoE
from mimo.llm.router import topk_lowest_index
from mimo.parallel import gemm
from mimo.parallel.context import ParallelContext
from mimo.parallel.fp8 import apply_fp8, clear_fp8
from mimo.parallel.grouped import grouped_mm_takes
from mimo.parallel.params import full_tensors, load_full_, param_table, reduce_partial_grads

HIDDEN = 16
TOL = 1e-5
WORLD = 3
CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def moe_arch(**kw) -> MoEArch:
    base = dict(experts=6, topk=2, ffn=12)
    base.update(kw)
    return MoEArch(**base)


def random_state(cfg: MoEArch, seed: int, router_scale: float = 4.0) -> dict[str, torch.Tensor]:
    """Full random weights of one MoE layer: matrices ~ 1/sqrt(fan_in), norm 1 + noise; the
    router weight scaled up so that the top-k has a margin (no near-tie flips between layouts)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, info in param_table(MoE(HIDDEN, cfg)).items():
        noise = torch.randn(info.placement.full_shape, generator=gen, dtype=torch.float64)
        out[name] = 1 + 0.2 * noise if name == "norm.weight" else noise / noise.shape[-1] ** 0.5
    out["router.weight"] = out["router.weight"] * router_scale
    return out


def make_seq(seqlens: list[int], pad: int, loss_norm: float | None, device: str = "cpu") -> SeqContext:
    """A pack of ``seqlens`` samples plus a trailing padding segment of ``pad`` tokens."""
    seq = SeqContext.from_seqlens(seqlens + ([pad] if pad else []), device)
    seq.num_real = sum(seqlens)
    seq.loss_norm = loss_norm
    return seq


def make_inputs(seq: SeqContext, seed: int):
    gen = torch.Generator().manual_seed(seed)
    t = seq.positions.numel()
    return torch.randn(t, HIDDEN, generator=gen, dtype=torch.float64), torch.randn(t, HIDDEN, generator=gen, dtype=torch.float64)


def run_layer(cfg, state, h_TD, w_TD, seq, dtype=torch.float64, ctx=None, expert_bias=None):
    """Forward and backward of ``sum(out * w)`` (plus the aux losses when ``seq.loss_norm``);
    this rank's output, its input gradient and every full gradient (partials summed over TP)."""
    layer = MoE(HIDDEN, cfg, ctx=ctx).to(dtype)
    table = param_table(layer)
    load_full_(table, state)
    if expert_bias is not None:
        layer.router.expert_bias.copy_(expert_bias)
    layer.train()
    h = h_TD.to(dtype).clone().requires_grad_(True)
    out = layer(h, seq)
    (out * w_TD.to(dtype)).sum().backward()
    reduce_partial_grads(table)
    return {"out": out.detach(), "h_grad": h.grad, "grads": full_tensors(table, grads=True),
            "counts": layer.router.step_counts.clone()}


# ---------------------------------------------------------------- grouped GEMM


def test_grouped_linear_equals_a_loop_bit_for_bit():
    """fp32 takes torch._grouped_mm; forward and both gradients equal one F.linear per expert
    bit for bit, with an expert that gets no row; fp64 takes the loop fallback."""
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 7]  # expert 1 gets nothing
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(sum(counts), 8, generator=gen)
    w = torch.randn(len(counts), 12, 8, generator=gen)
    dy = torch.randn(sum(counts), 12, generator=gen)
    assert grouped_mm_takes(x, w) and not grouped_mm_takes(x.double(), w.double())
    for dtype in (torch.float32, torch.float64):
        xg, wg = x.to(dtype).clone().requires_grad_(True), w.to(dtype).clone().requires_grad_(True)
        y = gemm.grouped_linear(xg, wg, ends)
        (y * dy.to(dtype)).sum().backward()
        xl, wl = x.to(dtype).clone().requires_grad_(True), w.to(dtype).clone().requires_grad_(True)
        parts, start = [], 0
        for e, end in enumerate(ends.tolist()):
            parts.append(torch.nn.functional.linear(xl[start:end], wl[e]))
            start = end
        yl = torch.cat(parts)
        (yl * dy.to(dtype)).sum().backward()
        assert torch.equal(y, yl) and torch.equal(xg.grad, xl.grad) and torch.equal(wg.grad, wl.grad), dtype
        assert torch.equal(wg.grad[1], torch.zeros_like(wg.grad[1]))


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("kw", [
    dict(),
    dict(act="relu2", score="sigmoid", norm_eps=1e-20, scale=2.5, shared_ffn=8, latent=8),
    dict(act="gelu", norm_topk=False, groups=3, group_topk=2, shared_ffn=8, shared_gate=True),
], ids=["softmax-swiglu", "sigmoid-relu2-latent-shared", "gelu-groups-shared-gate"])
def test_layer_equals_experts_loop(kw):
    """The layer (grouped GEMMs over sorted rows) equals the per-expert oracle in the output
    and every gradient; the padding gets exactly its input back and no gradient of its own."""
    cfg = moe_arch(**kw)
    state = {k: v.float() for k, v in random_state(cfg, 1).items()}
    seq = make_seq([5, 1, 9, 3], pad=6, loss_norm=None)
    h, w = (t.float() for t in make_inputs(seq, 2))
    got = run_layer(cfg, state, h, w, seq, torch.float32)

    layer = MoE(HIDDEN, cfg)
    load_full_(param_table(layer), state)
    params = dict(layer.named_parameters())
    hr = h.clone().requires_grad_(True)
    x = layer.norm(hr)
    routing = layer.router.route(layer.router.logits(x), seq.real_mask())
    xi = layer.latent_in(x) if cfg.latent else x
    y = experts_loop(xi, routing, params["experts.up_proj"], params["experts.down_proj"], cfg.act)
    if cfg.latent:
        y = layer.latent_out(y)
    if cfg.shared_ffn:
        y = y + layer.shared(x)
    ((hr + y) * w).sum().backward()
    want = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    ys = Yardstick(TOL)
    ys.check("out", got["out"], hr + y, hr + y)
    ys.check("h_grad", got["h_grad"], hr.grad, hr.grad)
    for n in want:
        ys.check(n, got["grads"][n], want[n], want[n])
    ys.assert_ok()
    real = seq.num_real
    assert (layer.experts(xi, routing)[real:] == 0).all()  # no routed expert reaches the padding
    if not cfg.shared_ffn:  # (the shared expert sees every token)
        assert torch.equal(got["out"][real:], h[real:])  # nothing reaches the padding ...
        assert torch.equal(got["h_grad"][real:], w[real:])  # ... and it gets only the residual's gradient
    assert got["counts"].sum().item() == real * cfg.topk  # the padding counts nowhere


def test_ties_go_to_the_lowest_index():
    """All-equal logits choose experts 0..k-1 (softmax and sigmoid), in that order."""
    for score in ("softmax", "sigmoid"):
        layer = MoE(HIDDEN, moe_arch(experts=8, topk=3, score=score))
        r = layer.router.route(torch.zeros(5, 8), None)
        assert r.idx_TK.tolist() == [[0, 1, 2]] * 5
        assert torch.allclose(r.gate_TK, torch.full((5, 3), 1 / 3))
    vals, idx = topk_lowest_index(torch.tensor([[1.0, 3.0, 1.0, 3.0, 2.0]]), 3)
    assert idx.tolist() == [[1, 3, 4]] and vals.tolist() == [[3.0, 3.0, 2.0]]


def hf_group_limited_topk(scores_TE, bias_E, k, groups, group_topk, norm_topk, eps, scale):
    """Hugging Face's DeepSeek-V3 / Nemotron-H ``route_tokens_to_experts``, written out:

        s = scores + e_score_correction_bias
        group_scores = s.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = topk(group_scores, k=topk_group)[1]; mask the other groups' experts to 0
        topk_indices = topk(s masked, k)[1]; weights = scores.gather(topk_indices)
        weights /= weights.sum(-1) + 1e-20 (norm_topk_prob); weights *= routed_scaling_factor
    """
    t, e = scores_TE.shape
    s = scores_TE + bias_E
    gs = s.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(-1)
    gi = torch.topk(gs, k=group_topk, dim=-1, sorted=False)[1]
    gmask = torch.zeros_like(gs).scatter_(1, gi, 1)
    smask = gmask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, -1)
    masked = s.masked_fill(~smask.bool(), 0.0)
    idx = torch.topk(masked, k=k, dim=-1, sorted=False)[1]
    wts = scores_TE.gather(1, idx)
    if norm_topk:
        wts = wts / (wts.sum(-1, keepdim=True) + eps)
    return idx, wts * scale


@pytest.mark.parametrize("norm_topk", [True, False])
def test_group_limited_sigmoid_routing_equals_hugging_face(norm_topk):
    """Sigmoid scores, expert bias, 4 groups of 4 (best 2), top-3, norm_eps, scale: the same
    experts and gates as Hugging Face's formula (compared as sets: HF's top-k is unsorted); the
    gates come from the unbiased scores and the bias changes the selection."""
    e, k, groups, gk, eps, scale = 16, 3, 4, 2, 0.1, 2.5  # eps: HF's 1e-20 would hide it
    cfg = moe_arch(experts=e, topk=k, score="sigmoid", groups=groups, group_topk=gk, expert_bias=True,
                   norm_topk=norm_topk, norm_eps=eps, scale=scale)
    router = MoE(HIDDEN, cfg).router
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, e, generator=gen, dtype=torch.float64) * 2
    bias = torch.randn(e, generator=gen, dtype=torch.float64).abs() * 0.3  # s > 0: HF masks with 0
    router.expert_bias.copy_(bias)
    got = router.route(logits, None)
    idx, wts = hf_group_limited_topk(logits.sigmoid(), bias, k, groups, gk, norm_topk, eps, scale)
    order_got, order_hf = got.idx_TK.argsort(-1), idx.argsort(-1)
    assert torch.equal(got.idx_TK.gather(1, order_got), idx.gather(1, order_hf))
    assert torch.allclose(got.gate_TK.gather(1, order_got), wts.gather(1, order_hf), rtol=1e-12, atol=0)
    router.expert_bias.zero_()
    unbiased = router.route(logits, None)
    assert not torch.equal(unbiased.idx_TK, got.idx_TK)  # the bias steers the selection ...
    scores = logits.sigmoid()
    gates = scores.gather(1, got.idx_TK)
    if norm_topk:
        gates = gates / (gates.sum(-1, keepdim=True) + eps)
    assert torch.allclose(got.gate_TK, gates * scale, rtol=1e-12, atol=0)  # ... the gates stay unbiased


def test_expert_bias_selects_only():
    """A large bias on expert 5 puts it in every token's top-k; its gate is its softmax score
    (renormalised over the chosen two), not the biased score."""
    cfg = moe_arch(expert_bias=True)
    router = MoE(HIDDEN, cfg).router
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    router.expert_bias[5] = 10.0
    r = router.route(logits, None)
    assert (r.idx_TK == 5).any(-1).all()
    p = logits.softmax(-1).gather(1, r.idx_TK)
    assert torch.allclose(r.gate_TK, p / p.sum(-1, keepdim=True), rtol=1e-12, atol=0)


def test_padding_routes_nowhere_and_idle_experts():
    """Padding: idx = E, gate 0, not counted; a pack where some experts get no token (a bias
    steers every token away from them) still runs forward and backward, their grads exactly 0."""
    cfg = moe_arch(expert_bias=True)
    state = random_state(cfg, 5)
    seq = make_seq([4, 3], pad=5, loss_norm=None)
    layer = MoE(HIDDEN, cfg).double()
    load_full_(param_table(layer), state)
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -9.0, -9.0, 0.0], dtype=torch.float64))
    h, w = make_inputs(seq, 6)
    x = layer.norm(h)
    r = layer.router.route(layer.router.logits(x), seq.real_mask())
    assert (r.idx_TK[7:] == 6).all() and (r.gate_TK[7:] == 0).all()
    assert not ((r.idx_TK[:7] == 3) | (r.idx_TK[:7] == 4)).any()
    got = run_layer(cfg, state, h, w, seq, expert_bias=layer.router.expert_bias.clone())
    for name in ("experts.up_proj", "experts.down_proj"):
        g = got["grads"][name]
        assert (g[3:5] == 0).all() and (g[[0, 1, 2, 5]] != 0).any(), name
    assert got["counts"].tolist()[3:5] == [0.0, 0.0] and got["counts"].sum().item() == 7 * cfg.topk


def test_aux_losses_equal_their_formulas():
    """``Router.aux_loss`` against the formulas written out (a factor on an aux loss is the same
    at every layout, so only a direct check sees it): global (f running over the step's
    microbatches so far), per_sample (sigmoid probabilities normalised per token), z-loss; the
    padding counts nowhere; divided by the step's loss-token count."""
    gen = torch.Generator().manual_seed(7)
    e, k, c, zc, n_loss = 6, 2, 0.3, 0.05, 11.0
    seqlens, pad = [4, 1, 6], 3
    seg = torch.repeat_interleave(torch.arange(4), torch.tensor(seqlens + [pad]))
    valid = torch.arange(seg.numel()) < sum(seqlens)
    lse2 = lambda lg: (torch.logsumexp(lg, -1).square() * valid).sum()  # noqa: E731
    for kind, score in (("global", "softmax"), ("per_sample", "sigmoid")):
        router = MoE(HIDDEN, moe_arch(score=score, aux_loss=AuxLoss(kind, c), z_loss_coeff=zc)).router.double()
        router.train()
        counts_E, got, want = torch.zeros(e, dtype=torch.float64), [], []
        for _ in range(2):  # two microbatches of one step
            logits = torch.randn(seg.numel(), e, generator=gen, dtype=torch.float64)
            r = router.route(logits, valid)
            got.append(router.aux_loss(logits, r, valid, seg, 4, n_loss).item())
            p = logits.softmax(-1) if score == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
            p = p * valid[:, None]
            onehot_TE = torch.zeros(seg.numel(), e, dtype=torch.float64)
            for slot in range(k):
                onehot_TE[valid, r.idx_TK[valid, slot]] += 1
            if kind == "global":
                counts_E += onehot_TE.sum(0)
                f_E = counts_E / (k * valid.sum() * len(got))  # every microbatch so far has the same count
                balance = e * (f_E * p.sum(0)).sum()
            else:
                balance = sum(e * ((onehot_TE[seg == s].sum(0) / (k * n)) * p[seg == s].sum(0)).sum()
                              for s, n in enumerate(seqlens))
            want.append(((c * balance + zc * lse2(logits)) / n_loss).item())
        assert got == pytest.approx(want, rel=1e-12), kind


def test_per_sample_aux_loss_does_not_depend_on_packing():
    """The same five samples (their router logits) in one pack, or reordered over two packs with
    padding: the per-sample aux loss (and z-loss) summed over the packs is the same."""
    gen = torch.Generator().manual_seed(8)
    e, n_loss = 6, 13.0
    lens = [5, 1, 7, 3, 4]
    samples = [torch.randn(n, e, generator=gen, dtype=torch.float64) for n in lens]
    router = MoE(HIDDEN, moe_arch(score="softmax", aux_loss=AuxLoss("per_sample", 0.2), z_loss_coeff=0.01)).router.double()
    router.train()

    def pack_loss(order: list[int], pad: int) -> float:
        logits = torch.cat([samples[i] for i in order] + [torch.randn(pad, e, generator=gen, dtype=torch.float64)])
        seg = torch.repeat_interleave(torch.arange(len(order) + 1), torch.tensor([lens[i] for i in order] + [pad]))
        valid = seg < len(order)
        return router.aux_loss(logits, router.route(logits, valid), valid, seg, len(order) + 1, n_loss).item()

    one = pack_loss([0, 1, 2, 3, 4], 3)
    two = pack_loss([3, 0], 2) + pack_loss([4, 2, 1], 5)
    assert one > 0 and two == pytest.approx(one, rel=1e-12)
    merged = torch.cat(samples[:2])  # two samples taken as one sequence: a different loss
    seg = torch.zeros(merged.shape[0], dtype=torch.long)
    valid = torch.ones_like(seg, dtype=torch.bool)
    joined = router.aux_loss(merged, router.route(merged, valid), valid, seg, 1, n_loss).item()
    assert joined + pack_loss([2, 3, 4], 1) != pytest.approx(one, rel=1e-6)


PACKS = (([5, 9, 3], 4), ([11, 2], 0), ([7, 7, 7, 1], 6), ([20, 10], 0), ([2, 3], 1))


def assert_compiled_traces_whole(layer, backend: str, packs=PACKS, graphs: int = 2) -> None:
    """``layer`` under ``torch.compile(dynamic=True, backend=backend)`` on each pack: no graph
    break, ``graphs`` graphs in all, and the eager layer's outputs and gradients bit for bit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, dynamic=True, backend=backend)
    for lens, pad in packs:
        seq = make_seq(lens, pad, 20.0)
        h = make_inputs(seq, seed=len(lens))[0].to(torch.bfloat16).requires_grad_()
        grads = []
        for fn in (layer, compiled):
            layer.zero_grad(set_to_none=True)
            h.grad = None
            y = fn(h, seq)
            y.float().square().sum().backward()
            grads.append([y, h.grad, *(p.grad for p in layer.parameters())])
        for eager_t, compiled_t in zip(*grads):
            torch.testing.assert_close(compiled_t, eager_t, rtol=0, atol=0)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


@pytest.mark.parametrize("aux", [None, AuxLoss("per_sample", 0.1)], ids=["no aux", "per-sample aux"])
def test_compiled_layer_traces_whole_and_once(aux):
    """``train.compile`` on an MoE layer: two graphs for every pack length (one for packs with a
    padding segment, one without; aux loss or not), no graph break (no host read of the pack, no Python counter or context read
    inside), and the eager layer's outputs and gradients. A graph break or a recompile per pack
    would cost the GPU step its fusions and seconds per new length."""
    cfg = moe_arch(ffn=16, **({} if aux is None else {"aux_loss": aux}))
    layer = MoE(HIDDEN, cfg).to(torch.bfloat16)
    layer.init_weights(seed=3, std=0.2)
    layer.train()
    assert_compiled_traces_whole(layer, "eager")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_fp8_layer_traces_whole_and_once(backend):
    """The same under ``train.fp8`` rowwise, on the experts' grouped products and the shared
    expert's dense ones: no graph break at an FP8 GEMM, the same two graphs whatever the pack
    length (packs of 32 and 16 tokens among them: a dense weight gradient pads no row there, and
    must not guard the graph on the length modulo 16), the eager FP8 layer bit for bit.
    ``aot_eager`` traces the autograd Functions' backwards too."""
    layer = MoE(HIDDEN, moe_arch(ffn=16, shared_ffn=16)).to(torch.bfloat16)
    layer.init_weights(seed=3, std=0.2)
    layer.train()
    assert apply_fp8(layer, "rowwise", ParallelContext.for_tp(None)) == 2  # experts, shared expert
    assert_compiled_traces_whole(layer, backend, (([20, 12], 0), ([9, 3], 4)) + PACKS)


def test_compiled_layers_of_one_class_each_take_their_own_recipe():
    """``train.compile`` compiles each layer in place, and layers of one class share the compiled
    code: a layer's GEMM recipe must be part of what that code checks. With ``bf16_layers`` one
    MoE layer keeps plain products beside one under FP8, and ``set_fp8`` may switch them after
    compiling; each compiled layer stays equal to its own eager self, bit for bit, in both
    settings (torch.compile did not guard an expert's recipe object that the router's default
    argument had reached first: the FP8 layer ran the bf16 layer's plain graph)."""
    cfg = moe_arch(ffn=16, shared_ffn=16)
    layers = [MoE(HIDDEN, cfg).to(torch.bfloat16) for _ in range(2)]
    for layer in layers:
        layer.init_weights(seed=3, std=0.2)
        layer.train()
    seq = make_seq([9, 14, 5], 4, 20.0)
    h = make_inputs(seq, seed=3)[0].to(torch.bfloat16)
    eager = [layer.forward for layer in layers]
    torch._dynamo.reset()
    for layer in layers:
        layer.compile(dynamic=True, backend="eager")
    ctx = ParallelContext.for_tp(None)
    for plain, fp8 in ((0, 1), (1, 0)):
        clear_fp8(layers[plain], gemm.default_recipe)
        apply_fp8(layers[fp8], "rowwise", ctx)
        want = [forward(h, seq) for forward in eager]
        assert not torch.equal(want[0], want[1])  # the same weights: FP8 shows
        for layer, y in zip(layers, want):
            torch.testing.assert_close(layer(h, seq), y, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._scaled_grouped_mm)"))])
def test_fp8_experts_on_aligned_rows_equal_the_padded_copy(device, monkeypatch):
    """Under FP8 the dispatcher lays each expert's rows out at a multiple of 16 (padding rows of
    gate 0 between) and the grouped products take them as they are; packed tight instead, each
    product pads a copy of its own. Both give the same output and gradients (tokens, every
    weight): the padding rows add exact zeros. On CUDA the two are the kernel's two routes (the
    weight gradients to bf16 rounding: their sums run over other row counts)."""
    cfg = moe_arch(ffn=16, shared_ffn=16)
    state = random_state(cfg, seed=4)
    seq = make_seq([9, 14, 5], 4, None, device)
    h_TD, w_TD = make_inputs(seq, seed=4)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    seen, grouped_linear = [], gemm.grouped_linear

    def recorded(x, w, ends, recipe=gemm.DEFAULT_RECIPE, aligned=False):
        seen.append((x.shape[0], aligned))
        return grouped_linear(x, w, ends, recipe, aligned)

    monkeypatch.setattr(gemm, "grouped_linear", recorded)

    def run(align: bool) -> list[torch.Tensor]:
        if not align:
            monkeypatch.setattr(gemm, "grouped_row_align", lambda recipe: 1)
        layer = MoE(HIDDEN, cfg).to(device, dtype)
        table = param_table(layer)
        load_full_(table, state)
        assert apply_fp8(layer, "rowwise", ParallelContext.for_tp(None)) == 2
        layer.train()
        h = h_TD.to(device, dtype).requires_grad_(True)
        (layer(h, seq) * w_TD.to(device, dtype)).sum().backward()
        return [h.grad, *(p.grad for p in layer.parameters())]

    aligned, tight = run(True), run(False)
    rows = seq.positions.numel() * 2
    assert seen == [(-(-(rows + 16 * 6) // 16) * 16, True)] * 2 + [(rows, False)] * 2
    for a, b in zip(aligned, tight):  # fp32: the same products, sums in another order
        assert rel_err(a.float(), b.float()) <= (1e-6 if device == "cpu" else 1e-2)


# ---------------------------------------------------------------- TP over gloo


def tp_case(cfg, tp, sp, state, h_TD, w_TD, seqlens, pad, loss_norm):
    """On every rank of the pool: the layer at ``tp`` (ranks 0..tp-1), this rank's token slice
    under SP; returns its outputs, input gradients and full gradients (None off the group)."""
    group = dist.new_group(list(range(tp)))
    if dist.get_rank() >= tp:
        return None
    ctx = ParallelContext.for_tp(group, sequence_parallel=sp)
    seq = make_seq(seqlens, pad, loss_norm)
    t = h_TD.shape[0]
    rows = slice(dist.get_rank() * t // tp, (dist.get_rank() + 1) * t // tp) if sp else slice(0, t)
    out = run_layer(cfg, state, h_TD[rows], w_TD[rows], seq, torch.float32, ctx)
    return {**out, "rows": rows}


TP_CASES = {
    "tp2 shared+gate aux global": (2, False, dict(shared_ffn=8, shared_gate=True, aux_loss=AuxLoss("global", 0.1))),
    "tp2 sp latent per_sample z": (2, True, dict(latent=8, shared_ffn=8, aux_loss=AuxLoss("per_sample", 0.1), z_loss_coeff=0.01)),
    "tp3 sp sigmoid groups bias shared+gate": (3, True, dict(score="sigmoid", groups=3, group_topk=2, expert_bias=True,
                                                              norm_eps=1e-20, scale=2.0, shared_ffn=6, shared_gate=True, latent=8)),
    "tp3 relu2 latent aux global z": (3, False, dict(act="relu2", latent=8, aux_loss=AuxLoss("global", 0.1), z_loss_coeff=0.01)),
}


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tp_layer_equals_one_process(pools, name):
    tp, sp, kw = TP_CASES[name]
    cfg = moe_arch(**kw)
    state = random_state(cfg, 11)
    seqlens, pad = [7, 1, 10, 5], 10 if tp == 3 else 9  # T = 33 or 32: divisible by tp
    seq = make_seq(seqlens, pad, loss_norm=17.0)
    h, w = make_inputs(seq, 12)
    ref32 = run_layer(cfg, state, h, w, seq, torch.float32)
    ref64 = run_layer(cfg, state, h, w, seq, torch.float64)
    ys = Yardstick(TOL)
    for rank, r in enumerate(x for x in pools(WORLD).run(tp_case, cfg, tp, sp, state, h, w, seqlens, pad, 17.0) if x):
        rows = r["rows"]
        for key in ("out", "h_grad"):
            ys.check(f"{key} (rank {rank})", r[key], ref32[key][rows], ref64[key][rows])
        ys.check_all(r["grads"], ref32["grads"], ref64["grads"], f"grad (rank {rank}) ")
        assert torch.equal(r["counts"], ref32["counts"])  # the same experts chosen
    ys.assert_ok(name)


def test_exact_ties_choose_the_same_experts_at_every_layout(pools):
    """A zero router weight: every logit ties; every layout routes every token to 0..k-1."""
    cfg = moe_arch()
    state = random_state(cfg, 13)
    state["router.weight"] = torch.zeros_like(state["router.weight"])
    seqlens, pad = [9, 4, 7], 4
    seq = make_seq(seqlens, pad, None)
    h, w = make_inputs(seq, 14)
    want = run_layer(cfg, state, h, w, seq, torch.float32)["counts"]
    assert want.tolist() == [20.0, 20.0, 0.0, 0.0, 0.0, 0.0]
    for tp, sp in ((2, False), (2, True), (3, True)):
        for r in filter(None, pools(WORLD).run(tp_case, cfg, tp, sp, state, h, w, seqlens, pad, None)):
            assert torch.equal(r["counts"], want), (tp, sp)


# ---------------------------------------------------------------- verify-train


@pytest.fixture(scope="module")
def moe_configs(tmp_path_factory, write_moe_configs):
    """tests/configs/moe_{tp,pp}.yaml over fresh demo shards: name -> path."""
    return write_moe_configs(tmp_path_factory.mktemp("moe"), train_samples=160, seed=3)


STEPS = 3
LANG = "modules.language."
TRAIN_LAYOUTS = {
    "tp2 dp2 sp: shared+gate, bias, per_sample, z": ("moe_tp", []),
    "tp2 dp2 no sp": ("moe_tp", [LANG + "parallel.sequence_parallel=false"]),
    # small packs, 3 microbatches: ranks whose packs are empty (every expert idle there)
    "tp1 dp4, global aux, ranks without samples": ("moe_tp", [
        LANG + "parallel.tp=1", LANG + "parallel.dp=4", LANG + "arch.moe.aux_loss.kind=global",
        "data.tokens_per_microbatch=200", "data.max_sample_tokens=150", "train.micro_batches=3"]),
    "pp2 dp2: sigmoid groups latent, global, z": ("moe_pp", []),
    "pp2 dp2 1f1b, per_sample": ("moe_pp", ["train.schedule=1f1b", LANG + "arch.moe.aux_loss.kind=per_sample"]),
    # parallel folding (mimo.llm.dispatch): EP > DP over the TP ranks; ETP inside EP
    "tp2 dp2 sp, ep4 etp1": ("moe_tp", [LANG + "arch.moe.experts=8", LANG + "parallel.ep=4", LANG + "parallel.etp=1"]),
    "tp2 dp2 no sp, ep2 etp2": ("moe_tp", [LANG + "arch.moe.experts=8", LANG + "parallel.ep=2", LANG + "parallel.etp=2",
                                           LANG + "parallel.sequence_parallel=false"]),
    # a non-colocated encoder (rank 0) feeding an EP LLM on ranks 1:4 (ep 3: non-power-of-two)
    "non-colocated vision, llm tp1 dp3 ep3": ("moe_tp", [
        "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1", LANG + "parallel.tp=1", LANG + "parallel.dp=3",
        LANG + "parallel.ranks=1:4", LANG + "parallel.sequence_parallel=false", LANG + "parallel.ep=3", LANG + "parallel.etp=1"]),
}


def _train_reference(pools, config, overrides, cache={}):
    """The one-process run (simple schedule) in fp32 and fp64, shared by layouts of one model."""
    overrides = [o for o in overrides if "parallel" not in o and not o.startswith("train.schedule")]
    key = (config, tuple(overrides))
    if key not in cache:
        from mimo.commands.verify_train import references

        cache[key] = references(pools(1), config, overrides + ["train.schedule=simple"], STEPS)
    return cache[key]


@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_verify_train_moe(pools, moe_configs, name):
    from mimo.commands.verify_train import compare, train_case

    config, overrides = TRAIN_LAYOUTS[name]
    config = moe_configs[config]
    layout = pools(4).run(train_case, config, overrides, STEPS, False)
    ref32, ref64 = _train_reference(pools, config, overrides)
    report = compare(layout, ref32, TOL, fp64=ref64)
    assert report["ok"], report
    assert report["losses"][0] > 0
    routers = {n: g for n, g in ref32[0]["steps"][0]["grads"]["language"].items() if n.endswith("router.weight")}
    assert len(routers) == 2 and all(g.abs().sum() > 0 for g in routers.values())  # both E layers compared
    if "ep" in name:  # every (token, rank) pair crossed once, forward and backward
        assert report["moe_dispatch"]["bytes_ratio"] == 1.0 and report["moe_dispatch"]["min_forward_bytes"] > 0
    else:
        assert "moe_dispatch" not in report


def test_resume_at_an_ep_layout_reproduces_the_uninterrupted_run(pools, moe_configs, tmp_path, resume_case):
    """tp2 dp2 with ep2 etp1 (expert gradients over edp 2), expert bias on: the losses and every
    saved weight and optimizer state of step 4 equal bit for bit."""
    from safetensors.torch import load_file

    overrides = [LANG + "parallel.ep=2", LANG + "parallel.etp=1"]
    results = pools(4).run(resume_case, moe_configs["moe_tp"], overrides, str(tmp_path))
    for r in results:
        assert r["resumed"] == r["straight"], r
    a, b = tmp_path / "straight" / "step-00000004", tmp_path / "cut" / "step-00000004"
    files = sorted(f for f in os.listdir(a) if f.endswith((".model.safetensors", ".optim.safetensors")))
    assert files == sorted(f for f in os.listdir(b) if f.endswith((".model.safetensors", ".optim.safetensors")))
    assert any(f.startswith("language-") for f in files)
    for f in files:
        want, got = load_file(a / f), load_file(b / f)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), f
    assert any("expert_bias" in k for f in files for k in load_file(a / f))


# ---------------------------------------------------------------- config checks


ARCH = "modules.language.arch."
BAD_MOE = {
    "topk > experts": (["moe.topk=7"], "arch.moe.topk: topk=7 exceeds experts=6"),
    "groups not dividing experts": (["moe.groups=4"], "arch.moe.groups: groups=4 must divide experts=6"),
    "too few experts in the best groups": (["moe.groups=3", "moe.group_topk=1", "moe.topk=3"],
                                           "arch.moe.group_topk: group_topk * experts / groups"),
    "group_topk > groups": (["moe.groups=3", "moe.group_topk=4"], "arch.moe.group_topk: group_topk=4 exceeds groups=3"),
    "groups of one expert": (["moe.groups=6", "moe.group_topk=2"], "arch.moe.groups: group-limited routing"),
    "quantile balancing with an aux loss": (["moe.quantile_balancing=true", "moe.expert_bias=false"],
                                            "arch.moe.quantile_balancing: exclusive with aux losses"),
    "quantile balancing with groups": (["moe.quantile_balancing=true", "moe.expert_bias=false", "moe.aux_loss.kind=none",
                                        "moe.groups=3"], "arch.moe.quantile_balancing: exclusive with group-limited routing"),
    "quantile balancing with expert bias": (["moe.quantile_balancing=true", "moe.aux_loss.kind=none"],
                                            "arch.moe.quantile_balancing: exclusive with expert_bias"),
    "shared gate without shared expert": (["moe.shared_ffn=0"], "arch.moe.shared_gate: needs a shared expert"),
    "aux kind without coeff": (["moe.aux_loss.coeff=0"], "arch.moe.aux_loss.coeff: aux_loss kind 'per_sample' needs coeff > 0"),
    "TP not dividing moe.ffn": (["moe.ffn=15"], "parallel.tp"),
    "TP not dividing moe.shared_ffn": (["moe.shared_ffn=15"], "parallel.tp"),
    "pattern E without arch.moe": (["moe=null"], "arch.moe: the pattern has MoE layers"),
}


@pytest.mark.parametrize("case", list(BAD_MOE))
def test_invalid_moe_configs_fail_check_config(case, capsys, monkeypatch):
    """``mimo check-config`` on tests/configs/moe_tp.yaml with one bad arch.moe override: exit 2,
    an error naming the key path (no traceback); the unmodified config passes that check."""
    import json

    from mimo.commands.cli import main

    monkeypatch.chdir(CONFIGS)  # (its data paths do not exist here: those errors are not ours)
    overrides, expected = BAD_MOE[case]
    path = os.path.join(CONFIGS, "moe_tp.yaml")
    assert main(["check-config", path, *(ARCH + o for o in overrides)]) == 2
    out = capsys.readouterr()
    errors = json.loads(out.out.strip().splitlines()[-1])["errors"]
    assert any(expected in e and "modules.language." in e for e in errors), errors
    assert "Traceback" not in out.err
    main(["check-config", path])
    clean = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not any("arch.moe" in e or "parallel.tp" in e for e in clean.get("errors", [])), clean


# ---------------------------------------------------------------- pipeline cost, FLOPs


def test_moe_layers_cost_their_active_params_in_the_split():
    """An MoE layer costs its active parameters over a dense MLP layer's; the automatic split
    follows (a heavy E gets a stage of its own), an explicit '|' stays as written, dense
    patterns keep the even split."""
    from mimo.llm.config import HybridArch
    from mimo.llm.pattern import LAYER_COST, layer_costs

    arch = lambda pattern, **moe: HybridArch(pattern=pattern, hidden=32, heads=4, vocab=61, ffn=64,  # noqa: E731
                                             moe=MoEArch(**{"experts": 8, "topk": 2, "ffn": 32, **moe}))
    light = arch("E*E*")  # router 8*32 + 2 experts of 3*32*32 = a 3*32*64 MLP + 256
    assert layer_costs(light)["moe"] == pytest.approx((8 * 32 + 2 * 3 * 32 * 32) / (3 * 32 * 64))
    assert [len(s) for s in light.layer_pattern().stages(2)] == [2, 2]
    heavy = arch("E****", topk=8, shared_ffn=64, latent=16)  # 8 experts on 16, shared 64, latent 2*16*32
    want = (8 * 32 + 8 * 3 * 32 * 16 + 3 * 64 * 32 + 2 * 16 * 32) / (3 * 32 * 64)
    assert layer_costs(heavy)["moe"] == pytest.approx(want) and want > 3
    assert [len(s) for s in heavy.layer_pattern().stages(2)] == [1, 4]
    assert [len(s) for s in parse_pattern_sizes(heavy, "E**|**")] == [3, 2]
    assert MoE(32, heavy.moe).active_params() == heavy.moe.active_params(32)
    dense = HybridArch(pattern="*-*-*-", hidden=32, heads=4, vocab=61)
    assert layer_costs(dense) is LAYER_COST and [len(s) for s in dense.layer_pattern().stages(3)] == [2, 2, 2]


def parse_pattern_sizes(arch, pattern):
    from dataclasses import replace

    return replace(arch, pattern=pattern).layer_pattern().stages(2)


def test_model_flops_count_active_expert_params(moe_configs):
    """The FLOP count's LLM parameters: the model's and its projector's, less each MoE layer's
    inactive routed experts (E - topk of E)."""
    from mimo.compose.config import load_config
    from mimo.encoders.projector import build_projector
    from mimo.llm.model import LLMStage
    from mimo.training.flops import param_counts

    config = load_config(moe_configs["moe_tp"])
    arch, m = config.llm.arch, config.llm.arch.moe
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    projector = count(build_projector("mlp2x_gelu", config.encoders["vision"].arch.hidden, arch.hidden))
    inactive = arch.pattern.count("E") * 3 * m.ffn * arch.hidden * (m.experts - m.topk)
    counts = param_counts(config)
    assert counts[config.llm_name] == count(LLMStage(arch)) - inactive and counts["vision.projector"] == projector

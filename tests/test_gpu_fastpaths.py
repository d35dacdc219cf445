"""GPU fast paths against the exact paths (docs/design.md §3): varlen flash attention (forward and
backward), ``train.compile``'s compiled LLM layers and vision blocks, and the chunked cross
entropy. Fast paths run in bf16 on CUDA; the reference is the exact path in fp32 on the same
(bf16-rounded) weights and inputs, TF32 off. Tolerance: ‖fast − ref‖ / ‖ref‖ ≤ 2e-2 for every
output and gradient (bf16 operands land between 1e-3 and 1e-2; the margin covers gradients that
sum many bf16 products). A compiled layer is compared with the same layer run eagerly in bf16
too: a gradient that bf16 itself rounds worse than 2e-2 (a norm bias summed over many rows)
passes when the compiled error is at most 1.25x the eager bf16 error + 1e-3. The chunked cross
entropy is also checked on the CPU, in fp32, ≤ 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from mimo.encoders.config import VitArch
from mimo.encoders.vit import Block
from mimo.llm.attention import exact_attention, varlen_attention
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.pattern import LayerSpec
from mimo.parallel import cross_entropy as ce
from mimo.parallel import vocab_parallel_cross_entropy
from mimo.core.testing import rel_err

BF16_TOL = 2e-2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU fast paths need CUDA (this machine has none)")


@pytest.fixture(autouse=True)
def _no_tf32():
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _randomize_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5) + (1.0 if p.dim() == 1 else 0.0))


def _fwd_bwd(module, x, *args):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, *args)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.device, out.dtype)
    out.backward(grad_out)
    grads = {n: p.grad.float().cpu() for n, p in module.named_parameters()}
    return out.float().cpu(), x.grad.float().cpu(), grads


def _errors(got, ref) -> dict[str, float]:
    errs = {"out": rel_err(got[0], ref[0]), "dx": rel_err(got[1], ref[1])}
    errs.update({f"d{n}": rel_err(got[2][n], ref[2][n]) for n in ref[2]})
    return errs


def _check(fast, ref, what: str, eager=None) -> None:
    """``fast`` against the fp32 ``ref``; ``eager``: the same bf16 layer run without compiling."""
    assert all(torch.isfinite(t).all() for t in (fast[0], fast[1], *fast[2].values()))
    errs = _errors(fast, ref)
    base = _errors(eager, ref) if eager is not None else {k: 0.0 for k in errs}
    worst = max(errs, key=errs.get)
    print(f"{what}: max rel err {errs[worst]:.2e} ({worst}; eager bf16 {base[worst]:.2e})")
    for k, e in errs.items():
        assert e <= BF16_TOL or e <= 1.25 * base[k] + 1e-3, f"{what}: {k} rel err {e:.3e} (eager bf16 {base[k]:.3e})"


@needs_cuda
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (8, 2)])
def test_varlen_attention_forward_and_backward_match_exact(heads, kv_heads):
    gen = torch.Generator().manual_seed(heads)
    lens = [300, 1, 77, 1024, 5, 640]
    ctx = SeqContext.from_seqlens(lens, device="cuda")
    t = sum(lens)
    qkv = [torch.randn(t, h, 128, generator=gen).cuda().bfloat16() for h in (heads, kv_heads, kv_heads)]
    grad = torch.randn(t, heads, 128, generator=gen).cuda()

    def run(fn, dtype):
        ins = [x.detach().to(dtype).clone().requires_grad_(True) for x in qkv]
        out = fn(*ins, ctx, 128 ** -0.5)
        out.backward(grad.to(dtype))
        return out.float().cpu(), [x.grad.float().cpu() for x in ins]

    out_f, g_f = run(varlen_attention, torch.bfloat16)
    out_r, g_r = run(exact_attention, torch.float32)
    errs = [rel_err(out_f, out_r)] + [rel_err(a, b) for a, b in zip(g_f, g_r)]
    print(f"varlen attention heads={heads} kv={kv_heads}: rel err out/dq/dk/dv " + " ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= BF16_TOL


@needs_cuda
def test_varlen_attention_with_key_runs_is_bottom_right_causal():
    """Context parallelism's fast path: each query run attends to a longer key run, the last
    query seeing every key (bottom-right causal), against explicit masks in fp32."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(4)
    lens_q, lens_k = [5, 64, 1, 300, 128], [40, 64, 9, 1200, 256]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    ctx = SeqContext(cu_q.cuda(), torch.zeros(sum(lens_q), dtype=torch.int64, device="cuda"), max(lens_q))
    q = torch.randn(sum(lens_q), 8, 128, generator=gen).cuda().bfloat16()
    k, v = (torch.randn(sum(lens_k), 2, 128, generator=gen).cuda().bfloat16() for _ in range(2))
    grad = torch.randn(q.shape, generator=gen).cuda()

    def run(fast: bool):
        ins = [x.detach().to(torch.bfloat16 if fast else torch.float32).clone().requires_grad_(True) for x in (q, k, v)]
        if fast:
            out = varlen_attention(*ins, ctx, 128 ** -0.5, (cu_k.cuda(), max(lens_k)))
        else:
            outs = []
            for i in range(len(lens_q)):
                qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
                mask = torch.ones(lens_q[i], lens_k[i], dtype=torch.bool, device="cuda").tril(lens_k[i] - lens_q[i])
                o = F.scaled_dot_product_attention(ins[0][qs].transpose(0, 1), ins[1][ks].transpose(0, 1),
                                                   ins[2][ks].transpose(0, 1), attn_mask=mask, scale=128 ** -0.5,
                                                   enable_gqa=True)
                outs.append(o.transpose(0, 1))
            out = torch.cat(outs)
        out.backward(grad.to(out.dtype))
        return [out.float().cpu()] + [x.grad.float().cpu() for x in ins]

    errs = [rel_err(a, b) for a, b in zip(run(True), run(False))]
    print("varlen attention, key runs: rel err out/dq/dk/dv " + " ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= BF16_TOL


def _llm_arch() -> HybridArch:
    return HybridArch(pattern="*-", hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=1000, norm_eps=1e-6)


@needs_cuda
@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_compiled_llm_layer_matches_exact(kind):
    arch = _llm_arch()
    ref = build_layer(arch, LayerSpec(0, kind))
    _randomize_(ref, seed=3)
    ref = ref.cuda()
    if kind == "attention":
        ref.impl = "exact"
    eager = build_layer(arch, LayerSpec(0, kind)).cuda().bfloat16()
    eager.load_state_dict({k: v.bfloat16() for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.bfloat16().float() for k, v in ref.state_dict().items()})  # the same rounded weights
    fast = build_layer(arch, LayerSpec(0, kind)).cuda().bfloat16()
    fast.load_state_dict(eager.state_dict())
    fast.compile(dynamic=True)
    gen = torch.Generator().manual_seed(4)
    for lens in ([300, 1, 77, 513], [64, 900, 3]):  # two pack lengths: one dynamic-shape graph
        ctx = SeqContext.from_seqlens(lens, device="cuda")
        x = torch.randn(sum(lens), arch.hidden, generator=gen).cuda().bfloat16()
        for m in (ref, eager, fast):
            m.zero_grad(set_to_none=True)
        _check(_fwd_bwd(fast, x, ctx), _fwd_bwd(ref, x.float(), ctx), f"compiled {kind} layer, T={sum(lens)}", _fwd_bwd(eager, x, ctx))


@needs_cuda
def test_compiled_vision_block_matches_exact():
    arch = VitArch(image_size=224, patch=14, hidden=256, layers=2, heads=4, mlp=1024, pre_norm=True, act="quick_gelu")
    ref = Block(arch)
    _randomize_(ref, seed=5)
    with torch.no_grad():  # the fused q|k|v bias is 1-d, but a bias: no norm-like offset of 1
        ref.attn.qkv.bias.sub_(1.0)
    ref = ref.cuda()
    eager = Block(arch).cuda().bfloat16()
    eager.load_state_dict({k: v.bfloat16() for k, v in ref.state_dict().items()})
    ref.load_state_dict({k: v.bfloat16().float() for k, v in ref.state_dict().items()})
    fast = Block(arch).cuda().bfloat16()
    fast.load_state_dict(eager.state_dict())
    fast.compile()
    n, L = 3, 257
    x = torch.randn(n * L, arch.hidden, generator=torch.Generator().manual_seed(6)).cuda().bfloat16()
    _check(_fwd_bwd(fast, x, n, L), _fwd_bwd(ref, x.float(), n, L), "compiled vision block", _fwd_bwd(eager, x, n, L))


def _ce_case(device, dtype, rows=777, vocab=1000, chunk_logits=None, monkeypatch=None, compiled=False, pad=24):
    gen = torch.Generator().manual_seed(rows)
    logits = (3 * torch.randn(rows, vocab + pad, generator=gen)).to(device, dtype)  # padding columns
    labels = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    labels[::7] = -100
    mask = (torch.rand(rows, generator=gen) > 0.2).to(device)
    if chunk_logits is not None:
        monkeypatch.setattr(ce, "CHUNK_LOGITS", chunk_logits)
    x = logits.detach().clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, labels, None, vocab, mask, compiled=compiled)
    w = torch.randn(rows, generator=gen).to(device)
    (loss * w).sum().backward()
    return loss.double().cpu(), x.grad.double().cpu(), logits, labels, mask, w


def _ce_reference(logits, labels, mask, w, vocab):
    x = logits.double().cpu()[:, :vocab].requires_grad_(True)
    lab, m = labels.cpu(), mask.cpu()
    keep = (lab >= 0) & m
    loss = torch.nn.functional.cross_entropy(x, lab.clamp(min=0), reduction="none") * keep
    (loss * w.double().cpu()).sum().backward()
    return loss.detach(), torch.nn.functional.pad(x.grad, (0, logits.shape[1] - vocab))


@pytest.mark.parametrize("chunk_logits", [1000, 1 << 26])  # 1 row per chunk, and all rows in one
def test_chunked_cross_entropy_matches_reference_cpu(monkeypatch, chunk_logits):
    loss, grad, logits, labels, mask, w = _ce_case("cpu", torch.float32, chunk_logits=chunk_logits, monkeypatch=monkeypatch)
    ref_loss, ref_grad = _ce_reference(logits, labels, mask, w, 1000)
    assert rel_err(loss, ref_loss) <= 1e-6 and rel_err(grad, ref_grad) <= 1e-6
    assert grad[:, 1000:].abs().max() == 0  # padding columns


@pytest.mark.parametrize("pad", [24, 0], ids=["padding columns", "no padding"])
def test_compiled_cross_entropy_matches_reference_cpu(pad):
    """``compiled=True`` (train.compile): the row math as fused kernels over all rows; with
    padding columns the gradient is written into a zeroed buffer, without it returned as
    computed. fp32 on the CPU against the fp64 reference."""
    loss, grad, logits, labels, mask, w = _ce_case("cpu", torch.float32, compiled=True, pad=pad)
    ref_loss, ref_grad = _ce_reference(logits, labels, mask, w, 1000)
    assert rel_err(loss, ref_loss) <= 1e-6 and rel_err(grad, ref_grad) <= 1e-6
    if pad:
        assert grad[:, 1000:].abs().max() == 0


@needs_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_cross_entropy_bf16_on_gpu(monkeypatch, compiled):
    loss, grad, logits, labels, mask, w = _ce_case("cuda", torch.bfloat16, rows=4099, vocab=32000, chunk_logits=1 << 22,
                                                   monkeypatch=monkeypatch, compiled=compiled)
    ref_loss, ref_grad = _ce_reference(logits, labels, mask, w, 32000)
    errs = rel_err(loss, ref_loss), rel_err(grad, ref_grad)
    print(f"cross entropy bf16 logits ({'compiled' if compiled else 'chunked'}): rel err loss {errs[0]:.2e}, grad {errs[1]:.2e}")
    assert max(errs) <= BF16_TOL


@needs_cuda
def test_cuda_graph_tower_output_survives_the_next_replay():
    """``train.cuda_graphs``: the blocks replay as CUDA graphs, whose memory the next replay
    overwrites. The tower's output leaves it (an eval cache keeps it across steps): a second
    forward leaves the first output as it was; and the graphs' output equals the tower run
    eagerly in bf16 (every replay really captured: no cudagraph skip). Mutation: without the
    copy at the tower's end, the kept output is overwritten (no [CLS] dropped, no post-norm:
    the output is a view of the last block's)."""
    from torch._dynamo.utils import counters

    from mimo.encoders.vit import VisionTransformer

    arch = VitArch(image_size=56, patch=14, hidden=64, layers=3, heads=4, mlp=128, class_token=False, act="gelu")
    eager = VisionTransformer(arch, feature_layer=-1, drop_class_token=False)
    _randomize_(eager, seed=7)
    eager = eager.cuda().bfloat16()
    tower = VisionTransformer(arch, feature_layer=-1, drop_class_token=False).cuda().bfloat16()
    tower.load_state_dict(eager.state_dict())
    tower.graphs = True
    for block in tower.blocks:
        block.compile(mode="reduce-overhead")
    gen = torch.Generator().manual_seed(8)
    pixels = [torch.randn(5, 3, 56, 56, generator=gen).cuda() for _ in range(4)]
    counters.clear()
    with torch.no_grad():
        outs = []
        for px in pixels:  # warm-up, record, then replays
            torch.compiler.cudagraph_mark_step_begin()
            outs.append(tower(px))
        kept = [o.clone() for o in outs]
        torch.compiler.cudagraph_mark_step_begin()
        tower(pixels[0])
        for o, k in zip(outs, kept):
            assert torch.equal(o, k)
        for px, o in zip(pixels, outs):
            assert rel_err(o.float().cpu(), eager(px).float().cpu()) <= BF16_TOL
    assert not counters["inductor"]["cudagraph_skips"]


@needs_cuda
def test_cuda_graph_run_matches_the_compiled_run():
    """A tiny llava-1.3b (8 samples of one image per step) trained 4 steps on the GPU with
    ``train.compile`` and with ``train.compile`` + ``train.cuda_graphs``, from the same start:
    losses within 1e-3 of each other (GPU runs differ by about 1e-5 run to run) and the vision
    weights after the steps within the bf16 tolerance; the graphs replayed (no cudagraph skip)."""
    import pathlib

    from torch._dynamo.utils import counters

    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    tiny = ["modules.vision.arch.image_size=56", "modules.vision.arch.hidden=64", "modules.vision.arch.layers=3",
            "modules.vision.arch.heads=4", "modules.vision.arch.mlp=128", "modules.language.arch.pattern='*-*-'",
            "modules.language.arch.hidden=128", "modules.language.arch.heads=4", "modules.language.arch.kv_heads=4",
            "modules.language.arch.ffn=256", "modules.language.arch.vocab=512", "data.synthetic.text_tokens=[8,60]",
            "data.tokens_per_microbatch=1024", "data.max_sample_tokens=128", "train.compile=true"]
    path = pathlib.Path(__file__).resolve().parents[1] / "configs/llava-1.3b.yaml"
    got = {}
    for graphs in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        run = build_run(load_config(str(path), tiny + [f"train.cuda_graphs={str(graphs).lower()}"]), 0, device=torch.device("cuda"))
        assert run.model.cuda_graphs is graphs
        losses = [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss for s in range(1, 5)]
        tower = run.model.encoder_parts[0].module.tower
        got[graphs] = (losses, {n: p.detach().float().cpu() for n, p in tower.named_parameters()})
        if graphs:
            assert not counters["inductor"]["cudagraph_skips"]
        run.close()
    (plain, w_plain), (graphed, w_graphed) = got[False], got[True]
    for a, b in zip(plain, graphed):
        assert abs(a - b) <= 1e-3 * abs(a), (plain, graphed)
    for n in w_plain:
        assert rel_err(w_graphed[n], w_plain[n]) <= BF16_TOL, n

"""Qwen3-Next / Qwen3.5 Gated DeltaNet and MoE layers (issue 48), against transformers' own modules
on random weights, through the weight rules of ``mimo.llm.hf`` (``gdn_layer_from_hf`` /
``gdn_layer_to_hf``, ``moe_layer_pieces``).

* GDN: our ``G`` layer (zero-centred pre-norm) on a THD pack of several samples (one of length 1,
  one longer than transformers' chunk of 64, boundaries inside our chunks of 8) equals
  ``input_layernorm`` + ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` + residual run on
  each sample alone (transformers' torch path ignores packed boundaries): outputs, input and
  every weight gradient (transformers' gradients mapped by the same rules), in fp32 (by the
  yardstick: within max(1e-5, 4 x transformers' own fp32 error) of transformers in fp64) and
  fp64 (1e-10). Key heads 3 with 9 value heads (three per key head: Qwen3-Next's grouping of
  ``in_proj_qkvz`` / ``in_proj_ba`` matters) and 3 with 3. Recompute (full, selective) changes
  nothing, bit for bit.
* The rules: import -> export gives back every Hugging Face tensor exactly, in ``state_dict``
  order; lazy reads of a row range (a TP rank's slice) equal slicing the full import; a grouped
  tensor of the wrong shape is named.
* TP 2 (with and without SP; a key head and its three value heads per rank): the layer loaded
  from transformers' weights at tp 2 equals transformers per sample (outputs, input gradients,
  every gradient gathered to full and exported to Hugging Face names).
* CP 2 and 3: samples crossing the CP ranks' chunks equal the one-process layer (fp32 by the
  yardstick, fp64 within 1e-10) and transformers per sample.
* MoE: our ``E`` layer (zero-centred pre-norm, softmax top-k renormalised or not as
  ``norm_topk_prob`` says, shared expert with its sigmoid gate) equals
  ``post_attention_layernorm`` + ``Qwen3NextSparseMoeBlock`` / ``Qwen3_5MoeSparseMoeBlock`` +
  residual in fp32 and fp64 (not bf16: top-k near-ties), at tp 1 and tp 2.

In fp64 transformers' casts to fp32 (``.float()``, ``.to(torch.float32)``, a softmax in fp32)
are made to keep fp64 tensors fp64 while transformers runs (``mimo.core.testing.fp64_kept``), so its fp64 run is
the yardstick.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mimo.core.errors import MimoError
from mimo.core.testing import Yardstick, fp64_kept, rel_err
from mimo.llm import hf
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch, MoEArch
from mimo.llm.context import SeqContext
from mimo.llm.pattern import LayerSpec
from mimo.parallel.params import full_tensors, load_full_, param_table, reduce_partial_grads
from mimo.parallel.recompute import checkpoint, set_selective

from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5RMSNorm
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextGatedDeltaNet, Qwen3NextRMSNorm,
                                                               Qwen3NextSparseMoeBlock)

TOL, TOL64 = 1e-5, 1e-10
LENS = [9, 1, 23, 70, 4]  # one of length 1, one over transformers' chunk of 64
HIDDEN, EPS = 24, 1e-6
DK, DV = 8, 6  # key and value head sizes (unequal: a mix-up shows)
GDN_HEADS = {"k3-v9": (3, 9), "k3-v3": (3, 3)}


@pytest.fixture(scope="module")
def pools(session_pools):
    """This module's worker pools are the session's (``session_pools``)."""
    return session_pools


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _maybe_fp64(dtype):
    return fp64_kept() if dtype == torch.float64 else contextlib.nullcontext()


# ---------------------------------------------------------------- the layers, ours and transformers'
@dataclass(frozen=True)
class Case:
    """One layer of one family: ``kind`` "gdn" (``sizes``: key heads, value heads) or "moe"
    (``sizes``: experts, topk, norm_topk_prob)."""

    kind: str
    family: str  # "next" (Qwen3-Next) | "3.5" (Qwen3.5 / Qwen3.5-MoE)
    sizes: tuple

    @property
    def model_type(self) -> str:
        return {("gdn", "next"): "qwen3_next", ("gdn", "3.5"): "qwen3_5", ("moe", "next"): "qwen3_next",
                ("moe", "3.5"): "qwen3_5_moe"}[self.kind, self.family]

    def arch(self) -> HybridArch:
        common = dict(hidden=HIDDEN, heads=2, vocab=11, norm_eps=EPS, norm_zero_centred=True)
        if self.kind == "gdn":
            heads, v_heads = self.sizes
            return HybridArch(pattern="G", **common, gdn_heads=heads, gdn_v_heads=v_heads, gdn_head_dim=DK,
                              gdn_v_head_dim=DV, gdn_chunk=8)
        experts, topk, norm_topk = self.sizes
        return HybridArch(pattern="E", **common, moe=MoEArch(experts=experts, topk=topk, ffn=FFN, shared_ffn=SHARED_FFN,
                                                              shared_gate=True, norm_topk=norm_topk))

    def hf(self, seed: int = 3):
        """transformers' module and its pre-norm (``input_layernorm`` / ``post_attention_layernorm``),
        random weights (fp32; gated-norm weights around 1, the rest around 0)."""
        common = dict(hidden_size=HIDDEN, rms_norm_eps=EPS, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, hidden_act="silu")
        if self.kind == "gdn":
            heads, v_heads = self.sizes
            common.update(linear_num_key_heads=heads, linear_num_value_heads=v_heads, linear_key_head_dim=DK,
                          linear_value_head_dim=DV, linear_conv_kernel_dim=4, layer_types=["linear_attention"])
            cfg_type, mod_type, norm_type = ((Qwen3NextConfig, Qwen3NextGatedDeltaNet, Qwen3NextRMSNorm) if self.family == "next"
                                             else (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet, Qwen3_5RMSNorm))
            mod = mod_type(cfg_type(**common), 0)
        else:
            experts, topk, norm_topk = self.sizes
            common.update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=FFN,
                          shared_expert_intermediate_size=SHARED_FFN, layer_types=["full_attention"])
            if self.family == "next":
                cfg_type, mod_type, norm_type = Qwen3NextConfig, Qwen3NextSparseMoeBlock, Qwen3NextRMSNorm
                common["norm_topk_prob"] = norm_topk
            else:  # Qwen3.5-MoE always renormalises
                assert norm_topk
                cfg_type, mod_type, norm_type = Qwen3_5MoeTextConfig, Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeRMSNorm
            mod = mod_type(cfg_type(**common))
        norm = norm_type(HIDDEN, eps=EPS)
        g = _gen(seed)
        with torch.no_grad():
            for name, p in (*mod.named_parameters(), *norm.named_parameters(prefix="pre")):
                p.copy_((1.0 if name == "norm.weight" else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
        return mod, norm

    def state(self, mod, norm, grads: bool = False) -> dict[str, torch.Tensor]:
        """The decoder layer's tensors (names inside ``model.layers.{j}.``), or their gradients."""
        pick = (lambda p: p.grad.clone()) if grads else (lambda p: p.detach())
        prefix, norm_name = ("linear_attn.", "input_layernorm") if self.kind == "gdn" else ("mlp.", "post_attention_layernorm")
        return {**{prefix + n: pick(p) for n, p in mod.named_parameters()}, f"{norm_name}.weight": pick(norm.weight)}

    def to_ours(self, state: dict) -> dict[str, torch.Tensor]:
        arch = self.arch()
        if self.kind == "gdn":
            return hf.gdn_layer_from_hf(state, arch, self.model_type)
        return hf.layer_state_from_hf(hf.layer_placements(arch, "moe"), hf.moe_layer_pieces(arch), state)

    def to_hf(self, ours: dict) -> dict[str, torch.Tensor]:
        arch = self.arch()
        if self.kind == "gdn":
            return hf.gdn_layer_to_hf(ours, arch, self.model_type)
        return hf.layer_state_to_hf(hf.layer_placements(arch, "moe"), hf.moe_layer_pieces(arch), ours)

    def ours(self, mod, norm, dtype=torch.float32, ctx=None):
        """Our layer (on ``ctx``: this rank's slices) with transformers' weights."""
        arch = self.arch()
        assert arch.validate("arch") == []
        layer = build_layer(arch, LayerSpec(0, self.kind), ctx)
        if self.kind == "gdn":
            layer.mixer.impl = "chunked"
        else:
            layer.impl = "exact"
        load_full_(param_table(layer), self.to_ours(self.state(mod, norm)))
        return layer.to(dtype)


FFN, SHARED_FFN = 8, 12
GDN_CASES = {f"{family}-{name}": Case("gdn", family, sizes) for family in ("next", "3.5") for name, sizes in GDN_HEADS.items()}
MOE_CASES = {"next-renorm": Case("moe", "next", (5, 2, True)), "next-no-renorm": Case("moe", "next", (5, 3, False)),
             "3.5-moe": Case("moe", "3.5", (7, 3, True))}
TP_CASES = {"gdn-next-k2-v6": Case("gdn", "next", (2, 6)), "gdn-3.5-k2-v6": Case("gdn", "3.5", (2, 6)),
            "moe-next": MOE_CASES["next-no-renorm"], "moe-3.5": MOE_CASES["3.5-moe"]}


def _data(dtype, lens=LENS, seed: int = 4):
    g = _gen(seed)
    t = sum(lens)
    return (torch.randn(t, HIDDEN, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(t, HIDDEN, generator=g, dtype=torch.float64).to(dtype))


def hf_run(case: Case, mod, norm, dtype, lens=LENS) -> dict[str, torch.Tensor]:
    """``h + mod(norm(h))`` on each sample alone: outputs less the residual, input gradients and
    the weights' gradients summed over the samples, mapped to our names by the rules."""
    mod.to(dtype), norm.to(dtype)
    mod.zero_grad(), norm.zero_grad()
    h0, dy = _data(dtype, lens)
    cu = SeqContext.from_seqlens(lens).cu_seqlens.tolist()
    ys, dxs = [], []
    with _maybe_fp64(dtype):
        for s, e in zip(cu[:-1], cu[1:]):
            h = h0[s:e][None].clone().requires_grad_(True)
            y = h + mod(norm(h))
            y.backward(dy[s:e][None])
            ys.append((y - h)[0].detach())
            dxs.append(h.grad[0])
    grads = case.state(mod, norm, grads=True)
    mod.float(), norm.float()
    return {"y": torch.cat(ys), "dx": torch.cat(dxs), **{f"grad:{n}": g for n, g in case.to_ours(grads).items()}}


def hf_refs(case: Case, lens=LENS) -> dict:
    mod, norm = case.hf()
    return {dtype: hf_run(case, mod, norm, dtype, lens) for dtype in (torch.float32, torch.float64)}


def ours_run(layer, dtype, seq: SeqContext, part=lambda v: v, mode: str = "plain", lens=LENS) -> dict[str, torch.Tensor]:
    """Our layer on the pack (``part``: this rank's rows of it under SP): outputs less the
    residual, input gradients, every gradient (full, partial ones summed over TP)."""
    h0, dy = (part(v) for v in _data(dtype, lens))
    layer.zero_grad()
    set_selective(layer, mode == "selective")
    h = h0.clone().requires_grad_(True)
    y = checkpoint(layer, h, seq) if mode == "full" else layer(h, seq)
    y.backward(dy)
    set_selective(layer, False)
    table = param_table(layer)
    reduce_partial_grads(table)
    return {"y": (y - h0).detach(), "dx": h.grad, **{f"grad:{n}": g for n, g in full_tensors(table, grads=True).items()}}


def check_against_hf(got: dict, refs: dict, what: str) -> None:
    """fp32 by the yardstick against transformers in fp64, fp64 within ``TOL64``."""
    ys = Yardstick(TOL)
    ys.check_all(got[torch.float32], refs[torch.float32], refs[torch.float64])
    ys.assert_ok(f"{what} fp32")
    if torch.float64 in got:
        worst = max((rel_err(got[torch.float64][n], w), n) for n, w in refs[torch.float64].items())
        assert worst[0] < TOL64, f"{what} fp64 {worst[1]}: {worst[0]:.2e}"


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("name", list(GDN_CASES) + list(MOE_CASES))
def test_layer_equals_hugging_face_per_sample(name):
    """Outputs, input and every weight gradient; recompute (full, selective) bit for bit the same."""
    case = (GDN_CASES | MOE_CASES)[name]
    refs = hf_refs(case)
    mod, norm = case.hf()
    seq = SeqContext.from_seqlens(LENS)
    got = {}
    for dtype in (torch.float32, torch.float64):
        layer = case.ours(mod, norm, dtype)
        got[dtype] = ours_run(layer, dtype, seq)
        if dtype == torch.float32:
            for mode in ("full", "selective"):
                again = ours_run(layer, dtype, seq, mode=mode)
                assert all(torch.equal(again[n], got[dtype][n]) for n in again), mode
    check_against_hf(got, refs, name)


# ---------------------------------------------------------------- the weight rules
@pytest.mark.parametrize("name", list(GDN_CASES) + list(MOE_CASES))
def test_import_export_round_trip(name):
    """import -> export gives back every Hugging Face tensor exactly, in ``state_dict`` order."""
    case = (GDN_CASES | MOE_CASES)[name]
    mod, norm = case.hf()
    theirs = case.state(mod, norm)
    ours = case.to_ours(theirs)
    assert set(ours) == {n for n, _ in case.ours(mod, norm).named_parameters()}
    back = case.to_hf(ours)
    assert list(back) == list(theirs)
    assert all(torch.equal(back[n], t) for n, t in theirs.items())


@pytest.mark.parametrize("heads", list(GDN_HEADS))
def test_qwen3_next_grouping_is_transformers_own(heads):
    """Our q | k | v | z | b | a parts are what transformers' ``fix_query_key_value_ordering`` makes
    of the grouped projections (run on the weights: each input channel a token)."""
    case = GDN_CASES[f"next-{heads}"]
    mod, norm = case.hf()
    ours = case.to_ours(case.state(mod, norm))["mixer.in_proj_weight"]
    qkvz, ba = mod.in_proj_qkvz.weight.detach(), mod.in_proj_ba.weight.detach()
    q, k, v, z, b, a = mod.fix_query_key_value_ordering(qkvz.T[None], ba.T[None])
    want = torch.cat([x.reshape(HIDDEN, -1).T for x in (q, k, v, z, b, a)])
    assert torch.equal(ours, want)
    # transformers' conv channels are q | k | v in that order too: no regrouping of conv1d
    assert torch.equal(case.to_ours(case.state(mod, norm))["mixer.conv_weight"], mod.conv1d.weight.detach()[:, 0])


def test_qwen3_next_view_reads_rows_lazily_and_checks_shapes():
    """A row range of a label block (a TP rank's heads, or rows across key heads) read through the
    view is the same rows of the full import; each read touches only the source rows it needs."""
    case = GDN_CASES["next-k3-v9"]
    arch = case.arch()
    mod, norm = case.hf()
    state = case.state(mod, norm)
    full = case.to_ours(state)["mixer.in_proj_weight"]
    reads = []

    class Recording:
        def __init__(self, t):
            self.t = t

        def __getitem__(self, index):
            reads.append(index[0])
            return self.t[index]

    shapes, get = hf.qwen3_next_gdn_view(arch, state, {n: t.shape for n, t in state.items()}, lambda n: Recording(state[n]))
    r = 3  # value heads per key head
    assert shapes["linear_attn.in_proj_qkvz.weight:v"] == (9 * DV, HIDDEN) and "linear_attn.in_proj_qkvz.weight" not in shapes
    v_lo = 2 * 3 * DK  # our v rows start after q and k
    for label, lo, hi in (("v", r * DV - 2, 2 * r * DV + 3), ("q", DK, 2 * DK), ("a", 1, 8)):
        reads.clear()
        start = {"q": 0, "v": v_lo, "a": 2 * 3 * DK + 2 * 9 * DV + 9}[label]
        src = "linear_attn.in_proj_ba.weight" if label == "a" else "linear_attn.in_proj_qkvz.weight"
        got = get(f"{src}:{label}")[(slice(lo, hi), slice(2, 7))]
        assert torch.equal(got, full[start + lo:start + hi, 2:7]), label
        assert sum(s.stop - s.start for s in reads) == hi - lo  # only the rows asked for
    bad = {**state, "linear_attn.in_proj_ba.weight": state["linear_attn.in_proj_ba.weight"][:-1]}
    with pytest.raises(MimoError, match="in_proj_ba.weight.*has shape"):
        hf.gdn_layer_from_hf(bad, arch, "qwen3_next")
    with pytest.raises(MimoError, match="no tensor 'linear_attn.in_proj_z.weight'"):
        hf.gdn_layer_from_hf({n: t for n, t in GDN_CASES["3.5-k3-v9"].state(*GDN_CASES["3.5-k3-v9"].hf()).items()
                              if "in_proj_z" not in n}, arch, "qwen3_5")


# ---------------------------------------------------------------- tensor parallelism
def tp_against_hf(case: Case, sp: bool, refs: dict) -> list[dict]:
    """Rank function: the layer loaded from transformers' weights at tp 2 (this rank's slices of
    heads, experts' inner sizes) against transformers per sample (``refs``); every gradient
    gathered to full and exported to Hugging Face's names as well. Yardstick measures of this rank."""
    from sequence_mixer_checks import _ctx

    mod, norm = case.hf()
    pctx = _ctx(2, sp)
    layer = case.ours(mod, norm, ctx=pctx)
    part = (lambda v: v.chunk(2)[pctx.tp_rank]) if sp else (lambda v: v)
    got = ours_run(layer, torch.float32, SeqContext.from_seqlens(TP_LENS), part, lens=TP_LENS)
    ys = Yardstick(TOL)
    for name in ("y", "dx"):
        ys.check(name, got[name], part(refs[torch.float32][name]), part(refs[torch.float64][name]))
    by_hf = [case.to_hf({n[5:]: g for n, g in x.items() if n.startswith("grad:")})
             for x in (got, refs[torch.float32], refs[torch.float64])]
    ys.check_all(*by_hf)
    return [m.as_dict() for m in ys.measures]


TP_LENS = [9, 1, 17, 5]  # even: SP splits it


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("name", list(TP_CASES))
def test_tp2_equals_hugging_face(pools, name, sp):
    ys = Yardstick(TOL)
    case = TP_CASES[name]
    for rank, measures in enumerate(pools(4).run(tp_against_hf, case, sp, hf_refs(case, TP_LENS))):
        ys.extend(measures, f"rank{rank}/")
    ys.assert_ok(f"{name} sp={sp}")


# ---------------------------------------------------------------- context parallelism
def cp_share_run(case: Case, cp: int, dtype) -> dict | None:
    """Rank function: this CP rank's share of the pack (each sample padded to a multiple of 2cp,
    random rows at the padding) through the layer loaded from transformers' weights; its real
    rows' outputs and input gradients with their places in the pack of samples, its gradients."""
    from mimo.data.pack import PackItem, cp_share, pack
    from mimo.llm.cp import CPChunks
    from mimo.parallel.layout import PackLayout

    group = dist.new_group(list(range(cp)))
    rank = dist.get_rank()
    if rank >= cp:
        return None
    share = cp_share(pack([PackItem(i, [1] * n, [True] * n, {}) for i, n in enumerate(LENS)], {}, 1, cp, False, 0), rank)
    layout = PackLayout(tuple(LENS), 1, cp, False)
    sample_row = torch.full((layout.total_len,), -1)  # each position of the padded pack: its row in LENS' pack
    start = real = 0
    for n, padded in zip(LENS, layout.padded_lens):
        sample_row[start:start + n] = torch.arange(real, real + n)
        start, real = start + padded, real + n
    rows = sample_row[torch.tensor(layout.cp_local_index(rank))]
    keep = rows >= 0
    h0, dy = _data(dtype)
    x = torch.randn(len(rows), HIDDEN, generator=_gen(100 + rank), dtype=torch.float64).to(dtype)
    w = torch.zeros_like(x)
    x[keep], w[keep] = h0[rows[keep]], dy[rows[keep]]
    layer = case.ours(*case.hf(), dtype)
    seq = SeqContext(share.cu_seqlens, share.positions, share.max_seqlen, share.num_real_tokens, None,
                     CPChunks(share.cp, group, "cpu"))
    h = x.clone().requires_grad_(True)
    y = layer(h, seq)
    y.backward(w)
    return {"rows": rows[keep], "y": (y - h).detach()[keep], "dx": h.grad[keep],
            **{f"grad:{n}": p.grad for n, p in layer.named_parameters()}}


def _cp_joined(results: list) -> dict[str, torch.Tensor]:
    """The CP ranks' real rows in the pack's order; gradients summed over CP."""
    results = [r for r in results if r]
    out = {}
    for name in ("y", "dx"):
        out[name] = results[0][name].new_zeros(sum(LENS), HIDDEN)
        for r in results:
            out[name][r["rows"]] = r[name]
    return {**out, **{n: sum(r[n] for r in results) for n in results[0] if n.startswith("grad:")}}


@pytest.mark.parametrize("name,cp", [("next-k3-v9", 2), ("3.5-k3-v9", 2), ("next-k3-v3", 3)])
def test_cp_equals_one_process_and_hugging_face(pools, name, cp):
    """Every sample longer than 2cp crosses the CP ranks (its chunks on every rank); fp32 against
    the one-process (cp 1) run by the yardstick, fp64 against transformers within ``TOL64``."""
    case = GDN_CASES[name]
    refs = hf_refs(case)
    one = ours_run(case.ours(*case.hf()), torch.float32, SeqContext.from_seqlens(LENS))
    got = {dtype: _cp_joined(pools(4).run(cp_share_run, case, cp, dtype)) for dtype in (torch.float32, torch.float64)}
    ys = Yardstick(TOL)
    ys.check_all(got[torch.float32], one, refs[torch.float64])
    ys.assert_ok(f"{name} cp {cp} fp32")
    check_against_hf(got, refs, f"{name} cp {cp}")

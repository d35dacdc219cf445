"""Context parallelism in the LLM's layers (issue 23): ``mimo.llm.cp`` and the layers over it.

* ``cp_share`` cuts a pack as ``PackLayout`` places positions (the bridges' image slots agree);
* every sequence-mixing layer (attention with GQA and RoPE, multi-latent attention with its v head
  size unlike q / k's, Mamba-2 with groups, Gated DeltaNet
  with more value heads than q/k heads, their short convolutions) on each CP rank's share, over
  gloo at cp 2, 3 and 4, equals the one-process layer on the unsplit samples: outputs at real
  positions, the inputs' gradients, and parameter gradients summed over CP — in fp64 against the
  naive per-token recurrences (the cross-rank scans), and in fp32 against the one-process fp32
  run with the fp64 yardstick. The samples: one longer than a rank's share, one a multiple of 2cp
  (its boundaries on chunk borders), ones shorter than 2cp (chunks of padding only) and of
  length 1, chunks shorter than the convolution's halo.
* mutations (the state scan skipped, a halo from the wrong chunk, keys of the wrong rank) fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mimo.core.testing import Yardstick
from mimo.data.pack import PackItem, cp_share, pack
from mimo.llm.config import AuxLoss, HybridArch, MoEArch
from mimo.llm.context import SeqContext
from mimo.llm.cp import CPChunks
from mimo.parallel.layout import PackLayout

TOL = 1e-5
LOSS_NORM = 50.0
WORLD = 4
SEQLENS = [37, 8, 3, 1, 13, 6]  # cp 4: 37 > a rank's share; 8 = 2cp (borders); 3, 1 < 2cp (padding-only chunks)
KINDS = {"*": "attention", "+": "mla", "D": "dsa", "M": "mamba", "G": "gdn", "E": "moe"}


def arch(kind: str, impl: str = "chunked") -> HybridArch:
    moe = MoEArch(experts=6, topk=2, ffn=8, shared_ffn=8, aux_loss=AuxLoss("per_sample", 0.1), z_loss_coeff=0.01)
    return HybridArch(pattern=kind, hidden=24, heads=6, kv_heads=2, vocab=50, ffn=32, moe=moe,
                      mamba_heads=4, mamba_head_dim=6, mamba_state=5, mamba_groups=2, mamba_chunk=8,
                      gdn_heads=2, gdn_v_heads=4, gdn_head_dim=6, gdn_v_head_dim=5, gdn_chunk=8, conv_kernel=4,
                      mla_q_lora_rank=12, mla_kv_lora_rank=10, mla_qk_rope_head_dim=4, mla_qk_nope_head_dim=4, mla_v_head_dim=3,
                      dsa_index_topk=5, dsa_index_heads=8, dsa_index_head_dim=6)


def build(kind: str, impl: str, dtype):
    from mimo.llm.blocks import build_layer

    a = arch(kind)
    layer = build_layer(a, a.layer_pattern().layers[0], None).to(dtype)
    layer.init_weights(11, 0.3)
    with torch.no_grad():  # no all-ones / zeros weight: perturb every parameter
        g = torch.Generator().manual_seed(5)
        for p in layer.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    mixer = getattr(layer, "mixer", None)
    if mixer is not None:
        mixer.impl = impl
    else:
        layer.impl = "exact"
    return layer


def samples_input(dtype):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, 24, generator=g, dtype=torch.float64).to(dtype) for n in SEQLENS]


def run_layer(layer, x_TD, seq):
    x = x_TD.detach().clone().requires_grad_()
    y = layer(x, seq)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def one_process(kind: str, impl: str, dtype) -> dict:
    """The unsplit samples end to end; per-sample outputs and input grads, parameter grads.
    The output weights are drawn per position of the CP pack (below), so pad the reference the
    same way: each sample alone at its real positions, weights at those positions."""
    layer = build(kind, impl, dtype)
    xs = samples_input(dtype)
    seq = SeqContext.from_seqlens(SEQLENS)
    seq.loss_norm = LOSS_NORM  # MoE aux losses join
    x = torch.cat(xs).requires_grad_()
    y = layer(x, seq)
    weights = reference_weights(dtype)
    (y * weights).sum().backward()
    return {"y": y.detach(), "x": x.grad, "params": {n: p.grad.clone() for n, p in layer.named_parameters()}}


def reference_weights(dtype):
    """The output weights of every real position, the same whatever the layout."""
    g = torch.Generator().manual_seed(9)
    return torch.randn(sum(SEQLENS), 24, generator=g, dtype=torch.float64).to(dtype)


def cp_case(kind: str, impl: str, cp: int, dtype, mutate: str | None = None, tile: int = 512) -> dict | None:
    """Rank function: this CP rank's share of the pack through the layer (the exact CP
    attention in tiles of ``tile`` queries / keys; the module's tile restored after, as the
    worker processes may be the session's)."""
    from mimo.llm import attention

    saved, attention.TILE = attention.TILE, tile
    try:
        return _cp_case(kind, impl, cp, dtype, mutate)
    finally:
        attention.TILE = saved


def _cp_case(kind: str, impl: str, cp: int, dtype, mutate: str | None) -> dict | None:
    group = dist.new_group(list(range(cp)))
    rank = dist.get_rank()
    if rank >= cp:
        return None
    items = [PackItem(i, [1] * n, [True] * n, {}) for i, n in enumerate(SEQLENS)]
    whole = pack(items, {}, 1, cp, False, 0)
    share = cp_share(whole, rank)
    layout = PackLayout(tuple(SEQLENS), 1, cp, False)
    index = layout.cp_local_index(rank)
    # this rank's rows: the samples' inputs at their positions (padding rows random as well)
    xs = samples_input(dtype)
    weights = reference_weights(dtype)
    full_x = torch.zeros(layout.total_len, 24, dtype=dtype)
    full_w = torch.zeros(layout.total_len, 24, dtype=dtype)
    ref_index = torch.full((layout.total_len,), -1, dtype=torch.int64)
    start, ref = 0, 0
    g = torch.Generator().manual_seed(100)
    for s, (n, padded) in enumerate(zip(SEQLENS, layout.padded_lens)):
        full_x[start:start + n] = xs[s]
        full_x[start + n:start + padded] = torch.randn(padded - n, 24, generator=g, dtype=torch.float64).to(dtype)
        full_w[start:start + n] = weights[ref:ref + n]
        ref_index[start:start + n] = torch.arange(ref, ref + n)
        start, ref = start + padded, ref + n
    idx = torch.tensor(index)
    layer = build(kind, impl, dtype)
    cpc = CPChunks(share.cp, group, "cpu")
    if mutate == "no state scan":
        cpc.states_in = lambda combine, transfer, state: torch.zeros_like(state)
    elif mutate == "halo from the wrong chunk":
        real = cpc.with_halo
        cpc.with_halo = lambda x, width: (lambda r: (r[0].roll(1, 0), *r[1:]))(real(x, width))
    elif mutate == "keys of the wrong rank":
        rows, cu, longest = cpc.key_rows
        cpc.__dict__["key_rows"] = ((rows + cpc.local_len) % (cp * cpc.local_len), cu, longest)
    seq = SeqContext(share.cu_seqlens, share.positions, share.max_seqlen, share.num_real_tokens, LOSS_NORM, cpc)
    x = full_x[idx].clone().requires_grad_()
    y = layer(x, seq)
    (y * full_w[idx]).sum().backward()
    return {"y": y.detach(), "x": x.grad, "ref_index": ref_index[idx], "real": cpc.real_T,
            "params": {n: p.grad.clone() for n, p in layer.named_parameters()}}


def collect(results, total: int):
    """Outputs and input grads of the real positions in one-process order; params summed."""
    y = x = None
    for r in results:
        keep = r["ref_index"] >= 0
        assert torch.equal(keep, r["real"])  # the rank's real mask is exactly its sample positions
        if y is None:
            y = r["y"].new_zeros(total, r["y"].shape[1])
            x = r["x"].new_zeros(total, r["x"].shape[1])
        y[r["ref_index"][keep]] = r["y"][keep]
        x[r["ref_index"][keep]] = r["x"][keep]
    params = {n: sum(r["params"][n] for r in results) for n in results[0]["params"]}
    return {"y": y, "x": x, **{f"param {n}": g for n, g in params.items()}}


def flat(ref):
    return {"y": ref["y"], "x": ref["x"], **{f"param {n}": g for n, g in ref["params"].items()}}


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_layer_over_cp_ranks_equals_one_process(pools, kind, cp):
    """fp32 against the one-process fp32 run, with the fp64 run as yardstick (the chunked scans
    on both sides); fp64 against the naive per-token recurrences (the cross-rank scans' check;
    attention there in tiles of 3, so that runs span several tiles, masked and not)."""
    ref64 = flat(one_process(kind, "naive", torch.float64))
    ref32 = flat(one_process(kind, "chunked", torch.float32))
    total = sum(SEQLENS)
    got32 = collect([r for r in pools(WORLD).run(cp_case, kind, "chunked", cp, torch.float32) if r], total)
    ys = Yardstick(TOL)
    ys.check_all(got32, ref32, ref64)
    ys.assert_ok(f"{KINDS[kind]} cp {cp} fp32")
    got64 = collect([r for r in pools(WORLD).run(cp_case, kind, "chunked", cp, torch.float64, None, 3) if r], total)
    for name, want in ref64.items():
        err = (got64[name] - want).norm() / want.norm()
        assert err < 1e-10, (name, float(err))


@pytest.mark.parametrize("kind,mutation", [("M", "no state scan"), ("G", "no state scan"), ("M", "halo from the wrong chunk"),
                                           ("G", "halo from the wrong chunk"), ("*", "keys of the wrong rank"),
                                           ("+", "keys of the wrong rank"), ("D", "keys of the wrong rank")])
def test_mutations_fail(pools, kind, mutation):
    ref = flat(one_process(kind, "naive", torch.float64))
    got = collect([r for r in pools(WORLD).run(cp_case, kind, "chunked", 2, torch.float64, mutation) if r], sum(SEQLENS))
    worst = max(float((got[n] - w).norm() / w.norm()) for n, w in ref.items())
    assert worst > 1e-3, (mutation, worst)


# ---------------------------------------------------------------- verify-train (tests/configs/cp.yaml)
STEPS = 3
LANG, VIS = "modules.language.parallel.", "modules.vision.parallel."
TRAIN_LAYOUTS = {  # world 4; the LLM's pattern M*G-E* (per-sample aux, z-loss, expert bias)
    "cp2 dp2": [],
    "cp4, global aux": [LANG + "cp=4", LANG + "dp=1", "modules.language.arch.moe.aux_loss.kind=global"],
    "non-colocated vision, llm cp3": [VIS + "dp=1", VIS + "ranks=0:1", LANG + "cp=3", LANG + "dp=1", LANG + "ranks=1:4"],
    "cp2 dp2, ep4 folded over cp and dp": ["modules.language.arch.moe.experts=8", LANG + "ep=4", LANG + "etp=1"],
    "cp2 tp2 with sequence parallelism": [LANG + "tp=2", LANG + "dp=1", LANG + "sequence_parallel=true"],
}


@pytest.fixture(scope="module")
def cp_config(tmp_path_factory, write_moe_configs):
    return write_moe_configs(tmp_path_factory.mktemp("cp"), train_samples=160, seed=7, names=("cp",))["cp"]


def _reference(pools, config, overrides, cache={}):
    key = tuple(o for o in overrides if "parallel" not in o)
    if key not in cache:
        from mimo.commands.verify_train import references

        cache[key] = references(pools(1), config, list(key) + ["train.schedule=simple"], STEPS)
    return cache[key]


@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_verify_train_cp(pools, cp_config, name):
    """The whole run (vision, bridge into CP ranks, every layer kind, loss normaliser counted
    once, MoE statistics over CP) equals the one-process run: loss, gradients, parameters."""
    from mimo.commands.verify_train import compare, train_case

    overrides = TRAIN_LAYOUTS[name]
    layout = pools(4).run(train_case, cp_config, overrides, STEPS, False)
    ref32, ref64 = _reference(pools, cp_config, overrides)
    report = compare(layout, ref32, TOL, fp64=ref64)
    assert report["ok"], report
    assert report["losses"][0] > 0
    if "ep" in name:
        assert report["moe_dispatch"]["bytes_ratio"] == 1.0


def test_check_config_takes_cp_on_the_llm_only(capsys, monkeypatch):
    import json
    import os

    from mimo.commands.cli import main

    configs = os.path.join(os.path.dirname(__file__), "configs")
    monkeypatch.chdir(configs)  # (its data paths do not exist here: those errors are not ours)

    def errors(*overrides):
        main(["check-config", "cp.yaml", *overrides])
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        return [e for e in json.loads(out.out.strip().splitlines()[-1]).get("errors", []) if not e.startswith("data.")]

    assert errors() == []
    assert errors(LANG + "cp=4", LANG + "dp=1") == []
    assert any("modules.vision.parallel.cp" in e for e in errors(VIS + "cp=2", VIS + "dp=2"))
    assert any("tp*cp*dp*pp" in e for e in errors(LANG + "cp=3"))

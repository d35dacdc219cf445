"""Qwen3-VL's language model in mimo's LLMStage (issue 47 item 4): M-RoPE positions carried in
the pack, deepstack levels added after decoder layers, the Hugging Face mapping of the text
models of ``qwen3_vl`` (dense) and ``qwen3_vl_moe`` configs.

* One process against Hugging Face's ``Qwen3VLTextModel`` / ``Qwen3VLMoeTextModel`` (plus an
  ``lm_head``) run in fp32 and fp64: logits, loss, every parameter gradient (HF's, mapped to our
  names) and the image rows' gradient (main and deepstack columns), under the fp64 yardstick
  (docs/design.md §9.7). Odd sizes (hidden 40, vocab 67, 3 experts), uneven mrope sections, two
  deepstack levels, a pack of an image sample (two grids, one with t = 2), a text-only sample
  (HF given 1-D position ids: the degenerate case) and a sample opening with an image; MoE
  routing equal to HF's, token by token.
* TP 2 (with and without sequence parallelism), CP 2 and PP 2 (deepstack on stage 0) over gloo
  against the one-process model (its fp32 and fp64 runs): logits at every real position, loss,
  gradients, each rank's image-row gradients; MoE routing identical at every layout.
* The mapping: arch of a whole config.json, state to and from the whole model's state dict
  (fused experts transposed as published checkpoints hold them, too), a saved checkpoint.
* Planted bugs (no deepstack add, the add before its layer, Qwen2-VL's contiguous sections,
  positions_3d not cut with the tokens under CP) fail.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from mimo.core.batch import PackedBatch
from mimo.core.errors import LayoutError, MimoError
from mimo.core.testing import Yardstick
from mimo.llm.config import HybridArch, LLMModuleConfig
from mimo.llm.hf import (
    arch_from_hf_config,
    hf_config_from_arch,
    hf_model_type,
    load_hf_checkpoint,
    qwen3_vl_arch,
    qwen3_vl_text_from_hf,
    qwen3_vl_text_to_hf,
)
from mimo.llm.model import LLMStage
from mimo.data.positions import packed_positions_3d
from mimo.llm.verify import randomize_
from mimo.parallel.grid import ParallelConfig
from mimo.parallel.layout_reference import packed_placement

TOL = 1e-5
WORLD = 2
KEY = "<image>"
IMG, VID, VS, VE = 60, 61, 58, 59
MERGE = 2
HIDDEN = 40
LEVELS = 2

VISION = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=HIDDEN,
              spatial_merge_size=MERGE, deepstack_visual_indexes=[0, 1], num_position_embeddings=16)
TEXT = dict(vocab_size=67, hidden_size=HIDDEN, intermediate_size=36, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
MODELS = {  # non-default mrope sections (head_dim 16: they sum to 8); the MoE: 3 experts, layer 1 dense, tied
    "dense": ("Qwen3VLConfig", dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                mrope_section=[4, 2, 2], mrope_interleaved=True)),
              dict(tie_word_embeddings=False)),
    "moe": ("Qwen3VLMoeConfig", dict(TEXT, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=12,
                                     mlp_only_layers=[1], rope_parameters=dict(rope_type="default", rope_theta=5e5,
                                                                               mrope_section=[3, 3, 2])),
            dict(tie_word_embeddings=True)),
}


def hf_full_config(name: str):
    import transformers

    cls, text, top = MODELS[name]
    return getattr(transformers, cls)(text_config=text, vision_config=VISION, image_token_id=IMG, video_token_id=VID,
                                      vision_start_token_id=VS, vision_end_token_id=VE, **top)


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def image(t: int, h: int, w: int) -> list[int]:
    return [VS] + [IMG] * (t * (h // MERGE) * (w // MERGE)) + [VE]


# (tokens, image grids): two images (one of two time steps, h != w); text only; an image first
SAMPLES = [
    (text(3, 1) + image(1, 4, 6) + text(2, 2) + image(2, 4, 4) + text(3, 3), [(1, 4, 6), (2, 4, 4)]),
    (text(7, 4), []),
    (image(1, 6, 2) + text(4, 5) + image(1, 2, 2) + text(2, 6), [(1, 6, 2), (1, 2, 2)]),
]
GRIDS = [g for _, grids in SAMPLES for g in grids]


def image_rows(dtype=torch.float32) -> torch.Tensor:
    """Every image row of the pack, main features then the two deepstack levels: [R, 3 * HIDDEN]."""
    rows = sum(t.count(IMG) for t, _ in SAMPLES)
    g = torch.Generator().manual_seed(11)
    return torch.randn(rows, HIDDEN * (1 + LEVELS), generator=g, dtype=torch.float64).to(dtype)


def build_pack(tp: int = 1, cp: int = 1, sp: bool = False) -> PackedBatch:
    """The whole pack (before any CP cut) as ``mimo.data.pack`` pads it for the layout, with
    its 3-D positions and image slots (every image token, in order)."""
    from mimo.data.pack import PackItem, pack

    items = [PackItem(i, toks, [True] * len(toks), {}) for i, (toks, _) in enumerate(SAMPLES)]
    batch = pack(items, {}, tp, cp, sp, 0)
    batch.positions_3d = packed_positions_3d(batch.tokens, batch.cu_seqlens, GRIDS, None, MERGE, IMG, VID, VS)
    batch.image_slots[KEY] = torch.nonzero(batch.tokens == IMG).flatten()
    batch.validate()
    return batch


def real_index(batch: PackedBatch) -> torch.Tensor:
    """``[T]`` for each position of a whole pack: its position in the unpadded pack, -1 on padding."""
    out = torch.full((batch.num_tokens,), -1, dtype=torch.int64)
    starts = batch.cu_seqlens.tolist()
    ref = 0
    for i, (toks, _) in enumerate(SAMPLES):
        out[starts[i]:starts[i] + len(toks)] = torch.arange(ref, ref + len(toks))
        ref += len(toks)
    return out


# ---------------------------------------------------------------- Hugging Face's side


def hf_text_model(name: str, seed: int = 1):
    """(HF text model, lm_head weight, the whole config): random weights at which every path shows
    (``randomize_``); the head the embedding when tied."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

    cfg = hf_full_config(name)
    cls = Qwen3VLMoeTextModel if name == "moe" else Qwen3VLTextModel
    model = cls._from_config(cfg.text_config, experts_implementation="eager") if name == "moe" else cls(cfg.text_config)
    with torch.no_grad():
        randomize_(model, seed)
    model.eval()
    if cfg.tie_word_embeddings:
        head = model.embed_tokens.weight
    else:
        g = torch.Generator().manual_seed(seed + 100)
        head = torch.nn.Parameter(torch.randn(TEXT["vocab_size"], HIDDEN, generator=g) / HIDDEN ** 0.5)
    return model, head, cfg


def hf_state(model, head) -> dict[str, torch.Tensor]:
    """The text model's tensors as a whole Qwen3-VL ``state_dict()`` names them."""
    out = {"model.language_model." + k: v for k, v in model.state_dict().items()}
    out["lm_head.weight"] = head.detach()
    return out


def hf_run(model, head, rows: torch.Tensor, dtype, tied: bool) -> dict:
    """Hugging Face sample by sample (each alone, as it packs nothing): logits of the unpadded
    pack, the loss normalised by the pack's loss tokens, parameter grads by HF name, the image
    rows' grads; the experts each MoE layer chose (in layer order, tokens of the pack)."""
    model = copy.deepcopy(model).to(dtype)
    head = model.embed_tokens.weight if tied else torch.nn.Parameter(head.detach().to(dtype))
    rows = rows.to(dtype).clone().requires_grad_(True)
    chosen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda mod, i, out, n=n: chosen.setdefault(n, []).append(out[2].sort(-1).values))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    n_loss = sum(len(t) - 1 for t, _ in SAMPLES)
    logits, loss, r = [], 0.0, 0
    for toks, grids in SAMPLES:
        ids = torch.tensor(toks)[None]
        mask = ids == IMG
        emb = model.embed_tokens(ids).clone()
        if grids:
            mine = rows[r:r + int(mask.sum())]
            r += mine.shape[0]
            emb[mask] = mine[:, :HIDDEN]
            p3 = packed_positions_3d(ids[0], [0, ids.shape[1]], grids, None, MERGE, IMG, VID, VS)
            out = model(inputs_embeds=emb, position_ids=p3[:, None], visual_pos_masks=mask,
                        deepstack_visual_embeds=[mine[:, HIDDEN * (k + 1):HIDDEN * (k + 2)] for k in range(LEVELS)])
        else:  # text only: 1-D position ids, every M-RoPE axis the same
            out = model(inputs_embeds=emb, position_ids=torch.arange(ids.shape[1])[None])
        lg = out.last_hidden_state[0] @ head.T
        logits.append(lg)
        loss = loss + torch.nn.functional.cross_entropy(lg[:-1], ids[0, 1:], reduction="sum")
    loss = loss / n_loss
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {"model.language_model." + n: p.grad for n, p in model.named_parameters()}
    grads["lm_head.weight"] = head.grad
    return {"logits": torch.cat(logits).detach(), "loss": loss.detach(), "grads": grads, "rows_grad": rows.grad,
            "routing": {n: torch.cat(v) for n, v in chosen.items()}}


@pytest.fixture(scope="module")
def cases():
    """Per model: arch, our full state (mapped from HF), HF's fp32 and fp64 runs."""
    out = {}
    for name in MODELS:
        model, head, cfg = hf_text_model(name)
        arch = qwen3_vl_arch(cfg.to_dict())
        state = qwen3_vl_text_from_hf(hf_state(model, head), arch)
        rows, tied = image_rows(), cfg.tie_word_embeddings
        out[name] = dict(arch=arch, state=state, cfg=cfg, model=model, head=head,
                         hf32=hf_run(model, head, rows, torch.float32, tied),
                         hf64=hf_run(model, head, rows, torch.float64, tied))
    return out


# ---------------------------------------------------------------- mimo's one process


class RoutingRecorder:
    """The experts every ``Router.route`` call picks (sorted per token), by router."""

    def __init__(self):
        from mimo.llm.router import Router

        self.calls, self.cls, self.real = [], Router, Router.route

        def route(router, logits_TE, *args, **kwargs):
            routing = self.real(router, logits_TE, *args, **kwargs)
            self.calls.append((router, routing.idx_TK.sort(-1).values.detach().clone()))
            return routing

        Router.route = route

    def close(self, stage) -> dict[str, torch.Tensor]:
        """Restore ``Router.route``; the choices by layer name (``layers.<i>``) of ``stage``."""
        self.cls.route = self.real
        names = {id(m): n.rsplit(".", 1)[0] for n, m in stage.named_modules() if n.endswith("router")}
        return {names[id(r)]: idx for r, idx in self.calls}


def one_process(arch: HybridArch, state, dtype=torch.float32, mutate=None) -> dict:
    """LLMStage at tp 1 on the unpadded pack: logits, loss, full grads, image-row grads, routing."""
    stage = LLMStage(arch).to(dtype)
    stage.load_full_(state)
    batch = build_pack()
    rows = image_rows(dtype).requires_grad_(True)
    rec = RoutingRecorder()
    try:
        if mutate is not None:
            mutate(stage)
        logits = stage(batch, image_rows={KEY: rows})
        loss = stage.loss(logits, batch, batch.num_loss_tokens)
        loss.backward()
    finally:
        routing = rec.close(stage)
    return {"logits": stage.gather_logits(logits).detach(), "loss": loss.detach(), "grads": stage.full_grads(),
            "rows_grad": rows.grad, "routing": routing}


def test_one_process_equals_hugging_face(cases):
    """Logits, loss, every parameter gradient and the image rows' gradients (main and deepstack
    columns) of the mapped LLMStage against Hugging Face's text model + head, fp64 yardstick;
    the experts chosen for every token equal HF's."""
    for name, c in cases.items():
        arch, hf32, hf64 = c["arch"], c["hf32"], c["hf64"]
        ours = one_process(arch, c["state"])
        ys = Yardstick(TOL)
        for key in ("logits", "loss", "rows_grad"):
            ys.check(key, ours[key], hf32[key], hf64[key])
        g32, g64 = (qwen3_vl_text_from_hf(h["grads"], arch) for h in (hf32, hf64))
        assert set(g64) == set(ours["grads"])
        ys.check_all({f"grad {k}": v for k, v in ours["grads"].items()}, {f"grad {k}": v for k, v in g32.items()},
                     {f"grad {k}": v for k, v in g64.items()})
        ys.assert_ok(name)
        worst = ys.worst(1)[0]
        print(f"{name}: {len(ys.measures)} tensors; tightest {worst}")
        if name == "moe":  # the same experts for every token, layer by layer (HF decoder layer j: our 2j + 1)
            want = {f"layers.{2 * int(n.split('.')[1]) + 1}": idx for n, idx in hf64["routing"].items()}
            assert set(ours["routing"]) == set(want) == {"layers.1", "layers.5"}
            assert all(torch.equal(ours["routing"][k], want[k]) for k in want)


def test_text_only_pack_is_plain_rope(cases):
    """A text-only pack: without positions_3d (every axis = positions), with them equal to the
    positions, and on the same weights without M-RoPE, the logits are the same bit for bit."""
    arch, state = cases["dense"]["arch"], cases["dense"]["state"]
    toks = torch.tensor(SAMPLES[1][0] + text(5, 9))
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    positions = torch.cat([torch.arange(7), torch.arange(5)])
    batch = PackedBatch(toks, positions, cu, toks, torch.ones(12, dtype=torch.bool))
    plain = copy.copy(arch)
    plain.mrope_section, plain.deepstack_layers = None, []
    outs = []
    for a, p3 in ((arch, None), (arch, positions.expand(3, -1).clone()), (plain, None)):
        stage = LLMStage(a)
        stage.load_full_(state)
        batch.positions_3d = p3
        batch.validate()
        with torch.no_grad():
            outs.append(stage(batch))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ---------------------------------------------------------------- layouts over gloo


def local_rows(placement, rank: int, rows: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(placement.local_rows.get(rank, 0), rows.shape[1], dtype=rows.dtype)
    for p in placement.pieces_of(rank):
        out[p.local_row:p.local_row + p.rows] = rows[p.row:p.row + p.rows]
    return out


def layout_case(arch, state, tp: int, cp: int, pp: int, sp: bool, whole: PackedBatch, rows: torch.Tensor,
                mutate: str | None = None) -> dict | None:
    """Rank function: this rank's stage of ``arch`` at tp x cp x pp on its share of ``whole``
    (``mutate``: "positions_3d not cut": the share's 3-D positions the whole pack's first ones)."""
    from mimo.data.pack import cp_share
    from mimo.llm.model import build_stage, embedding_group, sync_tied_grads
    from mimo.llm.stage_runner import run_pipeline
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid
    from mimo.parallel.params import reduce_partial_grads

    grid = ParallelGrid({"tp": tp, "cp": cp, "dp": 1, "pp": pp})
    ctx = ParallelContext(grid, dist.get_rank(), grid.registry, sequence_parallel=sp)
    stage = build_stage(arch, ctx)
    tied_group = embedding_group(ctx)  # collective over the world
    if stage is None:
        return None
    stage.load_full_(state)
    cp_rank = ctx.dense.coord("cp")
    batch = cp_share(whole, cp_rank)
    if mutate == "positions_3d not cut":
        batch.positions_3d = whole.positions_3d[:, : batch.num_tokens].clone()
    batch.validate()
    samples = [(len(t), torch.nonzero(torch.tensor(t) == IMG).flatten().tolist()) for t, _ in SAMPLES]
    placement = stage.image_placement(grid, samples, [range(len(SAMPLES))], deepstack=True).to_placement()
    reference, slots = packed_placement(grid, samples, [range(len(SAMPLES))], placement.hidden, stage.sequence_parallel)
    assert placement == reference  # the production builder against the reference one
    rank = dist.get_rank()
    inputs, slots_ok = None, True
    if stage.is_first:
        slots_ok = stage.local_image_slots(batch, KEY).tolist() == slots[rank]
        inputs = {KEY: local_rows(placement, rank, rows).requires_grad_(True)}
    rec = RoutingRecorder()
    try:
        res = run_pipeline(stage, grid, batch, image_rows=inputs, num_loss_tokens=whole.num_loss_tokens, backward=True)
    finally:
        routing = rec.close(stage)
    reduce_partial_grads(stage.param_table())
    sync_tied_grads(stage, tied_group)  # the MoE model's tied head, on two stages at pp 2
    grads = stage.full_grads()
    loss = None if res.loss is None else res.loss.clone()
    if ctx.cp is not None:  # the gradient group's sum (training sums over cp x dp), the loss's parts
        for g in grads.values():
            dist.all_reduce(g, group=ctx.cp)
        if loss is not None:
            dist.all_reduce(loss, group=ctx.cp)
    out = {"stage": stage.stage, "tp_rank": stage.tp_rank, "cp_rank": cp_rank, "grads": grads, "slots_ok": slots_ok,
           "loss": loss, "logits": stage.gather_logits(res.logits) if stage.is_last else None, "routing": routing}
    if stage.is_first:
        out["rows_grad"], out["pieces"] = inputs[KEY].grad, placement.pieces_of(rank)
    return out


def local_index(whole: PackedBatch, cp: int, cp_rank: int) -> torch.Tensor:
    """Unpadded-pack position of each row of a rank's logits / routing (-1: padding)."""
    from mimo.parallel.layout import PackLayout

    ref = real_index(whole)
    if cp > 1:
        lens = tuple(b - a for a, b in zip(whole.cu_seqlens.tolist(), whole.cu_seqlens.tolist()[1:]))
        ref = ref[torch.tensor(PackLayout(lens, 1, cp, False).cp_local_index(cp_rank))]
    return ref


def check_layout(results, refs, whole, cp: int) -> Yardstick:
    ref32, ref64 = refs
    ys = Yardstick(TOL)
    results = [r for r in results if r is not None]
    assert results
    for r in results:
        assert r["slots_ok"], "local_image_slots disagree with image_placement"
        where = f"(stage {r['stage']}, tp {r['tp_rank']}, cp {r['cp_rank']})"
        for name, g in r["grads"].items():
            ys.check(f"grad {name} {where}", g, ref32["grads"][name], ref64["grads"][name])
        idx = local_index(whole, cp, r["cp_rank"])
        real = idx >= 0
        if r["logits"] is not None:
            ys.check(f"loss {where}", r["loss"], ref32["loss"], ref64["loss"])
            ys.check(f"logits {where}", r["logits"][: idx.numel()][real], *(x["logits"][idx[real]] for x in (ref32, ref64)))
        if "rows_grad" in r:
            for p in r["pieces"]:
                ys.check(f"image-row grads {p.row}:{p.row + p.rows} {where}", r["rows_grad"][p.local_row:p.local_row + p.rows],
                         *(x["rows_grad"][p.row:p.row + p.rows] for x in (ref32, ref64)))
        for layer, got in r["routing"].items():  # MoE routing exact, token by token
            assert torch.equal(got[: idx.numel()][real], ref32["routing"][layer][idx[real]]), f"{layer} routing {where}"
    return ys


LAYOUTS = {"tp2": (2, 1, 1, False), "tp2-sp": (2, 1, 1, True), "cp2": (1, 2, 1, False), "pp2": (1, 1, 2, False)}


@pytest.fixture(scope="module")
def references(cases):
    return {name: tuple(one_process(c["arch"], c["state"], dt) for dt in (torch.float32, torch.float64))
            for name, c in cases.items()}


def pp_arch(name: str) -> HybridArch:
    """The arch with explicit stages: decoder layers 0, 1 (both deepstack levels) | 2."""
    return qwen3_vl_arch(hf_full_config(name).to_dict(), pattern_stages=[2, 1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_layouts_equal_one_process(pools, cases, references, name, layout):
    tp, cp, pp, sp = LAYOUTS[layout]
    arch = pp_arch(name) if pp > 1 else cases[name]["arch"]
    whole = build_pack(tp, cp, sp)
    results = pools(WORLD).run(layout_case, arch, cases[name]["state"], tp, cp, pp, sp, whole, image_rows())
    ys = check_layout(results, references[name], whole, cp)
    if name == "moe":
        assert {k for r in results if r for k in r["routing"]} == {"layers.1", "layers.5"}
    ys.assert_ok(f"{name} {layout}")
    print(f"{name} {layout}: {len(ys.measures)} tensors; tightest {ys.worst(1)[0]}")


def bad_stage_case(arch) -> str:
    from mimo.llm.model import build_stage
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid

    grid = ParallelGrid({"tp": 1, "cp": 1, "dp": 1, "pp": 2})
    try:
        build_stage(arch, ParallelContext(grid, dist.get_rank(), grid.registry))
    except LayoutError as e:
        return str(e)
    return ""


def test_deepstack_beyond_the_first_stage_is_a_clear_error(pools):
    arch = qwen3_vl_arch(hf_full_config("dense").to_dict(), pattern_stages=[1, 2])  # level 1 after layer 3: stage 1
    module = LLMModuleConfig(kind="hybrid", arch=arch, parallel=ParallelConfig(pp=2))
    problems = module.validate("modules.language")
    assert any("deepstack_layers [3] lie beyond the first pipeline stage" in p for p in problems), problems
    assert all("deepstack_layers [3] are not layers of the first pipeline stage" in m
               for m in pools(WORLD).run(bad_stage_case, arch))


# ---------------------------------------------------------------- config and mapping


def test_arch_config_and_validation():
    dense = qwen3_vl_arch(hf_full_config("dense").to_dict())
    moe = qwen3_vl_arch(hf_full_config("moe").to_dict())
    assert (dense.pattern, dense.mrope_section, dense.deepstack_layers, dense.tie_embeddings, dense.qk_norm) == (
        "*-*-*-", [4, 2, 2], [1, 3], False, True)
    assert (moe.pattern, moe.mrope_section, moe.tie_embeddings, moe.moe.experts, moe.moe.topk, moe.moe.norm_topk) == (
        "*E*-*E", [3, 3, 2], True, 3, 2, True)
    assert (hf_model_type(dense), hf_model_type(moe)) == ("qwen3_vl_text", "qwen3_vl_moe_text")
    assert dense.validate("arch") == [] and moe.validate("arch") == []
    # the text config alone round-trips (the deepstack levels live in the vision config)
    for arch, text_type in ((dense, "qwen3_vl_text"), (moe, "qwen3_vl_moe_text")):
        cfg = hf_config_from_arch(arch)
        assert cfg["model_type"] == text_type and cfg["rope_parameters"]["mrope_section"] == arch.mrope_section
        again = arch_from_hf_config(cfg)
        assert again == HybridArch(**{**arch.__dict__, "deepstack_layers": []})
    # a Qwen3 arch stays qwen3; M-RoPE or deepstack keep an arch out of the 1-D families
    plain = HybridArch(**{**dense.__dict__, "mrope_section": None, "deepstack_layers": []})
    assert hf_model_type(plain) == "qwen3"
    with pytest.raises(MimoError, match="qwen3 has 1-D RoPE; arch.mrope_section is set"):
        hf_config_from_arch(dense, "qwen3")
    with pytest.raises(MimoError, match=r"after decoder layer k \(arch.deepstack_layers \[1, 3\]\), not \[0, 1\]"):
        hf_config_from_arch(HybridArch(**{**dense.__dict__, "deepstack_layers": [0, 1]}), "qwen3_vl_text")
    for change, message in [({"mrope_section": [4, 2, 1]}, "three positive ints summing to head_dim / 2"),
                            ({"mrope_section": [8, 0, 0]}, "three positive ints"),
                            ({"mrope_section": [4, 4]}, "three positive ints"),
                            ({"deepstack_layers": [3, 1]}, "strictly increasing"),
                            ({"deepstack_layers": [1, 6]}, "layer indices 0..5")]:
        problems = HybridArch(**{**dense.__dict__, **change}).validate("arch")
        assert any(message in p for p in problems), (change, problems)


def test_state_round_trip_transposed_experts_and_checkpoint(cases, tmp_path):
    """Export gives the whole model's state dict names, order and values; the MoE's fused experts
    also import transposed (published checkpoints); a saved Qwen3-VL(-MoE) checkpoint loads
    the language model (``init: {hf: DIR}``)."""
    import transformers

    for name, c in cases.items():
        arch, theirs = c["arch"], hf_state(c["model"], c["head"])
        back = qwen3_vl_text_to_hf(c["state"], arch)
        assert list(back) == list(theirs) and all(torch.equal(back[k], theirs[k]) for k in theirs)
        if name == "moe":
            flipped = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in theirs.items()}
            assert any(v.shape != theirs[k].shape for k, v in flipped.items())
            got = qwen3_vl_text_from_hf(flipped, arch)
            assert all(torch.equal(got[k], c["state"][k]) for k in c["state"])
        # a whole model saved by transformers (vision tower and all): its language model loads
        cls = transformers.Qwen3VLMoeForConditionalGeneration if name == "moe" else transformers.Qwen3VLForConditionalGeneration
        whole = cls(c["cfg"])
        with torch.no_grad():
            for k, v in whole.state_dict().items():
                if k in theirs:
                    v.copy_(theirs[k])
        whole.save_pretrained(tmp_path / name)
        stage = LLMStage(arch)
        load_hf_checkpoint(stage, str(tmp_path / name))
        loaded = stage.full_state()
        assert all(torch.equal(loaded[k], c["state"][k]) for k in c["state"])
    bad = dict(hf_state(cases["dense"]["model"], cases["dense"]["head"]))
    bad.pop("model.language_model.layers.2.mlp.up_proj.weight")
    with pytest.raises(MimoError, match=r"no tensor 'model\.language_model\.layers\.2\.mlp\.up_proj\.weight'"):
        qwen3_vl_text_from_hf(bad, cases["dense"]["arch"])


# ---------------------------------------------------------------- planted bugs


def _add_before_layers(stage, h_TD, seq, deepstack=()):
    """``LLMStage._layers`` with each deepstack level added before its layer instead of after."""
    for index, layer in stage.layers.items():
        level = stage.deepstack_after.get(int(index)) if deepstack else None
        if level is not None:
            for slots_R, levels_RW in deepstack:
                h_TD = h_TD.index_add(0, slots_R, levels_RW[:, level * HIDDEN:(level + 1) * HIDDEN])
        h_TD = layer(h_TD, seq)
    return h_TD


def _contiguous_sections(stage):
    """Qwen2-VL's M-RoPE layout (time, height, width in contiguous blocks), not interleaved."""
    from mimo.llm.attention import Attention

    sections = stage.arch.mrope_section
    axes = torch.cat([torch.full((n,), a) for a, n in enumerate(sections)])
    for layer in stage.modules():
        if isinstance(layer, Attention):
            layer._mrope_axes[torch.device("cpu")] = axes


MUTATIONS = {
    "no deepstack add": lambda stage: setattr(stage, "deepstack_after", {}),
    "deepstack before its layer": lambda stage: setattr(stage, "_layers", _add_before_layers.__get__(stage)),
    "contiguous mrope sections": _contiguous_sections,
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_planted_bugs_fail_against_hugging_face(cases, mutation):
    c = cases["dense"]
    got = one_process(c["arch"], c["state"], mutate=MUTATIONS[mutation])
    ys = Yardstick(TOL)
    for key in ("logits", "rows_grad"):
        ys.check(key, got[key], c["hf32"][key], c["hf64"][key])
    assert ys.worst(1)[0].ratio > 100, (mutation, ys.message())


def test_positions_3d_not_cut_under_cp_fails(pools, cases, references):
    c = cases["dense"]
    whole = build_pack(1, 2, False)
    results = pools(WORLD).run(layout_case, c["arch"], c["state"], 1, 2, 1, False, whole, image_rows(), "positions_3d not cut")
    ys = check_layout(results, references["dense"], whole, 2)
    assert ys.worst(1)[0].ratio > 100, ys.message()

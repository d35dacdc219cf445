"""``mimo verify-hf DIR``: a whole Qwen3-VL / Qwen3-VL-MoE (vision tower, deepstack, M-RoPE, the
language model and its head) at a TP / EP layout against transformers'
``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration``; or a whole Qwen3.5 /
Qwen3.5-MoE (the same without deepstack, its language model Gated DeltaNet and gated attention)
against ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``; or a whole
Kimi-K2.5 (MoonViT and its projector, a DeepSeek-V3 language model: MLA, routed and shared
experts; 1-D RoPE) against ``Kimi_K25ForConditionalGeneration``.

DIR holds ``config.json`` (``model_type`` ``qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5``,
``qwen3_5_moe`` or ``kimi_k25``) and, optionally,
safetensors weights as ``save_pretrained`` writes them. Without weights the Hugging Face model
gets random weights at which every path shows (``llm.verify.randomize_``, the tower's patch
embedding by its true fan-in) and is saved to a temporary directory, so that the workers import
exactly what Hugging Face runs.

Samples (main process, from ``--seed``; ``mimo.compose.native_vlm.random_samples``): two random
RGB images of different sizes (sides not multiples of 32) between text, a four-frame video
(two temporal patches; each frame block after its own vision-start token, a two-token timestamp
before it) between text, a text-only sample; more samples cycle through the three kinds where
the layout has more data-parallel ranks than three. A tower that takes no videos (Kimi-K2.5's)
gets one large image in the video's place (Kimi's processor scales it down; the others it pads to
whole merge blocks), its rows given to transformers in the processor's raster order
(``hf_pixels`` of the tower's class).

Hugging Face runs the samples as one batch (a row per sample, right-padded, ``attention_mask``,
``mm_token_type_ids``, ``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` /
``video_grid_thw``, ``labels``), eager attention and experts, in fp32 and as an fp64 copy.
Labels: next-token within each sample over every token but the image / video pads (padding
ignored). The loss compared is the mean per-token cross entropy over those positions, computed
from each run's logits in that run's dtype (transformers' own loss upcasts with ``.float()``,
which would round the fp64 run to fp32); the fp32 run's own ``loss`` output must agree with it
(``hf_builtin_loss``; a mismatch means the labels were not what we compare, and fails).
Gradients are those of that loss.

mimo runs on ``tp * ep`` gloo ranks: the LLM on the dense grid tp x dp (dp = ep) with, for
``--ep``, the experts' view etp = tp x ep (edp 1: ep folded onto the data-parallel ranks); the
tower colocated on the same ranks at the same tp, data parallel with the LLM. The samples are
dealt round-robin to the ep data-parallel ranks, each rank one THD pack
(``native_vlm.pack_samples``: ``cu_seqlens``, M-RoPE ``positions_3d``, image slots at every image
and video pad in token order); tower -> rows -> ``LLMStage.forward(batch, image_rows)`` -> loss
(summed over the data-parallel ranks, divided by the loss tokens of all of them) -> backward;
gradients summed over each parameter's gradient group (partial sums first), gathered to full
tensors and mapped back to Hugging Face names (``tower_state_to_hf``, ``qwen3_vl_text_to_hf``).

Compared (``mimo.core.testing.Yardstick``, docs/design.md §9.7): the logits of every sample at
its real positions (full vocab), the loss, and the gradient of every Hugging Face parameter; each
passes when its error against the fp64 run is at most ``max(tol, 4 * e1)``, ``e1`` the Hugging
Face fp32 run's own error against fp64. ``max_*_rel_err`` are the errors against the fp32 run;
``tightest`` the measure closest to its bound of each kind (logits, loss, grad). A Gated DeltaNet
model's gradients (Qwen3.5) carry fp32 noise near 1e-4 that mimo's and transformers' chunked delta
rules amplify by different factors (each up to several times the other's), so that 4 * e1 does
not bound them reliably, and by how much depends on the CPU's kernels (one tiny Qwen3.5-MoE's
worst gradient: 1.1e-4 with AVX2 kernels, 2.5e-4 with AVX-512 ones, where transformers' own stays
at 5e-5): their floor is ``max(tol, GDN_GRAD_FLOOR)`` (5e-4; planted mapping bugs still fail by
over 100x; in fp64 the two agree to ~5e-7), reported as ``grad_tol``; logits and loss keep ``tol``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from typing import Any, Callable

import torch

from mimo.commands.hf_qwen3_vl import ARCHITECTURES as _ARCHITECTURES_AND_CONFIGS
from mimo.compose.native_vlm import (
    VisionTokenIds,
    VLMPack,
    VLMSample,
    build_vlm,
    load_vlm_,
    pack_samples,
    random_samples,
    text_ids,
    vlm_archs,
)
from mimo.core.errors import ConfigError, MimoError
from mimo.encoders.config import native_tower_of
from mimo.core.testing import Yardstick, fp64_kept, rel_err
from mimo.llm.config import LLMModuleConfig
from mimo.llm.hf import QWEN3_VL, hf_model_type, normalised_qwen3_vl_config, read_config_json
from mimo.parallel.grid import ParallelConfig

# model_type -> the transformers class verify-hf runs
ARCHITECTURES = {t: a for t, (a, _) in _ARCHITECTURES_AND_CONFIGS.items()}
IGNORE = -100


# ---------------------------------------------------------------- checks before anything starts


def read_model_dir(path: str) -> tuple[str, dict, bool]:
    """(directory, config.json dict, whether it holds safetensors weights), or MimoError."""
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(path) or "."
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise MimoError(f"{path!r}: no config.json (verify-hf takes a Hugging Face Qwen3-VL, Qwen3.5 or Kimi-K2.5 model "
                        f"directory)")
    config = read_config_json(config_file)
    if not isinstance(config, dict):
        raise MimoError(f"{config_file}: not a JSON object")
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise MimoError(f"{config_file}: model_type {model_type!r} is not supported by verify-hf (Qwen3-VL, Qwen3.5, Kimi-K2.5: "
                        f"{', '.join(map(repr, ARCHITECTURES))}; and the causal LMs verify-llm checks)")
    archs = config.get("architectures") or [ARCHITECTURES[model_type]]
    if archs != [ARCHITECTURES[model_type]]:
        raise MimoError(f"{config_file}: architectures {archs} — verify-hf runs {ARCHITECTURES[model_type]} "
                        f"(the model_type {model_type!r} with its language-model head)")
    weights = any(n.endswith(".safetensors") for n in os.listdir(path))
    return path, config, weights


def check_layout(path: str, tp: int, ep: int) -> dict[str, Any]:
    """What ``verify_hf`` runs, checked before any process starts: MimoError for an unsupported
    config, a layout that does not fit (tp against the tower's heads / MLP / merger and the
    LLM's heads, ep against its experts) or weights that do not fit the config."""
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid

    if tp < 1 or ep < 1:
        raise MimoError(f"--tp and --ep must be >= 1, got tp={tp}, ep={ep}")
    path, config, weights = read_model_dir(path)
    tower_arch, arch = vlm_archs(config)
    tower = native_tower_of(config["model_type"])
    ids = VisionTokenIds.from_hf_config(normalised_qwen3_vl_config(config))  # the model type's defaults
    bad = [f"{name}={i}" for name, i in zip(("image_token_id", "video_token_id", "vision_start_token_id",
                                             "vision_end_token_id"), ids.all()) if not 0 <= i < arch.vocab]
    if bad:
        raise MimoError(f"{path}: {', '.join(bad)} outside the vocabulary ({arch.vocab} tokens)")
    if ep > 1 and arch.moe is None:
        raise MimoError(f"--ep {ep}: {config['model_type']} has no experts (Qwen3-VL-MoE, Qwen3.5-MoE and Kimi-K2.5 have)")
    parallel = ParallelConfig(tp=tp, dp=ep, ep=ep)
    problems = arch.validate("arch") + LLMModuleConfig(kind="hybrid", arch=arch, parallel=parallel).validate("llm")
    if problems:
        raise ConfigError(problems)
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": ep, "pp": 1})
    tower.tower_class()(tower_arch, ParallelContext.plan(grid), device="meta")  # LayoutError where tp does not divide it
    if weights:  # every tensor's name and shape, from the headers
        from mimo.encoders.hf_import import load_hf_state
        from mimo.llm.hf import check_hf_checkpoint

        tower.hf_module().import_hf_state(load_hf_state(path, shapes_only=True), tower_arch, where=f"checkpoint {path!r}")
        check_hf_checkpoint(arch, path)
    return {"path": path, "config": config, "weights": weights, "tower_arch": tower_arch, "arch": arch, "ids": ids,
            "tower": tower}


# ---------------------------------------------------------------- Hugging Face's side


@torch.no_grad()
def randomize_vlm_(model: torch.nn.Module, seed: int) -> None:
    """``llm.verify.randomize_`` over the whole model, then the tower's patch embedding (a
    Conv3d, MoonViT's Conv2d) by its true fan-in (C * tp * p * p) and its position table at scale
    0.5, so that positions show beside the pixels."""
    from mimo.llm.verify import randomize_

    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith(("visual.patch_embed.proj.weight", "vision_tower.patch_embed.proj.weight")):
            p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
        elif name.endswith(("visual.pos_embed.weight", "vision_tower.patch_embed.pos_emb.position_embeddings")):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars off (loading, saving): the command's output is its report."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def hf_model(path: str, config: dict, weights: bool, seed: int, moe: bool):
    """The transformers model of ``config`` in fp32, eval mode, eager attention (and, ``moe``,
    experts): the checkpoint's weights, every tensor accounted for, or ``randomize_vlm_``'d."""
    import transformers

    model_type = config["model_type"]
    cls = getattr(transformers, ARCHITECTURES[model_type])
    kwargs = {"attn_implementation": "eager", **({"experts_implementation": "eager"} if moe else {})}
    if not weights:
        hf_config = getattr(transformers, QWEN3_VL[model_type][0])(**{k: v for k, v in config.items() if k != "model_type"})
        model = cls._from_config(hf_config, dtype=torch.float32, **kwargs)
        randomize_vlm_(model, seed)
        return model.eval()
    with _quiet():
        model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True, **kwargs)
    tied = bool(model.config.tie_word_embeddings)
    missing = [k for k in info.get("missing_keys", ()) if not (tied and k == "lm_head.weight")]
    problems = [f"{what} {sorted(keys)[:3]}" for what, keys in (("missing", missing),
                                                                ("unexpected", info.get("unexpected_keys", ())),
                                                                ("misfit", info.get("mismatched_keys", ()))) if keys]
    if problems:
        raise MimoError(f"checkpoint {path!r}: transformers loads it with {'; '.join(problems)} (a reference with "
                        f"weights left at random would not be the checkpoint's model)")
    return model.eval()


def hf_inputs(samples: list[VLMSample], ids: VisionTokenIds, pad_id: int, tower=None, tower_arch=None
              ) -> dict[str, torch.Tensor]:
    """The samples as transformers' processor would hand them over: one right-padded row each
    (``tower``: the ``NATIVE_TOWERS`` kind whose ``hf_pixels`` lays the rows out as its processor
    does; default as they are)."""
    n = max(len(s.tokens) for s in samples)
    input_ids = torch.full((len(samples), n), pad_id, dtype=torch.long)
    attention = torch.zeros(len(samples), n, dtype=torch.long)
    labels = torch.full((len(samples), n), IGNORE, dtype=torch.long)
    for b, s in enumerate(samples):
        toks = torch.tensor(s.tokens, dtype=torch.long)
        input_ids[b, : toks.numel()] = toks
        attention[b, : toks.numel()] = 1
        labels[b, : toks.numel()] = torch.where(torch.tensor(s.target(ids)), toks, IGNORE)
    kinds = torch.zeros_like(input_ids, dtype=torch.int32)
    kinds[input_ids == ids.image], kinds[input_ids == ids.video] = 1, 2
    out = {"input_ids": input_ids, "attention_mask": attention, "mm_token_type_ids": kinds, "labels": labels}
    for kind, pixels, grids in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        visuals = [v for s in samples for v in s.visuals if v.kind == kind]
        if visuals:
            grids_N3 = torch.tensor([v.grid for v in visuals], dtype=torch.long)
            rows = torch.cat([v.pixels_PJ for v in visuals])
            out[pixels] = rows if tower is None else tower.tower_class().hf_pixels(tower_arch, rows, grids_N3)
            out[grids] = grids_N3
    return out


def hf_run(model, inputs: dict[str, torch.Tensor], lengths: list[int], moe: bool) -> dict[str, Any]:
    """One forward / backward of ``model`` (its own dtype): per-sample logits at the real
    positions, the mean per-token loss computed from the logits in that dtype (module doc),
    transformers' own loss, every parameter's gradient by name."""
    dtype = next(model.parameters()).dtype
    model.zero_grad(set_to_none=True)
    feed = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    extra = {"output_router_logits": False} if moe else {}
    out = model(**feed, use_cache=False, **extra)
    logits = out.logits
    labels = inputs["labels"][:, 1:]
    counted = labels != IGNORE
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][counted], labels[counted], reduction="sum") / counted.sum()
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for n, p in model.named_parameters()}
    return {"logits": [logits[b, :n].detach() for b, n in enumerate(lengths)], "loss": loss.detach(),
            "builtin_loss": out.loss.detach(), "grads": grads}


# ---------------------------------------------------------------- worker side


def _sum_grads_(table) -> None:
    """Partial sums first (``reduce_partial_grads``), then each parameter's gradient group
    (dense: dp; experts: edp), as training's gradient sync does."""
    import torch.distributed as dist

    from mimo.parallel.params import main_grad, reduce_partial_grads

    reduce_partial_grads(table)
    seen: set[int] = set()
    for info in table.values():
        p = info.param
        group = info.view.group("grad")
        if group is None or id(p) in seen:
            continue
        seen.add(id(p))
        if main_grad(p) is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(main_grad(p), group=group)


def verify_hf_worker(path: str, config: dict, tp: int, ep: int, packs: list[VLMPack], num_loss_tokens: int,
                     mutate: Callable | None = None) -> dict | None:
    """On every rank of the pool (ranks past tp * ep idle): build and load the VLM at the layout
    (module doc), run this data-parallel rank's pack, return the logits (one per DP rank), the
    loss and the full gradients by Hugging Face name (rank 0). ``mutate(vlm)``: a planted bug
    (tests), applied after loading."""
    import torch.distributed as dist

    from mimo.encoders.tp_state import full_grads
    from mimo.llm.hf import qwen3_vl_text_to_hf
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid
    from mimo.parallel.params import param_table

    rank = dist.get_rank()
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": ep, "pp": 1})
    # every rank of the pool makes the contexts (their groups are collective over the world);
    # ranks past tp * ep then idle
    llm_ctx = ParallelContext(grid, rank, grid.registry, expert=(tp, ep) if ep > 1 else None)
    tower_ctx = ParallelContext(grid, rank, grid.registry)  # the same ranks and groups: colocated, dp = ep
    if not llm_ctx.member:
        return None
    vlm = build_vlm(config, llm_ctx, tower_ctx)
    load_vlm_(vlm, path)
    if mutate is not None:
        mutate(vlm)
    dp_rank = llm_ctx.dense.coord("dp")
    pack = packs[dp_rank]
    logits = vlm(pack)
    loss = vlm.loss(logits, pack, num_loss_tokens)
    loss.backward()
    _sum_grads_(param_table(vlm.tower))
    _sum_grads_(vlm.stage.param_table())
    tower_grads, llm_grads = full_grads(vlm.tower), vlm.stage.full_grads()
    # persistent buffers a family maps (DeepSeek-V3's router.expert_bias: transformers' buffer
    # e_score_correction_bias), without gradients: zeros, so that the mapping finds every tensor
    buffers = dict(vlm.stage.named_buffers())
    llm_grads.update({k: torch.zeros_like(v) for k, v in vlm.stage.state_dict().items() if k in buffers})
    total = loss.detach().clone()
    if llm_ctx.dp is not None:
        dist.all_reduce(total, group=llm_ctx.dp)
    full_logits = vlm.stage.gather_logits(logits).detach()
    if llm_ctx.tp_rank != 0:
        return None
    out = {"dp_rank": dp_rank, "logits": full_logits}
    if rank == 0:
        tower_to_hf = native_tower_of(config["model_type"]).hf_module().tower_state_to_hf
        grads = {**tower_to_hf(tower_grads, vlm.tower.arch), **qwen3_vl_text_to_hf(llm_grads, vlm.stage.arch)}
        out.update(loss=float(total), grads=grads)
    return out


# ---------------------------------------------------------------- main side


def deal(count: int, dp: int) -> list[list[int]]:
    """Sample indices per data-parallel rank: round-robin."""
    return [list(range(d, count, dp)) for d in range(dp)]


GDN_GRAD_FLOOR = 5e-4  # the gradients' yardstick floor of a model with Gated DeltaNet layers (module doc)


def verify_hf(path: str, pool, *, tp: int = 1, ep: int = 1, seed: int = 0, tol: float = 1e-5,
              mutate: Callable | None = None) -> dict[str, Any]:
    """Compare the whole VLM at tp x ep with transformers (module doc). ``pool``: a worker pool
    (``mimo.training.launch.WorkerPool``) of at least tp * ep ranks."""
    plan = check_layout(path, tp, ep)
    path, config, weights, ids = plan["path"], plan["config"], plan["weights"], plan["ids"]
    tower_arch, arch = plan["tower_arch"], plan["arch"]
    model_type = config["model_type"]
    moe = arch.moe is not None
    hf = hf_model(path, config, weights, seed, moe)
    text_cfg = hf.config.text_config
    other = [getattr(text_cfg, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    other = [i for v in other for i in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(i, int)]
    tower = plan["tower"]
    samples = random_samples(tower_arch, arch.vocab, ids, seed + 2, count=max(3, ep), other_special=other,
                             videos=tower.videos, resize=tower.image().spec_fields()["resize"])
    pad_id = int(text_ids(arch.vocab, ids, other)[0])  # a text token: never an image / video pad
    merge = tower_arch.spatial_merge
    dealt = deal(len(samples), ep)
    packs = [pack_samples([samples[i] for i in idx], ids, merge, pad_id=pad_id, sample_ids=idx) for idx in dealt]
    num_loss_tokens = sum(p.batch.num_loss_tokens for p in packs)

    inputs = hf_inputs(samples, ids, pad_id, tower, tower_arch)
    lengths = [len(s.tokens) for s in samples]
    ref = hf_run(hf, inputs, lengths, moe)
    with fp64_kept():  # its "fp32" norms, rotary and router softmax fp64 too: the yardstick's fp64 run
        ref64 = hf_run(copy.deepcopy(hf).double(), inputs, lengths, moe)
    hf_loss_count = int((inputs["labels"][:, 1:] != IGNORE).sum())

    with tempfile.TemporaryDirectory(prefix="mimo-verify-hf-") as tmp:
        source = path
        if not weights:
            with _quiet():
                hf.save_pretrained(tmp)
            source = tmp
        results = pool.run(verify_hf_worker, source, config, tp, ep, packs, num_loss_tokens, mutate)
    results = [r for r in results if r is not None]
    head = next(r for r in results if "grads" in r)
    by_dp = {r["dp_rank"]: r["logits"] for r in results}

    ys = Yardstick(tol)
    grad_tol = max(tol, GDN_GRAD_FLOOR) if "gdn" in arch.layer_pattern().kinds else tol
    ys_grad = Yardstick(grad_tol)
    logits_errs: dict[int, float] = {}
    for d, idx in enumerate(dealt):
        cu = packs[d].batch.cu_seqlens.tolist()
        for j, i in enumerate(idx):
            ours = by_dp[d][cu[j]:cu[j] + lengths[i]]
            logits_errs[i] = rel_err(ours, ref["logits"][i])
            ys.check(f"logits of sample {i}", ours, ref["logits"][i], ref64["logits"][i])
    ys.check("loss", head["loss"], ref["loss"], ref64["loss"])
    theirs = set(ref["grads"])
    missing = sorted(theirs - set(head["grads"]))
    if missing:
        raise MimoError(f"the mapped gradients lack Hugging Face parameters {missing[:3]}")
    grad_errs = {}
    for name in ref["grads"]:
        grad_errs[name] = rel_err(head["grads"][name], ref["grads"][name])
        ys_grad.check(f"grad {name}", head["grads"][name], ref["grads"][name], ref64["grads"][name])
    ys.measures += ys_grad.measures  # (each keeps its own bound)

    loss = head["loss"]
    ref_loss, builtin = float(ref["loss"]), float(ref["builtin_loss"])
    builtin_err = abs(builtin - ref_loss) / max(abs(ref_loss), 1e-30)
    labels_agree = builtin_err <= max(tol, 1e-6) and hf_loss_count == num_loss_tokens
    worst_sample = max(logits_errs, key=logits_errs.get)
    worst_grad = max(grad_errs, key=grad_errs.get)
    return {
        "command": "verify-hf",
        "model_type": model_type,
        "architecture": ARCHITECTURES[model_type],
        "text_family": hf_model_type(arch),
        "weights": "checkpoint" if weights else f"random (seed {seed})",
        "tp": tp, "ep": ep,
        "layout": {"world": tp * ep,
                   "llm": {"tp": tp, "dp": ep, "pp": 1, **({"etp": tp, "ep": ep, "edp": 1} if ep > 1 else {})},
                   "tower": {"tp": tp, "dp": ep, "colocated_with": "llm"}},
        "samples": [{"index": i, "tokens": len(s.tokens), "dp_rank": i % ep,
                     "image_grids": [list(v.grid) for v in s.visuals if v.kind == "image"],
                     "video_grids": [list(v.grid) for v in s.visuals if v.kind == "video"]} for i, s in enumerate(samples)],
        "loss_tokens": num_loss_tokens,
        "loss": loss, "hf_loss": ref_loss, "hf_builtin_loss": builtin,
        "loss_rel_err": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
        "labels_agree": labels_agree,
        "max_logits_rel_err": logits_errs[worst_sample], "worst_logits_sample": worst_sample,
        "max_grad_rel_err": grad_errs[worst_grad], "worst_grad": worst_grad, "grads_checked": len(grad_errs),
        "tol": tol, "grad_tol": grad_tol,
        "max_err_vs_fp64": max(m.err for m in ys.measures),
        "hf_fp32_rel_err_vs_fp64": max(m.e1 for m in ys.measures),
        "yardstick": ys.summary(5),
        "tightest": {kind: ys.worst(1, kind)[0].as_dict() for kind in ("logits", "loss", "grad")},
        "ok": ys.ok and labels_agree,
    }

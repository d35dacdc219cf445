"""Encoder verification against the original timm / Hugging Face model (``mimo verify-encoder``, tests).

Every rank of a TP group builds the original (its weights: a checkpoint, or random init from
a fixed seed, which is checked to agree across ranks), imports its state dict into a mimo
tower at the requested TP (position embeddings resampled when the image size differs),
and compares the features on the same random images with the original's own forward
(timm ``forward_features`` / ``forward_intermediates``, HF ``hidden_states``). Optionally the
weight gradients of a random linear loss are compared too, gathered to full tensors and
mapped back to the original's parameter names. Error = ||a - b|| / ||b||, the worst reported.

The verdict is the yardstick of ``mimo.core.testing`` (docs/design.md §9): the original runs in fp64
too (a copy of it, ``.double()``), and our fp32 tower must be within ``max(tol, k * e1)`` of
it, where ``e1`` is the *original's own fp32 run* against its fp64 run: the rounding floor of
the computation itself, measured on every rank beside the reference, without a second mimo run.
``max_rel_err`` stays our error against the fp32 original.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mimo.encoders.config import VitArch
from mimo.encoders.tp_state import full_grads
from mimo.parallel.params import param_table, reduce_partial_grads
from mimo.encoders.vit import VisionTransformer, resolve_feature_layer
from mimo.core.errors import MimoError
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelGrid
from mimo.core.testing import Yardstick, rel_err

__all__ = ["EncoderSource", "parse_feature_layer", "parse_kwargs", "describe_source", "check_request", "preflight",
           "verify_case", "summarise"]

TOL_FP32 = 1e-5


@dataclass(frozen=True)
class EncoderSource:
    """The original model: a timm name (plus create_model kwargs and an optional weights
    file), or a Hugging Face directory (its weights, or random init from its config)."""

    kind: str  # "timm" | "hf"
    name: str  # timm model name, or the HF directory
    kwargs: dict = field(default_factory=dict)  # timm.create_model overrides (small test models)
    weights: str | None = None  # timm: a local weights file
    hf_weights: bool = False  # hf: load the checkpoint's weights (else random from config.json)

    def label(self) -> str:
        if self.kind == "timm":
            extra = f" {self.kwargs}" if self.kwargs else ""
            return f"timm {self.name}{extra}" + (f" weights {self.weights}" if self.weights else "")
        return f"hf {'checkpoint' if self.hf_weights else 'config'} {self.name}"


def parse_feature_layer(text: str) -> int | str:
    if text == "post_norm":
        return text
    try:
        return int(text)
    except ValueError:
        raise MimoError(f"--feature-layer must be an integer or post_norm, got {text!r}") from None


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """``depth=2,embed_dim=48,act_layer=quick_gelu`` -> dict (Python literals, else strings)."""
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise MimoError(f"--timm-kwargs item {item!r} must look like name=value")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def describe_source(source: EncoderSource) -> tuple[VitArch, str]:
    """(architecture, family) of the original, cheaply (timm: a meta-device model; HF: its
    config); raises MimoError for an unknown name, a missing directory or missing weights."""
    if source.kind == "timm":
        from mimo.encoders.timm_import import create_timm_model, timm_arch

        if source.weights is not None and not os.path.isfile(source.weights):
            raise MimoError(f"weights file {source.weights!r} not found")
        return timm_arch(create_timm_model(source.name, device="meta", **source.kwargs)), "timm"
    from mimo.encoders.hf_import import hf_arch, read_hf_config

    family, vision, _ = read_hf_config(source.name)
    if source.hf_weights and not any(
        os.path.isfile(os.path.join(source.name, f)) for f in ("model.safetensors", "model.safetensors.index.json")
    ):
        raise MimoError(f"{source.name!r} has no model.safetensors (or model.safetensors.index.json); use --hf-config for random weights")
    return hf_arch(family, vision), family


def preflight(source: EncoderSource, arch: VitArch) -> None:
    """Check a checkpoint against the tower in this process (MimoError naming the first
    tensor that does not fit), so a bad file fails before any rank starts."""
    if source.kind == "timm" and source.weights is not None:
        from mimo.encoders.timm_import import import_timm_state
        from mimo.encoders.weights import load_state_file

        import_timm_state(load_state_file(source.weights), arch, f"checkpoint {source.weights!r}")
    elif source.kind == "hf" and source.hf_weights:
        from mimo.encoders.hf_import import check_hf_tower, import_hf_state, load_hf_state, read_hf_config

        family, vision, _ = read_hf_config(source.name)
        state = load_hf_state(source.name, shapes_only=True)
        import_hf_state(state, arch, family, f"checkpoint {source.name!r}")
        check_hf_tower(family, vision, state, f"checkpoint {source.name!r}")  # the reference loads every weight too


def check_request(arch: VitArch, tp: int, feature_layer: int | str, image_size: int | None) -> VitArch:
    """The tower's arch at ``image_size``; MimoError for a TP size or layer that cannot work."""
    if tp < 1:
        raise MimoError(f"--tp must be >= 1, got {tp}")
    for name in ("heads", "mlp"):
        if getattr(arch, name) % tp:
            raise MimoError(f"--tp {tp} does not divide the model's {name} ({getattr(arch, name)})")
    resolve_feature_layer(arch.layers, feature_layer)
    if image_size is not None:
        if image_size < arch.patch or image_size % arch.patch:
            raise MimoError(f"--image-size {image_size} must be a positive multiple of the patch size {arch.patch}")
        arch = dataclasses.replace(arch, image_size=image_size)
    return arch


# ---------------------------------------------------------------- on every rank


def _build_original(source: EncoderSource, family: str, seed: int):
    """(model, state dict to import, where) -- the same on every rank."""
    torch.manual_seed(seed)  # random init must agree across ranks
    if source.kind == "timm":
        from mimo.encoders.timm_import import create_timm_model
        from mimo.encoders.weights import load_state_file

        model = create_timm_model(source.name, **source.kwargs)
        if source.weights is not None:
            state = load_state_file(source.weights)
            model.load_state_dict(state)
            return model.eval(), state, f"checkpoint {source.weights!r}"
        return model.eval(), model.state_dict(), f"timm {source.name}"
    from mimo.encoders.hf_import import build_hf_model, load_hf_state, read_hf_config

    _, vision, _ = read_hf_config(source.name)
    if source.hf_weights:
        # the original through HF's own loader; the import reads the files independently
        return build_hf_model(family, vision, source.name), load_hf_state(source.name), f"checkpoint {source.name!r}"
    model = build_hf_model(family, vision)
    return model, model.state_dict(), f"config {source.name!r}"


def _import(family: str, state, arch: VitArch, where: str):
    if family == "timm":
        from mimo.encoders.timm_import import import_timm_state

        return import_timm_state(state, arch, where)
    from mimo.encoders.hf_import import import_hf_state

    return import_hf_state(state, arch, family, where)


def _reference(source, family, model, state, arch_src: VitArch, arch: VitArch):
    """(model, features): ``features(model, pixels, layer) -> [N, L, D]`` computes the
    original's features at ``arch.image_size`` (the model may be a copy in another dtype)."""
    if family == "timm":
        from mimo.encoders.timm_import import create_timm_model, timm_features

        if arch.image_size != arch_src.image_size:
            # timm's own way to run weights at another resolution: a model of that size,
            # loaded through its checkpoint filter (which resamples the position embedding)
            from timm.models.vision_transformer import checkpoint_filter_fn

            torch.manual_seed(0)
            model = create_timm_model(source.name, **{**source.kwargs, "img_size": arch.image_size})
            model.load_state_dict(checkpoint_filter_fn(dict(state), model))
            model.eval()
        return model, timm_features
    from mimo.encoders.hf_import import hf_features

    interpolate = arch.image_size != arch_src.image_size
    return model, lambda m, px, fl: hf_features(m, family, px, fl, interpolate)


def _checksum(state) -> bytes:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().float().contiguous().cpu().numpy().tobytes())
    return h.digest()


def _check_same_in_group(state, group) -> None:
    """Random init must agree on every rank of the TP group (all compare with the same original)."""
    if group is None:
        return
    mine = _checksum(state)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(d != mine for d in everyone):
        raise MimoError("the original model's weights differ across ranks (non-deterministic initialisation)")


def verify_case(
    source: EncoderSource,
    tp: int,
    feature_layers: list,
    image_size: int | None = None,
    seed: int = 0,
    n_images: int = 2,
    grads: bool = False,
    sequence_parallel: bool = False,
    drop_class_token: bool = True,
) -> dict | None:
    """Run on every rank of the world (ranks >= tp sit out and return None).

    Returns ``{"errors": {name: rel_err against the fp32 original}, "measures": the yardstick's
    (``Measure.as_dict()``: against the fp64 original), "rows": rows of the last case,
    "resampled": bool}``.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    grid = ParallelGrid({"tp": tp})
    group = grid.group("tp")  # collective on the whole world the first time
    arch_src, family = describe_source(source)
    if rank not in grid:
        return None
    arch = check_request(arch_src, tp, feature_layers[0], image_size)
    model, state, where = _build_original(source, family, seed)
    _check_same_in_group(state, group)
    ctx = ParallelContext.for_tp(group, sequence_parallel)
    weights = _import(family, state, arch, where)
    ref_model, features = _reference(source, family, model, state, arch_src, arch)
    ref64_model = copy.deepcopy(ref_model).double()
    ref_params, ref64_params = dict(ref_model.named_parameters()), dict(ref64_model.named_parameters())
    prefix = weights.meta.get("prefix", "")
    # the reference's own prefix of the tower (HF: "vision_model."), where the source's differs (a LLaVA tower)
    ref_prefix = next((k[: -len("embeddings.patch_embedding.weight")] for k in ref_params
                       if k.endswith("embeddings.patch_embedding.weight")), "")

    def ref_name(key: str) -> str | None:
        if key in ref_params:
            return key
        for ours in dict.fromkeys(["", ref_prefix]):
            if prefix and key.startswith(prefix) and ours + key[len(prefix):] in ref_params:
                return ours + key[len(prefix):]
        return None

    gen = torch.Generator().manual_seed(seed + 1)
    pixels = torch.randn(n_images, arch.channels, arch.image_size, arch.image_size, generator=gen)
    errors: dict[str, float] = {}
    ys = Yardstick(TOL_FP32)
    rows = 0
    for fl in feature_layers:
        tower = VisionTransformer(arch, fl, drop_class_token=drop_class_token, ctx=ctx)
        tower.load_weights_(weights)
        with torch.set_grad_enabled(grads):
            ours_TD = tower(pixels)
            ref_TD, ref64_TD = (
                (f_NLD[:, 1:] if tower.drop_class_token else f_NLD).reshape(-1, arch.hidden)
                for f_NLD in (features(ref_model, pixels, fl), features(ref64_model, pixels.double(), fl))
            )
        rows = ours_TD.shape[0]
        errors[f"features[{fl}]"] = rel_err(ours_TD, ref_TD)
        ys.check(f"features[{fl}]", ours_TD, ref_TD, ref64_TD)
        if not grads:
            continue
        dY = torch.randn(ref_TD.shape, generator=gen)
        ref_model.zero_grad(set_to_none=True)
        ref64_model.zero_grad(set_to_none=True)
        (ours_TD * dY).sum().backward()
        (ref_TD * dY).sum().backward()
        (ref64_TD * dY.double()).sum().backward()
        reduce_partial_grads(param_table(tower))  # SP norm weights: partial over TP, as training sums them once per step
        ours = full_grads(tower)
        for rule in weights.rules:
            if rule.ours not in ours or (rule.ours == "pos_embed" and weights.resampled and family != "timm"):
                continue  # HF interpolates inside its forward: its gradient is w.r.t. the old grid
            # compared as mimo tensors: HF's k_proj.bias alone has a zero gradient in exact
            # arithmetic (softmax ignores a shift shared by all keys), only rounding noise
            want, want64 = [], []
            for key in rule.theirs:
                name = ref_name(key)
                if name is None:
                    raise MimoError(f"no parameter of the original matches {key!r}")
                for params, out in ((ref_params, want), (ref64_params, want64)):
                    p = params[name]
                    out.append(p.grad if p.grad is not None else torch.zeros_like(p))
            key = f"grad[{fl}] {rule.ours}"
            errors[key] = rel_err(ours[rule.ours], rule.to_ours(want))
            ys.check(key, ours[rule.ours], rule.to_ours(want), rule.to_ours(want64))
    return {"errors": errors, "measures": [m.as_dict() for m in ys.measures], "rows": rows,
            "resampled": bool(weights.resampled)}


def summarise(results: list[dict | None], tol: float = TOL_FP32) -> dict:
    """Over the ranks: the worst error against the fp32 original (``max_rel_err``, ``worst``),
    the yardstick's verdict (``ok``) and its tightest tensors (``yardstick``)."""
    worst, worst_key = 0.0, ""
    ys = Yardstick(tol)
    for rank, r in enumerate(results):
        if not r:
            continue
        for key, err in r["errors"].items():
            if err > worst or not worst_key:
                worst, worst_key = err, f"rank {rank}: {key}"
        ys.extend(r["measures"], prefix=f"rank {rank}: ")
    first = next(r for r in results if r)
    return {"max_rel_err": worst, "worst": worst_key, "rows": first["rows"], "tol": tol,
            "max_rel_err_vs_fp64": max((m.err for m in ys.measures), default=0.0),
            "reference_rel_err_vs_fp64": max((m.e1 for m in ys.measures), default=0.0),
            "yardstick": ys.summary(5), "ok": ys.ok and bool(ys.measures)}

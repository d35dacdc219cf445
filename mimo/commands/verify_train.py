"""``mimo verify-train``: a config's layout against the one-process reference, step by step.

Both runs start from the same weights (layout-independent init) and see the same global
microbatches (the plan depends on the data config alone). Per step they report the loss, the
global gradient norm and every gradient gathered to full tensors *before* clipping; after
the last step every parameter. Errors are ||a-b|| / ||b||; the report keeps the largest.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

from mimo.compose.config import MimoConfig, load_config
from mimo.core.testing import rel_err


def one_process(config: MimoConfig) -> MimoConfig:
    """The same model and data on one rank: every module tp=cp=dp=pp=1."""
    ref = copy.deepcopy(config)
    ref.world_size = 1
    for module in ref.modules.values():
        module.parallel = dataclasses.replace(module.parallel, tp=1, cp=1, dp=1, pp=1, ep=1, etp=1, ranks="0:1", sequence_parallel=False)
    return ref


def _reporter(model, grid) -> bool:
    """One rank per (module, pipeline stage) reports full tensors: TP, CP and DP rank 0."""
    c = grid.coords(model.rank)
    return all(c.get(d, 0) == 0 for d in ("tp", "cp", "dp"))


def train_case(config_path: str, overrides: list[str], steps: int, reference: bool, device: str = "cpu",
               precision: str = "fp32") -> dict:
    """Runs on every rank of a worker pool: ``steps`` training steps, recording what to compare.
    ``device``: ``cuda`` runs on the rank's GPU (TF32 off); ``precision``: the layout run's
    (bf16 takes the GPU fast paths); the reference always runs fp32."""
    from mimo.training.optim import PrecisionPolicy
    from mimo.training.run import build_run
    from mimo.training.step import train_step
    from mimo.core.testing import rank_device

    config = load_config(config_path, overrides)
    if reference:
        config, precision = one_process(config), "fp32"
    # `mimo train`'s assembly
    run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named(precision), device=rank_device(device))
    model, pipeline, optimizers = run.model, run.pipeline, run.optimizers
    record = {"steps": []}

    def grab(model, norm):
        full = model.full_grads()  # collective over each TP group
        mine = {}
        for name, tensors in full.items():
            grid = model.llm_grid if name == model.llm_name else model.encoders[name].grid
            if _reporter(model, grid):
                mine[name] = tensors
        record["steps"][-1].update(grad_norm=norm, grads=_to_cpu(mine))

    for step in range(1, steps + 1):
        record["steps"].append({})
        result = train_step(model, pipeline, step, optimizers, run.policy, on_grads=grab)
        record["steps"][-1].update(loss=result.loss, loss_tokens=result.loss_tokens)
    full = model.full_params()
    record["params"] = _to_cpu({
        name: tensors for name, tensors in full.items()
        if _reporter(model, model.llm_grid if name == model.llm_name else model.encoders[name].grid)
    })
    pipeline.close()
    return record


def _to_cpu(by_module: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 CPU copies: results travel back to the launcher, which must not touch a GPU."""
    return {m: {n: t.detach().float().cpu() for n, t in tensors.items()} for m, tensors in by_module.items()}


def _merge(per_rank: list[dict], key) -> dict[str, dict[str, torch.Tensor]]:
    """Union over reporting ranks (pipeline stages hold different layers)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in per_rank:
        for module, tensors in key(r).items():
            out.setdefault(module, {}).update(tensors)
    return out


def compare(layout: list[dict], reference: list[dict], tol: float, per_module: bool = False) -> dict:
    """Largest errors against the reference. ``per_module``: gradients and parameters are
    compared as one vector per module (bf16 checks: a tensor whose reference is near zero, a
    norm bias after two Adam steps, has a large error of its own in bf16 that says nothing
    about the layout); the per-tensor maxima are still reported, as ``max_tensor_*``."""
    ref = reference[0]
    worst = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "params": 0.0}
    tensor_worst = {"grads": 0.0, "params": 0.0}
    where = {}

    def bump(kind, err, name, table=worst, prefix=""):
        if err > table[kind] or prefix + kind not in where:
            table[kind] = max(table[kind], err)
            if err >= table[kind]:
                where[prefix + kind] = name

    def tensors(kind, got, want, label):
        for module, ts in want.items():
            for name, t in ts.items():
                bump(kind, rel_err(got[module][name], t), f"{label}{module}.{name}", *((tensor_worst, "tensor_") if per_module else ()))
            if per_module:
                flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(ts)])  # noqa: E731
                bump(kind, rel_err(flat(got[module]), flat(ts)), f"{label}{module}")

    for i, want in enumerate(ref["steps"]):
        got = layout[0]["steps"][i]
        bump("loss", abs(got["loss"] - want["loss"]) / max(abs(want["loss"]), 1e-30), f"step {i + 1}")
        bump("grad_norm", abs(got["grad_norm"] - want["grad_norm"]) / max(want["grad_norm"], 1e-30), f"step {i + 1}")
        tensors("grads", _merge(layout, lambda r: r["steps"][i].get("grads", {})), want["grads"], f"step {i + 1} ")
    tensors("params", _merge(layout, lambda r: r["params"]), ref["params"], "")
    report = {f"max_{k}_rel_err": v for k, v in worst.items()}
    if per_module:
        report.update({f"max_tensor_{k}_rel_err": v for k, v in tensor_worst.items()})
    report["worst"] = where
    report["losses"] = [s["loss"] for s in layout[0]["steps"]]
    report["reference_losses"] = [s["loss"] for s in ref["steps"]]
    report["ok"] = all(v <= tol for v in worst.values())
    return report

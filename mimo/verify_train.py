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

from mimo.config import MimoConfig, load_config
from mimo.testing import rel_err


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


def train_case(config_path: str, overrides: list[str], steps: int, reference: bool) -> dict:
    """Runs on every rank of a worker pool: ``steps`` training steps, recording what to compare."""
    from mimo.optim import PrecisionPolicy
    from mimo.run import build_run
    from mimo.step import train_step

    config = load_config(config_path, overrides)
    if reference:
        config = one_process(config)
    run = build_run(config, dist.get_rank(), policy=PrecisionPolicy.named("fp32"))  # `mimo train`'s assembly; checks run fp32
    model, pipeline, optimizers = run.model, run.pipeline, run.optimizers
    record = {"steps": []}

    def grab(model, norm):
        full = model.full_grads()  # collective over each TP group
        mine = {}
        for name, tensors in full.items():
            grid = model.llm_grid if name == model.llm_name else model.encoders[name].grid
            if _reporter(model, grid):
                mine[name] = tensors
        record["steps"][-1].update(grad_norm=norm, grads=mine)

    for step in range(1, steps + 1):
        record["steps"].append({})
        result = train_step(model, pipeline, step, optimizers, on_grads=grab)
        record["steps"][-1].update(loss=result.loss, loss_tokens=result.loss_tokens)
    full = model.full_params()
    record["params"] = {
        name: tensors for name, tensors in full.items()
        if _reporter(model, model.llm_grid if name == model.llm_name else model.encoders[name].grid)
    }
    pipeline.close()
    return record


def _merge(per_rank: list[dict], key) -> dict[str, dict[str, torch.Tensor]]:
    """Union over reporting ranks (pipeline stages hold different layers)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in per_rank:
        for module, tensors in key(r).items():
            out.setdefault(module, {}).update(tensors)
    return out


def compare(layout: list[dict], reference: list[dict], tol: float) -> dict:
    ref = reference[0]
    worst = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "params": 0.0}
    where = {}

    def bump(kind, err, name):
        if err > worst[kind] or kind not in where:
            worst[kind] = max(worst[kind], err)
            if err >= worst[kind]:
                where[kind] = name

    for i, want in enumerate(ref["steps"]):
        got = layout[0]["steps"][i]
        bump("loss", abs(got["loss"] - want["loss"]) / max(abs(want["loss"]), 1e-30), f"step {i + 1}")
        bump("grad_norm", abs(got["grad_norm"] - want["grad_norm"]) / max(want["grad_norm"], 1e-30), f"step {i + 1}")
        grads = _merge(layout, lambda r: r["steps"][i].get("grads", {}))
        for module, tensors in want["grads"].items():
            for name, t in tensors.items():
                bump("grads", rel_err(grads[module][name], t), f"step {i + 1} {module}.{name}")
    params = _merge(layout, lambda r: r["params"])
    for module, tensors in ref["params"].items():
        for name, t in tensors.items():
            bump("params", rel_err(params[module][name], t), f"{module}.{name}")
    report = {f"max_{k}_rel_err": v for k, v in worst.items()}
    report["worst"] = where
    report["losses"] = [s["loss"] for s in layout[0]["steps"]]
    report["reference_losses"] = [s["loss"] for s in ref["steps"]]
    report["ok"] = all(v <= tol for v in worst.values())
    return report

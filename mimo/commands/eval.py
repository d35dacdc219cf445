"""``mimo eval``: held-out loss and exact-match accuracy of greedy answers, at the config's layout.

The launcher resolves the checkpoint (a ``step-N`` folder, or a folder of them: its latest),
compares its layout with the config's before any process starts (another one: resharded on
load, with a warning), indexes the held-out shards (``eval.shards`` or ``--shards``) and runs ``eval_rank`` on ``world_size`` local processes.
Every rank builds the model exactly as training does (``mimo.compose.model``; on its own GPU
with ``--device cuda``, as ``mimo train``), loads its shards, and evaluates it
(``mimo.training.evaluation.Evaluator``).

Loss, generation and exact match: ``mimo.training.evaluation`` (shared with ``eval.every``
during ``mimo train``).
"""

from __future__ import annotations

import logging

from mimo.compose.config import load_config
from mimo.core.errors import ConfigError
from mimo.training.evaluation import (  # noqa: F401 (the matching helpers, importable from here as before)
    COUNTS, EXAMPLES, EvalRequest, Evaluator, cut_at, end_marker, exact_match, last_answer, normalise, request_for,
    subset_blocks,
)

log = logging.getLogger("mimo.commands.eval")


# ---------------------------------------------------------------- launcher


def evaluate(config_path: str, overrides: list[str], checkpoint: str | None = None, shards: str | None = None,
             timeout_s: float = 900.0, device: str = "auto") -> dict:
    """``mimo eval``: the result dict (loss, exact_match, counts, examples); ``checkpoint``
    defaults to ``train.checkpoint.dir``; ``device`` as for ``mimo train`` (``cuda``: one GPU
    per rank; ``auto``: cuda when there is a GPU for every rank, else cpu)."""
    from mimo.compose.inputs import ensure_index
    from mimo.training.launch import WorkerPool, resolve_device
    from mimo.training.train import under_torchrun

    if under_torchrun():  # each torchrun process would start a whole world of its own
        raise ConfigError("mimo eval starts its own local processes (world_size of them); run it without torchrun")
    config = load_config(config_path, overrides)
    config.require_trainable()  # (a native-resolution encoder cannot take synthetic data; request_for checks the rest)
    req = request_for(config, checkpoint or config.train.checkpoint.dir, shards)
    device = resolve_device(device, config.world_size)
    ensure_index(config, shards=req.shards)  # once, before any rank reads it
    with WorkerPool(config.world_size, timeout_s=timeout_s, device=device) as pool:
        results = pool.run(eval_rank, config_path, list(overrides), req, device)
    return summarise(results, req)


def summarise(results: list[dict], req: EvalRequest) -> dict:
    """Per-rank counts summed (each sample is scored by exactly one rank)."""
    total = {k: sum(r[k] for r in results) for k in COUNTS}
    head = results[0]
    examples = [e for r in results for e in r["examples"]]
    examples = [e for e in examples if e["match"]][:EXAMPLES] + [e for e in examples if not e["match"]][:EXAMPLES]
    return {
        "ok": True, "command": "eval", "loss": head["loss"], "loss_tokens": head["loss_tokens"],
        "exact_match": total["matched"] / total["scored"] if total["scored"] else None,
        "samples": head["samples"], "scored": total["scored"], "matched": total["matched"],
        "captions": total["captions"], "read_failures": total["read_failures"],
        "skipped": head["skipped"], "generated_tokens": total["generated_tokens"],
        "checkpoint": req.checkpoint, "checkpoint_step": head["checkpoint_step"], "shards": req.shards,
        "max_new_tokens": req.max_new_tokens, "examples": examples,
    }


# ---------------------------------------------------------------- one rank


def eval_rank(config_path: str, overrides: list[str], req: EvalRequest, device: str = "cpu") -> dict:
    """Runs on every rank of the world (a WorkerPool worker with its group up, started for
    ``device``: ``cpu`` or ``cuda``, the rank's GPU)."""
    import torch.distributed as dist

    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import load_checkpoint
    from mimo.training.launch import rank_compute_device

    config = load_config(config_path, overrides)
    model = MimoModel(config, dist.get_rank(), device=rank_compute_device(device))
    meta = load_checkpoint(model, req.checkpoint, rng=False) if req.checkpoint else {"step": 0}
    evaluator = Evaluator(config, model, req)
    try:
        return {**evaluator.run(), "checkpoint_step": meta["step"]}
    finally:
        evaluator.close()

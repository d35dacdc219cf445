"""``mimo convert-checkpoint CKPT --config NEW.yaml --out DIR``: a checkpoint rewritten at another layout, offline.

The new config's ranks run as local processes (CPU, gloo): each builds its part of the model and
its optimizers at the new layout (no data is read), loads CKPT resharded
(``mimo.training.reshard``: weights, optimizer states, step counts, balancing buffers) and
writes it at the same step under DIR, as training would have written it at that layout. A run
at the new layout then resumes from DIR (``--resume-from DIR``, or DIR as its
``train.checkpoint.dir``) without resharding. A module whose optimizer state the checkpoint does
not hold (frozen, or weights only such as an imported model) is converted weights only.
"""

from __future__ import annotations

import os
import re

from mimo.compose.config import load_config
from mimo.core.errors import CheckpointError
from mimo.training.train import changed_keys, plain_config

_MODEL_KEY = re.compile(r"^modules\.[^.]+\.(kind|arch|projector)(\.|$)")  # what decides the tensors a module has


def convert_checkpoint(checkpoint: str, config_path: str, overrides: list[str], out: str, timeout_s: float = 900.0) -> dict:
    from mimo.training.checkpoint import check_layout, layout_of, read_meta, resolve_checkpoint, step_dir
    from mimo.training.launch import WorkerPool
    from mimo.training.reshard import holds_state

    config = load_config(config_path, overrides)
    source = resolve_checkpoint(os.path.abspath(checkpoint))
    meta = read_meta(source)
    check_layout(meta, config, source)  # the same modules, before any process starts
    other = [k for k in changed_keys(meta.get("config", {}), plain_config(config)) if _MODEL_KEY.match(k)]
    if other:
        raise CheckpointError(f"{source}: written for another model ({', '.join(other[:4])} differ from the config); "
                              "convert-checkpoint changes the layout only")
    out = os.path.abspath(out)
    target = step_dir(out, meta["step"])
    if os.path.abspath(source) == target:
        raise CheckpointError(f"--out {out}: would overwrite the checkpoint being converted ({source}); name another folder")
    if os.path.exists(target):
        raise CheckpointError(f"--out {out}: already holds {os.path.basename(target)}; name another folder (or remove it)")
    with_state = sorted(m for m in config.modules if holds_state(meta["files"], m))
    with WorkerPool(config.world_size, timeout_s=timeout_s) as pool:
        path = pool.run(_convert_rank, source, config_path, list(overrides), out, with_state)[0]
    print(f"wrote {path} (layout {layout_of(config)}), converted from {source}")
    return {"ok": True, "command": "convert-checkpoint", "checkpoint": source, "out": path, "step": meta["step"],
            "layout": layout_of(config), "from_layout": meta["layout"]}


def _convert_rank(source: str, config_path: str, overrides: list[str], out: str, with_state: list[str]) -> str:
    """Rank function: load ``source`` at the config's layout, write it to ``out``; ``with_state``:
    the modules whose optimizer state the checkpoint holds."""
    import torch.distributed as dist

    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import load_checkpoint, save_checkpoint
    from mimo.training.optim import model_optimizers
    from mimo.training.precision import PrecisionPolicy

    config = load_config(config_path, overrides)
    policy = PrecisionPolicy.named(config.train.precision, config.train.grad_reduce)
    model = MimoModel(config, dist.get_rank(), dtype=policy.params)
    optimizers = {m: opt for m, opt in model_optimizers(config, model, policy).items() if m in with_state}
    meta = load_checkpoint(model, source, optimizers)
    return save_checkpoint(model, optimizers, meta["step"], out, extra_meta={"converted_from": source})

"""Loading a reference model's weights with every tensor accounted for (the verify commands'
Hugging Face references: a weight silently left at its random initialisation would make the
comparison meaningless)."""

from __future__ import annotations

from typing import Mapping

import torch

from mimo.core.errors import MimoError


def load_exactly_(model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str,
                  source_name=lambda key: key, may_miss: tuple[str, ...] = ()) -> None:
    """Load ``state`` (by ``model``'s own keys; keys it does not have stay as they are) into
    ``model`` with every weight accounted for: a missing, unexpected or misfit tensor is a
    MimoError naming it (``source_name``: a model key as the checkpoint spells it), never a
    weight left at its random initialisation. ``may_miss``: keys a checkpoint may leave out
    (a tied head, re-tied after loading)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and k not in may_miss]
    unexpected = [k for k in state if k not in own]
    misfit = [f"{source_name(k)} {tuple(state[k].shape)} (the model's is {tuple(own[k].shape)})"
              for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)]

    def listed(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    problems = ([f"missing {listed([source_name(k) for k in missing])}"] if missing else []) + (
        [f"unexpected {listed(unexpected)}"] if unexpected else []) + ([f"misfit {listed(misfit)}"] if misfit else [])
    if problems:
        raise MimoError(f"{where}: the weights do not fit {type(model).__name__} exactly: {'; '.join(problems)} "
                        f"(a reference with weights left at random would not be the checkpoint's model)")
    with torch.no_grad():
        model.load_state_dict(dict(state), strict=False)
    if may_miss and hasattr(model, "tie_weights"):
        model.tie_weights()

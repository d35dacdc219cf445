"""Activation recompute: run a piece of the forward without keeping what it saves for backward,
and run it again in backward (``torch.utils.checkpoint``, non-reentrant).

``train.recompute`` (per module: ``modules.<name>.recompute``) chooses, for the first
``recompute_layers`` layers of each pipeline stage (or ViT blocks; all when unset):

* ``full``: each such layer's forward is recomputed whole; only its input is kept;
* ``selective``: inside each such layer the cheap, memory-heavy parts are (``selective`` set on
  its modules, each of which asks ``maybe``): pre-norms, the attention core (from q, k, v to its
  output, RoPE included), the MLP / expert / shared-expert activations, and the MoE permutation
  (the gathered rows of a local dispatch together with the experts' up projection, and the
  gated sum back per token);
* ``none``.

A recomputed forward must compute what the first one did and change nothing twice. What a
forward reads from state that later forwards change (the global aux loss's running counts) or
from a collective it need not repeat goes through ``stash``: the first run records the value,
the recompute reads it back. What a forward adds to step accumulators (the MoE routers' token
counts, quantiles, aux values) is added only when ``replaying()`` is false. The recompute does
repeat the communication inside the piece (TP gathers, the MoE all-to-all), as every rank of
those groups recomputes the same piece at the same point of the schedule.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

__all__ = ["RECOMPUTE_MODES", "checkpoint", "maybe", "replaying", "stash", "set_selective", "set_block_recompute"]

RECOMPUTE_MODES = ("none", "selective", "full")


class _Stash:
    def __init__(self):
        self.values: list = []
        self.replaying = False
        self.at = 0


class _Current:
    """The checkpointed piece running now (None: none). A plain attribute, not a ContextVar:
    torch.compile (2.11) breaks its graph at a ContextVar read but guards a global's attribute.
    Forwards and their recomputes run one at a time (the schedule's thread, or autograd's
    during that thread's backward), so one slot serves."""

    stash: _Stash | None = None


_CURRENT = _Current()


def checkpoint(fn, *args):
    """``fn(*args)``, its saved activations dropped and recomputed in backward (see module doc)."""
    record = _Stash()

    def run(*a):
        outer, _CURRENT.stash = _CURRENT.stash, record
        try:
            return fn(*a)
        finally:
            _CURRENT.stash = outer
            record.replaying, record.at = True, 0  # the next run of this piece is its recompute

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def maybe(recompute: bool, fn, *args):
    """``fn(*args)``, recomputed in backward when ``recompute`` (a selective piece: nothing in it
    reads moving state or adds to accumulators, so no stash). Plain ``torch.utils.checkpoint``,
    which ``torch.compile`` traces into the compiled layer (its partitioner does the recompute),
    where the stash's context variable would break the graph. A layer is recomputed whole or by
    pieces, never both (``set_recompute``)."""
    if recompute and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def replaying() -> bool:
    """Whether the running forward is a recompute (step accumulators must not count it again)."""
    s = _CURRENT.stash
    return s is not None and s.replaying


def stash(compute):
    """``compute()`` in a first forward (recorded when it is a checkpointed piece's), the
    recorded value in its recompute."""
    s = _CURRENT.stash
    if s is None:
        return compute()
    if s.replaying:
        value = s.values[s.at]
        s.at += 1
        return value
    value = compute()
    s.values.append(value)
    return value


def set_selective(module: torch.nn.Module, on: bool = True) -> None:
    """Mark every submodule of ``module`` selective (those that know what to recompute ask it)."""
    for m in module.modules():
        m.selective = on


def set_block_recompute(blocks, mode: str, layers: int | None = None) -> None:
    """Recompute ``mode`` for the first ``layers`` of ``blocks`` (all when None), none for the
    rest: ``full`` marks a block ``recompute_full`` (its owner runs it under ``checkpoint``),
    ``selective`` its memory-heavy cheap parts (``set_selective``), ``none`` neither."""
    blocks = list(blocks)
    chosen = {id(b) for b in blocks[:layers]}
    for block in blocks:
        on = id(block) in chosen
        block.recompute_full = on and mode == "full"
        set_selective(block, on and mode == "selective")

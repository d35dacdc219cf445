"""A rank's trace of a training step (``train_step(trace=True)``; ``train.trace_steps`` makes
``mimo train`` write it) and its Chrome trace JSON, for Perfetto or chrome://tracing.

A rank's events, in order: dicts with tick, kind, microbatch (None for buckets), module, time
(when it ended) and, for spans, start. Kinds: forward / backward (this rank's LLM stage; with
stage, and alive: microbatches whose activations it holds), send / recv (stage to stage, with
peer), encoder_fwd, bridge_fwd, bridge_bwd, encoder_bwd, send_wait (waiting for a
microbatch's bridge sends posted earlier), bucket_reduce_start / bucket_reduce_end (bucket, numel).
"""

from __future__ import annotations

import json
import os
import time

Trace = list


def note(trace: Trace | None, tick: int | None, kind: str, microbatch: int | None, module: str, **extra) -> None:
    """Append an event to ``trace`` (nothing when it is None). ``time``: when the event ended
    (``start``: when it began, for spans), in ``time.perf_counter()`` seconds: the host's
    monotonic clock, comparable between the processes of one machine."""
    if trace is not None:
        trace.append({"tick": tick, "kind": kind, "microbatch": microbatch, "module": module, "time": time.perf_counter(), **extra})


def chrome_trace(events: Trace, rank: int) -> list[dict]:
    """A rank's events in the Chrome trace event format (Perfetto, chrome://tracing): spans as
    complete events, the rest as instants, times in microseconds of the host clock; one process
    per rank (traces of several ranks concatenate), one thread per module."""
    modules = list(dict.fromkeys(e["module"] for e in events))
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}]
    out += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": m}} for i, m in enumerate(modules)]
    for e in events:
        name = e["kind"] if e["microbatch"] is None else f"{e['kind']} {e['microbatch']}"
        args = {k: v for k, v in e.items() if k not in ("kind", "module", "time", "start")}
        base = {"name": name, "pid": rank, "tid": modules.index(e["module"]), "args": args}
        if "start" in e:
            out.append({**base, "ph": "X", "ts": e["start"] * 1e6, "dur": (e["time"] - e["start"]) * 1e6})
        else:
            out.append({**base, "ph": "i", "s": "t", "ts": e["time"] * 1e6})
    return out


def write_trace(events: Trace, rank: int, path: str) -> None:
    """``chrome_trace`` of ``events`` as a JSON file (directories created)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": chrome_trace(events, rank), "displayTimeUnit": "ms"}, f)

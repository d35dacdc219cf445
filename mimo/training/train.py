"""``mimo train``: launch the ranks, train, report, checkpoint, resume.

Launching. Without torchrun, ``train`` validates the config, prepares a missing data index
(once, here), and starts ``world_size`` local processes over gloo through
``mimo.training.launch.WorkerPool`` — the same machinery as the verify commands: an exception on any
rank, or a rank dying, ends every rank and reports that rank's message. Under ``torchrun``
(any number of nodes) or as one of several ``srun`` tasks (``mimo.training.cluster``: the
environment each sets, mapped to RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) this
process is one rank: rank 0 prepares the index and the run directory (a filesystem every node
sees), and the first rank that fails posts its message in the rendezvous store, which ends every
other rank with it (a rank that vanished without one, its node killed, is named as such).
Either way a collective that does not complete within ``--timeout`` seconds raises on the ranks
waiting in it (the process group's timeout), which ends the run with a message naming the rank
and step.

Stopping. SIGINT / SIGTERM / SIGHUP (or ``--stop-at STEP``, or rank 0's stdout closing: a pipe
to ``head``, a closed terminal) stop cleanly: every rank finishes the
current step, a checkpoint is written, and a later ``mimo train`` with the same config resumes
from it. The stop request travels in the per-step statistics all-gather, so all ranks stop
after the same step. A second Ctrl-C to the launcher aborts at once.

Run directory (``--run-dir``; default: ``runs/<config file name>/``, or the parent of
``train.checkpoint.dir`` where the config sets it, e.g. ``runs/demo`` for ``runs/demo/ckpt``;
unset, checkpoints go to ``<run dir>/checkpoints``): ``config.yaml`` (the resolved config),
``metrics.jsonl`` (one JSON object per step, rank 0), ``logs/rank<N>.log``, ``tensorboard/``
(when the tensorboard package is installed), and (by default) the checkpoints. On resume,
metrics of steps after the checkpoint (done by the interrupted run, about to be redone) are
dropped, so the file always reads as one run.

Resuming is automatic: ``mimo train`` continues from the newest usable checkpoint in
``train.checkpoint.dir`` (complete, every file there and readable; a newer damaged one is skipped
with a warning naming its bad file), or from ``--resume-from DIR`` (a ``step-N`` folder: an error
when it is damaged). The launcher picks it before any process starts and every rank loads that
one. A checkpoint written at another layout (any module's tp, pp, dp, cp, ep, etp, gtp, its
ranks, the distributed optimizer) is resharded on load, with a warning; a config that differs
otherwise (``train.checkpoint`` and data loader settings aside) is resumed with a
warning naming the keys, as it will not reproduce an uninterrupted run.

Exact resume: the step number fixes the data (docs/design.md §2), the learning rate is a function of
the step, and the checkpoint holds parameters, optimizer states and RNG; a resumed run
therefore computes the uninterrupted run's steps bit for bit (CPU, fp32).

Non-finite steps: a step whose loss or gradient norm is not finite (the same on every rank:
both are world-wide) ends the run with exit status 2 and no checkpoint of it
(``train.on_nonfinite: stop``), or is not applied (``skip_step``: counted in metrics.jsonl).

Test hook: ``MIMO_TRAIN_FAULT=KIND:RANK:STEP`` makes rank RANK, at step STEP, ``raise`` an
exception, ``nan`` (one of its weights NaN during that step), ``hang`` (stop responding before
the step's collectives), or ``stall-save`` (stop
after writing its checkpoint files, before the checkpoint is committed; with
``train.checkpoint.async_save`` the rank's background writer stalls, before its done mark,
and training goes on until the next save waits for it).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

from mimo.compose.config import MimoConfig, load_config
from mimo.core.errors import ConfigError, DistributedError, TrainingError
from mimo.training.cluster import TORCHRUN_ENV  # noqa: F401  (tests keep a child's environment free of them)
from mimo.training.cluster import ClusterRank, FailureNotice, detect, end_with_launcher, is_communication_failure, one_line

log = logging.getLogger("mimo.training.train")

FAULT_ENV = "MIMO_TRAIN_FAULT"
# a clean stop (the step finished, a checkpoint written): Ctrl-C, a scheduler's TERM, a closed terminal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class TrainOptions:
    run_dir: str | None = None  # None: the parent of train.checkpoint.dir (runs/<config name>/checkpoints when unset)
    timeout_s: float = 900.0  # how long one collective may wait
    stop_at: int | None = None  # stop cleanly (checkpointed) after this step
    log_every: int = 1  # progress lines when stdout is not a terminal
    device: str = "auto"  # cpu | cuda (one GPU per rank) | auto (cuda when there is a GPU per rank)
    resume_from: str | None = None  # --resume-from; once picked before the start: the checkpoint every rank loads


def default_run_dir(config: MimoConfig) -> str:
    return os.path.dirname(os.path.abspath(config.train.checkpoint.dir))


def under_torchrun() -> bool:
    """This process is one rank of a run started by torchrun or srun (``mimo.training.cluster``)."""
    return detect() is not None


# ---------------------------------------------------------------- the command (launcher side)


def train(config_path: str, overrides: list[str], options: TrainOptions) -> dict:
    """``mimo train CONFIG [key=value ...]``; returns the summary printed as the last line."""
    config = load_config(config_path, overrides, run_dir=options.run_dir)
    config.require_trainable()  # (a native-resolution encoder has no data path yet)
    if options.timeout_s <= 0 or options.log_every < 1:
        raise ConfigError("--timeout must be > 0 and --log-every >= 1")
    if options.stop_at is not None and not 1 <= options.stop_at <= config.train.steps:
        raise ConfigError(f"--stop-at {options.stop_at}: must be a step in 1..train.steps={config.train.steps}")
    options = replace(options, run_dir=os.path.abspath(options.run_dir or default_run_dir(config)))
    place = detect()  # torchrun's or srun's environment; a ConfigError when half of it is there
    if place is not None:
        return _train_under_launcher(place, config_path, overrides, config, options)
    handler = _launcher_logging()
    try:
        options = replace(options, resume_from=_resume_point(config, options))
        done = _preflight(config, options)
        if done is not None:
            return done
        from mimo.compose.inputs import ensure_index
        from mimo.compose.preflight import check_inputs
        from mimo.training.launch import WorkerPool, resolve_device
        from mimo.training.metrics import check_reporting

        options = replace(options, device=resolve_device(options.device, config.world_size))
        check_inputs(config, samples=0, echo=log.info)  # init.hf checkpoints and the tokenizer, before any rank starts
        log.info("indexing data (%s)", config.data.shards)
        index, status = ensure_index(config)  # once, before any rank reads it
        check_reporting(config)  # train.log.wandb's package; eval.every's held-out index
        log.info("data index %s%s", status, "" if index is None else f": {len(index.entries)} samples")
        _prepare_run_dir(config, options.run_dir, config_path, overrides)
        account_for_data(config, index, status, options.run_dir)
        log.info("starting %d ranks (%s) to train %s; run directory %s", config.world_size, options.device, config_path,
                 options.run_dir)
        with _stop_on_signals(), WorkerPool(config.world_size, timeout_s=math.inf, collective_timeout_s=options.timeout_s,
                                            device=options.device) as pool:
            try:
                results = pool.run(train_rank, config_path, list(overrides), options)
            except DistributedError as e:
                raise DistributedError(_short_failure(str(e), options.run_dir)) from None
        return _summary(results[0])
    finally:
        logging.getLogger("mimo").removeHandler(handler)


def _short_failure(message: str, run_dir: str) -> str:
    """'train_rank: rank 2 failed:\n<traceback>' -> 'rank 2 failed: <the exception line> (traceback in
    logs/rank2.log)': the cause, without a wall of traceback (the rank logged it in full)."""
    m = re.match(r"^.*?(rank (\d+) failed):\n(.*)$", message, re.S)
    if not m:
        return message
    head, rank, trace = m.groups()
    last = [line for line in trace.strip().splitlines() if line.strip()][-1]
    last = re.sub(r"^[\w.]+\.(\w+: )", r"\1", last)  # mimo.core.errors.DistributedError: -> DistributedError:
    return f"{head}: {last} (traceback in {os.path.join(run_dir, 'logs', f'rank{rank}.log')})"


def _resume_point(config: MimoConfig, options: TrainOptions) -> str | None:
    """The checkpoint to continue from, checked readable: ``--resume-from``'s (an error when it
    is not usable), else the newest usable one in train.checkpoint.dir; None: a new run."""
    from mimo.training.checkpoint import resolve_checkpoint, usable_checkpoint

    if options.resume_from:
        return resolve_checkpoint(os.path.abspath(options.resume_from))
    found = usable_checkpoint(os.path.abspath(config.train.checkpoint.dir))
    return found[1] if found else None


def _preflight(config: MimoConfig, options: TrainOptions) -> dict | None:
    """Before any process starts (``options.resume_from`` picked): a checkpoint at another
    layout is announced (it is resharded on load); a run that is already done returns its summary."""
    from mimo.training.checkpoint import layout_change, read_meta, resolve_checkpoint

    path = options.resume_from
    if path is None:
        if config.train.init_from:  # a new run starting from another run's weights
            start = resolve_checkpoint(config.train.init_from)
            change = layout_change(read_meta(start), config, start)
            if change:
                log.warning(change)
        return None
    meta = read_meta(path)
    change = layout_change(meta, config, path)
    if change:
        log.warning(change)
    step = meta["step"]
    log.info("resuming from %s (step %d)", path, step)
    changed = changed_keys(meta.get("config", {}), plain_config(config))
    ignored = ("train.checkpoint.", "data.workers", "data.prefetch", "eval.", "train.log.")
    if change:  # the layout (announced above): data, model and optimizer settings still matter
        ignored += ("world_size", *(f"modules.{m}.parallel." for m in config.modules),
                    "train.distributed_optimizer", "train.optimizer_offload", "train.recompute", "train.moe_dispatcher")
    changed = [k for k in changed if not k.startswith(ignored)]
    if changed:
        log.warning("resuming from %s with a config that differs at %s: the run will not reproduce an uninterrupted one",
                    path, ", ".join(changed[:8]))
    target = options.stop_at or config.train.steps
    if step >= target:
        return {"ok": True, "command": "train", "steps": step, "final_loss": _last_loss(options.run_dir, step),
                "run_dir": options.run_dir, "checkpoint": path, "resumed_from": step, "steps_run": 0, "stopped": False}
    return None


def plain_config(config: MimoConfig) -> dict:
    """The resolved config as plain dicts and lists (as JSON and YAML write it)."""
    return json.loads(json.dumps(config.as_dict(), default=str))


def changed_keys(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += changed_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _last_loss(run_dir: str, step: int) -> float | None:
    from mimo.training.metrics import read_metrics

    for rec in read_metrics(os.path.join(run_dir, "metrics.jsonl")):
        if rec.get("step") == step:
            return rec.get("loss")
    return None


def _prepare_run_dir(config: MimoConfig, run_dir: str, config_path: str, overrides: list[str]) -> None:
    import yaml

    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    command = " ".join(["mimo train", config_path, *overrides])
    tmp = os.path.join(run_dir, "config.yaml.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"# resolved from `{command}`\n")
        yaml.safe_dump(plain_config(config), f, sort_keys=False)
    os.replace(tmp, os.path.join(run_dir, "config.yaml"))


SKIPPED_FILE = "skipped-samples.jsonl"  # in the run directory: every sample the run does not train on, with its reason


def account_for_data(config: MimoConfig, index, status: str, run_dir: str) -> None:
    """Before any step: what the run will not train on, where the user looks. Per reason its count
    (with the first samples and every damaged shard when the index was just built or rebuilt),
    the full list in the run directory, and a DataError when more than data.max_skipped_fraction
    of the samples would be dropped."""
    if index is None:  # synthetic data
        return
    from mimo.compose.inputs import data_plan
    from mimo.data.skipped import SkipReport

    report = SkipReport.of(data_plan(config, index), config.data.max_sample_tokens)
    path = os.path.join(run_dir, SKIPPED_FILE)
    if not report.counts() and not report.shards:
        if os.path.exists(path):
            os.remove(path)  # an earlier index's list
        return
    report.write(path)
    counts = ", ".join(f"{kind} {n}" for kind, n in report.counts().items())
    log.warning("data: %d of %d samples (%.2f%%) will not be trained on (%s); every one listed in %s",
                sum(report.counts().values()), report.samples, 100 * report.fraction, counts or "-", path)
    if status != "loaded":  # the details once, when the index is built or rebuilt
        for line in report.lines():
            log.warning("  %s", line)
    report.check(config.data.max_skipped_fraction)


def _launcher_logging() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [launcher] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("mimo")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


@contextmanager
def _stop_on_signals():
    """First SIGINT / SIGTERM: ask every rank to stop after its step (checkpointed); second: abort."""
    caught = []

    def handler(signum, frame):
        caught.append(signum)
        if len(caught) > 1:
            for child in mp.active_children():
                child.kill()
            raise KeyboardInterrupt
        log.warning("%s: stopping after the current step (a checkpoint is written); again to abort", signal.Signals(signum).name)
        for child in mp.active_children():
            try:
                os.kill(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _train_under_launcher(place: ClusterRank, config_path: str, overrides: list[str], config: MimoConfig, options: TrainOptions) -> dict:
    """One rank of a run torchrun or srun started."""
    import torch
    import torch.distributed as dist

    end_with_launcher(place)
    if place.world_size != config.world_size:
        started = "torchrun started" if place.launcher == "torchrun" else "srun started (SLURM_NTASKS)"
        raise ConfigError(f"world_size: the config asks for {config.world_size} ranks, {started} {place.world_size}")
    options = replace(options, resume_from=_resume_point(config, options))
    done = _preflight(config, options)  # on every rank: all of them stop on a user error, before any group starts
    if done is not None:
        return done
    # the launcher places the ranks: auto means this rank's GPU when there is one
    device = options.device if options.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    options = replace(options, device=device)
    if device == "cuda":
        torch.cuda.set_device(_local_gpu(place.local_rank))
    place.export()  # srun's variables as torch's env:// reads them
    # gloo for the CPU tensors (statistics, data), NCCL for CUDA tensors
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=options.timeout_s))
        notice = FailureNotice(place, _abort_rank, timeout_s=min(options.timeout_s, 60.0)).start()
    except Exception as e:
        raise DistributedError(f"{place.describe()}: could not join the run: {one_line(e)}") from e
    # once train_rank runs, a SIGTERM (torchrun's, after a rank of this node failed) no longer kills the rank at once:
    # train_rank stops cleanly on it, and a rank ending with a failure still reports the message
    training = []

    def on_sigterm(signum, frame):
        if not training:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if place.rank == 0:
            from mimo.compose.inputs import ensure_index

            from mimo.training.metrics import check_reporting

            index, status = ensure_index(config)
            check_reporting(config)
            _prepare_run_dir(config, options.run_dir, config_path, overrides)
            account_for_data(config, index, status, options.run_dir)
        dist.barrier()
        training.append(True)
        summary = _summary(train_rank(config_path, overrides, options), place.rank)
    except TrainingError:
        raise  # the same verdict on every rank: nobody failed
    except Exception as e:
        raise DistributedError(_posted_failure(e, notice, place.rank, options.run_dir)) from e
    finally:
        notice.close()
        dist.destroy_process_group()
        signal.signal(signal.SIGTERM, previous)
    return summary


def _summary(result: dict, rank: int | None = None) -> dict:
    """The command's result from rank 0's (or, under a launcher, this rank's): a TrainingError
    (exit status 2) when the run ended on a non-finite loss or gradient norm."""
    if result.get("nonfinite"):
        raise TrainingError(result["nonfinite"])
    result = {k: v for k, v in result.items() if k != "nonfinite"}
    return {"ok": True, "command": "train", **({} if rank is None else {"rank": rank}), **result}


def _local_gpu(local_rank: int) -> int:
    """The GPU of this node's ``local_rank``-th rank: that index, or the only GPU visible when the
    launcher binds one per task (srun ``--gpus-per-task=1``)."""
    import torch

    count = torch.cuda.device_count()
    if count == 1:
        return 0
    if local_rank >= count:
        raise ConfigError(f"local rank {local_rank}: this node shows {count} GPUs (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most one rank per GPU")
    return local_rank


def _posted_failure(error: Exception, notice: FailureNotice, rank: int, run_dir: str) -> str:
    """The message this rank ends with, the same on every rank: the first failure posted. A failed
    or timed-out collective waits a moment for the failure behind it (posted by the rank that
    failed before its connections closed); with none, the peer vanished without a word."""
    import socket
    import traceback

    host = socket.gethostname()
    if is_communication_failure(error):
        posted = notice.posted(wait_s=5.0)
        if posted:
            return posted
        if isinstance(error, DistributedError):  # a named timeout: this rank, this step
            return notice.post(f"{error} (on {host})")
        return notice.post(f"rank {rank} on {host}: another rank ended without a message (its process or node died: killed, "
                           f"out of memory, or the machine failed), and the connection to it closed: {one_line(error)}")
    own = _short_failure(f"rank {rank} failed:\n{traceback.format_exc()}", run_dir)
    return notice.post(own.replace(f"rank {rank} failed", f"rank {rank} on {host} failed", 1))


def _abort_rank(message: str) -> None:
    """The watchdog's end of a rank that another rank's failure did not reach in time: the CLI's
    error contract (the message on stderr, the JSON object last on stdout, exit 2), at once."""
    log.error(message)
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    print(json.dumps({"ok": False, "command": "train", "errors": [message]}), flush=True)
    os._exit(2)


# ---------------------------------------------------------------- one rank


def train_rank(config_path: str, overrides: list[str], options: TrainOptions) -> dict:
    """Runs on every rank (a WorkerPool worker, or a torchrun process with its group up). A
    worker of the local launch ends with its launcher (``mimo.training.launch``)."""
    import torch.distributed as dist

    from mimo.training.async_save import CheckpointSaver
    from mimo.training.checkpoint import latest_checkpoint, load_checkpoint, remove_leftovers, resolve_checkpoint
    from mimo.training.evaluation import Evaluator, request_for
    from mimo.training.metrics import Reporter, StepTimer
    from mimo.training.run import build_run
    from mimo.training.launch import rank_compute_device
    from mimo.training.step import train_step
    from mimo.training.trace import write_trace

    rank = dist.get_rank()
    config = load_config(config_path, overrides, run_dir=options.run_dir)  # the launcher's checkpoint dir
    handlers = _rank_logging(rank, options.run_dir)
    stop = _StopRequest()
    fault = _Fault.from_env(rank)
    ckpt = config.train.checkpoint
    ckpt_dir = os.path.abspath(ckpt.dir)
    last_step = options.stop_at or config.train.steps
    run = evaluator = None
    try:
        _groups_inherit_timeout(options.timeout_s)
        log.info("%d ranks up; building the model and the data pipeline", dist.get_world_size())
        t0 = time.perf_counter()
        run = build_run(config, rank, device=rank_compute_device(options.device))
        run.pipeline.last_step = last_step  # nothing is prepared past the run's end
        log.info("model and data pipeline built (%.1f s)", time.perf_counter() - t0)
        start, resume = 0, _agreed(lambda: options.resume_from)
        if resume:
            log.info("loading weights, optimizer states and RNG (%s)", resume)
            start = load_checkpoint(run.model, resume, run.optimizers)["step"]
            log.info("resumed from %s (step %d)", resume, start)
        elif config.train.init_from:
            path = _agreed(lambda: resolve_checkpoint(config.train.init_from))
            log.info("loading weights (%s, train.init_from)", path)
            load_checkpoint(run.model, path, rng=False, start=True)  # weights only: a new run, step 1, fresh optimizer
        if rank == 0:
            for path in remove_leftovers(ckpt_dir):
                log.info("removed an incomplete checkpoint: %s", path)
        saver = CheckpointSaver(ckpt_dir, ckpt.keep, async_save=ckpt.async_save, timeout_s=options.timeout_s)
        timer = StepTimer(run)
        report = Reporter(run, options.run_dir, options.log_every, start, last_step) if rank == 0 else None
        if config.eval.every:  # built on every rank at the same point (its data pipeline's groups)
            evaluator = Evaluator(config, run.model, request_for(config, None, None))
        step, loss, path, stopped, failed, skipped_steps = start, None, None, False, None, []
        log.info("training steps %d..%d", start + 1, last_step)
        for step in range(start + 1, last_step + 1):
            with _name_timeouts(rank, step, options.timeout_s):
                fault.at_step(step)
                timer.begin()
                with fault.poisoned(run.model, step):
                    result = train_step(run.model, timer.pipeline, step, run.optimizers, run.policy,
                                        trace=step in config.train.trace_steps)
                if report is not None and report.console_closed:  # stdout went away: stop as on Ctrl-C
                    stop.requested = True
                stats = timer.end(result.read_failures, stop.requested or step == options.stop_at)
                if result.trace is not None:  # train.trace_steps: open in Perfetto or chrome://tracing
                    write_trace(result.trace, rank, os.path.join(options.run_dir, "traces", f"step-{step:08d}-rank{rank}.json"))
                # the loss and norm are world-wide: every rank takes the same turn here
                nonfinite = None if result.skipped else _nonfinite(result.loss, result.grad_norm)
                stopped = stats["stop"] and step < config.train.steps
                saved_at = None
                if nonfinite is not None and config.train.on_nonfinite == "stop":
                    pass  # no checkpoint of an update that read a non-finite gradient
                elif (ckpt.every and step % ckpt.every == 0) or step == config.train.steps or stats["stop"]:
                    t0 = time.perf_counter()
                    path = saver.save(run.model, run.optimizers, step, after_write=(lambda s=step: fault.during_save(s)))
                    # what the step paid: the whole save, or (async_save) waiting for the previous one and the snapshot
                    stats["time_s"]["checkpoint"] = time.perf_counter() - t0
                    saved_at = path
            loss = result.loss
            if report is not None:
                report.step(step, result, stats, saved_at)
            if result.skipped:
                skipped_steps.append(step)
                log.warning("step %d: gradient norm %s; the update was skipped (train.on_nonfinite: skip_step)", step,
                            result.grad_norm)
            if nonfinite is not None and config.train.on_nonfinite == "stop":
                failed = f"step {step}: {nonfinite}"
                break
            if evaluator is not None and step % config.eval.every == 0:
                t0 = time.perf_counter()
                with _name_timeouts(rank, step, options.timeout_s):
                    evaluated = evaluator.run_summed()
                if report is not None:
                    report.eval(step, evaluated, time.perf_counter() - t0)
            if stats["stop"]:
                break
        with _name_timeouts(rank, step, options.timeout_s):
            saver.wait()  # an asynchronous save of the last step committed before anything reads it
        if report is not None:
            report.close()
        latest = latest_checkpoint(ckpt_dir)
        if failed is not None:
            failed += (f"; stopped without writing a checkpoint of it (the newest is {latest[1]}). Lower train.lr or check "
                       f"the data of that step, or set train.on_nonfinite: skip_step" if latest else
                       "; stopped without writing a checkpoint of it")
            log.error(failed)
        elif stopped and rank == 0:
            log.warning("stopped after step %d; `mimo train` with the same config resumes from %s", step, path)
        return {"steps": step, "final_loss": loss, "run_dir": options.run_dir, "checkpoint": latest[1] if latest else None,
                "resumed_from": start or None, "steps_run": step - start, "stopped": stopped, "skipped_steps": skipped_steps,
                "nonfinite": failed}
    except BaseException:
        log.exception("rank %d failed", rank, extra={"file_only": True})
        raise
    finally:
        if evaluator is not None:
            evaluator.close()
        if run is not None:  # a failing rank does not wait for data its peers may never send
            run.close(wait=sys.exc_info()[0] is None)
        sys.stdout.flush()
        stop.restore()
        for h in handlers:
            logging.getLogger("mimo").removeHandler(h)
            h.close()


def _nonfinite(loss: float, grad_norm: float) -> str | None:
    """What is not finite about a step ('loss nan, gradient norm inf'), or None."""
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(value)]
    return ", ".join(bad) if bad else None


def _groups_inherit_timeout(timeout_s: float) -> None:
    """``dist.new_group()`` without a timeout takes torch's default (30 min), not the world
    group's: make the groups this rank creates from now on (grids, bridges, data) time out
    after ``timeout_s`` too, so a hung collective ends the run in the time the user asked for."""
    from torch.distributed import distributed_c10d as c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(c10d, name, None), timedelta):
            setattr(c10d, name, timedelta(seconds=timeout_s))


def _agreed(on_rank0):
    """``on_rank0()``'s answer (a path) on every rank: every rank loads the checkpoint rank 0
    picked (under torchrun each rank picked its own before the group started)."""
    import torch
    import torch.distributed as dist

    answer = [on_rank0() if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0, device=torch.device("cpu"))
    return answer[0]


@contextmanager
def _name_timeouts(rank: int, step: int, timeout_s: float):
    """A collective that timed out says so, with this rank and step (the backend's message
    alone names neither)."""
    try:
        yield
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise DistributedError(
                f"rank {rank}, step {step}: a collective did not complete within {timeout_s:g} s "
                f"(another rank failed or stopped responding): {str(e).strip().splitlines()[0]}"
            ) from e
        raise


def _rank_logging(rank: int, run_dir: str) -> list[logging.Handler]:
    """Rank-prefixed records: rank 0 shows INFO on the console, the others warnings; every rank
    logs INFO into ``logs/rank<N>.log``."""
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.addFilter(lambda record: not getattr(record, "file_only", False))  # e.g. step lines: the progress display shows them
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    file = logging.FileHandler(os.path.join(run_dir, "logs", f"rank{rank}.log"), encoding="utf-8")
    handlers = [console, file]
    root = logging.getLogger("mimo")
    root.setLevel(logging.INFO)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    return handlers


class _StopRequest:
    """SIGINT / SIGTERM ask for a clean stop after the current step (idempotent)."""

    def __init__(self):
        self.requested = False
        self._previous = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _handler(self, signum, frame):
        if not self.requested:
            log.warning("%s: stopping after the current step", signal.Signals(signum).name)
        self.requested = True


@dataclass
class _Fault:
    """The ``MIMO_TRAIN_FAULT`` test hook (see the module doc)."""

    kind: str | None = None
    step: int = 0

    @classmethod
    def from_env(cls, rank: int) -> "_Fault":
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return cls()
        try:
            kind, at_rank, step = spec.split(":")
            at_rank, step = int(at_rank), int(step)
        except ValueError:
            raise ConfigError(f"{FAULT_ENV}={spec!r}: expected KIND:RANK:STEP") from None
        if kind not in ("raise", "hang", "stall-save", "nan"):
            raise ConfigError(f"{FAULT_ENV}={spec!r}: KIND is raise, hang, stall-save or nan")
        return cls(kind, step) if at_rank == rank else cls()

    def at_step(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected failure ({FAULT_ENV}) at step {step}")
        if self.kind == "hang":
            log.warning("%s: not responding from step %d on", FAULT_ENV, step)
            while True:
                time.sleep(3600)

    @contextmanager
    def poisoned(self, model, step: int):
        """``nan``: one of this rank's trainable weights is NaN during the step (its loss and
        gradient norm with it), and as before afterwards (unless the step updated it)."""
        params = [p.param for p in model.train_params()] if self.kind == "nan" and step == self.step else []
        if not params:
            yield
            return
        import torch

        saved = params[0].detach().clone()
        with torch.no_grad():
            params[0].fill_(math.nan)
        try:
            yield
        finally:
            with torch.no_grad():
                params[0].copy_(saved)

    def during_save(self, step: int) -> None:
        if self.kind == "stall-save" and step == self.step:
            log.warning("%s: stalling inside the save of step %d", FAULT_ENV, step)
            while True:
                time.sleep(3600)

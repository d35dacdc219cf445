"""What ``mimo train`` reports: per-module step times (from hooks) and peak memory, model
FLOP/s and MFU (``mimo.training.flops``), metrics.jsonl, TensorBoard, Weights & Biases
(``train.log.wandb``), the progress display, and the held-out evaluations of ``eval.every``."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from mimo.core import strict_json
from mimo.core.console import to_devnull
from mimo.core.errors import ConfigError
from mimo.compose.adapters import trainable_parameters
from mimo.training.flops import device_peak_flops, model_flops, param_counts, throughput
from mimo.training.optim import lr_for, optimizer_settings

log = logging.getLogger("mimo.training.train")


class _TimedPipeline:
    """The data pipeline, with the time ``train_step`` spends getting a step's data."""

    def __init__(self, pipeline, timer: "StepTimer"):
        self._pipeline, self._timer = pipeline, timer

    def step(self, step: int):
        t0 = time.perf_counter()
        try:
            return self._pipeline.step(step)
        finally:
            self._timer.data += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._pipeline, name)


class StepTimer:
    """Wall times of one step on this rank, per module, from hooks (no change to the step):

    * forward: the module's ``forward`` calls;
    * backward: from the gradient reaching the module's output to its last parameter
      gradient (modules without trainable parameters report 0);
    * optimizer: the module optimizer's ``step``;
    * data: the pipeline's ``step``: waiting for the step's data (read, packed and routed on the
      data thread during the step before) and delivering it to the device.

    ``end`` all-gathers every rank's numbers (one small collective): times are reported as the
    maximum over ranks (the slowest rank sets the pace), read failures as the sum, and on GPUs
    each module's peak memory as the most that one of its ranks allocated during the step
    (colocated modules share their ranks, hence the number).
    """

    def __init__(self, run):
        self.modules = list(run.config.modules)  # the same order on every rank
        self.ranges = {m: run.config.rank_range(m) for m in self.modules}
        self.device = run.model.device
        self.pipeline = _TimedPipeline(run.pipeline, self)
        for part in run.model.parts:
            if part.module is not None:
                self._hook_module(part.name, part.module)
        for name, opt in run.optimizers.items():
            started = []
            opt.register_step_pre_hook(lambda o, a, k, s=started: s.append(time.perf_counter()))
            opt.register_step_post_hook(lambda o, a, k, s=started, n=name: self._add("optimizer", n, time.perf_counter() - s.pop()))
        self.begin()

    def _hook_module(self, name: str, module: torch.nn.Module) -> None:
        started = []

        def pre(mod, args):
            started.append(time.perf_counter())

        def post(mod, args, output):
            self._add("forward", name, time.perf_counter() - started.pop())
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(lambda grad: self._spans[name].append([time.perf_counter()] * 2))

        def grad_done(param):
            if self._spans[name]:
                self._spans[name][-1][1] = time.perf_counter()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(grad_done)

    def _add(self, kind: str, module: str, seconds: float) -> None:
        self.times[kind][module] += seconds

    def begin(self) -> None:
        self.times = {k: dict.fromkeys(self.modules, 0.0) for k in ("forward", "backward", "optimizer")}
        self._spans = {m: [] for m in self.modules}
        self.data = 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()

    def end(self, read_failures: dict, stop: bool) -> dict:
        """Collective (every rank, once per step): the step's times and counts over the world."""
        step_s = time.perf_counter() - self._t0
        for m, spans in self._spans.items():
            self.times["backward"][m] = sum(b - a for a, b in spans)
        kinds = ("forward", "backward", "optimizer")
        memory = memory_peak_gib(self.device)
        local = [step_s, self.data, *(self.times[k][m] for k in kinds for m in self.modules),
                 math.nan if memory is None else memory, float(sum(read_failures.values())), float(stop)]
        mine = torch.tensor(local, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            table = torch.stack(everyone)
        else:
            table = mine[None]
        most, total = table.max(0).values.tolist(), table.sum(0).tolist()
        n = len(self.modules)
        times = {"step": most[0], "data": most[1]}
        for i, k in enumerate(kinds):
            times[k] = dict(zip(self.modules, most[2 + i * n: 2 + (i + 1) * n]))
        for reason, count in read_failures.items():
            log.warning("%d sample(s) failed at read time: %s", count, reason)
        memory = module_peaks(table[:, 2 + len(kinds) * n].tolist(), self.ranges)
        return {"time_s": times, "read_failures": int(total[-2]), "stop": bool(most[-1]), "mem_peak_gib": memory}


def memory_peak_gib(device: torch.device) -> float | None:
    """The most memory this rank's GPU held in tensors since the last reset (None off GPUs)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def module_peaks(rank_peaks: list[float], ranges: dict[str, range]) -> dict[str, float] | None:
    """Per module, the most of its ranks' peaks (``rank_peaks`` by rank, NaN: none); None
    where no rank has one (CPU runs)."""
    out = {}
    for module, ranks in ranges.items():
        known = [rank_peaks[r] for r in ranks if not math.isnan(rank_peaks[r])]
        out[module] = max(known) if known else None
    return out if any(v is not None for v in out.values()) else None


# ---------------------------------------------------------------- reporting (rank 0)


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut short by a kill
                pass
    return out


def check_reporting(config) -> None:
    """Launcher side, before any process starts: what the reporting of ``config`` needs is
    there (the wandb package when ``train.log.wandb`` is set; ``eval.every``'s held-out
    shards, checked and indexed once)."""
    if config.train.log.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError("train.log.wandb: the wandb package is not installed (pip install 'mimo[wandb]', "
                          "or remove train.log.wandb)")
    if config.eval.every:
        from mimo.compose.inputs import ensure_index
        from mimo.training.evaluation import request_for

        ensure_index(config, shards=request_for(config, None, None).shards)


class Reporter:
    """metrics.jsonl, TensorBoard (when installed), Weights & Biases (when asked for) and the
    progress display, on one rank."""

    def __init__(self, run, run_dir: str, log_every: int, start: int, last_step: int):
        self.run, self.log_every, self.start, self.last_step = run, log_every, start, last_step
        self.cfg = run.config
        self.path = os.path.join(run_dir, "metrics.jsonl")
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:  # drop what the interrupted run did after its checkpoint
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", encoding="utf-8")
        steps = [r for r in kept if not r.get("eval")]
        self.read_failures_total = steps[-1].get("read_failures_total", 0) if steps else 0
        self.skipped = run.pipeline.plan.skipped_counts()
        # every training module's base learning rate (known on every rank, unlike its optimizer)
        self.base_lr = {m: lr for m, lr in optimizer_settings(self.cfg)[0].items() if run.model.part(m).trains}
        self.param_counts = param_counts(self.cfg)
        self.trainable = trainable_parameters(self.cfg)  # per module, on every step's record
        peak = self.cfg.train.log.peak_tflops
        self.peak_flops = peak * 1e12 if peak is not None else device_peak_flops(run.model.device, self.cfg.train.precision,
                                                                          fp8=self.cfg.train.fp8 is not None)
        self.tty = sys.stdout.isatty()
        self.console_closed = False  # stdout went away (a closed pipe or terminal): the run stops as on Ctrl-C
        self.skipped_steps = steps[-1].get("skipped_steps", 0) if steps else 0
        self.recent: list[float] = []
        self.last_report = time.perf_counter()
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start + 1)
        except ImportError:
            pass
        self.wandb = _wandb_run(self.cfg, run_dir) if self.cfg.train.log.wandb is not None else None
        if start:
            log.info("continuing at step %d of %d", start + 1, self.cfg.train.steps)

    def step(self, step: int, result, stats: dict, checkpoint: str | None) -> None:
        now = time.perf_counter()
        self.recent = (self.recent + [now - self.last_report])[-20:]
        self.last_report = now
        samples = [s for mb in self.run.pipeline.plan.step(step, self.cfg.train.micro_batches) for s in mb]
        tokens = sum(s.tokens for s in samples)
        step_s = stats["time_s"]["step"]
        tflops, mfu = throughput(model_flops(self.cfg, samples, self.param_counts), step_s, self.cfg.world_size, self.peak_flops)
        self.read_failures_total += stats["read_failures"]
        self.skipped_steps += result.skipped
        rec = {
            "step": step, "loss": result.loss, "grad_norm": result.grad_norm,
            "lr": {m: lr_for(self.cfg.train, step, base) for m, base in self.base_lr.items()},
            "loss_tokens": result.loss_tokens, "tokens": tokens, "samples": len(samples),
            "tokens_per_s": tokens / step_s if step_s else None, "samples_per_s": len(samples) / step_s if step_s else None,
            "tflops": tflops, "mfu": mfu, "mem_peak_gib": stats.get("mem_peak_gib"), "params_trainable": self.trainable,
            "time_s": stats["time_s"], "read_failures": stats["read_failures"], "read_failures_total": self.read_failures_total,
            "skipped": {**self.skipped, "read failure": self.read_failures_total}, "checkpoint": checkpoint,
            "skipped_step": result.skipped, "skipped_steps": self.skipped_steps,
            "wall_time": time.time(),
            **getattr(result, "mtp", {}),  # mtp/loss (and mtp/loss_depth<k>): LLMs with arch.mtp
            **getattr(result, "dsa", {}),  # dsa/indexer_kl (DeepSeek sparse attention layers)
            **getattr(result, "moe", {}),  # moe/max_load, moe/dead_experts, moe/aux_loss, moe/layer<i>/... (MoE LLMs)
        }
        self._write(rec)
        line = self._line(rec)
        log.info(line, extra={"file_only": True})
        if self.tty:
            done = (step - self.start) / max(self.last_step - self.start, 1)
            bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
            self._console(f"\r[{bar}] {line}\033[K")
        elif (step - self.start) % self.log_every == 0 or step == self.last_step:
            self._console(line + "\n")

    def _console(self, text: str) -> None:
        """``text`` to stdout; a closed pipe (``| head``) or terminal does not end the rank: stdout
        goes to /dev/null from then on and the run stops after the next step, checkpointed."""
        if self.console_closed:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError as e:  # BrokenPipeError; EIO from a terminal that closed
            self.console_closed = True
            to_devnull(sys.stdout)
            log.warning("stdout was closed (%s): stopping after the next step, with a checkpoint, as on Ctrl-C; "
                        "`mimo train` with the same config resumes", e.strerror or type(e).__name__)

    def eval(self, step: int, result: dict, seconds: float) -> None:
        """An ``eval.every`` evaluation after ``step`` (``Evaluator.run_summed``'s result): one
        metrics.jsonl line with ``"eval": true`` and ``eval_*`` keys, and a progress line."""
        rec = {"step": step, "eval": True, **{f"eval_{k}": v for k, v in result.items()}, "time_s": seconds,
               "wall_time": time.time()}
        self._write(rec)
        em = rec["eval_exact_match"]
        line = (f"eval at step {step} | loss {rec['eval_loss']:.4f} | exact match "
                f"{'-' if em is None else f'{em:.3f}'} ({rec['eval_matched']}/{rec['eval_scored']}) | {seconds:.1f} s")
        log.info(line, extra={"file_only": True})
        self._console(("\n" if self.tty else "") + line + "\n")

    def _write(self, rec: dict) -> None:
        """One metrics.jsonl line; its numbers to TensorBoard and W&B."""
        self.file.write(strict_json.dumps(rec) + "\n")  # a NaN loss as null: every JSON reader takes the file
        self.file.flush()
        scalars = _scalars(rec)
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, rec["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])

    def _line(self, rec: dict) -> str:
        eta = sum(self.recent) / len(self.recent) * (self.last_step - rec["step"])
        skipped = sum(rec["skipped"].values())
        rate = f"{rec['tokens_per_s']:,.0f} tok/s | {rec['samples_per_s']:.1f} samples/s" if rec["tokens_per_s"] else "- tok/s"
        if rec["tflops"] is not None:
            rate += f" | {rec['tflops']:.3g} TFLOP/s"
        if rec["mfu"] is not None:
            rate += f" | MFU {rec['mfu']:.1%}"
        if rec["mem_peak_gib"]:
            rate += f" | mem {max(v for v in rec['mem_peak_gib'].values() if v is not None):.1f} GiB"
        skipped_step = " | update skipped (gradient norm not finite)" if rec["skipped_step"] else ""
        return (f"step {rec['step']}/{self.last_step} | loss {rec['loss']:.4f} | {rate} | "
                f"ETA {timedelta(seconds=round(eta))} | skipped {skipped}{skipped_step}")

    def close(self) -> None:
        if self.tty:
            self._console("\n")
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _scalars(rec: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers under TensorBoard / W&B names: train/loss, lr/<module>,
    time/<kind>/<module>, mem_peak_gib/<module>, eval/loss, ..."""
    if rec.get("eval"):
        return {f"eval/{k[5:]}": v for k, v in rec.items() if k.startswith("eval_") and isinstance(v, (int, float))}
    out = {f"train/{k}": rec[k] for k in ("loss", "grad_norm", "tokens_per_s", "samples_per_s", "tflops", "mfu") if rec[k] is not None}
    out.update({f"lr/{m}": lr for m, lr in rec["lr"].items()})
    out.update({f"time/{kind}/{m}": t for kind in ("forward", "backward", "optimizer") for m, t in rec["time_s"][kind].items()})
    out.update({f"mem_peak_gib/{m}": v for m, v in (rec["mem_peak_gib"] or {}).items() if v is not None})
    out.update({k: v for k, v in rec.items() if k.startswith("moe/")})
    return out


def _wandb_run(config, run_dir: str):
    """A W&B run for ``train.log.wandb``; a resumed ``mimo train`` continues the same one (its id
    is kept in the run directory)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("train.log.wandb: the wandb package is not installed (pip install 'mimo[wandb]')") from None
    w = config.train.log.wandb
    id_file = os.path.join(run_dir, "wandb-run-id")
    if os.path.isfile(id_file):
        with open(id_file, encoding="utf-8") as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        with open(id_file, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
    plain = json.loads(json.dumps(config.as_dict(), default=str))
    return wandb.init(project=w.project, entity=w.entity, name=w.name or os.path.basename(run_dir), id=run_id, resume="allow",
                      dir=run_dir, config=plain)

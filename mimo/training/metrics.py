"""What ``mimo train`` reports: per-module step times (from hooks), metrics.jsonl, TensorBoard
and the progress display."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mimo.training.optim import lr_at

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
    * data: the pipeline's ``step`` (reading, packing, pixel routing).

    ``end`` all-gathers every rank's numbers (one small collective): times are reported as the
    maximum over ranks (the slowest rank sets the pace), read failures as the sum.
    """

    def __init__(self, run):
        self.modules = list(run.config.modules)  # the same order on every rank
        self.pipeline = _TimedPipeline(run.pipeline, self)
        model = run.model
        parts = {name: p.module for name, p in model.encoders.items() if p.module is not None}
        if model.stage is not None:
            parts[model.llm_name] = model.stage
        for name, module in parts.items():
            self._hook_module(name, module)
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
        self._t0 = time.perf_counter()

    def end(self, read_failures: dict, stop: bool) -> dict:
        """Collective (every rank, once per step): the step's times and counts over the world."""
        step_s = time.perf_counter() - self._t0
        for m, spans in self._spans.items():
            self.times["backward"][m] = sum(b - a for a, b in spans)
        kinds = ("forward", "backward", "optimizer")
        local = [step_s, self.data, *(self.times[k][m] for k in kinds for m in self.modules), float(sum(read_failures.values())), float(stop)]
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
        return {"time_s": times, "read_failures": int(total[-2]), "stop": bool(most[-1])}


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


class Reporter:
    """metrics.jsonl, TensorBoard (optional) and the progress display, on one rank."""

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
        self.read_failures_total = kept[-1].get("read_failures_total", 0) if kept else 0
        self.skipped = run.pipeline.plan.skipped_counts()
        # every training module's base learning rate (known on every rank, unlike its optimizer)
        trains = {**run.model.encoder_trains, run.model.llm_name: not self.cfg.llm.freeze}
        self.base_lr = {m: lr for m, lr in self.cfg.optimizer_settings()[0].items() if trains[m]}
        self.tty = sys.stdout.isatty()
        self.recent: list[float] = []
        self.last_report = time.perf_counter()
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start + 1)
        except ImportError:
            pass
        if start:
            log.info("continuing at step %d of %d", start + 1, self.cfg.train.steps)

    def step(self, step: int, result, stats: dict, checkpoint: str | None) -> None:
        now = time.perf_counter()
        self.recent = (self.recent + [now - self.last_report])[-20:]
        self.last_report = now
        samples = [s for mb in self.run.pipeline.plan.step(step, self.cfg.train.micro_batches) for s in mb]
        tokens = sum(s.tokens for s in samples)
        step_s = stats["time_s"]["step"]
        self.read_failures_total += stats["read_failures"]
        rec = {
            "step": step, "loss": result.loss, "grad_norm": result.grad_norm,
            "lr": {m: lr_at(step, base, self.cfg.train.warmup_steps, self.cfg.train.steps) for m, base in self.base_lr.items()},
            "loss_tokens": result.loss_tokens, "tokens": tokens, "samples": len(samples),
            "tokens_per_s": tokens / step_s if step_s else None, "samples_per_s": len(samples) / step_s if step_s else None,
            "time_s": stats["time_s"], "read_failures": stats["read_failures"], "read_failures_total": self.read_failures_total,
            "skipped": {**self.skipped, "read failure": self.read_failures_total}, "checkpoint": checkpoint,
            "wall_time": time.time(),
        }
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key in ("loss", "grad_norm", "tokens_per_s", "samples_per_s"):
                if rec[key] is not None:
                    self.tb.add_scalar(f"train/{key}", rec[key], step)
            for module, lr in rec["lr"].items():
                self.tb.add_scalar(f"lr/{module}", lr, step)
            for kind in ("forward", "backward", "optimizer"):
                for module, seconds in rec["time_s"][kind].items():
                    self.tb.add_scalar(f"time/{kind}/{module}", seconds, step)
        line = self._line(rec)
        log.info(line, extra={"file_only": True})
        if self.tty:
            done = (step - self.start) / max(self.last_step - self.start, 1)
            bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
            sys.stdout.write(f"\r[{bar}] {line}\033[K")
            sys.stdout.flush()
        elif (step - self.start) % self.log_every == 0 or step == self.last_step:
            print(line, flush=True)

    def _line(self, rec: dict) -> str:
        eta = sum(self.recent) / len(self.recent) * (self.last_step - rec["step"])
        skipped = sum(rec["skipped"].values())
        rate = f"{rec['tokens_per_s']:,.0f} tok/s | {rec['samples_per_s']:.1f} samples/s" if rec["tokens_per_s"] else "- tok/s"
        return (f"step {rec['step']}/{self.last_step} | loss {rec['loss']:.4f} | {rate} | "
                f"ETA {timedelta(seconds=round(eta))} | skipped {skipped}")

    def close(self) -> None:
        if self.tty:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.file.close()
        if self.tb is not None:
            self.tb.close()

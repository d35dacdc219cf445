"""AdamW over the run's gradient buckets: the distributed optimizer and optimizer-state offload.

``BucketAdamW`` steps one module's parameters through its ``GradSync`` buckets (contiguous
fp32 main gradients), each bucket as one flat tensor:

* **sharded** (``train.distributed_optimizer``, Megatron's ZeRO-1): ``GradSync`` runs in
  ``reduce_scatter`` mode, so after backward each rank holds the sum of its contiguous shard of
  every bucket over the bucket's data-parallel group (DP x CP for dense parameters, EDP for
  experts). The rank keeps the fp32 master weights and the two moments of that shard only, steps
  it, and all-gathers the updated shard into the bucket's parameter buffer — the parameters are
  views of it, so the gather writes them in place. The gathers are started after the step and
  waited for by forward pre-hooks of the layers that use them (``wait_hooks``), so they overlap
  the next step's first forward; ``finish`` waits for all (before a checkpoint, an evaluation,
  or reading the weights).
* **whole** (``train.optimizer_offload`` without the distributed optimizer): every rank steps
  whole buckets of all-reduced gradients.
* **offload** (``train.optimizer_offload``): masters and moments live in pinned host memory;
  each step copies the gradient shard to the host, runs AdamW there, and copies the new weights
  back (on the CPU the state is host memory anyway).

The update is ``torch.optim.AdamW``'s (its functional kernel), with the decoupled weight decay
applied first per element (the bucket mixes parameters with and without decay), exactly where
AdamW applies it. The global gradient norm and clipping read the shards (``grad_norm_sq`` counts
each element once in the world: its data-parallel copies by shard, its other copies by the
placement's owner rule); the checkpoint holds each rank's shard, parameter by parameter with the
flat range it covers and the parameter's placement record (``state_pieces``), read back at any
layout through those records (``load_local_states``, ``mimo.training.reshard``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from mimo.core.errors import CheckpointError
from mimo.parallel.params import TrainParam


@dataclass
class _Piece:
    """A parameter's elements inside a bucket: its flat range in the bucket, and of those the
    part in this rank's shard (``lo`` .. ``hi`` of the parameter's own flat elements)."""

    name: str
    param: torch.nn.Parameter
    start: int  # offset of the parameter in the bucket
    lo: int  # first element of the parameter in this rank's shard (parameter-relative), or 0
    hi: int  # one past the last (lo == hi: none)
    decay: bool
    counts: bool  # this rank's copy counts in the norm (data-parallel copies aside: the shard decides)


class _State:
    """One bucket's optimizer side on this rank."""

    def __init__(self, bucket, pieces: list[_Piece], sharded: bool, offload: bool):
        self.bucket, self.pieces = bucket, pieces
        flat = bucket.flat
        group = bucket.group if sharded else None
        self.group = group
        self.n = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        size = flat.numel() // self.n
        self.lo, self.hi = self.rank * size, (self.rank + 1) * size
        self.grad = bucket.shard if bucket.shard is not None else flat  # the summed gradients of the shard
        host = torch.device("cpu")
        self.device = flat.device
        where = host if offload else self.device
        pin = offload and self.device.type == "cuda"
        dtype = bucket.params[0].dtype
        # the parameters become views of one buffer laid out like the gradients (padding included)
        self.params = torch.zeros(flat.numel(), dtype=dtype, device=self.device)
        with torch.no_grad():
            for pc in pieces:
                view = self.params[pc.start:pc.start + pc.param.numel()].view_as(pc.param)
                view.copy_(pc.param.detach())
                pc.param.data = view
        new = lambda: torch.zeros(size, dtype=torch.float32, device=where, pin_memory=pin)  # noqa: E731
        self.master = new()
        self.master.copy_(self.params[self.lo:self.hi])
        self.exp_avg, self.exp_avg_sq = new(), new()
        self.step = torch.zeros((), dtype=torch.float32)
        self.decay = torch.zeros(size, dtype=torch.bool, device=where)
        self.norm_mask = torch.zeros(size, dtype=torch.bool, device=self.device)
        for pc in pieces:
            a, b = pc.start + pc.lo - self.lo, pc.start + pc.hi - self.lo
            self.decay[a:b] = pc.decay
            self.norm_mask[a:b] = pc.counts
        self.grad_host = new() if offload and where != self.device else None
        self.send = torch.empty(size, dtype=dtype, device=self.device)  # this shard's new weights, gathered from
        self.pending = None  # the all-gather in flight

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def _waiter(states: list[_State]):
    def wait(module, args) -> None:  # (a pre-hook returning something would replace the inputs)
        for s in states:
            s.wait()

    return wait


class BucketAdamW(torch.optim.Optimizer):
    """AdamW of one module over its ``GradSync`` buckets (see module doc)."""

    reads_main_grads = True

    def __init__(self, params: list[TrainParam], grad_sync, lr: float, weight_decay: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, sharded: bool = True, offload: bool = False):
        super().__init__([p.param for p in params], dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if sharded and grad_sync.mode != "reduce_scatter":
            raise ValueError("a sharded BucketAdamW needs GradSync in reduce_scatter mode")
        self.sharded, self.offload = sharded, offload
        info = {id(p.param): p for p in params}
        self.states: list[_State] = []
        for bucket in grad_sync.module_buckets(params[0].module):
            pieces, off = [], 0
            n = dist.get_world_size(bucket.group) if sharded and bucket.group is not None else 1
            r = dist.get_rank(bucket.group) if n > 1 else 0
            size = bucket.flat.numel() // n
            for p in bucket.params:
                tp = info[id(p)]
                lo = min(max(r * size - off, 0), p.numel())
                hi = min(max((r + 1) * size - off, 0), p.numel())
                # sharded: the shard owns this rank's part of the data-parallel sum, so only the
                # other axes' copies decide; whole: one data-parallel copy counts too
                counts = tp.counts_in_shard_norm if n > 1 else tp.counts_in_norm
                pieces.append(_Piece(tp.name, p, off, lo, hi, tp.weight_decay, counts))
                off += p.numel()
            self.states.append(_State(bucket, pieces, sharded, offload))
        self._hooks = []

    # ---- the step ----
    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        from torch.optim.adamw import adamw

        for s in self.states:
            s.wait()  # (a gather still in flight: never, a step needs a forward first)
            grad = s.grad
            if s.grad_host is not None:
                s.grad_host.copy_(grad, non_blocking=True)
                torch.cuda.current_stream().synchronize()
                grad = s.grad_host
            # AdamW's decoupled decay first, per element (AdamW computes 1 - lr * wd as a float)
            s.master.mul_(torch.where(s.decay, 1 - lr * wd, 1.0).to(s.master.dtype))
            adamw([s.master], [grad.to(torch.float32)], [s.exp_avg], [s.exp_avg_sq], [], [s.step], foreach=False,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=0.0, eps=eps, maximize=False)
            s.send.copy_(s.master, non_blocking=True)
            if s.n > 1:
                s.pending = dist.all_gather_into_tensor(s.params, s.send, group=s.group, async_op=True)
            else:
                s.params[s.lo:s.hi].copy_(s.send)

    def finish(self) -> None:
        """Wait for every parameter gather in flight: the weights are the updated ones."""
        for s in self.states:
            s.wait()

    def wait_hooks(self, roots: list[torch.nn.Module]) -> None:
        """Forward pre-hooks on ``roots`` (a stage and its layers; an encoder and its blocks),
        each waiting for the gathers of the buckets holding the parameters it uses (its own,
        not those of a later root in the list that lies inside it)."""
        owner = {id(pc.param): s for s in self.states for pc in s.pieces}
        claimed: set[int] = set()
        plans = []
        for root in reversed(roots):  # inner roots first: they claim their parameters
            mine = {id(owner[id(p)]): owner[id(p)] for p in root.parameters() if id(p) in owner and id(p) not in claimed}
            claimed |= {id(p) for p in root.parameters()}
            plans.append((root, list(mine.values())))
        for root, states in plans:
            if states:
                self._hooks.append(root.register_forward_pre_hook(_waiter(states)))

    # ---- norm, clipping ----
    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's share of the gradients (fp64, on the device)."""
        total = torch.zeros((), dtype=torch.float64, device=self.states[0].device if self.states else "cpu")
        for s in self.states:
            total += (s.grad.double() * s.norm_mask).square().sum()
        return total

    def clip_(self, scale: torch.Tensor) -> None:
        for s in self.states:
            s.grad.mul_(scale.to(device=s.grad.device, dtype=s.grad.dtype))

    # ---- checkpoints ----
    def state_pieces(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's state, parameter by parameter: ``{name}.{master|exp_avg|exp_avg_sq}``
        1-d tensors of the elements ``lo .. hi`` of its flat local tensor, and the ranges.
        ``copy`` takes each piece off the optimizer's buffers (a host copy of its own)."""
        self.finish()
        tensors, ranges, steps = {}, {}, {}
        for i, s in enumerate(self.states):
            steps[i] = float(s.step)
            for pc in s.pieces:
                if pc.hi <= pc.lo:
                    continue
                a, b = pc.start + pc.lo - s.lo, pc.start + pc.hi - s.lo
                for key, buf in (("master", s.master), ("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)):
                    tensors[f"{pc.name}.{key}"] = copy(buf[a:b])
                ranges[pc.name] = {"range": [pc.lo, pc.hi], "numel": pc.param.numel(), "bucket": i}
        return tensors, {"ranges": ranges, "steps": steps, "sharded": self.sharded}

    @torch.no_grad()
    def load_local_states(self, states: Callable[[str], dict], step: Callable[[str], float], where: str) -> None:
        """Every bucket's state from whole local tensors (a checkpoint of another layout):
        ``states(name)`` gives ``master`` / ``exp_avg`` / ``exp_avg_sq`` shaped like the
        parameter, ``step(name)`` its step count (one per bucket: they must agree)."""
        for i, s in enumerate(self.states):
            counts = {step(pc.name) for pc in s.pieces}
            if len(counts) > 1:
                raise CheckpointError(f"{where}: the parameters of bucket {i} were written at different step counts {sorted(counts)}")
            if counts:
                s.step.fill_(counts.pop())
            for pc in s.pieces:
                if pc.hi <= pc.lo:
                    continue
                got = states(pc.name)
                a, b = pc.start + pc.lo - s.lo, pc.start + pc.hi - s.lo
                for key, buf in (("master", s.master), ("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)):
                    buf[a:b].copy_(got[key].reshape(-1)[pc.lo:pc.hi])

    def state_dict(self):
        raise NotImplementedError("BucketAdamW's state is saved per shard (state_pieces)")

    def close(self) -> None:
        self.finish()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def finish_updates(optimizers) -> None:
    """Wait for the weight gathers any ``BucketAdamW`` of ``optimizers`` (a dict or a list) has
    in flight: before reading, saving or evaluating the weights."""
    for opt in (optimizers.values() if isinstance(optimizers, dict) else optimizers):
        if isinstance(opt, BucketAdamW):
            opt.finish()


def bucket_grad_norm(optimizers: list[BucketAdamW], device: torch.device | str) -> torch.Tensor:
    """The global gradient norm from the optimizers' shards (one world-wide all-reduce of one
    number, left on ``device``; every element counted once)."""
    total = torch.zeros((), dtype=torch.float64, device=torch.device(device))
    for opt in optimizers:
        total += opt.grad_norm_sq().to(total.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def build_bucket_optimizers(params: list[TrainParam], grad_sync, lr: dict[str, float], weight_decay: dict[str, float],
                            sharded: bool, offload: bool) -> dict[str, BucketAdamW]:
    """One ``BucketAdamW`` per module with trainable parameters on this rank."""
    by_module: dict[str, list[TrainParam]] = defaultdict(list)
    for p in params:
        if p.param.requires_grad:
            by_module[p.module].append(p)
    return {m: BucketAdamW(ps, grad_sync, lr[m], weight_decay[m], sharded=sharded, offload=offload)
            for m, ps in by_module.items()}

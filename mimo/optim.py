"""Gradients and optimizers across modules: DP sync, global norm, clipping, AdamW, LR schedule.

Every local parameter is described by a ``TrainParam`` that says where it belongs (module,
layout-independent name), over which group its gradient is summed (the module's data-parallel
group: DP x CP), and whether this rank's copy is the one that counts in the global gradient
norm (one copy of every element in the world: TP-replicated copies count on TP rank 0 only,
DP copies on DP rank 0 only, a tied embedding on its first stage only).

The loss is normalised by the global loss-token count before backward, so gradients are
*summed* over DP (never averaged) and come out independent of how samples were split.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist


@dataclass
class TrainParam:
    module: str
    name: str
    param: torch.nn.Parameter
    dp_group: object | None  # gradients are summed over it; None: one rank
    counts_in_norm: bool
    weight_decay: bool = True


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each thing uses (DESIGN §8)."""

    params: torch.dtype
    compute: torch.dtype
    grad_reduce: torch.dtype
    optimizer_state: torch.dtype

    @classmethod
    def named(cls, name: str) -> "PrecisionPolicy":
        if name == "fp32":
            return cls(torch.float32, torch.float32, torch.float32, torch.float32)
        if name == "bf16":  # bf16 weights, activations and Adam state; gradients reduced in fp32
            return cls(torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16)
        raise ValueError(f"unknown precision {name!r}")


def sync_grads(params: Iterable[TrainParam], policy: PrecisionPolicy | None = None, bucket_numel: int = 1 << 22) -> None:
    """Sum gradients over each parameter's DP group, in buckets of about ``bucket_numel``."""
    pending = GradSync(policy, bucket_numel)
    pending.start(params)
    pending.finish()


class GradSync:
    """DP gradient sums started asynchronously, bucket by bucket, so they overlap what still
    runs (other modules' backward); ``finish()`` waits and writes the sums back, before the
    optimizer step. Every rank of a DP group must start the same params in the same order."""

    def __init__(self, policy: PrecisionPolicy | None = None, bucket_numel: int = 1 << 22):
        self.reduce_dtype = policy.grad_reduce if policy else torch.float32
        self.bucket_numel = bucket_numel
        self.started: set[int] = set()  # id() of the params already started
        self._pending: list[tuple] = []  # (work, flat, grads, group)

    def start(self, params: Iterable[TrainParam]) -> int:
        """Launch the sums of ``params``' gradients (which must be final); returns the bucket count."""
        by_group: dict[int, tuple[object, list[torch.Tensor]]] = {}
        for p in params:
            if p.dp_group is None:
                continue
            if p.param.grad is None:  # unused on this rank (e.g. no samples): every DP rank must send the same buckets
                p.param.grad = torch.zeros_like(p.param)
            self.started.add(id(p.param))
            by_group.setdefault(id(p.dp_group), (p.dp_group, []))[1].append(p.param.grad)
        count = 0
        for group, grads in by_group.values():
            for bucket in _buckets(grads, self.bucket_numel):
                flat = torch.cat([g.reshape(-1).to(self.reduce_dtype) for g in bucket])
                self._pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket, group))
                count += 1
        return count

    def finish(self) -> None:
        for work, flat, bucket, _ in self._pending:
            work.wait()
            off = 0
            for g in bucket:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
        self._pending.clear()


def _buckets(grads: list[torch.Tensor], bucket_numel: int):
    """Consecutive grads of one dtype and device, about ``bucket_numel`` elements each."""
    bucket, size = [], 0
    for g in grads:
        if bucket and (size + g.numel() > bucket_numel or g.dtype != bucket[0].dtype or g.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        yield bucket


def global_grad_norm(params: Iterable[TrainParam], world_group=None, device: torch.device | str = "cpu") -> float:
    """L2 norm of the whole model's gradient: one world-wide all-reduce of one number."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.counts_in_norm and p.param.grad is not None:
            total += p.param.grad.detach().double().pow(2).sum().to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, group=world_group)
    return math.sqrt(total.item())


def clip_grads_(params: Iterable[TrainParam], max_norm: float | None, norm: float) -> float:
    """Scale gradients so the global norm is at most ``max_norm``; returns the factor used."""
    if max_norm is None or norm <= max_norm or norm == 0.0:
        return 1.0
    scale = max_norm / (norm + 1e-6)
    for p in params:
        if p.param.grad is not None:
            p.param.grad.mul_(scale)
    return scale


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine", min_ratio: float = 0.1) -> float:
    """Learning rate for ``step`` (1-based): linear warmup, then constant or cosine decay."""
    if warmup_steps and step <= warmup_steps:
        return base_lr * step / warmup_steps
    if schedule == "constant":
        return base_lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizers(params: Iterable[TrainParam], lr: dict[str, float], weight_decay: dict[str, float]) -> dict[str, torch.optim.Optimizer]:
    """One AdamW per module, with weight decay only on the parameters that take it."""
    by_module: dict[str, list[TrainParam]] = defaultdict(list)
    for p in params:
        if p.param.requires_grad:
            by_module[p.module].append(p)
    optimizers = {}
    for module, infos in by_module.items():
        decay = [p.param for p in infos if p.weight_decay]
        no_decay = [p.param for p in infos if not p.weight_decay]
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay[module]}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        fused = all(p.param.is_cuda for p in infos)
        optimizers[module] = torch.optim.AdamW(groups, lr=lr[module], betas=(0.9, 0.95), eps=1e-8, fused=fused or None, foreach=None if fused else True)
    return optimizers

"""Gradients across modules: main-gradient buffers and their bucketed sums (``GradSync``),
the run's optimizers over them (``model_optimizers``: the buffers first, then one AdamW of
``mimo.training.bucket_optim`` per module over its buckets), global norm, clipping, LR schedule.

Every local parameter is described by a ``TrainParam`` that says where it belongs (module,
layout-independent name), over which group its gradient is summed (the module's data-parallel
group: DP x CP; first over TP where it is a partial sum there), and whether this rank's copy
is the one that counts in the global gradient norm (one copy of every element in the world:
TP-replicated copies count on TP rank 0 only, DP copies on DP rank 0 only, a tied embedding on
its first stage only).

The loss is normalised by the global loss-token count before backward, so gradients are
*summed* over DP (never averaged) and come out independent of how samples were split.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist

from mimo.parallel.params import TrainParam, main_grad
from mimo.training.bucket_optim import AdamW, build_optimizers
from mimo.training.precision import PrecisionPolicy

if TYPE_CHECKING:
    from mimo.compose.config import MimoConfig
    from mimo.compose.model import MimoModel


def bucket_numel(bucket_mb: float, reduce_dtype: torch.dtype) -> int:
    """Elements of ``reduce_dtype`` in a bucket of ``bucket_mb`` MiB (at least one)."""
    return max(1, int(bucket_mb * (1 << 20)) // torch.empty((), dtype=reduce_dtype).element_size())


REDUCE_MODES = ("all_reduce", "reduce_scatter")


@dataclass
class _Bucket:
    module: str
    group: object  # its gradients are summed over it (the DP group); None: no DP sum
    partial_groups: tuple  # then first over these (TP: its parameters' gradients are partial sums there)
    params: list[torch.nn.Parameter]
    flat: torch.Tensor | None = None  # the main gradients (fp32 at least); each parameter's ``main_grad`` is a view
    numel: int = 0  # its elements, padded to a multiple of the DP group's size in reduce-scatter mode
    dtype: torch.dtype | None = None  # its gradients' (the main gradients'; a direct bucket's: the weights')
    shard: torch.Tensor | None = None  # reduce-scatter mode: this rank's contiguous part of ``flat``
    index: int = -1  # DP launch order within its module, the same on every rank of the group (-1: no DP sum)
    ready: set[int] = field(default_factory=set)  # id() of params whose final grad is there
    work: object = None
    partial_done: bool = False  # this step's partial sums ran

    @property
    def direct(self) -> bool:
        """Its gradients are autograd's own ``.grad`` tensors (no buffer; see ``GradSync``)."""
        return self.flat is None


class GradSync:
    """A run's gradients: persistent main-gradient buffers, and their sums over each
    parameter's gradient groups in buckets, each DP sum launched (async) as soon as every
    parameter of its bucket has its final gradient, while the rest of backward still runs.

    Built once per run (``grad_sync_for``). Buckets are formed per module
    from its parameters in reverse registration order (about the order backward produces them),
    split by DP group, partial (TP) groups, dtype and device; each bucket's gradients live in
    one flat buffer of the reduction dtype, fp32 at least (``param.main_grad`` is a view).
    Where that is the parameter's own dtype (fp32), ``.grad`` is that view too: backward
    accumulates into the bucket, with no copy. Under bf16 each microbatch's ``.grad`` is added
    into the fp32 main gradient by a post-accumulate-grad hook and freed, so microbatches
    accumulate in fp32. The norm, clipping and the optimizer (``mimo.training.bucket_optim``)
    read the buckets' main gradients (``mimo.parallel.params.main_grad``: each parameter's view).

    A bucket with nothing to sum (no DP group, no partial groups) whose gradients are of its
    weights' dtype is **direct**: no buffer at all. ``zero_grad`` sets ``.grad`` to None, so
    autograd hands each parameter the gradient tensor it computed (no zero fill, no add into a
    view; later microbatches add into it) and the optimizer steps on ``.grad``. The memory of
    those gradients then exists only from the backward that makes them to the optimizer step,
    not through the forward's activation peak (issue 55: on one GPU the persistent bf16 buffer
    cost 10 GB and ~14 ms a step of fill and adds).

    The hook also marks a parameter ready, but only while its module is ``arm``-ed, i.e.
    during the module's last backward on this rank (earlier backwards only accumulate).
    Buckets of a module launch strictly in index order, so every rank of a DP group issues the
    same collectives in the same order whatever order autograd happens to produce the
    gradients in; ``flush`` launches the rest (a parameter this rank never used contributes
    zeros), and ``finish`` waits for all, before the optimizer step. Parameters whose
    gradient is a partial sum over TP (``TrainParam.partial_groups``: norm weights under
    sequence parallelism, QK-norm, ...) have buckets of their own, the module's last: each is
    all-reduced over its TP group once per step at ``flush`` (a point every TP rank reaches
    alike, never between the TP collectives of backward), then joins the DP sums.

    ``mode``: ``all_reduce`` (every rank gets each bucket's whole sum), or ``reduce_scatter``
    for a sharded optimizer: each DP bucket is padded to a multiple of its group's size and
    each rank gets the sum of its contiguous shard of it (``shards``); the rest of the bucket
    is then not a sum. ``note(kind, module, **extra)`` (optional) records
    bucket_reduce_start / _end events of the DP sums and partial_reduce events of the TP ones."""

    def __init__(self, params: list[TrainParam], policy: PrecisionPolicy | None = None, bucket_numel: int = 1 << 22,
                 note=None, mode: str = "all_reduce"):
        if mode not in REDUCE_MODES:
            raise ValueError(f"GradSync mode must be one of {REDUCE_MODES}, not {mode!r}")
        self.mode = mode
        self.params = list(params)  # what it was built from: the step's norm and clipping read these, not a rebuilt table
        self.reduce_dtype = policy.grad_reduce if policy else torch.float32
        self.note = note
        self.buckets: dict[str, list[_Bucket]] = {}  # per module: the DP-summed buckets, in launch order
        self.partial_buckets: dict[str, list[_Bucket]] = {}  # per module: those summed over TP first
        self._all: list[_Bucket] = []
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (param, its main grad)
        # main gradients (of weights in another dtype) not written yet this step: their first
        # microbatch copies instead of adding, so a new step need not zero them first
        self._fresh: dict[int, torch.Tensor] = {}
        # per module: (param, main grad) of the buckets without a DP sum: no hook per parameter;
        # ``accumulate`` adds their gradients with one foreach call per backward
        self._bulk: dict[str, list[tuple[torch.nn.Parameter, torch.Tensor]]] = defaultdict(list)
        self._next: dict[str, int] = {}  # per module: the index of the next bucket to launch
        self._armed: set[str] = set()
        self._hooks = []
        # per module: the GTP chains of its weights (``mimo.parallel.gtp``), whose gradients are
        # still being reduce-scattered when a backward ends
        self._gtp_chains: dict[str, list] = defaultdict(list)
        by_module: dict[str, list[TrainParam]] = defaultdict(list)
        seen: set[int] = set()  # a parameter listed twice (shared by two names) is reduced once
        for p in self.params:
            if p.param.requires_grad and id(p.param) not in seen:
                seen.add(id(p.param))
                by_module[p.module].append(p)
        for module, infos in by_module.items():
            buckets: list[_Bucket] = []
            open_: dict[tuple, _Bucket] = {}  # (groups, dtype, device) -> the bucket being filled
            sizes: dict[tuple, int] = {}
            # the partial ones last: their sums wait for flush, and DP buckets launch in order
            order = [p for p in reversed(infos) if not p.partial_groups] + [p for p in reversed(infos) if p.partial_groups]
            for p in order:
                key = (id(p.dp_group), tuple(map(id, p.partial_groups)), p.param.dtype, p.param.device)
                b = open_.get(key)
                if b is None or sizes[key] + p.param.numel() > bucket_numel:
                    b = open_[key] = _Bucket(module, p.dp_group, tuple(p.partial_groups), [])
                    buckets.append(b)
                    sizes[key] = 0
                b.params.append(p.param)
                sizes[key] += p.param.numel()
            for b in buckets:
                self._allocate(b)
            reduced = [b for b in buckets if b.group is not None]
            for i, b in enumerate(reduced):
                b.index = i
            self.buckets[module] = reduced
            self.partial_buckets[module] = [b for b in buckets if b.partial_groups]
            self._next[module] = 0
            self._all += buckets

    def _allocate(self, b: _Bucket) -> None:
        """The bucket's flat main-gradient buffer (zeros, or the gradients already there), the
        parameters' views into it, and their hooks; a direct bucket's size only."""
        p0 = b.params[0]
        b.dtype = dtype = torch.promote_types(p0.dtype, self.reduce_dtype)
        numel = sum(p.numel() for p in b.params)
        n = dist.get_world_size(b.group) if b.group is not None and self.mode == "reduce_scatter" else 1
        b.numel = -(-numel // n) * n
        for p in b.params:
            chain = getattr(p, "gtp", (None,))[0]
            if chain is not None and chain not in self._gtp_chains[b.module]:
                self._gtp_chains[b.module].append(chain)
        if b.group is None and not b.partial_groups and dtype == p0.dtype:
            return  # direct: autograd's own gradients (class doc)
        b.flat = torch.zeros(b.numel, dtype=dtype, device=p0.device)
        if n > 1:
            b.shard = b.flat.view(n, b.flat.numel() // n)[dist.get_rank(b.group)]
        off = 0
        with torch.no_grad():
            for p in b.params:
                view = b.flat[off : off + p.numel()].view_as(p)
                off += p.numel()
                if p.grad is not None:
                    view.copy_(p.grad)
                p.main_grad = view
                p.grad = view if p.dtype == dtype else None
                self._views.append((p, view))
                if b.group is not None:  # its DP sum launches when every gradient of it is final
                    p.grad_sync_hook = self._hook(b, view)
                    # a GTP weight's gradient is handed over outside autograd (mimo.parallel.gtp calls
                    # the hook then); autograd would call it, gradient-less, at its backward already
                    if getattr(p, "gtp", None) is None:
                        self._hooks.append(p.register_post_accumulate_grad_hook(p.grad_sync_hook))
                else:
                    self._bulk[b.module].append((p, view))

    def _hook(self, bucket: _Bucket, main: torch.Tensor):
        def on_grad(param: torch.nn.Parameter) -> None:
            g = param.grad
            if g is not None and g.numel() and g.data_ptr() != main.data_ptr():
                # a gradient outside the buffer (bf16 weights; or a .grad someone replaced):
                # this backward's contribution, accumulated in the main gradient's precision
                with torch.no_grad():
                    if self._fresh.pop(id(param), None) is not None:
                        main.copy_(g)
                    else:
                        main.add_(g)
                param.grad = main if g.dtype == main.dtype else None
            if bucket.index >= 0 and bucket.module in self._armed:
                bucket.ready.add(id(param))
                self._launch_ready(bucket.module)

        return on_grad

    def zero_grad(self) -> None:
        """A new step: every main gradient zero, and ``.grad`` its view again (or None under bf16;
        None in a direct bucket)."""
        self._fresh.clear()
        zeroed = []
        for b in self._all:
            if b.direct:
                for p in b.params:
                    p.grad = None  # autograd's next gradient becomes .grad itself
            elif b.params[0].dtype == b.flat.dtype:
                zeroed.append(b.flat)  # autograd accumulates straight into these views
            else:
                self._fresh.update((id(p), p.main_grad) for p in b.params)
            b.ready.clear()
            b.work, b.partial_done = None, False
        if zeroed:
            torch._foreach_zero_(zeroed)  # one launch (per device and dtype), not one per bucket
        for p, view in self._views:
            if p.dtype == view.dtype:
                if p.grad is not view:
                    p.grad = view
            elif p.grad is not None:
                p.grad = None
        self._next = dict.fromkeys(self._next, 0)
        self._armed.clear()

    def accumulate(self, module: str) -> None:
        """After a backward of ``module``: first its GTP weights' gradients, still being
        reduce-scattered, handed over (``GTPChain.finish_grads``, which calls their hooks); then the
        gradients of its buckets without a DP sum that are not their main gradients (bf16 weights;
        a replaced ``.grad``) into the main gradients (the first microbatch of a step copies),
        ``.grad`` freed or pointed at the main gradient again. Buckets with a DP sum do this in
        their per-parameter hooks, which also launch them."""
        for chain in self._gtp_chains.get(module, ()):
            chain.finish_grads()
        # fp32 weights' .grad is their main gradient already, unless someone replaced it
        pairs = [(p, main) for p, main in self._bulk.get(module, ())
                 if p.grad is not None and p.grad.data_ptr() != main.data_ptr()]
        if not pairs:
            return
        with torch.no_grad():
            fresh = [(p, main) for p, main in pairs if self._fresh.pop(id(p), None) is not None]
            seen = {id(p) for p, _ in fresh}
            added = [(p, main) for p, main in pairs if id(p) not in seen]
            if fresh:
                torch._foreach_copy_([m for _, m in fresh], [p.grad for p, _ in fresh])
            if added:
                torch._foreach_add_([m for _, m in added], [p.grad for p, _ in added])
        for p, main in pairs:
            p.grad = main if p.dtype == main.dtype else None

    def _settle(self, b: _Bucket) -> None:
        """Zero the main gradients of ``b`` that no microbatch wrote this step."""
        if self._fresh:
            for p in b.params:
                view = self._fresh.pop(id(p), None)
                if view is not None:
                    view.zero_()

    def arm(self, module: str) -> None:
        """The module's next backward on this rank is its last: launch buckets as they fill."""
        if module in self.buckets:
            self._armed.add(module)

    def flush(self, module: str) -> None:
        """After the module's last backward: its partial sums over TP, then every DP sum not
        launched yet."""
        self._armed.discard(module)
        for b in self.partial_buckets.get(module, []):
            if not b.partial_done:
                b.partial_done = True
                self._settle(b)
                for group in b.partial_groups:
                    if self.note is not None:
                        self.note("partial_reduce", module, numel=b.flat.numel())
                    dist.all_reduce(b.flat, group=group)
        for b in self.buckets.get(module, [])[self._next.get(module, 0):]:
            b.ready = {id(p) for p in b.params}
        self._launch_ready(module, flushing=True)

    def _launch_ready(self, module: str, flushing: bool = False) -> None:
        buckets, i = self.buckets.get(module, []), self._next.get(module, 0)
        while i < len(buckets) and len(buckets[i].ready) == len(buckets[i].params):
            b = buckets[i]
            if b.partial_groups and not b.partial_done:
                break  # its TP sum comes first, at flush
            self._settle(b)
            if self.note is not None:
                self.note("bucket_reduce_start", module, bucket=b.index, numel=b.flat.numel())
            if b.shard is not None:
                b.work = _reduce_scatter(b.shard, b.flat, b.group)
            else:
                b.work = dist.all_reduce(b.flat, group=b.group, async_op=True)
            i += 1
        self._next[module] = i

    def finish(self) -> None:
        """Launch what is left and wait for every bucket: the main gradients hold the sums."""
        for module in self._bulk:
            self.accumulate(module)
        for module in self.buckets:
            self.flush(module)
        for b in self._all:  # buckets that are not reduced (one rank): unused parameters read zero
            self._settle(b)
        for module, buckets in self.buckets.items():
            for b in buckets:
                b.work.wait()
                b.work = None
                if self.note is not None:
                    self.note("bucket_reduce_end", module, bucket=b.index)

    def module_buckets(self) -> dict[str, list[_Bucket]]:
        """Every bucket of each module (summed over a DP group or not), in the order they were made:
        what the module's optimizer steps on."""
        by_module: dict[str, list[_Bucket]] = defaultdict(list)
        for b in self._all:
            by_module[b.module].append(b)
        return dict(by_module)

    def gather_shards(self, params: Iterable[torch.nn.Parameter] | None = None) -> None:
        """Reduce-scatter mode, after ``finish``: all-gather the summed shards of the buckets
        holding ``params`` (default: all) so that their main gradients hold the whole sums (a
        tied embedding's copies summed across stages; verification reading full gradients)."""
        if self.mode != "reduce_scatter":
            return
        wanted = None if params is None else {id(p) for p in params}
        for b in self._all:
            if b.shard is None or (wanted is not None and not any(id(p) in wanted for p in b.params)):
                continue
            dist.all_gather_into_tensor(b.flat, b.shard.clone(), group=b.group)

    def shards(self, module: str) -> list[tuple[torch.Tensor, int]]:
        """Reduce-scatter mode: (this rank's summed shard, its offset in the bucket) of each DP
        bucket of ``module``, in launch order (after ``finish``)."""
        if self.mode != "reduce_scatter":
            raise ValueError("GradSync.shards: only in reduce_scatter mode")
        return [(b.shard, b.shard.numel() * dist.get_rank(b.group)) for b in self.buckets.get(module, [])]

    def close(self) -> None:
        """Remove the hooks and the ``main_grad`` views (fp32 ``.grad`` views stay: the gradients)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p, _ in self._views:
            if getattr(p, "main_grad", None) is not None:
                del p.main_grad
            if getattr(p, "grad_sync_hook", None) is not None:
                del p.grad_sync_hook
        self._views.clear()


def grad_sync_for(model: MimoModel, policy: PrecisionPolicy | None = None) -> GradSync:
    """The run's gradient buffers and bucketed sums: built on the first call (``model_optimizers``
    makes it) and kept on the model, the same buffers every step."""
    if model.grad_sync is None:
        reduce_dtype = policy.grad_reduce if policy else torch.float32
        mode = "reduce_scatter" if model.config.train.distributed_optimizer else "all_reduce"
        model.grad_sync = GradSync(model.train_params(), policy, bucket_numel(model.config.train.grad_bucket_mb, reduce_dtype),
                                   mode=mode)
    return model.grad_sync


def model_optimizers(config: MimoConfig, model: MimoModel, policy: PrecisionPolicy) -> dict[str, AdamW]:
    """The optimizer of each module ``model`` trains on this rank, over the run's gradient
    buffers (``grad_sync_for``: made here once; sharded under ``train.distributed_optimizer``)."""
    lr, weight_decay = optimizer_settings(config)
    # the gradient buffers first: each module's AdamW lays its weights and state out like its buckets
    buckets = grad_sync_for(model, policy).module_buckets()
    optimizers = build_optimizers(model.train_params(), buckets, lr, weight_decay, policy=policy,
                                  offload=config.train.optimizer_offload)
    for name, opt in optimizers.items():  # each layer waits for its weights' gather, not the whole model
        opt.wait_hooks(model.wait_roots(name))
    return optimizers


def _reduce_scatter(shard: torch.Tensor, flat: torch.Tensor, group):
    """Async: this rank's ``shard`` of ``flat`` (a view of it) becomes the group's sum of it."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.14
    return fn(shard, flat, group=group, async_op=True)


def global_grad_norm(params: Iterable[TrainParam], device: torch.device | str, world_group=None,
                     grads: list[torch.Tensor] | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient, as a 0-dim fp64 tensor left on ``device``: one
    world-wide all-reduce of one number.

    ``device``: the rank's compute device, where its term is summed and reduced. It is given,
    not taken from the parameters: a rank where nothing trains (a frozen module on its own
    ranks) has none, and its term must still be on the device every other rank reduces on (a
    CPU tensor there against CUDA tensors elsewhere: different NCCL/gloo collectives, a hang).
    Per-tensor norms in fp32 (``torch._foreach_norm``; fp64 for fp64 gradients, the references),
    squared and summed in fp64; nothing is read back to the host here (``clip_grads_`` takes the
    tensor), so the step need not wait for the device. ``grads``: the counted gradients (the
    optimizers' runs of them: ``grad_norm``), instead of ``params``'."""
    if grads is None:
        grads = [g for p in params if p.counts_in_norm and (g := main_grad(p.param)) is not None]
    total = torch.zeros((), dtype=torch.float64, device=torch.device(device))
    for on_device, wide in _by_device([g.detach() for g in grads]):
        norms = torch._foreach_norm(on_device, 2, dtype=wide)
        total += torch.stack(norms).double().pow(2).sum().to(total.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, group=world_group)
    return total.sqrt()


def clip_grads_(grads: list[torch.Tensor], max_norm: float | None, norm: torch.Tensor) -> None:
    """Scale ``grads`` (every gradient once: the optimizers' buckets) so the global norm is at
    most ``max_norm``: by ``min(1, max_norm / (norm + 1e-6))``, computed where ``norm`` lives (no
    host read)."""
    if max_norm is None:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for on_device, wide in _by_device(grads):
        torch._foreach_mul_(on_device, scale.to(device=on_device[0].device, dtype=wide))


def grad_norm(optimizers, device: torch.device | str) -> torch.Tensor:
    """The global gradient norm from the gradients the optimizers step on (one world-wide
    all-reduce of one number, left on ``device``; every element counted once). Every rank calls
    it, also one where nothing trains."""
    return global_grad_norm((), device, grads=[t for opt in optimizers for s in opt.states for t in s.counted_grads()])


def clip_(optimizers, max_norm: float | None, norm: torch.Tensor) -> None:
    """The gradients ``optimizers`` step on scaled so that the global norm (``grad_norm``) is at
    most ``max_norm`` (``clip_grads_``)."""
    clip_grads_([g for opt in optimizers for s in opt.states for g in s.grads()], max_norm, norm)


def _by_device(grads: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.dtype]]:
    """``grads`` grouped by device, each group with the dtype its norms and scales work in:
    fp32, or fp64 where a gradient is fp64 (the references)."""
    groups: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[g.device].append(g)
    return [(gs, torch.float64 if any(g.dtype == torch.float64 for g in gs) else torch.float32) for gs in groups.values()]


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
DEFAULT_MIN_RATIO = 0.1  # without train.min_lr the decaying schedules end at 10% of each base lr


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
          min_ratio: float = DEFAULT_MIN_RATIO, decay_steps: int = 0) -> float:
    """Learning rate for ``step`` (1-based): linear warmup over ``warmup_steps`` to ``base_lr``,
    then ``cosine`` or ``linear`` decay to ``min_ratio * base_lr`` at ``total_steps``,
    ``constant``, or ``wsd`` (warmup-stable-decay): constant until the last ``decay_steps``
    steps, then linear decay to ``min_ratio * base_lr``. A function of the step alone (exact
    resume relies on it)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; one of {LR_SCHEDULES}")
    if warmup_steps and step <= warmup_steps:
        return base_lr * step / warmup_steps
    if schedule == "constant":
        return base_lr
    start = total_steps - decay_steps if schedule == "wsd" else warmup_steps  # where the decay begins
    if step <= start:
        return base_lr
    progress = min(1.0, (step - start) / max(1, total_steps - start))
    if schedule == "cosine":
        return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return base_lr * (min_ratio + (1 - min_ratio) * (1 - progress))


def optimizer_settings(config: MimoConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Each module's AdamW base learning rate and weight decay (its own, else train's)."""
    train = config.train
    lr = {n: m.lr if m.lr is not None else train.lr for n, m in config.modules.items()}
    wd = {n: m.weight_decay if m.weight_decay is not None else train.weight_decay for n, m in config.modules.items()}
    return lr, wd


def lr_for(train, step: int, base_lr: float) -> float:
    """``lr_at`` under a ``train`` config section (``mimo.compose.config.TrainConfig``):
    ``warmup_ratio`` / ``decay_ratio`` are fractions of ``train.steps`` (rounded up),
    ``train.min_lr`` the final lr of a module at ``train.lr`` (a module with its own lr ends at
    the same fraction of it)."""
    min_ratio = train.min_lr / train.lr if train.min_lr is not None else DEFAULT_MIN_RATIO
    return lr_at(step, base_lr, train.warmup, train.steps, train.lr_schedule, min_ratio, train.decay)

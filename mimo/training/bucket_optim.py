"""AdamW, the run's one optimizer: each module's parameters stepped through its ``GradSync``
buckets, each bucket's weights, gradients and state as flat tensors.

One ``AdamW`` per module with trainable parameters on the rank (``build_optimizers``, handed
each module's buckets: ``mimo.training.optim.model_optimizers`` makes them first). At
construction the parameters of each bucket become views of one flat buffer laid out like the
bucket's main gradients, so a step is a handful of kernels over whole buckets whatever the count
of parameters (one AdamW call for the module's buckets, one weight-decay multiply), with no
Python pass over the parameters.

* **Precision** (``PrecisionPolicy.master_params``): the update runs on an fp32 master copy of
  the weights where the policy keeps one and the weights are narrower (bf16: the weights become
  the masters rounded), else on the weights themselves (fp32; bf16-pure; the fp64 references).
  The moments are of the dtype the update runs in, as torch's AdamW keeps them in its
  parameter's (bf16-pure: bf16; fp32 routers keep fp32 state everywhere). The gradient is the
  bucket's main gradient in that dtype (bf16-pure rounds the fp32 sum; bf16 with bf16
  reduction widens). Bytes per parameter beside the weights and main gradients: fp32 8, bf16 12,
  bf16-pure 4 (its moments) and, during the step only, 2 for the rounded gradient.
* **sharded** (``train.distributed_optimizer``, Megatron's ZeRO-1): ``GradSync`` runs in
  ``reduce_scatter`` mode, so after backward each rank holds the sum of its contiguous shard of
  every bucket over the bucket's data-parallel group (DP x CP for dense parameters, EDP for
  experts). The rank keeps the state (and masters) of that shard only, steps it, and all-gathers
  its part of the weights in place into the bucket's weight buffer. The gathers are started after
  the step and waited for by forward pre-hooks of the layers that use them (``wait_hooks``), so
  they overlap the next step's first forward; ``finish`` waits for all (before a checkpoint, an
  evaluation, or reading the weights).
* **whole** (the degenerate case: not sharded, or a bucket without a data-parallel group): every
  rank steps whole buckets of all-reduced gradients, and nothing is gathered.
* **offload** (``train.optimizer_offload``): masters and moments live in pinned host memory (on
  a GPU; the masters then in every precision, as the weights' host copy); each step copies the
  gradients to the host, runs AdamW there, and copies the new weights back.

The update is ``torch.optim.AdamW``'s (its functional kernel: foreach on the CPU; on CUDA the
same arithmetic as its fused kernel in ``mimo.parallel.adamw``'s Triton kernel, torch's fused one
where Triton is missing), with the decoupled weight decay where AdamW applies it, in the kernel's own pass: a bucket mixes
parameters with and without decay, so each step is one call over the decayed runs and one over
the others; on the CPU
an fp32 run's weights are torch's AdamW's, bit for bit. The global gradient norm and clipping
read the gradients the optimizers step on (``mimo.training.optim.grad_norm`` counts each
element once in the world: its data-parallel copies by shard, its other copies by the
placement's owner rule). The
checkpoint holds per parameter the flat elements this rank keeps (whole parameters where the
rank writes their weights; each rank's shard under the distributed optimizer), with its range
and placement record (``state_pieces``), read back at any layout through those records
(``load_local_states``, ``mimo.training.reshard``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from mimo.core.errors import CheckpointError
from mimo.parallel import adamw as adamw_kernel
from mimo.parallel.params import TrainParam
from mimo.training.precision import PrecisionPolicy


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


def _runs(pieces: list[_Piece], offset: int, keep: Callable[[_Piece], bool], merge: bool = True) -> list[tuple[int, int]]:
    """The ranges (in the shard, which starts at ``offset`` of the bucket) of the pieces ``keep``
    takes, neighbours merged (unless not ``merge``: a direct bucket's gradients are tensors of
    their own)."""
    out: list[tuple[int, int]] = []
    for pc in pieces:
        if not keep(pc) or pc.hi <= pc.lo:
            continue
        a, b = pc.start + pc.lo - offset, pc.start + pc.hi - offset
        if merge and out and out[-1][1] == a:
            a = out.pop()[0]
        out.append((a, b))
    return out


class _State:
    """One bucket's optimizer side on this rank."""

    def __init__(self, bucket, info: dict[int, TrainParam], master_dtype: torch.dtype | None, offload: bool):
        self.bucket = bucket
        self.group = bucket.group if bucket.shard is not None else None  # (reduce-scatter mode: sharded)
        self.n = 1 if self.group is None else dist.get_world_size(self.group)
        size = bucket.numel // self.n
        self.lo = (0 if self.group is None else dist.get_rank(self.group)) * size
        # the summed gradients this rank steps on (a direct bucket: each parameter's .grad, ``_grad_of``)
        self.grad = bucket.flat if bucket.shard is None else bucket.shard
        self.pieces = pieces = []
        off = 0
        for p in bucket.params:
            tp = info[id(p)]
            lo, hi = (min(max(x - off, 0), p.numel()) for x in (self.lo, self.lo + size))
            # sharded: the shard owns this rank's part of the data-parallel sum, so only the other
            # axes' copies decide; whole: one data-parallel copy counts too
            counts = tp.counts_in_shard_norm if self.n > 1 else tp.counts_in_norm
            pieces.append(_Piece(tp.name, p, off, lo, hi, tp.weight_decay, counts))
            off += p.numel()
        self.device = bucket.params[0].device
        dtype = bucket.params[0].dtype
        # the parameters become views of one buffer laid out like the gradients (padding included)
        self.params = torch.zeros(bucket.numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            for pc in pieces:
                view = self.params[pc.start:pc.start + pc.param.numel()].view_as(pc.param)
                view.copy_(pc.param.detach())
                pc.param.data = view
        self.own = self.params[self.lo:self.lo + size]  # this rank's part of the weights
        where = torch.device("cpu") if offload else self.device
        pin = where != self.device and self.device.type == "cuda"
        wide = master_dtype if master_dtype is not None and master_dtype.itemsize > dtype.itemsize else dtype
        new = lambda: torch.zeros(size, dtype=wide, device=where, pin_memory=pin)  # noqa: E731
        # what AdamW updates: a master copy (wider than the weights, or away from them), else the
        # weights; a copy is taken from the weights at the first step unless a checkpoint gave it
        # (weights loaded after the optimizer was built, train.init_from, are its start)
        self.keeps_master = wide != dtype
        self.master = self.own if wide == dtype and where == self.device else new()
        self.stale = self.master is not self.own
        self.exp_avg, self.exp_avg_sq = new(), new()
        self.fused = where.type == "cuda"  # the fused kernel takes its step counts on the device
        self.step = torch.zeros((), dtype=torch.float32, device=where if self.fused else "cpu")
        self.grad_host = torch.empty(size, dtype=bucket.dtype, pin_memory=pin) if where != self.device else None
        # the runs of parameters with and without weight decay: AdamW steps each kind in one call
        # that applies (or not) the decay in its own pass; each run counts its steps in its own
        # tensor (the kernel advances every count it is given), all equal to ``step``
        merge = not bucket.direct
        self.spans = {decay: _runs(pieces, self.lo, lambda pc, d=decay: pc.decay == d, merge) for decay in (True, False)}
        self.span_steps = {d: [torch.zeros_like(self.step) for _ in spans] for d, spans in self.spans.items()}
        self.counted = _runs(pieces, self.lo, lambda pc: pc.counts, merge)
        self._at = {pc.start: pc.param for pc in pieces}  # a direct bucket's parameters by their run's start
        self.pending = None  # the all-gather in flight

    def _grad_of(self, a: int, b: int) -> torch.Tensor:
        """The gradient of the run ``a .. b`` of this rank's elements (a direct bucket's runs are
        whole parameters: its ``.grad``, zeros where backward never reached it)."""
        if not self.bucket.direct:
            return self.grad[a:b]
        g = self._at[a].grad
        return g.reshape(-1) if g is not None else torch.zeros(b - a, dtype=self.bucket.dtype, device=self.device)

    def counted_grads(self) -> list[torch.Tensor]:
        """The gradients this rank's norm counts."""
        return [self._grad_of(a, b) for a, b in self.counted]

    def grads(self) -> list[torch.Tensor]:
        """Every gradient it steps on (clipping scales these)."""
        if not self.bucket.direct:
            return [self.grad]
        return [p.grad for p in self.bucket.params if p.grad is not None]

    def step_grads(self, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The gradients of ``runs`` as the update reads them: in the update's dtype, from the
        host copy when offloaded (taken by ``to_host``)."""
        host = self.grad_host
        return [(host[a:b] if host is not None else self._grad_of(a, b)).to(self.master.dtype) for a, b in runs]

    def to_host(self) -> None:
        """Offloaded: the gradients copied to the host (asynchronously)."""
        if self.bucket.direct:
            for a, b in self.spans[True] + self.spans[False]:
                self.grad_host[a:b].copy_(self._grad_of(a, b), non_blocking=True)
        else:
            self.grad_host.copy_(self.grad, non_blocking=True)

    def refresh(self) -> None:
        """The master taken from the weights, if it was not set since they were."""
        if self.stale:
            self.master.copy_(self.own)
            self.stale = False

    def publish(self) -> None:
        """The updated part of the weights into the parameters (and to the other shards' ranks)."""
        if self.master is not self.own:
            self.own.copy_(self.master, non_blocking=True)
        if self.n > 1:
            self.pending = dist.all_gather_into_tensor(self.params, self.own, group=self.group, async_op=True)

    def set_step(self, count: float) -> None:
        for t in [self.step, *self.span_steps[True], *self.span_steps[False]]:
            t.fill_(count)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def fields(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """The state checkpointed: the moments, and the masters where they are not the weights."""
        return (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)) + ((("master", self.master),)
                                                                               if self.keeps_master else ())


def _waiter(states: list[_State]):
    def wait(module, args) -> None:  # (a pre-hook returning something would replace the inputs)
        for s in states:
            s.wait()

    return wait


class AdamW(torch.optim.Optimizer):
    """AdamW of one module over its ``GradSync`` buckets (``buckets``: the module's entry of
    ``GradSync.module_buckets``; see module doc), with the masters of ``policy`` (a
    ``mimo.training.precision.PrecisionPolicy``; None: none). ``param_groups[0]`` holds the
    hyperparameters (the step sets its ``lr``); ``state[p]`` is a view of ``p``'s state in the
    buckets' buffers (``exp_avg``, ``exp_avg_sq``, ``master`` where kept, its bucket's ``step``):
    the elements this rank keeps, shaped like ``p`` where that is all of it."""

    def __init__(self, params: list[TrainParam], buckets: list, lr: float, weight_decay: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, policy: PrecisionPolicy | None = None, offload: bool = False):
        super().__init__([p.param for p in params], dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        info = {id(p.param): p for p in params}
        master_dtype = policy.master_params if policy is not None else None
        self.states = [_State(b, info, master_dtype, offload) for b in buckets]
        for s in self.states:  # ``state[p]``: views of what this rank keeps of p (shaped like p where it is all of p)
            for pc in s.pieces:
                if pc.hi > pc.lo:
                    a, b = pc.start + pc.lo - s.lo, pc.start + pc.hi - s.lo
                    shape = pc.param.shape if pc.hi - pc.lo == pc.param.numel() else (pc.hi - pc.lo,)
                    self.state[pc.param] = {key: buf[a:b].view(shape) for key, buf in s.fields()} | {"step": s.step}
        self._hooks = []
        # per kind of run (decayed or not): the kernel's lists, and where each run's gradient lies
        # (taken at each step: bf16-pure rounds the gradients anew)
        self._calls = {}
        for decay in (True, False):
            runs = [(i, a, b) for i, s in enumerate(self.states) for a, b in s.spans[decay]]
            self._calls[decay] = (runs, *([getattr(self.states[i], k)[a:b] for i, a, b in runs]
                                          for k in ("master", "exp_avg", "exp_avg_sq")),
                                  [t for s in self.states for t in s.span_steps[decay]])

    # ---- the step ----
    @torch.no_grad()
    def step(self, closure=None):
        if not self.states:
            return
        group = self.param_groups[0]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        from torch.optim.adamw import adamw

        for s in self.states:
            s.wait()  # (a gather still in flight: never, a step needs a forward first)
            s.refresh()
            if s.grad_host is not None:
                s.to_host()
        if self.states[0].grad_host is not None and self.states[0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        fused = self.states[0].fused
        for decay, (runs, masters, exp_avgs, exp_avg_sqs, steps) in self._calls.items():
            if runs:
                grads = [g for s in self.states for g in s.step_grads(s.spans[decay])]  # in the runs' order
                if fused and adamw_kernel.takes(masters, grads, exp_avgs, exp_avg_sqs):  # wide blocks, one pass
                    adamw_kernel.adamw_(masters, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
                                        eps=eps, weight_decay=wd if decay else 0.0)
                    continue
                adamw(masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                      foreach=None if fused else True, fused=fused or None, amsgrad=False, beta1=beta1, beta2=beta2,
                      lr=lr, weight_decay=wd if decay else 0.0, eps=eps, maximize=False)
        torch._foreach_add_([s.step for s in self.states], 1.0)
        for s in self.states:
            s.publish()

    def finish(self) -> None:
        """Wait for every parameter gather in flight: the weights are the updated ones."""
        for s in self.states:
            s.wait()

    def wait_hooks(self, roots: list[torch.nn.Module]) -> None:
        """Forward pre-hooks on ``roots`` (a stage and its layers; an encoder and its blocks),
        each waiting for the gathers of the sharded buckets holding the parameters it uses (its
        own, not those of a later root in the list that lies inside it). None where nothing is
        gathered."""
        owner = {id(pc.param): s for s in self.states if s.n > 1 for pc in s.pieces}
        claimed: set[int] = set()
        plans = []
        for root in reversed(roots):  # inner roots first: they claim their parameters
            mine = {id(owner[id(p)]): owner[id(p)] for p in root.parameters() if id(p) in owner and id(p) not in claimed}
            claimed |= {id(p) for p in root.parameters()}
            plans.append((root, list(mine.values())))
        for root, states in plans:
            if states:
                self._hooks.append(root.register_forward_pre_hook(_waiter(states)))

    def state_bytes(self) -> int:
        """Bytes of its own tensors: moments, masters that are not the weights, host gradients."""
        own = [t for s in self.states for _, t in s.fields()] + [s.grad_host for s in self.states if s.grad_host is not None]
        return sum(t.numel() * t.element_size() for t in own)

    # ---- checkpoints ----
    def state_pieces(self, copy: Callable[[torch.Tensor], torch.Tensor], writes: Callable[[torch.nn.Parameter], bool]
                     ) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's state, parameter by parameter: ``{name}.{exp_avg|exp_avg_sq|master}``
        1-d tensors of the elements ``lo .. hi`` of its flat local tensor, and the ranges; of a
        bucket stepped whole only the parameters this rank ``writes`` (their weights' writer).
        ``copy`` takes each piece off the optimizer's buffers (a host copy of its own)."""
        self.finish()
        tensors, ranges, steps = {}, {}, {}
        for i, s in enumerate(self.states):
            s.refresh()
            steps[i] = float(s.step)
            for pc in s.pieces:
                if pc.hi <= pc.lo or (s.n == 1 and not writes(pc.param)):
                    continue
                a, b = pc.start + pc.lo - s.lo, pc.start + pc.hi - s.lo
                for key, buf in s.fields():
                    tensors[f"{pc.name}.{key}"] = copy(buf[a:b])
                ranges[pc.name] = {"range": [pc.lo, pc.hi], "numel": pc.param.numel(), "bucket": i}
        return tensors, {"ranges": ranges, "steps": steps, "sharded": any(s.n > 1 for s in self.states)}

    @torch.no_grad()
    def load_local_states(self, states: Callable[[str, bool], dict | None], step: Callable[[str], float], where: str) -> None:
        """Every bucket's state from whole local tensors (a checkpoint of another layout):
        ``states(name, master)`` gives ``exp_avg`` / ``exp_avg_sq`` (and with ``master`` the
        fp32 master) shaped like the parameter, or None for a parameter not stepped yet (zero
        moments, the master from the weights); ``step(name)`` its step count (one per bucket:
        they must agree)."""
        for i, s in enumerate(self.states):
            counts = {step(pc.name) for pc in s.pieces}
            if len(counts) > 1:
                raise CheckpointError(f"{where}: the parameters of bucket {i} were written at different step counts {sorted(counts)}")
            if counts:
                s.set_step(counts.pop())
            for pc in s.pieces:
                if pc.hi <= pc.lo:
                    continue
                got = states(pc.name, s.keeps_master)
                a, b = pc.start + pc.lo - s.lo, pc.start + pc.hi - s.lo
                for key, buf in s.fields():
                    if got is not None:
                        buf[a:b].copy_(got[key].reshape(-1)[pc.lo:pc.hi])
                    elif key == "master":  # not stepped yet when written: the weights, zero moments
                        buf[a:b].copy_(s.own[a:b])
                    else:
                        buf[a:b].zero_()
            # the masters read; a copy of the weights of their own dtype (offloaded) is taken at the next step
            s.stale = s.master is not s.own and not s.keeps_master

    def state_dict(self):
        raise NotImplementedError("AdamW's state is saved per parameter piece (state_pieces)")

    def close(self) -> None:
        self.finish()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def finish_updates(optimizers) -> None:
    """Wait for the weight gathers ``optimizers`` (a dict or a list) have in flight: before
    reading, saving or evaluating the weights."""
    for opt in (optimizers.values() if isinstance(optimizers, dict) else optimizers):
        opt.finish()


def build_optimizers(params: list[TrainParam], buckets: dict[str, list], lr: dict[str, float], weight_decay: dict[str, float],
                     policy: PrecisionPolicy | None = None, offload: bool = False) -> dict[str, AdamW]:
    """One ``AdamW`` per module with trainable parameters on this rank, over the module's
    gradient buckets (``buckets``: ``GradSync.module_buckets``; sharded where they are
    reduce-scattered), with the policy's masters."""
    by_module: dict[str, list[TrainParam]] = defaultdict(list)
    for p in params:
        if p.param.requires_grad:
            by_module[p.module].append(p)
    return {m: AdamW(ps, buckets.get(m, []), lr[m], weight_decay[m], policy=policy, offload=offload)
            for m, ps in by_module.items()}

"""GTP: large weights sharded further inside the TP group and gathered just in time.

With ``parallel.gtp: N`` a module's ranks are tp x gtp x cp x dp x pp and the gtp ranks of one
TP coordinate are data-parallel replicas of one another (each takes its own share of the data,
as a DP replica does: the module's grid has ``dp = gtp x dp`` data replicas, gtp the fastest)
that hold each large weight — every 2-d weight of the GEMM seam that is neither padded nor a
partial sum: attention, MLP, Mamba-2, GDN, shared experts, the ViT — as ``1/(tp*gtp)`` of it: its
TP shard split again along the output dim (``ParamPlacement`` shards ``("tp", d), ("gtp", 0)``;
a fused weight's parts each split on their own). Norms, biases, convolutions, Mamba-2's A/D/dt,
routers, embeddings and the LM head stay as TP leaves them.

A GTP weight used by ``mimo.parallel.gemm.linear`` goes through ``_GTPLinear``: forward gathers
the TP shard over the gtp group (``GTPChain.full``), multiplies, and keeps only the input and
the weight's own shard; backward gathers again, and the weight's gradient — this rank's full TP
shard of it, from its own data — is reduce-scattered over the gtp group into its GTP shard (the
sum over the gtp replicas), then summed over cp x dp with the other gradients (``GradSync``).
The reduce-scatter runs asynchronously: it is finished, and its result handed to the parameter
(``.grad``, then ``GradSync``'s hook), when the next GTP weight's backward starts, or by
``finish_grads`` at the end of the module's backward (``GradSync.accumulate`` calls it).

Prefetch: each module's chain records its weights in the order the first forward uses them; a
gather, once waited for, starts the next weight's gather (forward: the next one; backward: the
one before), so that it travels while this weight's GEMM runs. ``trace`` (a list, optional)
records ``(event, weight, time)`` for gathers and GEMMs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["GTPChain", "gtp_placement", "gtp_linear"]


def gtp_placement(placement, gtp: int):
    """``placement`` with its output dim (0) split over ``gtp`` inside TP, for a weight GTP
    shards (2-d, not padded, not a partial sum); else as it is."""
    from mimo.parallel.placement import ParamPlacement

    if gtp <= 1 or len(placement.full_shape) != 2 or placement.pad or placement.partial:
        return placement
    return ParamPlacement(placement.full_shape, (*placement.shards, ("gtp", 0)), placement.partial, placement.pad,
                          placement.parts, placement.parts_dim if placement.parts else None)


class GTPChain:
    """One module's GTP weights on this rank: gathers with prefetch, gradients scattered back."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self.order: list[torch.nn.Parameter] = []
        self._index: dict[int, int] = {}
        self._pending: dict[int, tuple[object, list[torch.Tensor]]] = {}
        self._grads: list[tuple[torch.nn.Parameter, object, torch.Tensor]] = []  # reduce-scatters in flight
        self.trace: list | None = None

    def register(self, param: torch.nn.Parameter, placement, axis: str, sizes: dict[str, int]) -> None:
        """Mark ``param``, which ``placement`` splits over this chain's ``axis``, as gathered by
        this chain (along the dim that axis splits; a fused weight's parts each on their own)."""
        dim = dict(placement.shards)[axis]
        if placement.parts and placement.parts_dim == dim:
            n = placement.count(dim, sizes)
            local = [p // n for p in placement.parts]
        else:
            local = [param.shape[dim]]
        param.gtp = (self, local, dim)

    # ---- gathers ----
    def _note(self, event: str, param) -> None:
        if self.trace is not None:
            self.trace.append((event, self._index.get(id(param), -1), time.perf_counter()))

    def _launch(self, param) -> None:
        self._note("gather_start", param)
        shard = param.detach().contiguous()
        bufs = [torch.empty_like(shard) for _ in range(self.size)]
        self._pending[id(param)] = (dist.all_gather(bufs, shard, group=self.group, async_op=True), bufs)

    def full(self, param, backward: bool) -> torch.Tensor:
        """``param``'s TP shard, gathered (waiting for a prefetch in flight), and the next
        weight's gather started (forward: the next in order; backward: the one before)."""
        key = id(param)
        if not backward and key not in self._index:
            self._index[key] = len(self.order)
            self.order.append(param)
        if key not in self._pending:
            self._launch(param)
        work, bufs = self._pending.pop(key)
        work.wait()
        self._note("gather_end", param)
        i = self._index.get(key)
        if i is not None:
            j = i - 1 if backward else i + 1
            if 0 <= j < len(self.order) and id(self.order[j]) not in self._pending:
                self._launch(self.order[j])
        return _assemble(bufs, param.gtp[1], param.gtp[2])

    def scatter_grad(self, grad: torch.Tensor, param) -> None:
        """Start summing this rank's GTP shard of ``grad`` (a full TP shard) over the gtp group;
        it reaches ``param`` when finished (``finish_grads``)."""
        pieces = _split(grad, param.gtp[1], self.size, param.gtp[2])  # [rank g's shard of it, for every g]
        self._note("scatter_start", param)
        if grad.is_cuda and "nccl" in str(dist.get_backend(self.group)).lower():
            out = torch.empty_like(pieces[0])
            work = dist.reduce_scatter_tensor(out, torch.stack(pieces), group=self.group, async_op=True)
        else:  # gloo: no reduce-scatter; all-reduce and keep this rank's piece
            out = torch.stack(pieces)
            work = dist.all_reduce(out, group=self.group, async_op=True)
        self._grads.append((param, work, out))

    def finish_grads(self) -> None:
        """Wait for the gradient reduce-scatters in flight and hand each its parameter: into
        ``.grad`` (added), then the parameter's ``GradSync`` hook, as autograd's own would."""
        grads, self._grads = self._grads, []
        for param, work, out in grads:
            work.wait()
            self._note("scatter_end", param)
            g = out.view_as(param) if out.numel() == param.numel() else out[self.rank].clone()
            if param.grad is None:
                param.grad = g
            else:
                param.grad.add_(g)
            hook = getattr(param, "grad_sync_hook", None)
            if hook is not None:
                hook(param)

    def drop(self) -> None:
        """Forget prefetches not consumed (weights about to change)."""
        for work, _ in self._pending.values():
            work.wait()
        self._pending.clear()


def _assemble(bufs: list[torch.Tensor], local: list[int], dim: int = 0) -> torch.Tensor:
    """The TP shard from the gtp ranks' shards along ``dim``: part by part, rank after rank."""
    if len(local) == 1:
        return torch.cat(bufs, dim)
    chunks = [b.split(local, dim) for b in bufs]
    return torch.cat([c[p] for p in range(len(local)) for c in chunks], dim)


def _split(full: torch.Tensor, local: list[int], n: int, dim: int = 0) -> list[torch.Tensor]:
    """``_assemble``'s inverse: each gtp rank's shard of a TP shard (contiguous)."""
    if len(local) == 1:
        return [c.contiguous() for c in full.chunk(n, dim)]
    by_part = [p.chunk(n, dim) for p in full.split([k * n for k in local], dim)]
    return [torch.cat([by_part[p][g] for p in range(len(local))], dim) for g in range(n)]


class _GTPLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, bias):
        chain = shard.gtp[0]
        # a forward recomputed inside backward (mimo.parallel.recompute) prefetches backward's way
        w = chain.full(shard, backward=torch._C._current_graph_task_id() != -1)
        chain._note("gemm_start", shard)
        y = F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
        chain._note("gemm_end", shard)
        ctx.save_for_backward(x)
        # the parameter itself, not a saved tensor: saved-tensor hooks (recompute's, say) hand back
        # an alias without the parameter's ``gtp`` record
        ctx.shard, ctx.has_bias = shard, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        shard = ctx.shard
        chain = shard.gtp[0]
        chain._note("backward_start", shard)
        chain.finish_grads()  # the previous weights' reduce-scatters: they ran meanwhile
        w = chain.full(shard, backward=True).to(dy.dtype)
        dx = dy @ w
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        if shard.requires_grad:
            chain.scatter_grad((dy2.T @ x2).to(shard.dtype), shard)  # reaches the weight later
        db = dy2.sum(0) if ctx.has_bias else None
        return dx, None, db


def gtp_linear(x: torch.Tensor, weight: torch.nn.Parameter, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` for a GTP weight (see module doc)."""
    return _GTPLinear.apply(x, weight, bias)


class _GTPGroupedLinear(torch.autograd.Function):
    """The experts' grouped GEMM on a weight split over egtp: gathered in forward, kept as its
    shard, gathered again in backward, where the product is recomputed under autograd for the
    input's and the (full ETP shard's) weight's gradients; the weight's reduce-scattered as a
    dense GTP weight's is."""

    @staticmethod
    def forward(ctx, x, shard, offsets, grouped):
        chain = shard.gtp[0]
        w = chain.full(shard, backward=torch._C._current_graph_task_id() != -1)
        ctx.save_for_backward(x, offsets)
        ctx.shard, ctx.grouped = shard, grouped
        return grouped(x, w.to(x.dtype), offsets)

    @staticmethod
    def backward(ctx, dy):
        x, offsets = ctx.saved_tensors
        shard = ctx.shard
        chain = shard.gtp[0]
        chain._note("backward_start", shard)
        chain.finish_grads()
        w = chain.full(shard, backward=True)
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), w.detach().to(x.dtype).requires_grad_()
            dx, dw = torch.autograd.grad(ctx.grouped(xr, wr, offsets), (xr, wr), dy)
        if shard.requires_grad:
            chain.scatter_grad(dw.to(shard.dtype), shard)
        return dx, None, None, None


def gtp_grouped_linear(x: torch.Tensor, weight: torch.nn.Parameter, offsets: torch.Tensor, grouped) -> torch.Tensor:
    """``grouped(x, W, offsets)`` (``mimo.parallel.gemm.grouped_linear``'s product) for an egtp weight."""
    return _GTPGroupedLinear.apply(x, weight, offsets, grouped)

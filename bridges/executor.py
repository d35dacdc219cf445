"""Executing transfer plans, forward and (by the opposite plan) backward.

``Bridge`` moves a tensor from a source placement to a destination placement inside
autograd. Colocated bridges run one ``all_to_all_single`` on the shared ranks. Non-colocated
bridges run one ``batch_isend_irecv`` on the bridge's own group (source ∪ destination), then
an all-gather of even-sized column chunks inside each destination replica group.

On a non-colocated source rank ``bridge(x)`` returns an empty *token* attached to ``x``'s
graph; ``Bridge.backward_source(token)`` (or any autograd backward through the token) runs
the receive of the gradient, which lands as ``x``'s gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mimo.core.errors import LayoutError
from mimo.bridges.plan import FinishGather, Move, TransferPlan, rank_plans
from mimo.parallel.layout import Placement, RunPlacement, as_runs


@dataclass
class BridgeStats:
    """Elements sent by this rank to other ranks, per direction, and all-gather volume."""

    fwd_sent: int = 0
    bwd_sent: int = 0
    fwd_allgather: int = 0
    bwd_allgather: int = 0
    calls: int = 0
    history: list = field(default_factory=list)


def _slice(buf: torch.Tensor, m: Move, row: int, col0: int) -> torch.Tensor:
    return buf[row : row + m.rows, m.col - col0 : m.col - col0 + m.cols]


def _flat_region(buf: torch.Tensor, moves: list[Move], row_of, col0: int) -> torch.Tensor | None:
    """A flat view of ``buf`` holding the moves' slices in order, if they are consecutive
    full-width rows of a contiguous buffer; else None."""
    if not moves or not buf.is_contiguous():
        return None
    start = row = row_of(moves[0])
    for m in moves:
        if m.col - col0 != 0 or m.cols != buf.shape[1] or row_of(m) != row:
            return None
        row += m.rows
    return buf[start:row].view(-1)


def _per_peer(ranks: list[int], moves: list[Move], side: str) -> list[int]:
    """Elements of ``moves`` per peer (``m.dst`` or ``m.src``), in the order of ``ranks``."""
    numel = dict.fromkeys(ranks, 0)
    for m in moves:
        numel[getattr(m, side)] += m.numel
    return list(numel.values())


class _Executor:
    """Runs one direction of a bridge on this rank."""

    def __init__(self, plan: TransferPlan, rank: int, group, replica_group, defer_sends: bool = False):
        self.plan, self.rank, self.group = plan, rank, group
        self.replica_group = replica_group
        self.defer_sends = defer_sends
        self.deferred: list[tuple] = []  # (requests, tensors they read): sends not waited for yet
        self.src_col0 = plan.src.columns_of(rank).start if plan.src.holds_rank(rank) else 0
        self.dst_col0 = plan.dst.columns_of(rank).start if plan.dst.holds_rank(rank) else 0
        self.sends = [m for m in plan.moves if m.src == rank and m.dst != rank]
        self.recvs = [m for m in plan.moves if m.dst == rank and m.src != rank]
        self.local = [m for m in plan.moves if m.src == rank and m.dst == rank]
        self.gather = next((g for g in plan.gathers if rank in g.ranks), None)
        if self.gather is not None:
            members = tuple(sorted(dist.get_process_group_ranks(replica_group))) if replica_group is not None else (rank,)
            if members != self.gather.ranks:
                raise LayoutError(f"rank {rank}: replica group {members} differs from the plan's {self.gather.ranks}")

    @property
    def sent_numel(self) -> int:
        return sum(m.numel for m in self.sends)

    def _pack(self, x: torch.Tensor, moves: list[Move]) -> torch.Tensor:
        """The moves' source slices as one flat tensor: a view of ``x`` when they are
        consecutive full-width rows (no copy), else one gathered copy."""
        view = _flat_region(x, moves, lambda m: m.src_row, self.src_col0)
        if view is not None:
            return view
        flat = x.new_empty(sum(m.numel for m in moves))
        self._scatter(flat, moves, lambda m: _slice(x, m, m.src_row, self.src_col0), into_flat=True)
        return flat

    def _recv_buffer(self, y: torch.Tensor, moves: list[Move], dtype, device) -> tuple[torch.Tensor, bool]:
        """Where to receive: straight into ``y`` when the moves are consecutive full-width
        rows of it (second value False: nothing to unpack), else a staging buffer."""
        view = _flat_region(y, moves, lambda m: m.dst_row, self.dst_col0)
        if view is not None:
            return view, False
        return torch.empty(sum(m.numel for m in moves), dtype=dtype, device=device), True

    def _unpack(self, y: torch.Tensor, flat: torch.Tensor, moves: list[Move]) -> None:
        self._scatter(flat, moves, lambda m: _slice(y, m, m.dst_row, self.dst_col0), into_flat=False)

    @staticmethod
    def _scatter(flat: torch.Tensor, moves: list[Move], region, into_flat: bool) -> None:
        off = 0
        for m in moves:
            part = flat[off : off + m.numel].view(m.rows, m.cols)
            (part.copy_(region(m)) if into_flat else region(m).copy_(part))
            off += m.numel

    def _output(self, dtype, device) -> torch.Tensor:
        rows, cols = self.plan.dst.local_shape(self.rank)
        if self.gather is not None:
            cols = self.gather.chunk * len(self.gather.ranks)
        # rows no piece covers (gaps) must read as zeros; covered buffers need no fill
        covered = self.plan.dst.held_rows(self.rank) == rows
        return (torch.empty if covered else torch.zeros)(rows, cols, dtype=dtype, device=device)

    def run(self, x: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        plan = self.plan
        y = self._output(dtype, device) if plan.dst.holds_rank(self.rank) else None
        for m in self.local:
            _slice(y, m, m.dst_row, self.dst_col0).copy_(_slice(x, m, m.src_row, self.src_col0))
        if plan.colocated:
            self._all_to_all(x, y, dtype, device)
        else:
            self._point_to_point(x, y, dtype, device)
        if self.gather is not None:
            y = self._finish_gather(y, plan.dst.hidden)
        return y

    def _all_to_all(self, x, y, dtype, device) -> None:
        ranks = self.plan.src.ranks
        if len(ranks) == 1:
            return
        # the plan's moves come sorted by (src, dst): per peer in rank order already
        send_moves = sorted(self.sends, key=lambda m: m.dst)
        recv_moves = sorted(self.recvs, key=lambda m: m.src)
        in_splits, out_splits = _per_peer(ranks, send_moves, "dst"), _per_peer(ranks, recv_moves, "src")
        send = self._pack(x, send_moves) if send_moves else torch.empty(0, dtype=dtype, device=device)
        recv, staged = self._recv_buffer(y, recv_moves, dtype, device) if recv_moves else (torch.empty(0, dtype=dtype, device=device), False)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        if staged:
            self._unpack(y, recv, recv_moves)

    def _point_to_point(self, x, y, dtype, device) -> None:
        ops, staged = [], []
        for peer in sorted({m.dst for m in self.sends} | {m.src for m in self.recvs}):
            out_m = [m for m in self.sends if m.dst == peer]
            if out_m:
                ops.append(dist.P2POp(dist.isend, self._pack(x, out_m), peer, group=self.group))
            in_m = [m for m in self.recvs if m.src == peer]
            if in_m:
                buf, needs_unpack = self._recv_buffer(y, in_m, dtype, device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, group=self.group))
                if needs_unpack:
                    staged.append((buf, in_m))
        if ops:
            reqs = dist.batch_isend_irecv(ops)
            if self.defer_sends and not self.recvs:  # a pure sender runs ahead; wait_sends() later
                self.deferred.append((reqs, [op.tensor for op in ops]))
            else:
                for req in reqs:
                    req.wait()
        for buf, in_m in staged:
            self._unpack(y, buf, in_m)

    def _finish_gather(self, y: torch.Tensor, hidden: int) -> torch.Tensor:
        g: FinishGather = self.gather
        i = g.ranks.index(self.rank)
        mine = y[:, i * g.chunk : (i + 1) * g.chunk].contiguous()
        parts = [torch.empty_like(mine) for _ in g.ranks]
        dist.all_gather(parts, mine, group=self.replica_group)
        return torch.cat(parts, dim=1)[:, :hidden].contiguous()


class _BridgeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bridge: "Bridge", x: torch.Tensor):
        ctx.bridge = bridge
        ctx.x_meta = (x.shape, x.dtype, x.device)
        y = bridge.fwd.run(x if bridge.is_src else None, x.dtype, x.device)
        bridge.stats.fwd_sent += bridge.fwd.sent_numel
        if bridge.fwd.gather is not None:
            bridge.stats.fwd_allgather += bridge.fwd.gather.received_numel
        if y is None:  # non-colocated source: a token that carries the backward
            return x.new_empty(0)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        bridge: Bridge = ctx.bridge
        shape, dtype, device = ctx.x_meta
        g = bridge.bwd.run(grad_y.contiguous() if bridge.is_dst else None, dtype, device)
        bridge.stats.bwd_sent += bridge.bwd.sent_numel
        if bridge.bwd.gather is not None:
            bridge.stats.bwd_allgather += bridge.bwd.gather.received_numel
        if g is None:  # non-colocated destination: nothing flows further up
            return None, torch.zeros(shape, dtype=dtype, device=device)
        return None, g


class Bridge:
    """Moves a ``[rows, hidden]`` tensor from ``src`` to ``dst`` placement and gradients back.

    ``group``: a process group over src ∪ dst ranks (the same ranks for colocated), or None
    for a single rank. ``src_replica_group`` / ``dst_replica_group``: this rank's group of
    replicas that complete each other's copies (the module's TP group when its rows are
    replicated over TP); needed only on non-colocated bridges. ``needs_grad``: whether
    gradients flow back (False when nothing upstream trains); every rank must agree, since
    a non-colocated destination cannot see whether the source needs its gradient.
    ``defer_sends``: a non-colocated source's forward returns once its sends are posted; the
    caller must ``wait_sends()`` before reusing what it sent (a schedule's encoder prefetch).
    ``plans``: this rank's (forward, backward) plans when the caller has them already
    (``mimo.bridges.plan.rank_plans``); else they are computed here, for this rank only.
    """

    def __init__(
        self,
        src: Placement | RunPlacement,
        dst: Placement | RunPlacement,
        group,
        src_replica_group=None,
        dst_replica_group=None,
        *,
        needs_grad: bool = True,
        rank: int | None = None,
        defer_sends: bool = False,
        plans: tuple[TransferPlan, TransferPlan] | None = None,
    ):
        self.rank = dist.get_rank() if rank is None else rank
        self.needs_grad = needs_grad
        self.src, self.dst = as_runs(src), as_runs(dst)
        self.is_src = self.src.holds_rank(self.rank)
        self.is_dst = self.dst.holds_rank(self.rank)
        fwd, bwd = plans if plans is not None else rank_plans(self.src, self.dst, self.rank)
        self.fwd = _Executor(fwd, self.rank, group, dst_replica_group, defer_sends)
        self.bwd = _Executor(bwd, self.rank, group, src_replica_group)
        self.stats = BridgeStats()

    @property
    def colocated(self) -> bool:
        return self.fwd.plan.colocated

    def __call__(self, x: torch.Tensor | None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        """Forward. On a non-colocated destination pass ``x=None`` (dtype/device say what
        to receive); it returns the received tensor, which backward can flow through."""
        if x is None:
            if self.is_src:
                raise ValueError("a source rank must pass its local tensor")
            # a leaf that requires grad gives the output an autograd node (the backward send)
            x = torch.empty(0, dtype=dtype, device=device, requires_grad=self.needs_grad)
        elif self.is_src and tuple(x.shape) != self.src.local_shape(self.rank):
            raise LayoutError(f"rank {self.rank}: local tensor {tuple(x.shape)} != placement {self.src.local_shape(self.rank)}")
        return _BridgeFunction.apply(self, x)

    def wait_sends(self) -> None:
        """With ``defer_sends``: wait until the forward's sends completed (a non-colocated
        source returns from forward once they are posted, so it can compute ahead)."""
        for reqs, _ in self.fwd.deferred:
            for req in reqs:
                req.wait()
        self.fwd.deferred.clear()

    @staticmethod
    def backward_source(token: torch.Tensor) -> None:
        """On a non-colocated source rank: receive the gradient of the sent tensor."""
        torch.autograd.backward(token, torch.zeros_like(token))

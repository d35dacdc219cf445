"""MoE token dispatch: the rows each local expert processes, and the way back.

One interface (plain objects, as torchtitan's): ``dispatch(x_TD, routing) -> Dispatched``
gives the rows of this rank's local experts, grouped by local expert (``ends_L``: cumulative
row ends, the offsets ``mimo.parallel.gemm.grouped_linear`` takes), and
``combine(y_RD, dispatched) -> y_TD`` applies the gate values on the expert side and sums
every token's expert outputs back into its row. The experts run in between::

    d = dispatcher.dispatch(x_TD, routing)
    y_TD = dispatcher.combine(experts(d.x_RD, d.ends_L), d)

``LocalDispatcher`` (EP = 1): the permutation ``GroupedExperts`` does today. The ``T*K``
(token, slot) assignments are sorted by expert with a stable argsort; the padding's sentinel
expert ``E`` sorts last and rides along in the last group with gate 0, so nothing is read on
the host. (The padding slots' gate gradient is therefore not 0; the router's ``gate * valid``
stops it.)

``AllToAllDispatcher`` (the expert view: ``all_to_all_single`` over the EP group, EP rank ``r``
holding experts ``r*L .. (r+1)*L - 1``, ``L = E / ep``; each of its ETP peers holds an F-slice
of the same experts). A token goes to each destination rank at most once, however many of its
``k`` experts live there:

1. source side: the distinct (token, destination) pairs, grouped by destination, tokens in
   order; one row each (plus its ``k`` expert ids and gates, the small metadata);
2. one all-to-all of the counts (rows per destination, assignments per destination expert),
   and under ETP an all-gather of what each ETP peer received (rows, assignments per expert);
3. **the one device-to-host copy per call** (``_to_host``): send rows per peer, receive rows
   per peer and the number of local assignments, in one small tensor — the split sizes the
   collectives need. Nothing else is read on the host;
4. all-to-all of the metadata, then of the rows — started asynchronously, so that the
   caller's ``while_in_flight()`` (the shared expert's GEMMs) runs while they travel (the
   backward is the reverse all-to-all); under ETP an all-gather-v of the received rows and
   metadata over the ETP peers (backward: reduce-scatter-v). The expert side expands each row
   to its local experts (stable sort by local expert: rows keep (peer, source rank, token) order);
5. combine: gates applied on the expert side (to ETP partial sums: linear; the gates'
   gradient is summed back by the all-gather-v's adjoint), one summed row per gathered row,
   reduce-scatter-v over ETP, the reverse all-to-all, each token summed over its destinations.

Bytes: ``DispatchStats`` counts what the row exchanges send to other ranks, forward and
backward apart (a rank's rows to itself cross no wire), separately the metadata; with
``audit`` on (``mimo verify-train``) it also sums ``min_forward_bytes``, the minimum computed
independently from the routing alone (module function; it reads the routing on the host, so
training leaves it off). bytes_ratio = (forward + backward) / (2 x minimum), 1.0 when every
(token, rank) pair crossed once each way.

``make_dispatcher`` picks one per layer (``train.moe_dispatcher``); ``DeepEPDispatcher`` is
not implemented yet and says so.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.core.errors import LayoutError, MimoError
from mimo.llm.router import Routing

__all__ = ["Dispatched", "DispatchStats", "LocalDispatcher", "AllToAllDispatcher", "DeepEPDispatcher",
           "min_forward_bytes", "make_dispatcher", "all_to_all"]


@dataclass
class Dispatched:
    """The rows of this rank's local experts: ``x_RD`` grouped by local expert, ``ends_L``
    (int64 cumulative ends per local expert, ``ends_L[-1] = R``); the rest is the dispatcher's
    own state for ``combine``."""

    x_RD: torch.Tensor
    ends_L: torch.Tensor
    gate_R: torch.Tensor
    row_R: torch.Tensor  # the row (token, or received (token, rank) row) each expert row sums into
    rows: int  # tokens (local), or received rows (all-to-all)
    plan: "_Plan | None" = None
    overlapped: object = None  # what ``while_in_flight()`` returned (the shared expert's output)


@dataclass
class DispatchStats:
    """Elements and bytes the row all-to-alls sent to other ranks (``payload``) and the
    metadata's (expert ids, gates) bytes; ``d2h``: host copies taken (one per dispatch)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    min_forward_bytes: int = 0  # the independent minimum (``min_forward_bytes``), where audited
    meta_bytes: int = 0
    d2h: int = 0
    calls: int = 0

    @property
    def payload_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.min_forward_bytes = self.meta_bytes = self.d2h = self.calls = 0


def _check_routing(x_TD: torch.Tensor, routing: Routing, experts: int) -> None:
    idx_TK, gate_TK = routing.idx_TK, routing.gate_TK
    if idx_TK.dim() != 2 or idx_TK.shape != gate_TK.shape or idx_TK.shape[0] != x_TD.shape[0]:
        raise MimoError(f"moe.dispatch: routing idx {tuple(idx_TK.shape)} / gate {tuple(gate_TK.shape)} "
                        f"do not match tokens {tuple(x_TD.shape)} (want [T, K], [T, K], [T, D])")
    if idx_TK.dtype != torch.int64:
        raise MimoError(f"moe.dispatch: routing idx must be int64, got {idx_TK.dtype}")


def _group_by(key_N: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stable order by ``key`` in 0..groups, where ``groups`` is the sentinel sorting last;
    ``[groups]`` counts per group, the sentinel's dropped). No host read."""
    order_N = torch.argsort(key_N, stable=True)
    counts = torch.zeros(groups + 1, dtype=torch.int64, device=key_N.device)
    counts.scatter_add_(0, key_N, torch.ones_like(key_N))
    return order_N, counts[:groups]


class LocalDispatcher:
    """EP = 1: every expert is local (see module doc). Padding rows ride in the last group."""

    def __init__(self, experts: int):
        self.experts = experts
        self.stats = DispatchStats()

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, while_in_flight=None) -> Dispatched:
        _check_routing(x_TD, routing, self.experts)
        idx_TK, gate_TK = routing.idx_TK, routing.gate_TK
        k, e = idx_TK.shape[1], self.experts
        flat_R = idx_TK.reshape(-1)
        order_R, counts_E = _group_by(flat_R, e)
        ends_E = counts_E.cumsum(0)
        ends_E[-1] = flat_R.numel()  # the padding rows (sentinel E) ride along in the last group
        token_R = order_R // k
        self.stats.calls += 1
        return Dispatched(x_TD[token_R], ends_E, gate_TK.reshape(-1)[order_R], token_R, x_TD.shape[0],
                          overlapped=while_in_flight() if while_in_flight is not None else None)

    def combine(self, y_RD: torch.Tensor, d: Dispatched) -> torch.Tensor:
        y_RD = y_RD * d.gate_R[:, None].to(y_RD.dtype)
        return y_RD.new_zeros(d.rows, y_RD.shape[1]).index_add(0, d.row_R, y_RD)


# ---------------------------------------------------------------- all-to-all
def _to_host(t: torch.Tensor) -> list[int]:
    """The dispatcher's one device-to-host copy per call (see module doc, step 3)."""
    return t.tolist()


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _remote(splits: list[int], me: int) -> int:
    return sum(n for p, n in enumerate(splits) if p != me)


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group, async_op: bool = False):
    """``all_to_all_single`` along dim 0: ``send[p]`` rows to peer ``p``, ``recv[p]`` from it.
    Returns the output (and the work handle with ``async_op``). A group of one (None): ``x``."""
    if group is None:
        return (x, _Done()) if async_op else x
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group,
                                  async_op=async_op)
    return (out, work) if async_op else out


class _Done:
    def wait(self) -> None:
        pass


def _count(stats: DispatchStats | None, x: torch.Tensor, send: list[int], group, backward: bool) -> None:
    if stats is not None:
        nbytes = _remote(send, _rank(group)) * _row_bytes(x)
        if backward:
            stats.backward_bytes += nbytes
        else:
            stats.forward_bytes += nbytes


class _InFlight:
    """The work handle of an all-to-all started by ``_AllToAllStart`` (waited by ``_Wait``)."""

    work = None


class _AllToAllStart(torch.autograd.Function):
    """Differentiable all-to-all along dim 0, started asynchronously: the output is valid only
    after ``_Wait`` (the handle is left in ``flight``). Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, send, recv, group, stats, flight):
        ctx.meta = (send, recv, group, stats)
        _count(stats, x, send, group, backward=False)
        out, flight.work = _a2a(x, send, recv, group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, stats = ctx.meta
        _count(stats, grad, recv, group, backward=True)
        return _a2a(grad, recv, send, group), None, None, None, None, None


class _Wait(torch.autograd.Function):
    """Identity that first waits for the in-flight all-to-all filling ``x``."""

    @staticmethod
    def forward(ctx, x, flight):
        flight.work.wait()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group, stats: DispatchStats | None = None,
               while_in_flight=None):
    """Differentiable ``all_to_all_single`` along dim 0 (backward: the reverse all-to-all),
    counting the bytes to other ranks into ``stats``. ``while_in_flight()`` (optional) runs
    between starting and waiting for it; returns ``(out, its result)`` then."""
    flight = _InFlight()
    out = _AllToAllStart.apply(x, send, recv, group, stats, flight)
    done = while_in_flight() if while_in_flight is not None else None
    out = _Wait.apply(out, flight)
    return (out, done) if while_in_flight is not None else out


class _GatherV(torch.autograd.Function):
    """All-gather-v along dim 0 over ``group`` (``sizes[q]`` rows from peer ``q``, as an
    all-to-all sending this rank's rows to every peer); backward: reduce-scatter-v."""

    @staticmethod
    def forward(ctx, x, sizes, group, stats):
        ctx.meta = (sizes, group, stats)
        return _gather_v(x, sizes, group, stats, backward=False)

    @staticmethod
    def backward(ctx, grad):
        sizes, group, stats = ctx.meta
        return _reduce_scatter_v(grad, sizes, group, stats, backward=True), None, None, None


class _ReduceScatterV(torch.autograd.Function):
    """Reduce-scatter-v along dim 0: ``x`` holds every peer's segment (``sizes``); each peer
    gets the sum over the group of its own segment. Backward: all-gather-v."""

    @staticmethod
    def forward(ctx, x, sizes, group, stats):
        ctx.meta = (sizes, group, stats)
        return _reduce_scatter_v(x, sizes, group, stats, backward=False)

    @staticmethod
    def backward(ctx, grad):
        sizes, group, stats = ctx.meta
        return _gather_v(grad, sizes, group, stats, backward=True), None, None, None


def _gather_v(x, sizes, group, stats, backward):
    n = len(sizes)
    send = [x.shape[0]] * n
    _count(stats, x, send, group, backward)
    return _a2a(x.repeat(n, *([1] * (x.dim() - 1))), send, sizes, group)


def _reduce_scatter_v(x, sizes, group, stats, backward):
    n, mine = len(sizes), sizes[dist.get_rank(group)]
    _count(stats, x, sizes, group, backward)
    return _a2a(x, sizes, [mine] * n, group).view(n, mine, *x.shape[1:]).sum(0)


@dataclass
class _Plan:
    send: list[int]  # rows to each EP peer
    recv: list[int]  # rows from each EP peer
    token_S: torch.Tensor  # the token of each sent row (grouped by destination)
    tokens: int
    etp_rows: list[int]  # rows each ETP peer received over EP (this rank's: etp_rows[etp rank])


class AllToAllDispatcher:
    """EP over ``ep_group`` and ETP over ``etp_group`` (see module doc); this rank's experts
    are the contiguous block ``ep_rank * E/ep .. (ep_rank+1) * E/ep - 1``, shared (their
    inner size split) by its ETP peers."""

    def __init__(self, experts: int, ep_group, etp_group=None):
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.etp = 1 if etp_group is None else dist.get_world_size(etp_group)
        self.etp_rank = 0 if etp_group is None else dist.get_rank(etp_group)
        if experts % self.ep:
            raise LayoutError(f"parallel.ep: {experts} experts do not split over ep = {self.ep} ranks "
                              f"(experts % ep must be 0)")
        self.experts, self.local = experts, experts // self.ep
        self.stats = DispatchStats()
        self.audit = False  # also count the independent minimum (reads the routing on the host)

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, while_in_flight=None) -> Dispatched:
        _check_routing(x_TD, routing, self.experts)
        idx_TK, gate_TK = routing.idx_TK, routing.gate_TK
        t, k = idx_TK.shape
        ep, loc, dev = self.ep, self.local, idx_TK.device
        # 1. distinct (token, destination) pairs; padding (idx E) goes to the sentinel rank ep
        dest_TK = torch.div(idx_TK, loc, rounding_mode="floor")
        pair_TP = torch.zeros(t, ep + 1, dtype=torch.bool, device=dev).scatter_(1, dest_TK, True)[:, :ep]
        pair_PT = pair_TP.T.reshape(-1)
        order_S = torch.argsort((~pair_PT).to(torch.int8), stable=True)  # chosen pairs first, (p, t) order
        # 2. counts to each EP peer: [rows, assignments per local expert of that peer]; then
        #    each ETP peer's received rows and assignments per (shared) local expert
        assign_E = torch.zeros(self.experts + 1, dtype=torch.int64, device=dev)
        assign_E.scatter_add_(0, idx_TK.reshape(-1), torch.ones(t * k, dtype=torch.int64, device=dev))
        counts_P1 = torch.cat([pair_TP.sum(0, dtype=torch.int64)[:, None], assign_E[:-1].view(ep, loc)], 1)
        got_P1 = _a2a(counts_P1, [1] * ep, [1] * ep, self.ep_group) if ep > 1 else counts_P1
        mine_1 = got_P1.sum(0)  # [rows received, assignments per local expert]
        got_Q1 = _gather_v(mine_1[None], [1] * self.etp, self.etp_group, None, False) if self.etp > 1 else mine_1[None]
        counts_L = got_Q1[:, 1:].sum(0)
        # 3. the one host copy: rows to / from each EP peer, rows of each ETP peer, assignments
        host = _to_host(torch.cat([counts_P1[:, 0], got_P1[:, 0], got_Q1[:, 0], counts_L.sum()[None]]))
        self.stats.d2h += 1
        self.stats.calls += 1
        send, recv, etp_rows, assigned = host[:ep], host[ep:2 * ep], host[2 * ep:-1], host[-1]
        if self.audit:
            self.stats.min_forward_bytes += min_forward_bytes(idx_TK, self.experts, ep, self.rank, self.etp,
                                                              _row_bytes(x_TD))
        # 4. rows and their metadata to the destinations (the rows asynchronously: the caller's
        #    independent work, the shared expert, runs meanwhile)
        token_S = order_S[:sum(send)] % max(t, 1)
        gate_NK = all_to_all(gate_TK[token_S], send, recv, self.ep_group)
        idx_NK = _a2a(idx_TK[token_S], send, recv, self.ep_group)
        self.stats.meta_bytes += _remote(send, self.rank) * k * (gate_TK.element_size() + idx_TK.element_size())
        x_ND, overlapped = all_to_all(x_TD[token_S], send, recv, self.ep_group, self.stats,
                                      while_in_flight or (lambda: None))
        if self.etp > 1:  # every ETP peer computes its F-slice of every row its peers received
            x_ND = _GatherV.apply(x_ND, etp_rows, self.etp_group, self.stats)
            gate_NK = _GatherV.apply(gate_NK, etp_rows, self.etp_group, None)
            idx_NK = _gather_v(idx_NK, etp_rows, self.etp_group, None, False)
        # expand to the local experts: non-local slots get the sentinel loc and sort last
        local_NK = idx_NK - self.rank * loc
        local_NK = torch.where((local_NK >= 0) & (local_NK < loc), local_NK, loc).reshape(-1)
        order_A = torch.argsort(local_NK, stable=True)[:assigned]
        row_A = order_A // k
        d = Dispatched(x_ND[row_A], counts_L.cumsum(0), gate_NK.reshape(-1)[order_A], row_A, x_ND.shape[0],
                       _Plan(send, recv, token_S, t, etp_rows))
        d.overlapped = overlapped
        return d

    def combine(self, y_AD: torch.Tensor, d: Dispatched) -> torch.Tensor:
        # 5. gates on the expert side (on ETP partial sums: linear, and the gate's gradient is
        #    summed back by the all-gather's adjoint), one summed row per received (token,
        #    rank) pair, summed over ETP, back over EP, summed per token
        y_AD = y_AD * d.gate_R[:, None].to(y_AD.dtype)
        z_ND = y_AD.new_zeros(d.rows, y_AD.shape[1]).index_add(0, d.row_R, y_AD)
        if self.etp > 1:
            z_ND = _ReduceScatterV.apply(z_ND, d.plan.etp_rows, self.etp_group, self.stats)
        z_SD = all_to_all(z_ND, d.plan.recv, d.plan.send, self.ep_group, self.stats)
        return z_SD.new_zeros(d.plan.tokens, z_SD.shape[1]).index_add(0, d.plan.token_S, z_SD)


def min_forward_bytes(idx_TK: torch.Tensor, experts: int, ep: int, rank: int, etp: int, row_bytes: int) -> int:
    """The fewest bytes one forward dispatch + combine must move for ``rank``'s tokens,
    computed in Python from the routing alone (not from the dispatcher's splits): each distinct
    (token, remote EP rank) pair once to the expert side and once back; under ETP each distinct
    (token, EP rank) pair, remote or not, reaches the ``etp - 1`` other ETP ranks of that
    expert block once and its partial sum comes back once. The backward moves as much again."""
    loc = experts // ep
    pairs = {(t, e // loc) for t, row in enumerate(idx_TK.tolist()) for e in row if e < experts}
    remote = sum(1 for _, p in pairs if p != rank)
    return 2 * (remote + (etp - 1) * len(pairs)) * row_bytes


def make_dispatcher(kind: str, experts: int, ctx):
    """The dispatcher of one MoE layer on ``ctx`` (``train.moe_dispatcher``): ``local``
    without an expert view; on it ``alltoall``, or ``deepep``; ``auto`` is ``alltoall`` (the
    DeepEP path is exercised in the multi-GPU issue)."""
    if kind not in DISPATCHERS:
        raise MimoError(f"train.moe_dispatcher: {kind!r} is not one of {', '.join(DISPATCHERS)}")
    if ctx.expert is None:
        return LocalDispatcher(experts)
    ep_group, etp_group = ctx.expert.group("ep"), ctx.expert.group("etp")
    if kind == "deepep":
        return DeepEPDispatcher(experts, ep_group, etp_group)
    return AllToAllDispatcher(experts, ep_group, etp_group)


DISPATCHERS = ("auto", "alltoall", "deepep")


class DeepEPDispatcher:
    """The ``deep_ep`` package's buffers behind the same interface: not implemented yet (issue 22)."""

    def __init__(self, experts: int, ep_group, etp_group=None):
        if importlib.util.find_spec("deep_ep") is None:
            raise MimoError("train.moe_dispatcher: deepep needs the deep_ep package (not importable here); "
                            "use alltoall or auto")
        raise MimoError("train.moe_dispatcher: deepep is not implemented yet (issue 22); use alltoall or auto")

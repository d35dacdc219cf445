"""MoE token dispatch: the rows each local expert processes, and the way back.

One interface (plain objects, as torchtitan's): ``dispatch(x_TD, routing) -> Dispatched``
gives the rows of this rank's local experts, grouped by local expert (``ends_L``: cumulative
row ends, the offsets ``mimo.parallel.gemm.grouped_linear`` takes), and
``combine(y_RD, dispatched) -> y_TD`` applies the gate values on the expert side and sums
every token's expert outputs back into its row. The experts run in between::

    d = dispatcher.dispatch(x_TD, routing)
    y_TD = dispatcher.combine(experts(d.x_RD, d.ends_L), d)

Experts linear in their last product may apply the gates themselves (``d.gate_R``, one per
row, in row order) and pass ``combine(..., gated=True)``: ``GroupedExperts`` scales the
activation, fused with it, so the combine is a plain sum that keeps nothing for backward.

``LocalDispatcher`` (EP = 1): the permutation ``GroupedExperts`` does today. The ``T*K``
(token, slot) assignments are sorted by expert with a stable argsort; the padding's sentinel
expert ``E`` sorts last and rides along in the last group with gate 0 and a zero row, so
nothing is read on the host. (The padding slots' gate gradient is the expert's output on a zero
row, 0 for experts without bias; the router's ``gate * valid`` stops it anyway.)

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

``DeepEPDispatcher`` drives ``deep_ep.Buffer`` (DeepEP's normal kernels: NVLink within a node,
RDMA across) through the same interface: DeepEP does steps 1-4 itself (one send per (token,
rank), local expert ids with -1 elsewhere); the expert side and the gates on it are shared with
``alltoall``. ``make_dispatcher`` picks one per layer (``train.moe_dispatcher``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.core.errors import LayoutError, MimoError
from mimo.llm.router import Routing
from mimo.parallel.grouped import padded_groups
from mimo.parallel.recompute import replaying

__all__ = ["Dispatched", "DispatchStats", "LocalDispatcher", "AllToAllDispatcher", "DeepEPDispatcher",
           "min_forward_bytes", "make_dispatcher", "all_to_all"]


@dataclass
class Dispatched:
    """The rows of this rank's local experts: ``x_RD`` grouped by local expert, ``ends_L``
    (int64 cumulative ends per local expert, ``ends_L[-1] = R``); the rest is the dispatcher's
    own state for ``combine``."""

    x_RD: torch.Tensor
    ends_L: torch.Tensor
    gate_R: torch.Tensor  # the gate of each expert row, in row order
    row_R: torch.Tensor  # the row (token, or received (token, rank) row) each expert row sums into
    rows: int  # tokens (local), or received rows (all-to-all)
    plan: object = None  # the dispatcher's record for combine (``_Plan``, DeepEP's state)
    overlapped: object = None  # what ``while_in_flight()`` returned (the shared expert's output)
    # (source, index[, keep]): ``x_RD`` is ``source[index]`` (recomputable), rows outside ``keep`` zero
    gathered_from: tuple | None = None
    aligned: bool = False  # every group starts at a multiple of the ``align`` asked for (padding rows between)


@dataclass
class DispatchStats:
    """Elements and bytes the row all-to-alls sent to other ranks (``payload``) and the
    metadata's (expert ids, gates) bytes; ``d2h``: host copies taken (one per dispatch)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    recompute_bytes: int = 0  # what recomputed forwards sent again (``mimo.parallel.recompute``)
    min_forward_bytes: int = 0  # the independent minimum (``min_forward_bytes``), where audited
    meta_bytes: int = 0
    d2h: int = 0
    calls: int = 0

    @property
    def payload_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes

    def count_call(self) -> None:
        if not torch.compiler.is_compiling():  # a Python int would be a guard: recompiled at every call
            self.calls += 1

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.min_forward_bytes = self.meta_bytes = self.d2h = self.calls = 0
        self.recompute_bytes = 0


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


def _add_gathered(x_RD: torch.Tensor, index_TK: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k x_RD[index_TK[t, k]]``, accumulated in fp32 at least and in ``k`` order.
    Written as ``K`` gathered rows added, not a gather then a sum over a ``[T, K, D]`` view:
    compiled, this is one pointwise kernel reading each row once, where the reduction form
    became a persistent reduction at a third of the GPU's bandwidth (issue 55's H100 profile)."""
    acc = torch.promote_types(x_RD.dtype, torch.float32)
    out_TD = x_RD[index_TK[:, 0]].to(acc)
    for j in range(1, index_TK.shape[1]):
        out_TD = out_TD + x_RD[index_TK[:, j]]
    return out_TD.to(x_RD.dtype)


class _SlotsToRows(torch.autograd.Function):
    """``x_TD`` -> ``x_RD``: each token's ``K`` slots as rows in expert order (row ``r`` is slot
    ``order_R[r]``, of token ``token_R[r] = order_R[r] // K``). Backward sums each token's ``K``
    row gradients, found through the inverse permutation (``row_S``): gathers only, where
    autograd's indexing adjoint would scatter-add with atomics. ``_RowsToTokens`` is its adjoint."""

    @staticmethod
    def forward(ctx, x_TD, token_R, row_S, k, keep_R=None):
        ctx.save_for_backward(row_S)
        ctx.k = k
        return _kept(x_TD[token_R], keep_R)

    @staticmethod
    def backward(ctx, g_RD):
        (row_S,) = ctx.saved_tensors
        return _add_gathered(g_RD, row_S.view(-1, ctx.k)), None, None, None, None


def _kept(rows_R: torch.Tensor, keep_R: torch.Tensor | None) -> torch.Tensor:
    """``rows_R`` with the rows outside ``keep_R`` (padding rows) zero; None: all kept."""
    return rows_R if keep_R is None else torch.where(keep_R.view(-1, *([1] * (rows_R.dim() - 1))), rows_R, 0)


class _RowsToTokens(torch.autograd.Function):
    """``y_RD`` -> ``y_TD``: each token's ``K`` rows (``row_S``, slot order) summed; backward
    gathers each row its token's gradient (``token_R``; a padding row, outside ``keep_R``, gets
    zeros: FP8 weight gradients scale per expert over its rows, padding among them)."""

    @staticmethod
    def forward(ctx, y_RD, row_S, token_R, k, keep_R=None):
        ctx.save_for_backward(token_R, keep_R)
        return _add_gathered(y_RD, row_S.view(-1, k))

    @staticmethod
    def backward(ctx, g_TD):
        token_R, keep_R = ctx.saved_tensors
        return _kept(g_TD[token_R], keep_R), None, None, None, None


class _Permute(torch.autograd.Function):
    """``y[index]`` for a permutation ``index``; backward gathers by its inverse (no atomics).
    From slots to padded rows (``LocalDispatcher`` with ``align``), ``keep`` zeroes the
    padding rows."""

    @staticmethod
    def forward(ctx, y, index, inverse, keep=None):
        ctx.save_for_backward(inverse)
        return _kept(y[index], keep)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return g[inverse], None, None, None


class LocalDispatcher:
    """EP = 1: every expert is local (see module doc). Padding rows ride in the last group.

    Every token has exactly ``K`` rows (``R = T*K``, and padding rows under ``align``), so the
    row order is a permutation of the slots: combine gathers the (gated) expert outputs back into slot order and sums each
    token's ``K`` rows, no scatter."""

    def __init__(self, experts: int):
        self.experts = experts
        self.stats = DispatchStats()

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, while_in_flight=None, align: int = 1) -> Dispatched:
        """``align`` > 1: every expert's rows start at a multiple of ``align`` (the FP8 grouped
        kernel's rule), padding rows between groups and after the last, ``R = T*K + align*E``
        rounded up to ``align``, still without a host read; the grouped product then needs no
        padded copy of its own. A padding row is zeros with gate 0, and its gradient from the
        combine zeros too (its gate's gradient goes nowhere: the gates' backward gathers real
        rows only). So is a padding token's row (routed to the sentinel ``E``, riding in the last
        group): an FP8 weight gradient, scaled per expert over the expert's rows, then scales as
        at any EP, where these rows are nowhere."""
        _check_routing(x_TD, routing, self.experts)
        idx_TK, gate_TK = routing.idx_TK, routing.gate_TK
        k, e = idx_TK.shape[1], self.experts
        flat_S = idx_TK.reshape(-1)
        order_R, counts_E = _group_by(flat_S, e)  # the slot of each row
        row_S = torch.empty_like(order_R)  # the row of each slot
        row_S[order_R] = torch.arange(order_R.numel(), device=order_R.device)
        ends_E = counts_E.cumsum(0)
        ends_E[-1] = flat_S.numel()  # the padding rows (sentinel E) ride along in the last group
        keep_R = flat_S[order_R] < e  # the sentinel's rows (padding tokens, gate 0) zeros
        aligned = align > 1 and x_TD.shape[0] > 0
        if aligned:
            dest_R, ends_E, cap = padded_groups(ends_E, flat_S.numel(), align)
            cap = -(-cap // align) * align
            ends_E = torch.cat([ends_E[:-1], ends_E.new_full((1,), cap)])  # the tail pads the last group
            slots_R, kept_R = order_R.new_zeros(cap), torch.zeros(cap, dtype=torch.bool, device=order_R.device)
            slots_R[dest_R], kept_R[dest_R] = order_R, keep_R
            order_R, row_S, keep_R = slots_R, dest_R[row_S], kept_R
        token_R = order_R // k
        self.stats.count_call()
        gate_R = _Permute.apply(gate_TK.reshape(-1), order_R, row_S, keep_R)
        return Dispatched(_SlotsToRows.apply(x_TD, token_R, row_S, k, keep_R), ends_E, gate_R, token_R, x_TD.shape[0],
                          plan=(order_R, row_S, keep_R),
                          overlapped=while_in_flight() if while_in_flight is not None else None,
                          gathered_from=(x_TD, token_R, keep_R), aligned=aligned)

    def combine(self, y_RD: torch.Tensor, d: Dispatched, gated: bool = False) -> torch.Tensor:
        order_R, row_S, keep_R = d.plan
        y_RD = y_RD if gated else _gated(y_RD, d)
        k = max(row_S.numel() // max(d.rows, 1), 1)  # (no tokens: any k reads no rows)
        return _RowsToTokens.apply(y_RD, row_S, d.row_R, k, keep_R)


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
        if replaying():
            stats.recompute_bytes += nbytes
        elif backward:
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
        flight.work = _Done()  # waited once: a second output of the same exchange passes through
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


def _to_local_experts(x_ND, gate_NK, local_NK, ends_L, assigned: int, plan, overlapped) -> Dispatched:
    """The expert side of a dispatch: each received row once per local expert it chose, grouped
    by local expert (a stable sort: rows keep their arrival order). ``local_NK``: the local
    expert of each slot, ``L`` (sorting last, dropped) where the slot's expert lives elsewhere
    or is padding; ``assigned``: the host-known number of local slots."""
    k = local_NK.shape[1] if local_NK.dim() == 2 else 1
    order_A = torch.argsort(local_NK.reshape(-1), stable=True)[:assigned]
    row_A = order_A // k
    return Dispatched(x_ND[row_A], ends_L, gate_NK.reshape(-1)[order_A], row_A, x_ND.shape[0], plan, overlapped,
                      gathered_from=(x_ND, row_A))


def _gated(y_RD: torch.Tensor, d: Dispatched) -> torch.Tensor:
    return y_RD * d.gate_R[:, None].to(y_RD.dtype)


def _sum_rows(y_AD: torch.Tensor, d: Dispatched, gated: bool) -> torch.Tensor:
    """The gates applied on the expert side (unless ``gated``: the experts did) and one summed
    row per received row."""
    y_AD = y_AD if gated else _gated(y_AD, d)
    return y_AD.new_zeros(d.rows, y_AD.shape[1]).index_add(0, d.row_R, y_AD)


@dataclass
class _Plan:
    send: list[int]  # rows to each EP peer
    recv: list[int]  # rows from each EP peer
    token_S: torch.Tensor  # the token of each sent row (grouped by destination)
    tokens: int
    etp_rows: list[int]  # rows each ETP peer received over EP (this rank's: etp_rows[etp rank])


class _OverEP:
    """What a dispatcher over an EP group knows: its size, this rank's place, its experts
    (the contiguous block ``rank * E/ep ..``), its counters."""

    def __init__(self, experts: int, ep_group):
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if experts % self.ep:
            raise LayoutError(f"parallel.ep: {experts} experts do not split over ep = {self.ep} ranks "
                              f"(experts % ep must be 0)")
        self.experts, self.local = experts, experts // self.ep
        self.stats = DispatchStats()
        self.audit = False  # also count the independent minimum (reads the routing on the host)


class AllToAllDispatcher(_OverEP):
    """EP over ``ep_group`` and ETP over ``etp_group`` (see module doc); this rank's experts
    are the contiguous block ``ep_rank * E/ep .. (ep_rank+1) * E/ep - 1``, shared (their
    inner size split) by its ETP peers."""

    def __init__(self, experts: int, ep_group, etp_group=None):
        super().__init__(experts, ep_group)
        self.etp_group = etp_group
        self.etp = 1 if etp_group is None else dist.get_world_size(etp_group)
        self.etp_rank = 0 if etp_group is None else dist.get_rank(etp_group)

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, while_in_flight=None, align: int = 1) -> Dispatched:
        """(``align``: not taken here; the grouped product pads its own rows.)"""
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
        self.stats.count_call()
        send, recv, etp_rows, assigned = host[:ep], host[ep:2 * ep], host[2 * ep:-1], host[-1]
        if self.audit and not replaying():
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
        local_NK = idx_NK - self.rank * loc
        local_NK = torch.where((local_NK >= 0) & (local_NK < loc), local_NK, loc)
        return _to_local_experts(x_ND, gate_NK, local_NK, counts_L.cumsum(0), assigned,
                                 _Plan(send, recv, token_S, t, etp_rows), overlapped)

    def combine(self, y_AD: torch.Tensor, d: Dispatched, gated: bool = False) -> torch.Tensor:
        # 5. gates on the expert side (on ETP partial sums: linear, and the gate's gradient is
        #    summed back by the all-gather's adjoint), one summed row per received (token,
        #    rank) pair, summed over ETP, back over EP, summed per token
        z_ND = _sum_rows(y_AD, d, gated)
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
    without an expert view; on it ``alltoall``, or ``deepep``. ``auto`` is ``alltoall``: the
    DeepEP path is taken only when asked for until it has been verified on several GPUs (the
    multi-GPU issue)."""
    if kind not in DISPATCHERS:
        raise MimoError(f"train.moe_dispatcher: {kind!r} is not one of {', '.join(DISPATCHERS)}")
    if ctx.expert is None:
        return LocalDispatcher(experts)
    ep_group, etp_group = ctx.expert.group("ep"), ctx.expert.group("etp")
    if kind == "deepep":
        return DeepEPDispatcher(experts, ep_group, etp_group, ctx.expert.resources)
    return AllToAllDispatcher(experts, ep_group, etp_group)


DISPATCHERS = ("auto", "alltoall", "deepep")


# ---------------------------------------------------------------- DeepEP
def import_deep_ep():
    """The ``deep_ep`` package, or a MimoError saying why the ``deepep`` dispatcher cannot run."""
    try:
        import deep_ep
    except (ImportError, OSError) as e:  # absent, or built against another torch / CUDA
        raise MimoError(f"train.moe_dispatcher: deepep needs the deep_ep package (https://github.com/deepseek-ai/DeepEP), "
                        f"which does not import here ({e}); use alltoall or auto") from None
    if not hasattr(deep_ep, "Buffer"):
        raise MimoError("train.moe_dispatcher: this deep_ep has no Buffer (its normal-kernel interface, "
                        "which mimo drives); use alltoall or auto")
    return deep_ep


class _EventWork:
    """A DeepEP event as a work handle (``_Wait`` calls ``wait``): the compute stream waits
    for DeepEP's communication stream."""

    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        self.event.current_stream_wait()


@dataclass
class _DeepEPState:
    buffer: object
    experts: int
    stats: DispatchStats
    handle: object = None
    recv_idx_NK: torch.Tensor | None = None
    counts_L: list | None = None
    out_bytes: int = 0  # audited: bytes of this rank's rows to other ranks (dispatch; combine's backward)
    back_bytes: int = 0  # audited: bytes of other ranks' summed rows sent back (combine; dispatch's backward)


class _DeepEPDispatch(torch.autograd.Function):
    """DeepEP's dispatch, started (``flight.work``: its event; ``_Wait`` waits for it).
    Backward: DeepEP's combine of the rows' and the gates' gradients through the handle."""

    @staticmethod
    def forward(ctx, x_TD, gate_TK, idx_TK, state, flight):
        buf = state.buffer
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_TK, state.experts)
        recv_x, recv_idx, recv_gate, counts, handle, event = buf.dispatch(
            x_TD, topk_idx=idx_TK, topk_weights=gate_TK, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            async_finish=True)
        state.handle, state.recv_idx_NK, state.counts_L = handle, recv_idx, list(counts)
        flight.work = _EventWork(event)
        ctx.state = state
        return recv_x, recv_gate

    @staticmethod
    def backward(ctx, grad_x, grad_gate):
        buf, handle = ctx.state.buffer, ctx.state.handle
        grad_gate = torch.zeros_like(ctx.state.recv_idx_NK, dtype=torch.float32) if grad_gate is None else grad_gate
        grad_x_TD, grad_gate_TK, _ = buf.combine(grad_x.contiguous(), handle, topk_weights=grad_gate.float().contiguous())
        ctx.state.stats.backward_bytes += ctx.state.back_bytes
        return grad_x_TD, grad_gate_TK, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """DeepEP's combine (each token's returned rows summed, no weights); backward: its
    dispatch through the same handle."""

    @staticmethod
    def forward(ctx, z_ND, state):
        ctx.state = state
        combined_TD, _, _ = state.buffer.combine(z_ND.contiguous(), state.handle)
        state.stats.forward_bytes += state.back_bytes
        return combined_TD

    @staticmethod
    def backward(ctx, grad_TD):
        grad_ND = ctx.state.buffer.dispatch(grad_TD.contiguous(), handle=ctx.state.handle)[0]
        ctx.state.stats.backward_bytes += ctx.state.out_bytes
        return grad_ND, None


class DeepEPDispatcher(_OverEP):
    """``deep_ep.Buffer``'s normal (high-throughput) kernels over the EP group, behind the same
    interface: DeepEP finds each token's destination ranks (``get_dispatch_layout``), sends each
    (token, rank) pair once with its ``k`` expert ids (local ids; -1 where the expert lives
    elsewhere or the slot is padding) and gates, and its combine sums the rows that come back per
    token, without weights: the gates are applied on the expert side, as ``alltoall`` does.
    Combine is dispatch's adjoint and dispatch combine's, through the dispatch's handle.
    DeepEP's dispatch waits on the host for the receive counts: that is this dispatcher's one
    device-to-host copy. It moves bf16 rows, needs ``etp = 1`` (ETP inside EP runs with
    ``alltoall``) and NCCL ranks on GPUs connected by NVLink (RDMA across nodes). One buffer per
    EP group, sized for the widest rows seen, is shared by every layer (``resources``)."""

    def __init__(self, experts: int, ep_group, etp_group=None, resources: dict | None = None):
        self.deep_ep = import_deep_ep()
        if etp_group is not None and dist.get_world_size(etp_group) > 1:
            raise MimoError("train.moe_dispatcher: deepep needs parallel.etp = 1 (expert tensor parallelism "
                            "inside EP runs with alltoall)")
        super().__init__(experts, ep_group)
        self.resources = {} if resources is None else resources

    def _buffer(self, row_bytes: int):
        """The EP group's DeepEP buffer, large enough for rows of ``row_bytes`` (collective:
        every EP rank reaches it at the same layer)."""
        have = self.resources.get("deepep")
        if have is not None and have[0] >= row_bytes:
            return have[1]
        Buffer = self.deep_ep.Buffer
        nvl = rdma = 0
        for cfg in (Buffer.get_dispatch_config(self.ep), Buffer.get_combine_config(self.ep)):
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(row_bytes, self.ep))
            rdma = max(rdma, cfg.get_rdma_buffer_size_hint(row_bytes, self.ep))
        buffer = Buffer(self.ep_group, nvl, rdma)
        self.resources["deepep"] = (row_bytes, buffer)
        return buffer

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, while_in_flight=None, align: int = 1) -> Dispatched:
        """(``align``: not taken here; the grouped product pads its own rows.)"""
        _check_routing(x_TD, routing, self.experts)
        if x_TD.dtype != torch.bfloat16:
            raise MimoError(f"train.moe_dispatcher: deepep moves bf16 rows, got {x_TD.dtype} (train.precision bf16, "
                            f"or alltoall)")
        idx_TK = torch.where(routing.idx_TK < self.experts, routing.idx_TK, -1)  # padding: no selection
        state = _DeepEPState(self._buffer(_row_bytes(x_TD)), self.experts, self.stats)
        flight = _InFlight()
        x_ND, gate_NK = _DeepEPDispatch.apply(x_TD.contiguous(), routing.gate_TK.float().contiguous(), idx_TK,
                                              state, flight)
        overlapped = while_in_flight() if while_in_flight is not None else None
        x_ND, gate_NK = _Wait.apply(x_ND, flight), _Wait.apply(gate_NK, flight)
        self.stats.d2h += 1  # DeepEP's own wait for the receive counts
        self.stats.count_call()
        counts_L = state.counts_L
        if self.audit and not replaying():
            self._count(routing.idx_TK, x_ND.shape[0], _row_bytes(x_TD), state)
        local_NK = torch.where(state.recv_idx_NK >= 0, state.recv_idx_NK, self.local)
        ends_L = torch.tensor(counts_L, dtype=torch.int64, device=x_ND.device).cumsum(0)
        return _to_local_experts(x_ND, gate_NK, local_NK, ends_L, sum(counts_L), state, overlapped)

    def combine(self, y_AD: torch.Tensor, d: Dispatched, gated: bool = False) -> torch.Tensor:
        return _DeepEPCombine.apply(_sum_rows(y_AD, d, gated).to(torch.bfloat16), d.plan)

    def _count(self, idx_TK: torch.Tensor, received: int, row_bytes: int, state: _DeepEPState) -> None:
        """Audit only (reads the routing on the host): the rows this rank puts on a wire, as
        ``alltoall`` counts them (its tokens' rows out in dispatch, the summed rows of other
        ranks' tokens back in combine; the backward the same again), and the minimum."""
        pairs = {(t, e // self.local) for t, row in enumerate(idx_TK.tolist()) for e in row if e < self.experts}
        mine = sum(1 for _, p in pairs if p == self.rank)
        state.out_bytes = (len(pairs) - mine) * row_bytes
        state.back_bytes = (received - mine) * row_bytes
        self.stats.forward_bytes += state.out_bytes
        self.stats.min_forward_bytes += min_forward_bytes(idx_TK, self.experts, self.ep, self.rank, 1, row_bytes)

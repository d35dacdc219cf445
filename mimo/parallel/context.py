"""One parallel context per module, and one communicator per distinct rank set of a run.

``GroupRegistry`` (``mimo.parallel.grid``) is the run's only maker of process groups: every
distinct rank set gets exactly one communicator, however many grids, views, bridges or tied
embeddings ask for it.

``ParallelContext`` is what a module's builders and layers receive: its grid, this rank's
place in it, the tp / cp / dp / pp groups, the gradient group (cp × dp: gradients are summed
over it), ``sequence_parallel`` resolved once (on only when asked for and tp > 1) and, for a
module with experts, the expert view (etp × ep × edp × pp over the same ranks, the same PP
groups), for an encoder its bridge group (its ranks ∪ the LLM's). Placements
(``mimo.parallel.placement``) name the axes of a context; the context answers their sizes, this
rank's coordinate and group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from mimo.core.errors import LayoutError
from mimo.parallel.grid import GroupRegistry, ParallelGrid

DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")


@dataclass
class AxisView:
    """The groups of one view of a module's grid (dense: tp, cp, dp, pp; expert: etp, ep, edp, pp)."""

    grid: ParallelGrid
    rank: int
    groups: dict[str, object] = field(default_factory=dict)
    resources: dict[str, object] = field(default_factory=dict)  # communication state built once per view (DeepEP's buffer)

    @property
    def member(self) -> bool:
        return self.rank in self.grid

    def size(self, axis: str) -> int:
        return self.grid.shape.get(axis, 1)

    def coord(self, axis: str) -> int:
        return self.grid.coords(self.rank).get(axis, 0) if self.member else 0

    def group(self, axis: str):
        return self.groups.get(axis)


class ParallelContext:
    """A module's parallel context (see module doc). Build it on every rank of the world at
    the same point: it creates its groups (collective) in a fixed order."""

    def __init__(self, grid: ParallelGrid, rank: int, registry: GroupRegistry, *, sequence_parallel: bool = False,
                 expert: tuple[int, int] | None = None, gtp: int = 1, egtp: int = 1, bridge_to: ParallelGrid | None = None):
        from mimo.parallel.gtp import GTPChain

        self.grid, self.rank, self.registry = grid, rank, registry
        # the views of the grid first, then their groups in one fixed order (collective), then GTP's chains
        expert_grid = grid.expert_view(*expert) if expert is not None else None
        # GTP: the data replicas re-factored gtp x dp (the experts' egtp x edp); weights split over gtp
        gtp_grid = grid.split_view("dp", "gtp", gtp) if gtp > 1 else None
        egtp_grid = expert_grid.split_view("edp", "egtp", egtp) if egtp > 1 else None
        dense = registry.axis_groups(grid, {**{a: a for a in DENSE_AXES}, "grad": ("cp", "dp")}, rank)
        expert_groups = egtp_groups = gtp_groups = None
        if expert_grid is not None:  # the same pp ranks: the very same groups
            expert_groups = {**registry.axis_groups(expert_grid, {a: a for a in EXPERT_AXES if a != "pp"}, rank), "pp": dense["pp"]}
            expert_groups["grad"] = expert_groups["edp"]
        if egtp_grid is not None:
            egtp_groups = {**expert_groups, **registry.axis_groups(egtp_grid, {"egtp": "egtp", "edp": "edp", "grad": "edp"}, rank)}
        if gtp_grid is not None:
            gtp_groups = {**dense, **registry.axis_groups(gtp_grid, {"gtp": "gtp", "dp": "dp", "grad": ("cp", "dp")}, rank)}
        # an encoder's bridge to the LLM: one group over the union of the two grids' ranks
        self.bridge = None if bridge_to is None else registry.group(set(grid.ranks) | set(bridge_to.ranks), rank)
        self.dense = AxisView(grid, rank, dense)
        self.expert = None if expert_grid is None else AxisView(expert_grid, rank, expert_groups)
        self.gtp = None if gtp_grid is None else AxisView(gtp_grid, rank, gtp_groups)
        self.egtp = None if egtp_grid is None else AxisView(egtp_grid, rank, egtp_groups)
        self.gtp_chain = None if gtp_grid is None else GTPChain(gtp_groups["gtp"], gtp, gtp_grid.coords(rank)["gtp"])
        self.egtp_chain = None if egtp_grid is None else GTPChain(egtp_groups["egtp"], egtp, egtp_grid.coords(rank)["egtp"])
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1

    @classmethod
    def for_tp(cls, tp_group=None, sequence_parallel: bool = False) -> "ParallelContext":
        """A context with only a TP group (standalone layers, their tests and verify tools):
        the group's ranks as the tp axis, every other axis of size 1."""
        import torch.distributed as dist

        ctx = cls.__new__(cls)
        if tp_group is None:
            grid, rank = ParallelGrid({"tp": 1, "cp": 1, "dp": 1, "pp": 1}), 0
        else:
            ranks = dist.get_process_group_ranks(tp_group)
            if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
                raise LayoutError(f"a TP group over non-contiguous ranks {ranks} needs a full ParallelContext")
            grid, rank = ParallelGrid({"tp": len(ranks), "cp": 1, "dp": 1, "pp": 1}, ranks[0]), dist.get_rank()
        ctx.grid, ctx.rank, ctx.registry, ctx.bridge = grid, rank, None, None
        ctx.dense = AxisView(grid, rank, {"tp": tp_group, "cp": None, "dp": None, "pp": None, "grad": None})
        ctx.expert = None
        ctx.gtp = ctx.gtp_chain = ctx.egtp = ctx.egtp_chain = None
        ctx.sequence_parallel = bool(sequence_parallel) and ctx.tp_size > 1
        return ctx

    @classmethod
    def plan(cls, grid: ParallelGrid, *, sequence_parallel: bool = False, expert: tuple[int, int] | None = None,
             gtp: int = 1, egtp: int = 1) -> "ParallelContext":
        """The context of ``grid``'s first rank without process groups: what a module built on
        it holds (shapes, placements), for planning and memory prediction — never to run."""
        from mimo.parallel.gtp import GTPChain

        ctx = cls.__new__(cls)
        ctx.grid, ctx.rank, ctx.registry, ctx.bridge = grid, grid.offset, None, None
        none = dict.fromkeys(("tp", "cp", "dp", "pp", "grad", "etp", "ep", "edp", "gtp"))  # no process groups
        ctx.dense = AxisView(grid, grid.offset, dict(none))
        ctx.expert = None if expert is None else AxisView(grid.expert_view(*expert), grid.offset, dict(none))
        ctx.gtp = ctx.gtp_chain = ctx.egtp = ctx.egtp_chain = None
        if gtp > 1:
            ctx.gtp = AxisView(grid.split_view("dp", "gtp", gtp), grid.offset, dict(none))
            ctx.gtp_chain = GTPChain(None, gtp, 0)
        if egtp > 1:
            ctx.egtp = AxisView(ctx.expert.grid.split_view("edp", "egtp", egtp), grid.offset, dict(none))
            ctx.egtp_chain = GTPChain(None, egtp, 0)
        ctx.sequence_parallel = bool(sequence_parallel) and ctx.tp_size > 1
        return ctx

    def __repr__(self) -> str:
        extra = f", expert={self.expert.grid!r}" if self.expert is not None else ""
        return f"ParallelContext({self.grid!r}, rank={self.rank}, sp={self.sequence_parallel}{extra})"

    # ---- this rank ----
    @property
    def member(self) -> bool:
        return self.rank in self.grid

    def coords(self) -> dict[str, int]:
        return self.grid.coords(self.rank)

    # ---- the dense axes, by name (what layers use) ----
    @property
    def tp(self):
        return self.dense.groups["tp"]

    @property
    def tp_size(self) -> int:
        return self.dense.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.dense.coord("tp")

    @property
    def cp(self):
        return self.dense.groups["cp"]

    @property
    def dp(self):
        return self.dense.groups["dp"]

    @property
    def pp(self):
        return self.dense.groups["pp"]

    @property
    def pp_size(self) -> int:
        return self.dense.size("pp")

    @property
    def pp_rank(self) -> int:
        return self.dense.coord("pp")

    @property
    def grad_group(self):
        """Gradients of dense parameters are summed over it (cp × dp)."""
        return self.dense.groups["grad"]

    # ---- any axis (what placements use) ----
    @property
    def gtp_size(self) -> int:
        return 1 if self.gtp is None else self.gtp.size("gtp")

    @property
    def egtp_size(self) -> int:
        return 1 if self.egtp is None else self.egtp.size("egtp")

    def gtp_shard(self, placement):
        """``placement`` as GTP keeps it on this context (``mimo.parallel.gtp.gtp_placement``)."""
        from mimo.parallel.gtp import gtp_placement

        return gtp_placement(placement, self.gtp_size)

    def gtp_register(self, param, placement) -> None:
        """Gather ``param`` just in time when ``placement`` shards it over gtp (or egtp)."""
        for axis, chain in (("gtp", self.gtp_chain), ("egtp", self.egtp_chain)):
            if axis in placement.axes:
                view = self.view(placement.axes)
                chain.register(param, placement, axis, {a: view.size(a) for a in placement.axes})

    def view(self, axes: Iterable[str]) -> AxisView:
        """The view whose axes these are: the expert view for etp / ep / edp, the GTP view for
        gtp, else the dense one."""
        axes = tuple(axes)
        if "egtp" in axes:
            if self.egtp is None:
                raise LayoutError(f"axes {axes} need the expert GTP view, which this module does not have")
            return self.egtp
        if "gtp" in axes:
            if self.gtp is None:
                raise LayoutError(f"axes {axes} need the GTP view, which this module does not have")
            return self.gtp
        if any(a in ("etp", "ep", "edp") for a in axes):
            if self.expert is None:
                raise LayoutError(f"axes {axes} need the expert view, which this module does not have")
            return self.expert
        return self.dense

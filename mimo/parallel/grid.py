"""ParallelGrid: a named N-d grid of ranks, and the per-module parallel layout config.

Dims are listed fastest-varying first, so ``{"tp": 2, "cp": 1, "dp": 2, "pp": 2}`` numbers
ranks in Megatron's tp-cp-ep-dp-pp order: rank = offset + tp + 2*cp + 2*dp + 4*pp.

Process groups come from a ``GroupRegistry``, one per run, shared by every grid and view of
the run: each distinct rank set gets exactly one communicator. ``torch.distributed`` names a
new group by a counter that every rank advances, so the *first* request for a rank set is
collective over the whole world: every rank (members of the grid or not) asks at the same
point, and ``group(dims)`` creates every group of that partition in rank order. Later
requests are local look-ups. A group of one rank is never created: ``None`` stands for it, and
the collectives in ``mimo.parallel`` treat ``None`` as "no communication".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from mimo.core.errors import LayoutError

Dims = tuple[str, ...]


def _as_dims(dims: str | Iterable[str]) -> Dims:
    return (dims,) if isinstance(dims, str) else tuple(dims)


class GroupRegistry:
    """Hands out one process group per distinct rank set (see module doc) and purpose.

    ``purpose`` is "" for the training thread's groups. Work that runs collectives on another
    thread (the data pipeline preparing the next step: ``purpose="data"``) asks for its own
    groups, so its collectives never interleave with the training thread's on one communicator.
    ``created`` lists the rank sets in creation order, ``purposes`` each one's purpose (tests
    count communicators with them).
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[str, tuple[int, ...]], object] = {}
        self.created: list[tuple[int, ...]] = []
        self.purposes: list[str] = []

    def axis_groups(self, grid: "ParallelGrid", axes: dict[str, str | Iterable[str]], rank: int) -> dict[str, object]:
        """Name -> the group of ``rank`` over those dims of ``grid`` (None where they span one
        rank), created in the order given (``partition``: collective the first time)."""
        out = {}
        for name, dims in axes.items():
            spanned = tuple(d for d in _as_dims(dims) if grid.shape.get(d, 1) > 1)
            out[name] = self.partition(grid.partition(spanned), rank) if spanned else None
        return out

    def partition(self, groups: Iterable[Sequence[int]], rank: int | None = None, purpose: str = ""):
        """Create every not-yet-created rank set of ``groups`` (in the order given) and return
        the group holding ``rank`` (None where none does, or it has one rank). Collective over
        the world the first time a rank set appears: every rank calls it at the same point."""
        import torch.distributed as dist

        groups = [tuple(sorted(set(g))) for g in groups]
        for key in groups:
            if len(key) > 1 and (purpose, key) not in self._groups:
                if not dist.is_initialized():
                    raise LayoutError(f"a process group over ranks {list(key)} needs torch.distributed initialised")
                if key[-1] >= dist.get_world_size():
                    raise LayoutError(f"ranks {list(key)} do not fit in world size {dist.get_world_size()}")
                self._groups[(purpose, key)] = dist.new_group(list(key))
                self.created.append(key)
                self.purposes.append(purpose)
        rank = dist.get_rank() if rank is None else rank
        for key in groups:
            if rank in key:
                return self._groups.get((purpose, key))  # None for a one-rank set
        return None

    def group(self, ranks: Iterable[int], rank: int | None = None, purpose: str = ""):
        """The group over one rank set (e.g. a bridge over source ∪ destination): collective
        like ``partition``; None on ranks outside it and for one rank."""
        return self.partition([list(ranks)], rank, purpose)


class ParallelGrid:
    """Ranks ``offset .. offset+size-1`` arranged on named dims (first dim fastest)."""

    def __init__(self, shape: dict[str, int], offset: int = 0, *, registry: "GroupRegistry | None" = None):
        if not shape:
            raise LayoutError("a grid needs at least one dim")
        for name, n in shape.items():
            if not isinstance(n, int) or n < 1:
                raise LayoutError(f"grid dim {name!r} must be a positive integer, got {n!r}")
        if offset < 0:
            raise LayoutError(f"grid offset must be >= 0, got {offset}")
        self.shape: dict[str, int] = dict(shape)
        self.dims: Dims = tuple(shape)
        self.offset = offset
        self.size = math.prod(shape.values())
        strides, s = {}, 1
        for name in self.dims:
            strides[name] = s
            s *= shape[name]
        self._strides = strides
        # the run's registry: views over the same ranks (the expert view) and other grids over
        # the same rank sets hand out the very same group objects, e.g. for PP
        self.registry = GroupRegistry() if registry is None else registry
        self._partitions: dict[Dims, list[list[int]]] = {}

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}={n}" for d, n in self.shape.items())
        return f"ParallelGrid({dims}, ranks={self.offset}:{self.offset + self.size})"

    # ---- pure rank arithmetic (no torch.distributed needed) ----
    @property
    def ranks(self) -> range:
        return range(self.offset, self.offset + self.size)

    def __contains__(self, rank: int) -> bool:
        return self.offset <= rank < self.offset + self.size

    def dim_size(self, dims: str | Iterable[str]) -> int:
        return math.prod(self.shape[d] for d in self._check_dims(_as_dims(dims)))

    def coords(self, rank: int) -> dict[str, int]:
        if rank not in self:
            raise LayoutError(f"rank {rank} is not in {self!r}")
        local = rank - self.offset
        return {d: (local // self._strides[d]) % self.shape[d] for d in self.dims}

    def coord(self, rank: int, dims: str | Iterable[str]) -> int:
        """Index of ``rank`` within its group over ``dims`` (first listed dim fastest)."""
        c = self.coords(rank)
        idx, s = 0, 1
        for d in self._check_dims(_as_dims(dims)):
            idx += c[d] * s
            s *= self.shape[d]
        return idx

    def rank_at(self, **coords: int) -> int:
        for d, v in coords.items():
            if d not in self.shape:
                raise LayoutError(f"unknown grid dim {d!r}; dims are {list(self.dims)}")
            if not 0 <= v < self.shape[d]:
                raise LayoutError(f"coordinate {d}={v} outside 0..{self.shape[d] - 1}")
        return self.offset + sum(coords.get(d, 0) * self._strides[d] for d in self.dims)

    def group_ranks(self, dims: str | Iterable[str], rank: int) -> list[int]:
        """Ranks of the group over ``dims`` that contains ``rank``, in group-rank order."""
        dims_t = self._check_dims(_as_dims(dims))
        base = self.coords(rank)
        out = []
        for i in range(self.dim_size(dims_t)):
            c = dict(base)
            for d in dims_t:
                c[d] = i % self.shape[d]
                i //= self.shape[d]
            out.append(self.rank_at(**c))
        return out

    def partition(self, dims: str | Iterable[str]) -> list[list[int]]:
        """All groups over ``dims``, ordered by their first rank."""
        dims_t = self._check_dims(_as_dims(dims))
        seen: dict[tuple[int, ...], None] = {}
        for r in self.ranks:
            seen.setdefault(tuple(self.group_ranks(dims_t, r)), None)
        return sorted((list(g) for g in seen), key=lambda g: g[0])

    def _check_dims(self, dims: Dims) -> Dims:
        for d in dims:
            if d not in self.shape:
                raise LayoutError(f"unknown grid dim {d!r}; dims are {list(self.dims)}")
        if len(set(dims)) != len(dims):
            raise LayoutError(f"repeated dim in {dims}")
        return dims

    # ---- views ----
    def split_view(self, axis: str, inner: str, n: int) -> "ParallelGrid":
        """The same ranks with ``axis`` split as ``inner`` (n, fastest) x ``axis`` (the rest), in
        its place: GTP's view of the data replicas (``dp`` -> gtp x dp; ``edp`` -> egtp x edp),
        whose ``inner`` groups shard the large weights (``mimo.parallel.gtp``)."""
        size = self.shape.get(axis, 1)
        if n < 1 or size % n:
            raise LayoutError(f"{inner}={n} does not divide the grid's {size} {axis} ranks")
        shape: dict[str, int] = {}
        for d, k in self.shape.items():
            if d == axis:
                shape[inner], shape[axis] = n, k // n
            else:
                shape[d] = k
        return ParallelGrid(shape, self.offset, registry=self.registry)

    def expert_view(self, etp: int, ep: int) -> "ParallelGrid":
        """MoE parallel folding: ETP x EP x EDP x PP over the same ranks, sharing PP groups.

        Within each PP stage the tp*cp*dp ranks are re-factored as etp*ep*edp.
        """
        if "pp" in self.shape and self.dims[-1] != "pp":
            raise LayoutError("the expert view needs pp as the slowest dim of the grid")
        pp = self.shape.get("pp", 1)
        per_stage = self.size // pp
        if etp < 1 or ep < 1 or per_stage % (etp * ep):
            raise LayoutError(
                f"expert layout etp={etp} x ep={ep} does not divide the {per_stage} ranks "
                f"of a pipeline stage"
            )
        shape = {"etp": etp, "ep": ep, "edp": per_stage // (etp * ep), "pp": pp}
        return ParallelGrid(shape, self.offset, registry=self.registry)

    # ---- process groups ----
    def group(self, dims: str | Iterable[str], rank: int | None = None, purpose: str = ""):
        """This rank's process group over ``dims`` (``None`` for a group of one rank).

        The first call for a dims tuple is collective over the world (see module doc);
        on a rank outside the grid it creates the groups and returns ``None``. ``purpose``: see
        ``GroupRegistry`` ("" for the training thread's groups).
        """
        import torch.distributed as dist

        dims_t = self._check_dims(_as_dims(dims))
        if self.dim_size(dims_t) == 1:
            return None
        if not dist.is_initialized():
            raise LayoutError(f"group over {dims_t} of {self!r} needs torch.distributed initialised")
        if self.offset + self.size > dist.get_world_size():
            raise LayoutError(f"{self!r} does not fit in world size {dist.get_world_size()}")
        rank = dist.get_rank() if rank is None else rank
        if dims_t not in self._partitions:
            self._partitions[dims_t] = self.partition(dims_t)
        return self.registry.partition(self._partitions[dims_t], rank, purpose)


@dataclass
class ParallelConfig:
    """The ``parallel:`` section of a module: sizes and the rank range it runs on."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    gtp: int = 1  # GTP: large weights further split inside TP over gtp data replicas (mimo.parallel.gtp)
    egtp: int = 1  # GTP for the MoE experts: their weights split inside ETP over egtp expert data replicas
    ep: int = 1  # expert parallel size (MoE LLM): experts split over ep ranks of a stage
    etp: int | None = None  # expert tensor parallel size; None: tp
    sequence_parallel: bool = False
    ranks: str | None = None  # "a:b" (half-open); default: all ranks of the world

    @property
    def size(self) -> int:
        return self.tp * self.gtp * self.cp * self.dp * self.pp

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: dp, times gtp (each GTP rank takes its own share of the data)."""
        return self.gtp * self.dp

    @property
    def expert_tp(self) -> int:
        """etp resolved (default: tp)."""
        return self.tp if self.etp is None else self.etp

    @property
    def folded(self) -> bool:
        """Whether experts are laid out differently from the dense layers (ep > 1, etp != tp, or
        their weights split over egtp, which lives on their own view)."""
        return self.ep > 1 or self.expert_tp != self.tp or self.egtp > 1

    def rank_range(self, world_size: int) -> range:
        if self.ranks is None:
            return range(0, world_size)
        return parse_rank_range(self.ranks)

    def grid(self, world_size: int, registry: GroupRegistry | None = None) -> ParallelGrid:
        """The module's grid; ``registry``: the run's (its groups), else a private one."""
        r = self.rank_range(world_size)
        return ParallelGrid({"tp": self.tp, "cp": self.cp, "dp": self.replicas, "pp": self.pp}, r.start, registry=registry)

    def validate(self, path: str) -> list[str]:
        """Config problems of this section alone (mimo.core.schema calls it; the fit of the rank
        range into the world is checked where the world size is known)."""
        key = (lambda name: f"{path}.{name}" if path else name)
        problems = [
            f"{key(name)}: must be >= 1, got {getattr(self, name)}"
            for name in ("tp", "dp", "pp", "cp", "ep", "etp", "gtp", "egtp")
            if getattr(self, name) is not None and getattr(self, name) < 1
        ]
        if self.ranks is not None:
            try:
                parse_rank_range(self.ranks)
            except LayoutError as e:
                problems.append(f"{key('ranks')}: {e}")
        return problems


def parse_rank_range(text: str) -> range:
    """``"4:8"`` -> range(4, 8); a single ``"3"`` -> range(3, 4)."""
    s = str(text).strip()
    try:
        if ":" in s:
            a, b = s.split(":", 1)
            r = range(int(a), int(b))
        else:
            r = range(int(s), int(s) + 1)
    except ValueError:
        raise LayoutError(f"rank range {text!r} must look like 'a:b' (half-open) or 'a'") from None
    if r.start < 0 or len(r) < 1:
        raise LayoutError(f"rank range {text!r} is empty or negative")
    return r

"""ParallelGrid: a named N-d grid of ranks, and the per-module parallel layout config.

Dims are listed fastest-varying first, so ``{"tp": 2, "cp": 1, "dp": 2, "pp": 2}`` numbers
ranks in Megatron's tp-cp-ep-dp-pp order: rank = offset + tp + 2*cp + 2*dp + 4*pp.

Process groups are created on first use and cached on the grid. ``torch.distributed``
names a new group by a counter that every rank advances, so the *first* ``group(dims)`` call
for a given dims tuple is collective over the whole world: every rank (members of the grid
or not) calls it at the same point, and it creates every group of that partition in rank
order. Later calls are local cache look-ups. A group of one rank is never created: ``None``
stands for it, and the collectives in ``mimo.parallel`` treat ``None`` as "no communication".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from mimo.core.errors import LayoutError

Dims = tuple[str, ...]


def _as_dims(dims: str | Iterable[str]) -> Dims:
    return (dims,) if isinstance(dims, str) else tuple(dims)


class ParallelGrid:
    """Ranks ``offset .. offset+size-1`` arranged on named dims (first dim fastest)."""

    def __init__(self, shape: dict[str, int], offset: int = 0, *, _group_cache: dict | None = None):
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
        # Keyed by the member ranks of a group, so views over the same ranks (the expert
        # view) hand out the very same group objects, e.g. for PP.
        self._groups: dict[tuple[int, ...], object] = {} if _group_cache is None else _group_cache
        self._created: set[Dims] = set()

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
        return ParallelGrid(shape, self.offset, _group_cache=self._groups)

    # ---- process groups ----
    def group(self, dims: str | Iterable[str], rank: int | None = None):
        """This rank's process group over ``dims`` (``None`` for a group of one rank).

        The first call for a dims tuple is collective over the world (see module doc);
        on a rank outside the grid it creates the groups and returns ``None``.
        """
        import torch.distributed as dist

        dims_t = self._check_dims(_as_dims(dims))
        if self.dim_size(dims_t) == 1:
            return None
        if not dist.is_initialized():
            raise LayoutError(f"group over {dims_t} of {self!r} needs torch.distributed initialised")
        if dims_t not in self._created:
            if self.offset + self.size > dist.get_world_size():
                raise LayoutError(f"{self!r} does not fit in world size {dist.get_world_size()}")
            for ranks in self.partition(dims_t):
                key = tuple(ranks)
                if key not in self._groups:
                    self._groups[key] = dist.new_group(ranks)
            self._created.add(dims_t)
        rank = dist.get_rank() if rank is None else rank
        if rank not in self:
            return None
        return self._groups[tuple(self.group_ranks(dims_t, rank))]


@dataclass
class ParallelConfig:
    """The ``parallel:`` section of a module: sizes and the rank range it runs on."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    ranks: str | None = None  # "a:b" (half-open); default: all ranks of the world

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank_range(self, world_size: int) -> range:
        if self.ranks is None:
            return range(0, world_size)
        return parse_rank_range(self.ranks)

    def grid(self, world_size: int) -> ParallelGrid:
        r = self.rank_range(world_size)
        return ParallelGrid({"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}, r.start)

    def validate(self, path: str) -> list[str]:
        """Config problems of this section alone (mimo.core.schema calls it; the fit of the rank
        range into the world is checked where the world size is known)."""
        key = (lambda name: f"{path}.{name}" if path else name)
        problems = [
            f"{key(name)}: must be >= 1, got {getattr(self, name)}"
            for name in ("tp", "dp", "pp", "cp", "ep", "etp")
            if getattr(self, name) < 1
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



def new_group(ranks) -> object | None:
    """A process group over an arbitrary rank set (e.g. a bridge over source ∪ destination).

    Collective over the world, like a grid's first ``group`` call: every rank calls it at the
    same point. Returns the group on member ranks; None on the others and for one rank.
    """
    import torch.distributed as dist

    ranks = sorted(set(ranks))
    if len(ranks) <= 1:
        return None
    group = dist.new_group(ranks)
    return group if dist.get_rank() in ranks else None

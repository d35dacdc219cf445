"""Bridge verification against the one-process reference (``mimo verify-bridge`` and tests).

Every rank generates the same random logical tensors (the reference), cuts out its local
part by the source placement, runs the bridge, and compares what it received (forward) and
the gradient it got back (backward, on every source replica) with the reference, bit for bit.

Rows: ``ragged`` / ``uniform`` (images of a fixed-size tower, each a run of rows) or ``native``
(a native-resolution tower such as Qwen3-VL's: every image has its own grid and rows,
t*h*w / merge^2, a row carrying ``hidden * (1 + deepstack levels)`` values). Where the layouts
are ones training runs (the encoder replicated over its TP, the LLM packing its rows: shard none
or seq), the bridge is the one training runs: placements and this rank's plans from
``mimo.bridges.plan.image_bridge_plans``, checked against the reference builders' placements
(``mimo.parallel.layout_reference``) and ``make_plan``'s moves before the values move. Other
layouts (a hidden-sharded encoder or LLM side) run the reference builders' placements.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mimo.bridges.executor import Bridge
from mimo.bridges.plan import TransferPlan, image_bridge_plans
from mimo.bridges.plan_reference import make_plan, minimum_numel
from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid, parse_rank_range
from mimo.parallel.layout import Placement, RunPlacement, as_runs, dp_blocks
from mimo.parallel.layout_reference import dp_placement, packed_placement
from mimo.core.testing import rank_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROWS = ("ragged", "uniform", "native")


@dataclass(frozen=True)
class LayoutSpec:
    """A module layout as written on the command line: ``tp=2,dp=2,cp=1,shard=seq,ranks=0:4``."""

    tp: int = 1
    dp: int = 1
    cp: int = 1
    pp: int = 1
    shard: str | None = None
    ranks: range | None = None

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def grid(self, offset: int) -> ParallelGrid:
        start = self.ranks.start if self.ranks is not None else offset
        return ParallelGrid({"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}, start)


def parse_layout(text: str) -> LayoutSpec:
    fields: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise LayoutError(f"layout item {item!r} must look like key=value")
        key = key.strip()
        if key in ("tp", "dp", "cp", "pp"):
            if not value.isdigit() or int(value) < 1:
                raise LayoutError(f"layout {key}={value!r} must be a positive integer")
            fields[key] = int(value)
        elif key == "shard":
            if value not in ("hidden", "seq", "none"):
                raise LayoutError(f"layout shard={value!r} must be hidden, seq or none")
            fields["shard"] = None if value == "none" else value
        elif key == "ranks":
            fields["ranks"] = parse_rank_range(value)
        else:
            raise LayoutError(f"unknown layout key {key!r} (use tp, dp, cp, pp, shard, ranks)")
    spec = LayoutSpec(**fields)
    if spec.ranks is not None and len(spec.ranks) != spec.size:
        raise LayoutError(f"layout {text!r}: tp*cp*dp*pp = {spec.size} but ranks {spec.ranks.start}:{spec.ranks.stop} has {len(spec.ranks)}")
    if spec.cp > 1 and spec.shard == "hidden":
        raise LayoutError(f"layout {text!r}: cp>1 shards rows by position; shard=hidden does not combine with it")
    return spec


@dataclass(frozen=True)
class Sample:
    seq_len: int
    image_positions: tuple[int, ...]  # where its rows sit in the packed sequence

    @property
    def image_starts(self) -> tuple[int, ...]:
        """Its images as training sees them: each maximal run of consecutive positions one image."""
        p = self.image_positions
        return tuple(x for i, x in enumerate(p) if i == 0 or p[i - 1] != x - 1)

    @property
    def image_rows(self) -> tuple[int, ...]:
        p = self.image_positions
        firsts = [i for i in range(len(p)) if i == 0 or p[i - 1] != p[i] - 1]
        return tuple(b - a for a, b in zip(firsts, [*firsts[1:], len(p)]))


def random_samples(rng: random.Random, n: int, ragged: bool) -> list[Sample]:
    """Text and image rows interleaved (each image a contiguous run); some samples without
    images. Uniform: every sample is 2 text tokens, 4 image rows, 4 text tokens."""
    out = []
    for i in range(n):
        pieces = []  # (is_image, length)
        if ragged:
            images = 0 if i % 4 == 1 else rng.choice([0, 1, 1, 2])
            for _ in range(images):
                pieces += [(False, rng.randint(0, 3)), (True, rng.randint(1, 9))]
            pieces.append((False, rng.randint(1, 6)))
        else:
            pieces = [(False, 2), (True, 4), (False, 4)]
        positions, pos = [], 0
        for is_image, length in pieces:
            if is_image:
                positions.extend(range(pos, pos + length))
            pos += length
        out.append(Sample(pos, tuple(positions)))
    return out


# ---- native-resolution images --------------------------------------------------------------------
MERGE = 2  # patches merged per side into one LLM row (Qwen3-VL's spatial merge)
COST_WIDTH = 64  # a stand-in for the tower's cost width: its DP blocks balance patches x (COST_WIDTH + patches)


@dataclass(frozen=True)
class NativeSample:
    """A sample of ``seq_len`` positions whose images start at ``image_starts`` (in order) and
    have grids ``image_grids`` ((t, h, w) in patches, h and w multiples of ``MERGE``)."""

    seq_len: int
    image_starts: tuple[int, ...]
    image_grids: tuple[tuple[int, int, int], ...]

    @property
    def image_rows(self) -> tuple[int, ...]:
        return tuple(t * h * w // MERGE**2 for t, h, w in self.image_grids)

    @property
    def image_positions(self) -> tuple[int, ...]:
        """Where its rows sit in the packed sequence: each image's rows consecutive from its start."""
        return tuple(p for start, rows in zip(self.image_starts, self.image_rows) for p in range(start, start + rows))


def native_samples(rng: random.Random, n: int) -> list[NativeSample]:
    """0..3 images per sample (every fourth sample none), each of a random grid: one row
    (a 2x2-patch image) now and then, else 1..40 rows of any aspect; 0..3 text tokens before
    each image (0: it abuts the image before), 1..6 after the last."""
    out = []
    for i in range(n):
        images = 0 if i % 4 == 1 else rng.choice([0, 1, 1, 2, 3])
        pos, starts, grids = 0, [], []
        for _ in range(images):
            pos += rng.randint(0, 3)
            if rng.random() < 0.2:
                h = w = 1
            else:
                while True:
                    h, w = rng.randint(1, 8), rng.randint(1, 8)
                    if h * w <= 40:
                        break
            starts.append(pos)
            grids.append((1, MERGE * h, MERGE * w))
            pos += h * w
        out.append(NativeSample(pos + rng.randint(1, 6), tuple(starts), tuple(grids)))
    return out


def check_native(src: LayoutSpec, dst: LayoutSpec) -> None:
    """Layouts training gives a native tower's bridge: the tower's rows replicated over its TP,
    the LLM's packed (replicated over TP, or sequence shards)."""
    if src.shard is not None:
        raise LayoutError(f"--rows native: the encoder's rows are replicated over its TP in training; shard={src.shard} is not")
    if dst.shard == "hidden":
        raise LayoutError("--rows native: the LLM packs its rows (shard=none or seq); shard=hidden is not a layout training uses")


def native_blocks(src: LayoutSpec, dst: LayoutSpec, samples: list[NativeSample]) -> tuple[list[range], list[range]]:
    """(encoder DP blocks, LLM DP blocks) as the data pipeline makes them: the tower's balance
    patches x (``COST_WIDTH`` + patches) over each sample's images, the LLM's its tokens."""
    costs = [sum(MERGE**2 * r * (COST_WIDTH + MERGE**2 * r) for r in s.image_rows) for s in samples]
    return dp_blocks(costs, src.dp), dp_blocks([s.seq_len for s in samples], dst.dp)


def image_layout(samples: list[Sample] | list[NativeSample]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The samples as a bridge is planned from them (``SampleArrays.image_layout``'s arrays): tokens
    per sample, images per sample, each image's start and rows."""
    array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return (array([s.seq_len for s in samples]), array([len(s.image_starts) for s in samples]),
            array([p for s in samples for p in s.image_starts]), array([r for s in samples for r in s.image_rows]))


def native_placements(dst: LayoutSpec, sg: ParallelGrid, dg: ParallelGrid, samples: list[NativeSample], width: int,
                      blocks: tuple[list[range], list[range]]) -> tuple[Placement, Placement]:
    """The reference builders' placements of the samples' image rows (``reference_bridge``)."""
    return reference_bridge(*image_layout(samples), width, sg, blocks[0], dg, blocks[1], dst.shard == "seq")


def reference_bridge(tokens_N: np.ndarray, images_N: np.ndarray, image_start_I: np.ndarray, image_rows_I: np.ndarray,
                     width: int, encoder_grid: ParallelGrid, encoder_blocks, llm_grid: ParallelGrid, llm_blocks,
                     sequence_parallel: bool) -> tuple[Placement, Placement]:
    """What ``mimo.bridges.plan.image_bridge_plans`` must give for a microbatch (its arguments),
    by the reference builders: ``dp_placement`` over each sample's image rows on the encoder,
    ``packed_placement`` at each row's position on the LLM's first stage."""
    first_N1 = np.concatenate([[0], np.cumsum(images_N)]).astype(np.int64)
    samples = []
    for i, n in enumerate(tokens_N.tolist()):
        images = range(int(first_N1[i]), int(first_N1[i + 1]))
        samples.append((n, [p for j in images for p in range(int(image_start_I[j]), int(image_start_I[j] + image_rows_I[j]))]))
    src = dp_placement(encoder_grid, [len(positions) for _, positions in samples], encoder_blocks, width)
    dst, _ = packed_placement(llm_grid, samples, llm_blocks, width, sequence_parallel)
    return src, dst


def production_plans(dst: LayoutSpec, sg: ParallelGrid, dg: ParallelGrid, samples: list[NativeSample], width: int,
                     blocks: tuple[list[range], list[range]], rank: int
                     ) -> tuple[RunPlacement, RunPlacement, tuple[TransferPlan, TransferPlan]]:
    """What training runs for this microbatch on ``rank``: ``image_bridge_plans`` of the
    samples' arrays (``image_layout``)."""
    return image_bridge_plans(*image_layout(samples), width, sg, blocks[0], dg, blocks[1], dst.shard == "seq", rank)


def _pieces(pl: RunPlacement) -> set:
    return set(zip(*(getattr(pl, c).tolist() for c in ("rank_P", "row_P", "rows_P", "local_row_P", "col_P", "cols_P"))))


def placement_problems(src: RunPlacement, dst: RunPlacement, plans: tuple[TransferPlan, TransferPlan],
                       src_ref: Placement, dst_ref: Placement, rank: int) -> list[str]:
    """Where the production bridge differs from the reference as far as ``rank`` sees it: the
    encoder's placement whole; the LLM's (built near the rank's rows only) its tensor, ranks and
    replica groups, this rank's pieces, local shape and rows held, and no piece the reference
    lacks; this rank's plans both ways against ``make_plan``'s moves and all-gathers of the rank."""
    out = []
    if src.to_placement() != src_ref:
        out.append(f"rank {rank}: encoder placement differs from dp_placement")
    ref = as_runs(dst_ref)
    if (dst.rows, dst.hidden) != (ref.rows, ref.hidden):
        out.append(f"rank {rank}: LLM placement of [{dst.rows}, {dst.hidden}] rows, the reference [{ref.rows}, {ref.hidden}]")
        return out
    if dst.ranks != ref.ranks or dst.replicas != ref.replicas:
        out.append(f"rank {rank}: LLM placement ranks or replica groups differ from packed_placement's")
    if dst.pieces_of(rank) != ref.pieces_of(rank):
        out.append(f"rank {rank}: its LLM pieces differ from packed_placement's")
    if (dst.holds_rank(rank), dst.local_shape(rank), dst.held_rows(rank)) != (ref.holds_rank(rank), ref.local_shape(rank), ref.held_rows(rank)):
        out.append(f"rank {rank}: its LLM buffer differs from packed_placement's")
    if not _pieces(dst) <= _pieces(ref):
        out.append(f"rank {rank}: LLM pieces that packed_placement does not have")
    for name, ref_plan, mine in zip(("forward", "backward"), (make_plan(src_ref, dst_ref), make_plan(dst_ref, src_ref)), plans):
        if (mine.moves != tuple(m for m in ref_plan.moves if rank in (m.src, m.dst))
                or mine.gathers != tuple(g for g in ref_plan.gathers if rank in g.ranks) or mine.colocated != ref_plan.colocated):
            out.append(f"rank {rank}: its {name} plan differs from make_plan's")
    return out


def resolve(src: LayoutSpec, dst: LayoutSpec, world: int, colocated: bool | None) -> tuple[ParallelGrid, ParallelGrid]:
    """Grids for both ends: colocated shares ranks 0..n-1; otherwise source first, then
    destination. The source is an encoder (one pipeline stage, no CP); the destination an
    LLM whose first pipeline stage receives the rows."""
    if src.pp != 1 or src.cp != 1:
        raise LayoutError("the source is an encoder: pp and cp must be 1 there")
    if colocated is None:
        colocated = src.ranks == dst.ranks if src.ranks is not None and dst.ranks is not None else src.size == dst.size == world
    if colocated:
        if src.size != dst.size:
            raise LayoutError(f"colocated layouts need the same rank count: {src.size} vs {dst.size}")
        sg, dg = src.grid(0), dst.grid(0)
        if sg.ranks != dg.ranks:
            raise LayoutError("colocated layouts must name the same ranks")
    else:
        sg, dg = src.grid(0), dst.grid(src.size)
        if set(sg.ranks) & set(dg.ranks):
            raise LayoutError(f"non-colocated layouts overlap: {sg.ranks} and {dg.ranks}")
    top = max(sg.ranks.stop, dg.ranks.stop)
    if top > world:
        raise LayoutError(f"the layouts need {top} ranks but --world is {world}")
    return sg, dg


def placements(src: LayoutSpec, dst: LayoutSpec, sg: ParallelGrid, dg: ParallelGrid, samples: list[Sample], hidden: int) -> tuple[Placement, Placement]:
    """Source: an encoder's DP blocks balanced by its rows. Destination: an LLM's DP blocks
    balanced by sequence length, rows at their packed positions (CP order / sequence shards)."""
    rows = [len(s.image_positions) for s in samples]
    src_pl = dp_placement(sg, rows, dp_blocks(rows, src.dp), hidden, src.shard)
    blocks = dp_blocks([s.seq_len for s in samples], dst.dp)
    if dst.shard == "hidden":
        return src_pl, dp_placement(dg, rows, blocks, hidden, "hidden")
    dst_pl, _ = packed_placement(dg, [(s.seq_len, s.image_positions) for s in samples], blocks, hidden, dst.shard == "seq")
    return src_pl, dst_pl


def local_view(full: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """This rank's local buffer of ``full`` under ``placement`` (zeros where it holds nothing)."""
    rows, _ = placement.local_shape(rank)
    cols = placement.columns_of(rank)
    out = full.new_zeros(rows, len(cols))
    for p in placement.pieces_of(rank):
        out[p.local_row : p.local_row + p.rows, p.col - cols.start : p.col - cols.start + p.cols] = full[p.row : p.row + p.rows, p.col : p.col + p.cols]
    return out


def _replica_group(grid: ParallelGrid, shard: str | None, rank: int):
    return grid.group("tp") if shard is None and rank in grid else None


def bridge_case(src_text: str, dst_text: str, colocated: bool | None, hidden: int, microbatches: int, rows: bool | str, seed: int,
                device: str = "cpu", dtype: str = "fp32", levels: int = 0) -> dict:
    """Runs on every rank of the pool; returns this rank's errors and byte counts. ``rows``:
    ``ragged`` (True), ``uniform`` (False) or ``native`` (each image its own grid; rows of
    ``hidden * (1 + levels)`` values, the bridge built as training builds it); ``device``:
    where the rank's tensors live (``cuda``: its GPU, so they travel over NCCL); ``dtype``: the
    moved tensors' type (the reference is drawn in fp32 and rounded to it; moving is exact)."""
    rows = {True: "ragged", False: "uniform"}.get(rows, rows)
    if rows not in ROWS:
        raise LayoutError(f"rows must be one of {ROWS}, got {rows!r}")
    native = rows == "native"
    if levels and not native:
        raise LayoutError("deepstack levels go with native rows")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev, dt = rank_device(device), DTYPES[dtype]
    src, dst = parse_layout(src_text), parse_layout(dst_text)
    sg, dg = resolve(src, dst, world, colocated)
    if native:
        check_native(src, dst)
    # the layouts training runs (an encoder replicated over its TP, an LLM packing its rows): the
    # bridge is built by training's function and checked against the reference builders
    production = native or (src.shard is None and dst.shard != "hidden")
    width = hidden * (1 + levels)
    # groups are created on every rank, in the same order (ParallelGrid contract)
    src_tp, dst_tp = sg.group("tp"), dg.group("tp")
    members = sorted(set(sg.ranks) | set(dg.ranks))
    group = ParallelGrid({"bridge": len(members)}, members[0]).group("bridge") if len(members) > 1 else None
    if group is not None and rank in members:
        dist.barrier(group=group)  # first use by a collective (NCCL wants it before any p2p)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    fwd_err = grad_err = 0.0
    sent = {"fwd": 0, "bwd": 0, "allgather": 0}
    minimum = {"fwd": 0, "bwd": 0, "allgather": 0}
    problems, images, most_rows = [], 0, 0
    for _ in range(microbatches):
        n = rng.randint(1, 9) if rows != "uniform" else 4
        if native:
            samples = native_samples(rng, n)
            blocks = native_blocks(src, dst, samples)
            src_pl, dst_pl = native_placements(dst, sg, dg, samples, width, blocks)
            images += sum(len(s.image_starts) for s in samples)
            most_rows = max([most_rows, *(r for s in samples for r in s.image_rows)])
        else:
            samples = random_samples(rng, n, rows == "ragged")
            src_pl, dst_pl = placements(src, dst, sg, dg, samples, width)
            blocks = (dp_blocks([len(s.image_positions) for s in samples], src.dp), dp_blocks([s.seq_len for s in samples], dst.dp))
        X = torch.randn(src_pl.rows, width, generator=gen).to(dt)
        G = torch.randn(src_pl.rows, width, generator=gen).to(dt)
        for key, (a, b) in {"fwd": (src_pl, dst_pl), "bwd": (dst_pl, src_pl)}.items():
            m = minimum_numel(a, b)
            minimum[key] += m["cross"]
            minimum["allgather"] += m["allgather"]
        plans = None
        if production:  # the bridge as training builds it, checked before anything moves
            mine = []
            if rank in members:
                try:
                    bridge_src, bridge_dst, plans = production_plans(dst, sg, dg, samples, width, blocks, rank)
                    mine = placement_problems(bridge_src, bridge_dst, plans, src_pl, dst_pl, rank)
                except Exception as e:  # noqa: BLE001 - a production path that fails is a problem found, on every rank alike
                    mine = [f"rank {rank}: {type(e).__name__}: {e}"]
            problems += mine
            flag = torch.tensor([len(mine)], dtype=torch.int64)
            dist.all_reduce(flag)  # every rank of the pool: a wrong placement anywhere moves nothing
            if flag.item():
                continue
        if rank not in members:
            continue
        if plans is None:
            bridge = Bridge(src_pl, dst_pl, group, src_replica_group=_replica_group(sg, src.shard, rank),
                            dst_replica_group=_replica_group(dg, dst.shard, rank))
        else:  # as ``mimo.training.schedule_run.encode_and_bridge`` builds it
            bridge = Bridge(bridge_src, bridge_dst, group, src_replica_group=src_tp if rank in sg else None,
                            dst_replica_group=dst_tp if rank in dg and dst.shard != "seq" else None, rank=rank, plans=plans)
        x = local_view(X, src_pl, rank).to(dev).requires_grad_() if bridge.is_src else None
        y = bridge(x, dtype=dt, device=dev)
        if bridge.is_dst:
            if y.dtype != dt or y.device != dev:
                raise AssertionError(f"rank {rank}: the bridge returned {y.dtype} on {y.device}, sent {dt} on {dev}")
            fwd_err = max(fwd_err, (y - local_view(X, dst_pl, rank).to(dev)).abs().max().item() if y.numel() else 0.0)
            y.backward(local_view(G, dst_pl, rank).to(dev))
        elif bridge.colocated is False:
            Bridge.backward_source(y)
        if bridge.is_src:
            grad_err = max(grad_err, (x.grad - local_view(G, src_pl, rank).to(dev)).abs().max().item() if x.numel() else 0.0)
        sent["fwd"] += bridge.stats.fwd_sent
        sent["bwd"] += bridge.stats.bwd_sent
        sent["allgather"] += bridge.stats.fwd_allgather + bridge.stats.bwd_allgather
    out = {"fwd_err": fwd_err, "grad_err": grad_err, "sent": sent, "minimum": minimum}
    if production:
        out.update(problems=problems)
    if native:
        out.update(images=images, most_image_rows=most_rows, width=width)
    return out


def summarise(results: list[dict], itemsize: int = 4) -> dict:
    """Combine per-rank results into the verify-bridge report (bytes over all ranks)."""
    fwd = max(r["fwd_err"] for r in results)
    grad = max(r["grad_err"] for r in results)
    sent = sum(r["sent"]["fwd"] + r["sent"]["bwd"] for r in results) * itemsize
    allgather = sum(r["sent"]["allgather"] for r in results) * itemsize
    m = results[0]["minimum"]
    bytes_min = (m["fwd"] + m["bwd"]) * itemsize
    ratio = 1.0 if sent == bytes_min == 0 else (sent / bytes_min if bytes_min else float("inf"))
    report = {
        "fwd_max_abs_err": fwd,
        "grad_max_abs_err": grad,
        "bytes_sent": sent,
        "bytes_min": bytes_min,
        "allgather_bytes": allgather,
        "allgather_min_bytes": m["allgather"] * itemsize,
        "bytes_ratio": ratio,
        "ok": fwd == 0.0 and grad == 0.0 and ratio == 1.0 and allgather == m["allgather"] * itemsize,
    }
    if "problems" in results[0]:  # training's placements and plans against the reference's
        problems = [p for r in results for p in r["problems"]]
        report.update(placement_problems=problems[:8], placement_problem_count=len(problems))
        report["ok"] = report["ok"] and not problems
    if "images" in results[0]:
        first = results[0]
        report.update(images=first["images"], most_image_rows=first["most_image_rows"], width=first["width"])
    return report

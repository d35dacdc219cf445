"""Bridge verification against the one-process reference (``mimo verify-bridge`` and tests).

Every rank generates the same random logical tensors (the reference), cuts out its local
part by the source placement, runs the bridge, and compares what it received (forward) and
the gradient it got back (backward, on every source replica) with the reference, bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo.bridges.executor import Bridge
from mimo.bridges.plan import minimum_numel
from mimo.core.errors import LayoutError
from mimo.parallel.grid import ParallelGrid, parse_rank_range
from mimo.parallel.layout import Placement, dp_blocks, dp_placement, packed_placement
from mimo.core.testing import rank_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def bridge_case(src_text: str, dst_text: str, colocated: bool | None, hidden: int, microbatches: int, ragged: bool, seed: int,
                device: str = "cpu", dtype: str = "fp32") -> dict:
    """Runs on every rank of the pool; returns this rank's errors and byte counts. ``device``:
    where the rank's tensors live (``cuda``: its GPU, so they travel over NCCL); ``dtype``: the
    moved tensors' type (the reference is drawn in fp32 and rounded to it; moving is exact)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev, dt = rank_device(device), DTYPES[dtype]
    src, dst = parse_layout(src_text), parse_layout(dst_text)
    sg, dg = resolve(src, dst, world, colocated)
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
    for _ in range(microbatches):
        n = rng.randint(1, 9) if ragged else 4
        samples = random_samples(rng, n, ragged)
        src_pl, dst_pl = placements(src, dst, sg, dg, samples, hidden)
        X = torch.randn(src_pl.rows, hidden, generator=gen).to(dt)
        G = torch.randn(src_pl.rows, hidden, generator=gen).to(dt)
        for key, (a, b) in {"fwd": (src_pl, dst_pl), "bwd": (dst_pl, src_pl)}.items():
            m = minimum_numel(a, b)
            minimum[key] += m["cross"]
            minimum["allgather"] += m["allgather"]
        if rank not in members:
            continue
        bridge = Bridge(src_pl, dst_pl, group, src_replica_group=_replica_group(sg, src.shard, rank), dst_replica_group=_replica_group(dg, dst.shard, rank))
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
    return {"fwd_err": fwd_err, "grad_err": grad_err, "sent": sent, "minimum": minimum}


def summarise(results: list[dict], itemsize: int = 4) -> dict:
    """Combine per-rank results into the verify-bridge report (bytes over all ranks)."""
    fwd = max(r["fwd_err"] for r in results)
    grad = max(r["grad_err"] for r in results)
    sent = sum(r["sent"]["fwd"] + r["sent"]["bwd"] for r in results) * itemsize
    allgather = sum(r["sent"]["allgather"] for r in results) * itemsize
    m = results[0]["minimum"]
    bytes_min = (m["fwd"] + m["bwd"]) * itemsize
    ratio = 1.0 if sent == bytes_min == 0 else (sent / bytes_min if bytes_min else float("inf"))
    return {
        "fwd_max_abs_err": fwd,
        "grad_max_abs_err": grad,
        "bytes_sent": sent,
        "bytes_min": bytes_min,
        "allgather_bytes": allgather,
        "allgather_min_bytes": m["allgather"] * itemsize,
        "bytes_ratio": ratio,
        "ok": fwd == 0.0 and grad == 0.0 and ratio == 1.0 and allgather == m["allgather"] * itemsize,
    }

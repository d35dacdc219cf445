"""Per-rank data delivery: each sample read once, packs to LLM ranks, pixels to encoder ranks.

For every global microbatch every rank computes the same plan (samples, DP blocks) from the
index. The *reader* of LLM DP rank d (its first rank: tp=cp=pp=0) reads, checks, tokenizes
and decodes the samples of block d — in background threads, a bounded number of microbatches
ahead — then:

* packs them and broadcasts tokens, labels and loss mask over its DP group's other ranks
  (everything else of the pack follows from the plan, so nothing else travels); under context
  parallelism each rank keeps its CP rank's share (``mimo.data.pack.cp_share``);
* moves the preprocessed pixels to the encoder ranks that own them by a transfer plan
  (``mimo.bridges``), for any pair of DP sizes, colocated or not.

A sample that fails at read time (corrupt image, changed file) keeps its slot and length:
its tokens become padding, its pixels zeros, its loss mask zero, and it is counted.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mimo.core.batch import PackedBatch, to_device
from mimo.bridges.executor import Bridge
from mimo.data.images import ImageSpec, preprocess
from mimo.data.index import Index, TextSpec
from mimo.data.pack import PackItem, cp_share, pack
from mimo.data.plan import DataPlan, PlannedSample
from mimo.data.shards import SampleLocation, decode_image, image_keys, parse_text, read_files
from mimo.data.text import TextEncoder, load_tokenizer, turns_from_caption, turns_from_json
from mimo.core.errors import DataError
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import Piece, Placement, dp_blocks, dp_placement

log = logging.getLogger("mimo.data")


@dataclass(frozen=True)
class EncoderFeed:
    """What the data pipeline needs of one encoder module."""

    name: str
    placeholder: str
    rows_per_image: int
    image: ImageSpec
    grid: ParallelGrid


@dataclass
class ReadSample:
    item: PackItem
    pixels: dict[str, torch.Tensor]  # encoder name -> [images, C*H*W]
    failure: str | None = None


@dataclass
class Microbatch:
    """What one rank gets for one global microbatch."""

    samples: list[PlannedSample]
    llm_blocks: list[range]
    encoder_blocks: dict[str, list[range]]
    pack: PackedBatch | None = None  # on LLM ranks
    pixels: dict[str, torch.Tensor] = field(default_factory=dict)  # on encoder ranks: [images, C, H, W]
    read_failures: Counter = field(default_factory=Counter)  # on reader ranks
    loss_tokens: int = 0  # of the pack (counted on the CPU, before any move to a device)

    @property
    def real_tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    def to(self, device: torch.device | str) -> "Microbatch":
        """The pack and pixels on ``device`` (in place; returns self)."""
        pin = torch.device(device).type == "cuda"
        if self.pack is not None:
            self.pack = self.pack.to(device)
        self.pixels = {name: to_device(p, device, pin) for name, p in self.pixels.items()}
        return self


def encoder_blocks(samples: list[PlannedSample], feed: EncoderFeed) -> list[range]:
    """An encoder's DP blocks: balanced by its image rows (the same function for every user)."""
    return dp_blocks([s.images_for(feed.placeholder) * feed.rows_per_image for s in samples], feed.grid.shape["dp"])


def llm_blocks(samples: list[PlannedSample], dp: int) -> list[range]:
    return dp_blocks([s.tokens for s in samples], dp)


class SampleReader:
    """Reads and prepares samples (thread-safe: one tokenizer per thread is not needed, the
    fast tokenizers release nothing shared between calls)."""

    def __init__(self, index: Index, text: TextSpec, feeds: list[EncoderFeed]):
        self.index, self.feeds = index, feeds
        self.tokenizer = load_tokenizer(text.tokenizer)
        self.encoder = TextEncoder(self.tokenizer, text.template, dict(text.rows_per_image))
        self.placeholders = text.placeholders
        self.pad_id = self.encoder.pad_id

    def read(self, s: PlannedSample) -> ReadSample:
        entry = self.index.entries[s.id]
        path = self.index.shards[entry.shard]
        try:
            files = read_files(path, SampleLocation(entry.key, dict(entry.files)))
            kind, text = parse_text(files)
            images = [decode_image(files[ext]) for ext in image_keys(files)]
            turns = turns_from_json(text) if kind == "json" else turns_from_caption(text, self.placeholders, len(images))
            tok = self.encoder.encode(turns, len(images))
            if len(tok) != entry.tokens or tok.image_starts != entry.image_starts:
                raise DataError("sample changed since indexing")
            # each encoder gets the image files its placeholders take (mimo.data.text.image_files)
            pixels = {f.name: torch.stack([preprocess(images[i], f.image).reshape(-1) for i in tok.image_files[f.placeholder]])
                      if tok.image_files.get(f.placeholder) else torch.zeros(0, f.image.numel) for f in self.feeds}
            return ReadSample(PackItem(s.id, tok.tokens, tok.target, tok.image_starts), pixels)
        except (DataError, OSError) as e:
            # keep the slot: same length and image positions, no loss, zero pixels
            item = PackItem(s.id, [self.pad_id] * entry.tokens, [False] * entry.tokens, entry.image_starts, ok=False)
            pixels = {f.name: torch.zeros(s.images_for(f.placeholder), f.image.numel) for f in self.feeds}
            return ReadSample(item, pixels, failure=str(e).split(":", 1)[0])


class DataPipeline:
    """The data of every microbatch for this rank. Construct on every rank of the world at the
    same point (it creates process groups)."""

    def __init__(
        self,
        plan: DataPlan,
        text: TextSpec,
        llm_grid: ParallelGrid,
        sequence_parallel: bool,
        feeds: list[EncoderFeed],
        micro_batches: int,
        workers: int = 2,
        prefetch: int = 2,
        rank: int | None = None,
        make_reader=None,  # () -> a reader of the plan's samples (default: SampleReader over the index)
        device: torch.device | str = "cpu",  # where packs and pixels are delivered (read and routed on the CPU first)
    ):
        self.plan, self.text, self.feeds = plan, text, feeds
        self.device = torch.device(device)
        self.llm_grid, self.sequence_parallel = llm_grid, sequence_parallel
        self.micro_batches, self.prefetch = micro_batches, prefetch
        self.rank = dist.get_rank() if rank is None else rank
        self.tp, self.cp, self.dp = (llm_grid.shape.get(d, 1) for d in ("tp", "cp", "dp"))
        self.rows_per_image = dict(text.rows_per_image)
        # groups: asked for on every rank in the same order, from the run's registry (the LLM
        # grid's), so a pixel route over the same ranks as a bridge shares its communicator
        self.pack_group = llm_grid.group(("tp", "cp", "pp"))
        self.pixel_groups = {f.name: llm_grid.registry.group(set(llm_grid.ranks) | set(f.grid.ranks), self.rank)
                             for f in feeds}
        self.encoder_tp = {f.name: f.grid.group("tp") for f in feeds}
        self.readers = [llm_grid.rank_at(dp=d) for d in range(self.dp)]
        self.my_dp = llm_grid.coords(self.rank)["dp"] if self.rank in llm_grid else None
        self.my_cp = llm_grid.coords(self.rank).get("cp", 0) if self.rank in llm_grid else None
        self.is_reader = self.rank in self.readers
        make_reader = make_reader or (lambda: SampleReader(plan.index, text, feeds))
        self.reader = make_reader() if self.is_reader else None
        self.pad_id = self.reader.pad_id if self.reader else 0
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="mimo-read") if self.is_reader else None
        self._pending: dict[int, list[cf.Future]] = {}
        # A rank whose microbatches need no collective (no pack broadcast, no pixel routing
        # between ranks: e.g. world 1) prepares the next step's on a thread while this step
        # trains; elsewhere the collectives must stay in the training thread's order.
        rank_local = self.pack_group is None and all(g is None for g in self.pixel_groups.values())
        self._ahead_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="mimo-step") if rank_local and prefetch > 0 else None
        self._ahead: dict[int, cf.Future] = {}

    def close(self) -> None:
        for pool in (self._pool, self._ahead_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # ---- reading (reader ranks), bounded read-ahead ----
    def _block_samples(self, k: int) -> list[PlannedSample]:
        samples = self.plan.microbatch(k)
        return [samples[i] for i in llm_blocks(samples, self.dp)[self.my_dp]]

    def _request(self, k: int) -> None:
        if k not in self._pending:
            self._pending[k] = [self._pool.submit(self.reader.read, s) for s in self._block_samples(k)]

    def _read_block(self, k: int) -> list[ReadSample]:
        for ahead in range(k, k + self.prefetch + 1):
            self._request(ahead)
        futures = self._pending.pop(k)
        for old in [j for j in self._pending if j < k]:  # a jump backwards or forwards
            for f in self._pending.pop(old):
                f.cancel()
        return [f.result() for f in futures]

    # ---- one microbatch on this rank ----
    def microbatch(self, k: int) -> Microbatch:
        """Microbatch ``k`` on this rank, delivered on the pipeline's device."""
        return self._deliver(self._prepare(k))

    def _deliver(self, mb: Microbatch) -> Microbatch:
        return mb if self.device.type == "cpu" else mb.to(self.device)

    def _prepare(self, k: int) -> Microbatch:
        """Microbatch ``k`` on the CPU (read, packed, pixels routed)."""
        samples = self.plan.microbatch(k)
        mb = Microbatch(samples, llm_blocks(samples, self.dp), {f.name: encoder_blocks(samples, f) for f in self.feeds})
        read = self._read_block(k) if self.is_reader else []
        mb.read_failures = Counter(r.failure for r in read if r.failure)
        if self.rank in self.llm_grid:
            mb.pack = self._pack(mb, read)
            mb.loss_tokens = mb.pack.num_loss_tokens
        for f in self.feeds:
            pixels = self._route_pixels(mb, f, read)
            if pixels is not None:
                mb.pixels[f.name] = pixels
        return mb

    def _prepare_step(self, step: int) -> list[Microbatch]:
        return [self._prepare((step - 1) * self.micro_batches + i) for i in range(self.micro_batches)]

    def step(self, step: int) -> list[Microbatch]:
        """The microbatches of training step ``step`` (1-based)."""
        if self._ahead_pool is None:
            prepared = self._prepare_step(step)
        else:
            # every _prepare runs on the one step thread (the read-ahead state is not shared)
            future = self._ahead.pop(step, None) or self._ahead_pool.submit(self._prepare_step, step)
            for other in self._ahead.values():  # a jump (resume, eval): drop what was prepared
                other.cancel()
            self._ahead = {step + 1: self._ahead_pool.submit(self._prepare_step, step + 1)}
            prepared = future.result()
        return [self._deliver(mb) for mb in prepared]

    def _pack(self, mb: Microbatch, read: list[ReadSample]) -> PackedBatch:
        block = [mb.samples[i] for i in mb.llm_blocks[self.my_dp]]
        if read:
            items = [r.item for r in read]
        else:  # the plan gives everything but the token values, which the reader broadcasts
            items = [PackItem(s.id, [0] * s.tokens, [False] * s.tokens, s.image_starts) for s in block]
        batch = pack(items, self.rows_per_image, self.tp, self.cp, self.sequence_parallel, self.pad_id)
        if self.pack_group is not None:
            t = batch.num_tokens
            flat = torch.cat([batch.tokens, batch.labels, batch.loss_mask.long()])
            dist.broadcast(flat, src=self.readers[self.my_dp], group=self.pack_group)
            batch.tokens, batch.labels, batch.loss_mask = flat[:t].clone(), flat[t : 2 * t].clone(), flat[2 * t :].bool()
        return cp_share(batch, self.my_cp)  # under context parallelism: this CP rank's chunks

    def _route_pixels(self, mb: Microbatch, feed: EncoderFeed, read: list[ReadSample]) -> torch.Tensor | None:
        group = self.pixel_groups[feed.name]
        members = set(self.llm_grid.ranks) | set(feed.grid.ranks)
        if self.rank not in members:
            return None
        numel = feed.image.numel
        images = [s.images_for(feed.placeholder) for s in mb.samples]
        # modules are colocated or disjoint (config rule), so source = all LLM ranks works for both
        src = reader_placement(images, mb.llm_blocks, self.readers, set(self.llm_grid.ranks), numel)
        dst = dp_placement(feed.grid, images, mb.encoder_blocks[feed.name], numel)
        x = None
        if self.rank in src.local_rows:
            x = torch.cat([r.pixels[feed.name] for r in read]) if read else torch.zeros(src.local_rows[self.rank], numel)
        bridge = Bridge(src, dst, group, dst_replica_group=self.encoder_tp[feed.name] if self.rank in feed.grid else None, needs_grad=False, rank=self.rank)
        with torch.no_grad():
            y = bridge(x)
        if self.rank not in feed.grid:
            return None
        s = feed.image.size
        return y.view(-1, feed.image.channels, s, s)


def reader_placement(images: list[int], blocks: list[range], readers: list[int], ranks: set[int], numel: int) -> Placement:
    """Pixel rows (one per image, sample after sample) held by the reader of each LLM DP
    block; every other rank of ``ranks`` holds none."""
    starts = [0, *itertools.accumulate(images)]
    pieces, local_rows = [], {r: 0 for r in ranks}
    for reader, block in zip(readers, blocks):
        n = starts[block.stop] - starts[block.start]
        local_rows[reader] = n
        pieces.append(Piece(reader, starts[block.start], n, 0, 0, numel))
    return Placement(starts[-1], numel, tuple(pieces), local_rows)

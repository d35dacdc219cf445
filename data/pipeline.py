"""Per-rank data delivery: each sample read once, packs to LLM ranks, pixels to encoder ranks.

For every global microbatch every rank computes the same plan (samples, DP blocks) from the
index. The *reader* of LLM DP rank d (its first rank: tp=cp=pp=0) reads, checks, tokenizes
and decodes the samples of block d — in background threads, a bounded number of microbatches
ahead — then:

* packs them and broadcasts tokens, labels and loss mask over its DP group's other ranks
  (everything else of the pack follows from the plan, so nothing else travels); under context
  parallelism each rank keeps its CP rank's share (``mimo.data.pack.cp_share``);
* moves the pixels to the encoder ranks that own them by a transfer plan (``mimo.bridges``),
  for any pair of DP sizes, colocated or not. Decoded images travel as uint8 bytes (a quarter
  of fp32's), each image's row followed by one byte saying whether it was read (1) or is a
  failed sample's slot (0); the encoder rank turns them into the encoder's float numbers on its
  device when the microbatch is delivered (``mimo.data.images.PixelNorm``; failed slots become
  zeros). A feed whose ``pixel_dtype`` is float (synthetic data: drawn as the encoder's numbers
  already) routes those floats as they are.

A sample that fails at read time (corrupt image, changed file) keeps its slot and length:
its tokens become padding, its pixels zeros, its loss mask zero, and it is counted.

Step ahead (training's pipeline, at every world size): while step n trains, one data thread per
rank prepares step n+1 — reading, packing and routing — with its collectives on process groups
of its own (purpose "data" in the run's ``GroupRegistry``, created at construction on every
rank), in the one order every rank follows (microbatch by microbatch: pack broadcast, then each
encoder's pixels). The microbatches are those ``_prepare`` gives inline, in the same order; a
resume asks for its first step as any other. An error on the data thread reaches the training
thread when it asks for that step, as the same exception.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from mimo.core.batch import PackedBatch, PatchBatch, to_device
from mimo.bridges.executor import Bridge
from mimo.bridges.plan import TransferPlan, image_bridge_plans
from mimo.data.images import ImageSpec, PixelNorm, decode
from mimo.data.index import Index, TextSpec, sample_text
from mimo.data.native_images import NativeImageSpec, PatchNorm, patch_bytes
from mimo.data.native_video import video_patch_bytes
from mimo.data.pack import PackItem, cp_share, pack
from mimo.data.plan import DataPlan, PlannedSample, SampleArrays
from mimo.data.shards import SampleLocation, decode_image, read_files
from mimo.data.text import VIDEO, load_tokenizer
from mimo.core.errors import DataError
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.layout import RunPlacement, block_bounds, dp_blocks, dp_runs
from mimo.schedules.executor import TickPlan

log = logging.getLogger("mimo.data")


@dataclass(frozen=True)
class EncoderFeed:
    """What the data pipeline needs of one encoder module."""

    name: str
    placeholder: str
    rows_per_image: int  # 0 for a native-resolution tower (each image's own, from its grid)
    image: ImageSpec | None  # a fixed-size tower's images (None: native)
    grid: ParallelGrid
    # how pixels travel: uint8 (decoded images, normalised on the encoder's device) or a float
    # dtype (pixels that are the encoder's numbers already: synthetic data's draws)
    pixel_dtype: torch.dtype = torch.uint8
    # a native-resolution tower: how it cuts images; what a patch costs beside the attention over
    # its image's patches (2 * hidden + mlp: a block's matmul work per patch over the attention's per
    # patch and patch of its image), so that its DP blocks balance compute, not images
    native: NativeImageSpec | None = None
    row_frames: int = 1  # frames per routed patch row: the temporal patch's where the tower takes videos
    cost_width: int = 0
    # values per row of the encoder's bridge to the LLM (its output rows): the pipeline plans that
    # bridge on its own thread with the rest of the microbatch (0: the runner plans it)
    bridge_width: int = 0

    @property
    def raw(self) -> bool:
        return self.pixel_dtype == torch.uint8

    @property
    def numel(self) -> int:
        """Values per routed row: an image (fixed size), a patch's frames (native)."""
        if self.native is not None:
            return self.native.channels * self.row_frames * self.native.patch * self.native.patch
        return self.image.numel

    @property
    def wire_cols(self) -> int:
        """Elements per routed row: the pixels, plus the read flag for raw bytes."""
        return self.numel + (1 if self.raw else 0)

    def pixel_rows_N(self, arrays: SampleArrays) -> np.ndarray:
        """Rows each sample routes to this tower: one per image (fixed size), one per patch (native)."""
        if self.native is None:
            return arrays.images_for(self.placeholder)
        return arrays.rows_per_sample(self.placeholder, 0) * self.native.merge**2

    def costs_N(self, arrays: SampleArrays) -> np.ndarray:
        """What each sample costs this tower (its DP blocks balance it): image rows (fixed size),
        patches x (cost_width + patches of the image) summed over its images (native)."""
        if self.native is None:
            return arrays.images_for(self.placeholder) * self.rows_per_image
        patches_I = arrays.image_rows(self.placeholder, 0) * self.native.merge**2
        return arrays.per_sample(self.placeholder, patches_I * (self.cost_width + patches_I))

    def grids_of_block(self, arrays: SampleArrays, block: range) -> torch.Tensor:
        """``[N, 3]`` grids of a native tower's images in the samples of ``block``."""
        first_N1 = np.concatenate([[0], np.cumsum(arrays.images_for(self.placeholder))])
        grids = arrays.image_grids(self.placeholder)[first_N1[block.start]:first_N1[block.stop]]
        return torch.from_numpy(np.ascontiguousarray(grids, dtype=np.int64))


@dataclass
class ReadSample:
    item: PackItem
    pixels: dict[str, torch.Tensor]  # encoder name -> [images, C*H*W] (uint8; float for synthetic data)
    failure: str | None = None


@dataclass
class MicrobatchPlan:
    """Where one global microbatch's pieces go, made by the one planner (``DataPipeline.
    plan_microbatch``) with the rest of the microbatch, on the data thread: its samples and their
    arrays, each module's DP blocks, and on this rank each encoder's bridge (``image_bridge_plans``:
    the encoder's rows, the LLM first stage's placement of them, this rank's transfer plans both
    ways) and pixel route (the readers' rows, the encoder's DP placement of them)."""

    samples: list[PlannedSample]
    arrays: SampleArrays
    llm_blocks: list[range]
    encoder_blocks: dict[str, list[range]]
    bridges: dict[str, tuple] = field(default_factory=dict)
    pixel_routes: dict[str, tuple[RunPlacement, RunPlacement]] = field(default_factory=dict)

    @property
    def real_tokens(self) -> int:
        return int(self.arrays.tokens_N.sum())


@dataclass
class Microbatch:
    """What one rank gets for one global microbatch: its plan and its data."""

    plan: MicrobatchPlan
    pack: PackedBatch | None = None  # on LLM ranks
    # on encoder ranks: the encoder's float input [images, C, H, W] once delivered (as routed before)
    pixels: dict[str, torch.Tensor] = field(default_factory=dict)
    read_failures: Counter = field(default_factory=Counter)  # on reader ranks
    loss_tokens: int = 0  # of the pack (counted on the CPU, before any move to a device)


@dataclass
class StepPlan:
    """A training step as its executor takes it: the microbatches in order (each its plan and
    data) and the tick table that runs them (``mimo.schedules.executor``). Iterates over the
    microbatches."""

    microbatches: list[Microbatch]
    ticks: TickPlan

    def __len__(self) -> int:
        return len(self.microbatches)

    def __getitem__(self, k: int) -> Microbatch:
        return self.microbatches[k]

    def __iter__(self):
        return iter(self.microbatches)


def encoder_dp_blocks(samples: list[PlannedSample] | SampleArrays, feed: EncoderFeed) -> list[range]:
    """An encoder's DP blocks: balanced by its cost (``EncoderFeed.costs_N``; the same function for every user)."""
    return dp_blocks(feed.costs_N(SampleArrays.of(samples)), feed.grid.shape["dp"])


def llm_dp_blocks(samples: list[PlannedSample] | SampleArrays, dp: int) -> list[range]:
    return dp_blocks(SampleArrays.of(samples).tokens_N, dp)


def microbatch_bridge_plans(samples: SampleArrays | list[PlannedSample], placeholder: str, rows_per_image: int,
                            width: int, encoder_grid: ParallelGrid, encoder_blocks: list[range], llm_grid: ParallelGrid,
                            llm_blocks: list[range], sequence_parallel: bool, rank: int
                            ) -> tuple[RunPlacement, RunPlacement, tuple[TransferPlan, TransferPlan]]:
    """``mimo.bridges.plan.image_bridge_plans`` (the encoder's rows, the LLM first stage's
    placement of them near this rank's rows, this rank's plans both ways) of the images of
    ``placeholder`` in a microbatch of ``samples`` (its ``SampleArrays``, or ``PlannedSample``s):
    ``rows_per_image`` rows each image, or for a native tower (0) each image's own, of ``width``
    values."""
    return image_bridge_plans(*SampleArrays.of(samples).image_layout(placeholder, rows_per_image), width, encoder_grid,
                              encoder_blocks, llm_grid, llm_blocks, sequence_parallel, rank)


def plan_arrays(plan, k: int, samples: list[PlannedSample]) -> SampleArrays:
    """Microbatch ``k``'s ``SampleArrays`` from the plan (a plan without them: from its samples)."""
    return plan.microbatch_arrays(k) if hasattr(plan, "microbatch_arrays") else SampleArrays.of_samples(samples)


class SampleReader:
    """Reads and prepares samples (thread-safe: one tokenizer per thread is not needed, the
    fast tokenizers release nothing shared between calls)."""

    def __init__(self, index: Index, text: TextSpec, feeds: list[EncoderFeed]):
        self.index, self.feeds, self.text = index, feeds, text
        self.tokenizer = load_tokenizer(text.tokenizer)
        self.encoder = text.text_encoder(self.tokenizer)
        self.placeholders = text.placeholders
        self.pad_id = self.encoder.pad_id

    def read(self, s: PlannedSample) -> ReadSample:
        entry = self.index.entries[s.id]
        path = self.index.shards[entry.shard]
        try:
            files = read_files(path, SampleLocation(entry.key, dict(entry.files)))
            read = sample_text(files, self.encoder, self.text)
            tok = read.tokens
            if len(tok) != entry.tokens or tok.image_starts != entry.image_starts or tok.image_rows != entry.image_rows:
                raise DataError("sample changed since indexing")
            images = [decode_image(files[ext]) for ext in read.images]
            videos = [files[ext] for ext in read.videos]
            pixels = {f.name: self._pixels(f, tok, images, videos, read.layouts) for f in self.feeds}
            return ReadSample(PackItem(s.id, tok.tokens, tok.target, tok.image_starts, image_rows=tok.image_rows,
                                       image_grids=entry.image_grids), pixels)
        except (DataError, OSError) as e:
            # keep the slot: same length and image positions, no loss, zero pixels
            item = PackItem(s.id, [self.pad_id] * entry.tokens, [False] * entry.tokens, entry.image_starts, ok=False,
                            image_rows=entry.image_rows, image_grids=entry.image_grids)
            pixels = {f.name: torch.zeros(self._rows(f, s), f.numel, dtype=torch.uint8) for f in self.feeds}
            return ReadSample(item, pixels, failure=str(e).split(":", 1)[0])

    @staticmethod
    def _rows(feed: EncoderFeed, s: PlannedSample) -> int:
        """Pixel rows of ``s`` for ``feed``: its images (fixed size) or their patches (native)."""
        if feed.native is None:
            return s.images_for(feed.placeholder)
        return sum(s.image_rows.get(feed.placeholder, ())) * feed.native.merge**2

    @staticmethod
    def _pixels(feed: EncoderFeed, tok, images: list, videos: list[bytes], layouts: list) -> torch.Tensor:
        """uint8 rows for ``feed`` (each encoder gets the files its placeholders take:
        ``mimo.data.text``): one per image, or one per patch of each slot (native: an image, or a
        video's temporal patch; each video decoded once)."""
        if feed.native is None:
            taken = [images[i] for i in tok.image_files.get(feed.placeholder, ())]
            if not taken:
                return torch.zeros(0, feed.numel, dtype=torch.uint8)
            return torch.stack([decode(img, feed.image).reshape(-1) for img in taken])
        decoded: dict[int, torch.Tensor] = {}
        rows = []
        for kind, file, t in tok.slot_files.get(feed.placeholder, ()):
            if kind == VIDEO:
                if file not in decoded:
                    decoded[file] = video_patch_bytes(videos[file], layouts[file], feed.native)
                per_slot = decoded[file].shape[0] // len(layouts[file].stamps)
                rows.append(decoded[file][t * per_slot:(t + 1) * per_slot])
            else:
                rows.append(patch_bytes(images[file], feed.native, feed.row_frames)[0])
        return torch.cat(rows) if rows else torch.zeros(0, feed.numel, dtype=torch.uint8)


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
        ahead: bool = True,  # prepare step n+1 on a thread of its own while step n trains (``step``)
        mrope: bool = False,  # the LLM rotates by 3-D positions: packs carry them (``pack``'s ``mrope_merge``)
        schedule: str = "1f1b",  # the steps' tick table (``mimo.schedules``) and its encoder prefetch depth
        encoder_prefetch: int = 1,
    ):
        self.plan, self.text, self.feeds = plan, text, feeds
        self.device = torch.device(device)
        self.llm_grid, self.sequence_parallel = llm_grid, sequence_parallel
        self.micro_batches, self.prefetch = micro_batches, prefetch
        self.schedule, self.encoder_prefetch = schedule, encoder_prefetch
        self.rank = dist.get_rank() if rank is None else rank
        self.tp, self.cp, self.dp = (llm_grid.shape.get(d, 1) for d in ("tp", "cp", "dp"))
        self.rows_per_image = dict(text.rows_per_image)
        self.mrope_merge = text.mrope_merge() if mrope else None
        # groups: asked for on every rank in the same order, from the run's registry (the LLM
        # grid's). Preparing ahead, the pipeline runs its collectives on its own thread: on
        # groups of its own (purpose "data"), never interleaved with the training thread's on
        # one communicator. Inline (``mimo eval``'s pipeline, between training steps) it shares
        # the training thread's groups: a pixel route over a bridge's ranks, its communicator.
        purpose = "data" if ahead else ""
        self.pack_group = llm_grid.group(("tp", "cp", "pp"), purpose=purpose)
        self.pixel_groups = {f.name: llm_grid.registry.group(set(llm_grid.ranks) | set(f.grid.ranks), self.rank, purpose)
                             for f in feeds}
        self.encoder_tp = {f.name: f.grid.group("tp", purpose=purpose) for f in feeds}
        self._feed = {f.name: f for f in feeds}
        self._norm = {f.name: PatchNorm(f.native) if f.native is not None else PixelNorm(f.image) for f in feeds if f.raw}
        self.pixel_bytes = 0  # pixel bytes this rank sent to other ranks (routing and all-gathers), for benchmarks
        self.readers = [llm_grid.rank_at(dp=d) for d in range(self.dp)]
        self.my_dp = llm_grid.coords(self.rank)["dp"] if self.rank in llm_grid else None
        self.my_cp = llm_grid.coords(self.rank).get("cp", 0) if self.rank in llm_grid else None
        self.is_reader = self.rank in self.readers
        make_reader = make_reader or (lambda: SampleReader(plan.index, text, feeds))
        self.reader = make_reader() if self.is_reader else None
        self.pad_id = self.reader.pad_id if self.reader else 0
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="mimo-read") if self.is_reader else None
        self._pending: dict[int, list[cf.Future]] = {}
        self._plans: dict[int, tuple] = {}  # ``_planned``'s, by microbatch
        self._thread = StepThread() if ahead else None
        self._ahead: dict[int, cf.Future] = {}
        self.last_step: int | None = None  # the run's last step: none past it is prepared ahead

    def close(self, wait: bool = True) -> None:
        """Stops the threads. ``wait``: a step being prepared ahead is finished first (every
        rank prepares it, so its collectives complete). A rank ending on an error must not wait:
        its peers may never join those collectives (its data thread is a daemon)."""
        if self._thread is not None:
            self._thread.close(wait)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- reading (reader ranks), bounded read-ahead ----
    def _planned(self, k: int) -> tuple[list[PlannedSample], SampleArrays, list[range]]:
        """Microbatch ``k``'s samples, their arrays and its LLM DP blocks, computed once for both
        its read-ahead request and its preparation (one thread asks for both)."""
        got = self._plans.get(k)
        if got is None:
            samples = self.plan.microbatch(k)
            arrays = plan_arrays(self.plan, k, samples)
            got = self._plans[k] = (samples, arrays, llm_dp_blocks(arrays, self.dp))
        return got

    def _request(self, k: int) -> None:
        if k not in self._pending:
            samples, _, blocks = self._planned(k)
            self._pending[k] = [self._pool.submit(self.reader.read, samples[i]) for i in blocks[self.my_dp]]

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
        if self._thread is None:
            return self._deliver(self._prepare(k))
        return self._deliver(self._thread.submit(self._prepare, k).result())  # after what is queued

    def _deliver(self, mb: Microbatch) -> Microbatch:
        """The pack on the device, and the routed pixels as the encoder's float input there."""
        pin = self.device.type == "cuda"
        for name, wire in mb.pixels.items():
            feed = self._feed[name]
            x = self._encoder_input(feed, to_device(wire, self.device, pin))
            if feed.native is not None:  # the tower's images: this rank's DP block of the microbatch
                block = mb.plan.encoder_blocks[name][feed.grid.coords(self.rank)["dp"]]
                x = PatchBatch(x, feed.grids_of_block(mb.plan.arrays, block).to(self.device))
            mb.pixels[name] = x
        if mb.pack is not None and self.device.type != "cpu":
            mb.pack = mb.pack.to(self.device)
        return mb

    def _encoder_input(self, feed: EncoderFeed, wire: torch.Tensor) -> torch.Tensor:
        """Routed rows ``[images, wire_cols]`` -> ``[images, C, S, S]`` floats (on wire's device);
        native: ``[patches, wire_cols]`` -> the tower's patch rows ``[patches, C*tp*p*p]``."""
        if feed.native is not None:
            x = self._norm[feed.name](wire[:, :feed.numel])
            return x.masked_fill_(~wire[:, feed.numel].bool().view(-1, 1), 0.0)  # a failed sample's slot: zeros
        s, c, numel = feed.image.size, feed.image.channels, feed.image.numel
        if not feed.raw:
            return wire.view(-1, c, s, s)
        x = self._norm[feed.name](wire[:, :numel].reshape(-1, c, s, s))
        read = wire[:, numel].bool().view(-1, 1, 1, 1)
        return x.masked_fill_(~read, 0.0)  # a failed sample's slot: zero pixels (docs/design.md §2)

    def plan_microbatch(self, samples: list[PlannedSample], arrays: SampleArrays | None = None,
                        llm_blocks: list[range] | None = None,
                        encoder_blocks: dict[str, list[range]] | None = None) -> MicrobatchPlan:
        """The one planner of a microbatch on this rank: its samples' arrays, each module's DP
        blocks (balanced by ``dp_blocks``, unless given: generation keeps a microbatch's blocks as
        its samples grow), and each encoder's bridge and pixel route where this rank takes part."""
        arrays = SampleArrays.of_samples(samples) if arrays is None else arrays
        llm_blocks = llm_dp_blocks(arrays, self.dp) if llm_blocks is None else llm_blocks
        if encoder_blocks is None:
            encoder_blocks = {f.name: encoder_dp_blocks(arrays, f) for f in self.feeds}
        plan = MicrobatchPlan(samples, arrays, llm_blocks, encoder_blocks)
        for f in self.feeds:
            if self.rank not in f.grid and self.rank not in self.llm_grid:
                continue
            blocks = encoder_blocks[f.name]
            if f.bridge_width:
                plan.bridges[f.name] = microbatch_bridge_plans(arrays, f.placeholder, f.rows_per_image, f.bridge_width,
                                                               f.grid, blocks, self.llm_grid, llm_blocks,
                                                               self.sequence_parallel, self.rank)
            # modules are colocated or disjoint (config rule), so source = all LLM ranks works for both
            rows_N = f.pixel_rows_N(arrays)
            plan.pixel_routes[f.name] = (reader_runs(rows_N, llm_blocks, self.readers, self.llm_grid.ranks, f.wire_cols),
                                         dp_runs(f.grid, rows_N, blocks, f.wire_cols))
        return plan

    def _prepare(self, k: int) -> Microbatch:
        """Microbatch ``k`` on the CPU (planned, read, packed, pixels routed)."""
        samples, arrays, blocks = self._planned(k)
        mb = Microbatch(self.plan_microbatch(samples, arrays, blocks))
        read = self._read_block(k) if self.is_reader else []
        # kept: the microbatches requested ahead of this one, not yet prepared
        self._plans = {j: got for j, got in self._plans.items() if k < j <= k + self.prefetch}
        mb.read_failures = Counter(r.failure for r in read if r.failure)
        if self.rank in self.llm_grid:
            mb.pack = self._pack(mb, read)
            mb.loss_tokens = mb.pack.num_loss_tokens
        for f in self.feeds:
            pixels = self._route_pixels(mb, f, read)
            if pixels is not None:
                mb.pixels[f.name] = pixels
        return mb

    def _prepare_step(self, step: int) -> StepPlan:
        mbs = [self._prepare((step - 1) * self.micro_batches + i) for i in range(self.micro_batches)]
        return StepPlan(mbs, TickPlan.make(self.schedule, self.llm_grid.shape.get("pp", 1), len(mbs), self.encoder_prefetch))

    def step(self, step: int) -> StepPlan:
        """Training step ``step`` (1-based): its microbatches, delivered, and its ticks. Preparing
        ahead, step ``step + 1`` (up to ``last_step``) is planned, read, packed and routed on the
        data thread while this one trains."""
        if self._thread is None:
            return self._deliver_step(self._prepare_step(step))
        # Every preparation runs on the one data thread in the order asked for, which is the same
        # on every rank, so the data groups' collectives line up. A jump (a resume, a step asked
        # twice) drops what was prepared without cancelling it: a cancel could win on one rank and
        # lose on another, whose collectives would then wait for it.
        future = self._ahead.pop(step, None) or self._thread.submit(self._prepare_step, step)
        self._ahead.clear()
        if self.last_step is None or step < self.last_step:
            self._ahead[step + 1] = self._thread.submit(self._prepare_step, step + 1)
        return self._deliver_step(future.result())

    def _deliver_step(self, plan: StepPlan) -> StepPlan:
        for mb in plan:
            self._deliver(mb)
        return plan

    def _pack(self, mb: Microbatch, read: list[ReadSample]) -> PackedBatch:
        block = [mb.plan.samples[i] for i in mb.plan.llm_blocks[self.my_dp]]
        if read:
            items = [r.item for r in read]
        else:  # the plan gives everything but the token values, which the reader broadcasts
            items = [PackItem(s.id, [0] * s.tokens, [False] * s.tokens, s.image_starts, image_rows=s.image_rows,
                              image_grids=s.image_grids) for s in block]
        batch = pack(items, self.rows_per_image, self.tp, self.cp, self.sequence_parallel, self.pad_id, self.mrope_merge)
        if self.pack_group is not None:
            t = batch.num_tokens
            flat = torch.cat([batch.tokens, batch.labels, batch.loss_mask.long()])
            dist.broadcast(flat, src=self.readers[self.my_dp], group=self.pack_group)
            batch.tokens, batch.labels, batch.loss_mask = flat[:t].clone(), flat[t : 2 * t].clone(), flat[2 * t :].bool()
        return cp_share(batch, self.my_cp)  # under context parallelism: this CP rank's chunks

    def _route_pixels(self, mb: Microbatch, feed: EncoderFeed, read: list[ReadSample]) -> torch.Tensor | None:
        """This encoder rank's images of ``mb`` as routed: ``[images, wire_cols]`` (None elsewhere)."""
        group = self.pixel_groups[feed.name]
        members = set(self.llm_grid.ranks) | set(feed.grid.ranks)
        if self.rank not in members:
            return None
        src, dst = mb.plan.pixel_routes[feed.name]
        x = None
        if src.holds_rank(self.rank):
            x = (torch.cat([wire_rows(r, feed) for r in read]) if read
                 else torch.zeros(src.local_rows_of(self.rank), feed.wire_cols, dtype=feed.pixel_dtype))
        bridge = Bridge(src, dst, group, dst_replica_group=self.encoder_tp[feed.name] if self.rank in feed.grid else None, needs_grad=False, rank=self.rank)
        with torch.no_grad():
            y = bridge(x, dtype=feed.pixel_dtype)
        self.pixel_bytes += (bridge.stats.fwd_sent + bridge.stats.fwd_allgather) * feed.pixel_dtype.itemsize
        return y if self.rank in feed.grid else None


class StepThread:
    """One daemon thread running jobs in submission order (the data pipeline's preparations).
    After a job fails, later jobs fail with the same error without running: their collectives
    would no longer line up with the other ranks'. A daemon, so that a job stuck in a collective
    whose peers are gone never keeps the process from ending."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="mimo-data-step", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> cf.Future:
        if self._closed:  # no thread would ever run it: the caller would wait forever
            raise DataError("the data pipeline is closed: no step can be prepared after its run was closed")
        future: cf.Future = cf.Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self, wait: bool = True) -> None:
        self._closed = True
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            if self._failed is not None:
                future.set_exception(self._failed)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the job
                self._failed = e
                log.error("data thread: %s failed: %s", getattr(fn, "__name__", fn), e)
                future.set_exception(e)


def wire_rows(read: ReadSample, feed: EncoderFeed) -> torch.Tensor:
    """A read sample's images for ``feed`` as routed: ``[images, wire_cols]``."""
    pixels = read.pixels[feed.name]
    if pixels.dtype != feed.pixel_dtype:
        raise DataError(f"encoder {feed.name!r}: the reader gives {pixels.dtype} pixels, the pipeline routes {feed.pixel_dtype}")
    if not feed.raw:
        return pixels
    flag = torch.full((pixels.shape[0], 1), 0 if read.failure else 1, dtype=torch.uint8)
    return torch.cat([pixels, flag], dim=1)


def reader_runs(images_N: np.ndarray, blocks: list[range], readers: list[int], ranks, numel: int) -> RunPlacement:
    """``reader_placement`` as arrays (the pixel routing's source, per microbatch): the same
    pieces, one per reader in DP block order."""
    start_I1 = np.concatenate([[0], np.cumsum(images_N)]).astype(np.int64)
    start_D, stop_D = block_bounds(blocks)
    d = min(len(start_D), len(readers))  # as zip(readers, blocks)
    rank_P, row_P = np.asarray(readers[:d], dtype=np.int64), start_I1[start_D[:d]]
    rows_P = start_I1[stop_D[:d]] - row_P
    ranks_R = np.unique(np.asarray(list(ranks), dtype=np.int64))
    local_R = np.zeros(len(ranks_R), dtype=np.int64)
    local_R[np.searchsorted(ranks_R, rank_P)] = rows_P
    zeros_P = np.zeros_like(rank_P)
    return RunPlacement(int(start_I1[-1]), numel, rank_P, row_P, rows_P, zeros_P, zeros_P, np.full_like(rank_P, numel),
                        ranks_R, local_R, np.zeros((0, 0), dtype=np.int64))

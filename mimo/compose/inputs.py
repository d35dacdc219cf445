"""Composition of the data pipeline from a config: what data/ needs of the encoders and the LLM.

data/ does not import the encoders or the LLM; it receives rows per image, image
preprocessing and grids as plain parameters, assembled here.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from typing import TYPE_CHECKING, Mapping

import torch

from mimo.core.batch import PackedBatch
from mimo.compose.config import MimoConfig
from mimo.data.images import CLIP_MEAN, CLIP_STD, ImageSpec
from mimo.data.index import Index, TextSpec, index_path, prepare
from mimo.data.pipeline import DataPipeline, EncoderFeed, SampleReader, plan_arrays
from mimo.data.plan import DataPlan, SampleArrays
from mimo.data.synthetic import SyntheticEncoder, SyntheticPlan, SyntheticReader, SyntheticStream
from mimo.compose.data_spec import DataSpec, data_spec, mrope_merge, text_spec
from mimo.encoders.config import EncoderModuleConfig
from mimo.core.errors import DataError
from mimo.parallel.grid import ParallelGrid

if TYPE_CHECKING:
    from mimo.compose.model import MimoModel

log = logging.getLogger("mimo.data")


def training_pipeline(config: MimoConfig, spec: DataSpec, model: MimoModel, index: Index | None = None) -> DataPipeline:
    """The training data pipeline of ``model``'s rank, from the config's sizes and its data spec
    (``data_spec``, derived beforehand): over ``index`` (default: the config's, prepared when
    missing), read ahead."""
    if index is None:
        index, _ = index_for(config, spec.text)
    plan = plan_for(config, index, spec.synthetic)
    return data_pipeline(config, spec.text, model, plan, config.train.micro_batches)


def data_pipeline(config: MimoConfig, text: TextSpec, model: MimoModel, plan, micro_batches: int, ahead: bool = True,
                  make_reader=None) -> DataPipeline:
    """The data pipeline of ``model``'s rank over ``plan`` (training's, or ``mimo eval``'s
    held-out microbatches), delivering on the model's device. ``ahead``: each step's data
    prepared on a thread of its own during the step before (training's; only one pipeline of
    a run may: they would share the data groups). ``make_reader``: samples read from elsewhere
    than the config's shards (``mimo generate``'s prompts), delivered the same way."""
    feeds = feeds_for(config, text, model.encoder_grids())
    return DataPipeline(plan, text, model.llm.grid, model.llm.ctx.sequence_parallel, feeds, micro_batches,
                        config.data.workers, config.data.prefetch, model.rank,
                        make_reader=make_reader or (lambda: reader_for(plan, text, feeds)), device=model.device,
                        ahead=ahead, mrope=config.llm.arch.mrope_section is not None, schedule=config.train.schedule,
                        encoder_prefetch=config.train.encoder_prefetch)


def feeds_for(config: MimoConfig, text: TextSpec, grids: Mapping[str, ParallelGrid] | None = None) -> list[EncoderFeed]:
    """What the data pipeline feeds each encoder (a native tower's cuts: ``text``'s). ``grids``:
    the model's encoder grids (so the pipeline's groups come from the run's one registry);
    without them (readers, tools that create no groups) each grid is laid out from the config.
    Decoded images travel as uint8; synthetic data's pixels are drawn as the encoder's float
    numbers (the Hugging Face baseline's stream, ``mimo.data.synthetic``) and travel as they are."""
    pixel_dtype = torch.float32 if config.data.source == "synthetic" else torch.uint8
    natives = {n.placeholder: n for n in text.native}
    feeds = []
    for name, enc in config.encoders.items():
        grid = grids[name] if grids is not None else enc.parallel.grid(config.world_size)
        width = bridge_width(config, name)
        if enc.native:
            native = natives[enc.placeholder]
            feeds.append(EncoderFeed(name, enc.placeholder, 0, None, grid, pixel_dtype, native.image, native.row_frames,
                                     2 * enc.arch.hidden + enc.arch.mlp, bridge_width=width))
        else:
            feeds.append(EncoderFeed(name, enc.placeholder, enc.rows_per_image, image_spec(enc), grid, pixel_dtype,
                                     bridge_width=width))
    return feeds


def bridge_width(config: MimoConfig, name: str) -> int:
    """Values per row that encoder ``name``'s bridge moves: the LLM's hidden, times the levels
    of a native tower's rows (its merger's, then each deepstack level's: docs/design.md §10)."""
    enc = config.encoders[name]
    return config.llm.arch.hidden * (1 + len(enc.arch.deepstack_layers) if enc.native else 1)


def image_spec(enc: EncoderModuleConfig) -> ImageSpec:
    """Size from the arch; mean/std from the weights' own preprocessing where known (timm's
    pretrained config, a Hugging Face preprocessor_config.json), else CLIP's."""
    mean, std = CLIP_MEAN, CLIP_STD
    if enc.init.timm:
        try:
            from timm.models import get_pretrained_cfg

            cfg = get_pretrained_cfg(enc.init.timm)
            if cfg is not None:
                mean, std = tuple(cfg.mean), tuple(cfg.std)
        except Exception as e:  # noqa: BLE001 - an unknown name falls back, and says so
            log.warning("no timm preprocessing config for %s (%s); using CLIP mean/std", enc.init.timm, e)
    elif enc.init.hf:
        path = os.path.join(enc.init.hf, "preprocessor_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                pre = json.load(f)
            mean, std = tuple(pre.get("image_mean", mean)), tuple(pre.get("image_std", std))
    return ImageSpec(enc.arch.image_size, tuple(mean), tuple(std), enc.arch.channels)


def index_for(config: MimoConfig, text: TextSpec, rebuild: bool = False, shards: str | None = None) -> tuple[Index | None, str]:
    """The index of ``shards`` (default: data.shards) read as ``text``, prepared when missing or
    stale (logged); (None, 'synthetic') for ``source: synthetic``, which needs none."""
    if config.data.source == "synthetic" and shards is None:
        return None, "synthetic"
    if config.data.source != "webdataset":
        raise DataError(f"data.source is {config.data.source!r}: there are no shards to index")
    pattern = shards or config.data.shards
    index, status = prepare(pattern, text, workers=_index_workers(pattern, config.data.workers), rebuild=rebuild,
                            index_dir=config.data.index_dir)
    if status != "loaded":
        log.info("data index %s", status)
    return index, status


SMALL_SHARDS_BYTES = 64 << 20  # shards up to this much in all are indexed in this process (the demo's: 16 MB)


def _index_workers(pattern: str, workers: int) -> int:
    """Processes to index ``pattern``'s shards with: one (this process) where they are small in all,
    which it scans in less time than starting worker processes takes (each imports the tokenizer's
    libraries: seconds); else ``data.workers``. The index is the same either way."""
    from mimo.data.config import shard_paths

    total = 0
    for path in shard_paths(pattern):
        try:
            total += os.path.getsize(path)
        except OSError:  # a missing shard: prepare names it
            continue
        if total > SMALL_SHARDS_BYTES:
            return workers
    return 1


def plan_for(config: MimoConfig, index: Index | None, synthetic: tuple[int, tuple[int, int]]) -> DataPlan | SyntheticPlan:
    """The plan of the config's samples: over ``index``, or (``source: synthetic``) drawn in the
    shape ``synthetic`` (``MimoConfig.synthetic_shape``)."""
    d = config.data
    if d.source == "synthetic":
        return SyntheticPlan(synthetic_stream(config, *synthetic))
    return DataPlan(index, d.tokens_per_microbatch, d.max_sample_tokens, d.seed, d.shuffle, d.patches_per_microbatch)


def synthetic_stream(config: MimoConfig, samples: int, text_tokens: tuple[int, int]) -> SyntheticStream:
    encoders = [SyntheticEncoder(name, e.placeholder, e.rows_per_image, e.arch.channels, e.arch.image_size)
                for name, e in config.encoders.items()]
    return SyntheticStream(config.data.synthetic, encoders, config.llm.arch.vocab, config.data.seed, samples, text_tokens)


def reader_for(plan: DataPlan | SyntheticPlan, text: TextSpec, feeds: list[EncoderFeed]):
    """A reader of ``plan``'s samples (what the data pipeline's reader ranks use)."""
    if isinstance(plan, SyntheticPlan):
        return SyntheticReader(plan.stream)
    return SampleReader(plan.index, text, feeds)


# ---- the same from the config alone (commands, tools, tests: a run derives its DataSpec once) ----
def ensure_index(config: MimoConfig, rebuild: bool = False, shards: str | None = None) -> tuple[Index | None, str]:
    """``index_for`` the config's text spec."""
    return index_for(config, text_spec(config), rebuild, shards)


def index_location(config: MimoConfig, shards: str | None = None) -> str:
    """Where ``ensure_index`` keeps the index of ``shards`` (default: data.shards)."""
    return index_path(shards or config.data.shards, text_spec(config), config.data.index_dir)


def encoder_feeds(config: MimoConfig, grids: Mapping[str, ParallelGrid] | None = None) -> list[EncoderFeed]:
    """``feeds_for`` the config's text spec."""
    return feeds_for(config, text_spec(config), grids)


def data_plan(config: MimoConfig, index: Index | None) -> DataPlan | SyntheticPlan:
    """``plan_for`` the config's synthetic shape."""
    return plan_for(config, index, config.synthetic_shape())


def sample_reader(config: MimoConfig, plan: DataPlan | SyntheticPlan):
    """``reader_for`` the config's text spec and feeds."""
    return reader_for(plan, text_spec(config), encoder_feeds(config))


def read_packs(reader, samples: list, llm_parallel, rows_per_image: dict[str, int], map_fn=map,
               mrope_merge: dict[str, int] | None = None) -> list[tuple[list, PackedBatch]]:
    """The reader ranks' work for one global microbatch, in one process: each LLM DP block's
    samples read (``map_fn`` may be a thread pool's map) and packed as that rank packs them."""
    from mimo.data.pack import pack
    from mimo.data.pipeline import llm_dp_blocks

    par = llm_parallel
    out = []
    for block in llm_dp_blocks(samples, par.replicas):
        got = list(map_fn(reader.read, [samples[i] for i in block]))
        out.append((got, pack([r.item for r in got], rows_per_image, par.tp, par.cp, par.sequence_parallel, reader.pad_id,
                              mrope_merge)))
    return out


def inspect(config: MimoConfig, batches: int) -> dict:
    """Read ``batches`` global microbatches through the real reading and packing code, in one
    process, for every LLM DP block; report counts and the first sample as text.

    ``padding_fraction``: the share of the token budget (data.tokens_per_microbatch over the LLM
    DP ranks) that no sample fills, 1 - mean tokens per DP rank / capacity per DP rank;
    ``pack_padding_fraction``: positions the packs hold for SP / CP alignment that belong to no
    sample (docs/design.md §2, what the LLM computes beyond the samples)."""
    spec = data_spec(config)
    index, status = index_for(config, spec.text)
    plan = plan_for(config, index, spec.synthetic)
    rows = dict(spec.text.rows_per_image)
    feeds = feeds_for(config, spec.text)
    reader = reader_for(plan, spec.text, feeds)
    llm = config.llm.parallel
    failures: Counter = Counter()
    read = computed = real = image_rows = 0
    ratios, example = [], None
    towers = {f.name: NativeTowerStats(f, config.encoders[f.name]) for f in feeds if f.native is not None}
    bridges = {f.name: BridgeBytes(f, config) for f in feeds if f.bridge_width}
    for k in range(batches):
        samples = plan.microbatch(k)
        arrays = plan_arrays(plan, k, samples)
        for stats in towers.values():
            stats.add(arrays)
        for stats in bridges.values():
            stats.add(arrays)
        per_rank = []
        for got, batch in read_packs(reader, samples, llm, rows, mrope_merge=mrope_merge(config)):
            failures.update(r.failure for r in got if r.failure)
            computed += batch.num_tokens
            per_rank.append(sum(len(r.item.tokens) for r in got))
            image_rows += sum(int(v.numel()) for v in batch.image_slots.values())
            if example is None:
                example = next((r.item for r in got if r.item.ok), None)
        read += len(samples)
        real += sum(per_rank)
        mean = sum(per_rank) / len(per_rank)
        ratios.append(max(per_rank) / mean if mean else 1.0)
    capacity = config.data.tokens_per_microbatch / llm.dp
    mean_tokens = real / (batches * llm.replicas)
    return {
        "index": status,
        "samples_indexed": len(index.entries) if index is not None else None,
        "samples_read": read,
        "read_failures": dict(failures),
        "skipped": plan.skipped_counts(),
        "microbatches": batches,
        "padding_fraction": round(1 - mean_tokens / capacity, 6),
        "pack_padding_fraction": round(1 - real / computed, 6) if computed else 0.0,
        "max_over_mean_tokens_per_dp_rank": round(max(ratios), 4),
        "mean_tokens_per_dp_rank": round(mean_tokens, 2),
        "capacity_per_dp_rank": round(capacity, 2),
        "image_rows": image_rows,
        **({"native_towers": {name: stats.report() for name, stats in towers.items()}} if towers else {}),
        **({"bridges": {name: stats.report() for name, stats in bridges.items()}} if bridges else {}),
        "sample": example_view(example, index, reader, rows) if example is not None else None,
    }


class BridgeBytes:
    """``inspect``'s bytes of one encoder's bridge per global microbatch, from the plans training
    runs (``mimo.bridges.plan.image_bridge_plans``, made for every rank of the encoder's and the
    LLM's grids as the data pipeline makes each rank's): forward, the activation rows that cross
    between ranks plus what finishing all-gathers receive; backward, the gradient rows going back.
    Values travel in the run's compute precision (fp32: 4 bytes, else 2)."""

    def __init__(self, feed, config: MimoConfig):
        self.feed, self.llm_grid = feed, config.llm.parallel.grid(config.world_size)
        self.sequence_parallel = config.llm.parallel.sequence_parallel
        self.ranks = sorted(set(feed.grid.ranks) | set(self.llm_grid.ranks))
        self.item = 4 if config.train.precision == "fp32" else 2
        self.forward, self.backward = [], []

    def add(self, arrays: SampleArrays) -> None:
        from mimo.data.pipeline import encoder_dp_blocks, llm_dp_blocks, microbatch_bridge_plans

        blocks = llm_dp_blocks(arrays, self.llm_grid.shape.get("dp", 1))
        src_blocks = encoder_dp_blocks(arrays, self.feed)
        forward = backward = 0
        for rank in self.ranks:
            f = self.feed
            _, _, (fwd, bwd) = microbatch_bridge_plans(arrays, f.placeholder, f.rows_per_image, f.bridge_width, f.grid,
                                                       src_blocks, self.llm_grid, blocks, self.sequence_parallel, rank)
            forward += fwd.sent_numel(rank) + sum(g.received_numel for g in fwd.gathers)
            backward += bwd.sent_numel(rank)
        self.forward.append(forward * self.item)
        self.backward.append(backward * self.item)

    def report(self) -> dict:
        return {"forward_bytes_per_microbatch": self.forward, "backward_bytes_per_microbatch": self.backward,
                "bytes_per_value": self.item, "ranks": len(self.ranks)}


class NativeTowerStats:
    """``inspect``'s numbers of a native tower, per global microbatch: its images, patches and LLM
    tokens; and over all of them its packed input's padding (rows a DP rank's tower computes
    beyond its patches: under sequence parallelism, to whole merge blocks on each TP rank) and
    the balance of its DP ranks' cost (``EncoderFeed.costs_N``, what its DP blocks balance)."""

    def __init__(self, feed, enc):
        self.feed = feed
        self.multiple = enc.parallel.tp * enc.arch.spatial_merge**2 if enc.parallel.sequence_parallel else 1
        self.images, self.patches, self.tokens = [], [], []
        self.computed = self.real = 0
        self.imbalance = 1.0

    def add(self, arrays: SampleArrays) -> None:
        from mimo.data.pipeline import encoder_dp_blocks

        f = self.feed
        rows_N = arrays.rows_per_sample(f.placeholder, 0)
        self.images.append(int(arrays.images_for(f.placeholder).sum()))
        self.tokens.append(int(rows_N.sum()))
        patches_N, costs_N = f.pixel_rows_N(arrays), f.costs_N(arrays)
        self.patches.append(int(patches_N.sum()))
        costs = []
        for block in encoder_dp_blocks(arrays, f):
            real = int(patches_N[block.start:block.stop].sum())
            self.real += real
            self.computed += -(-max(real, 1) // self.multiple) * self.multiple if self.multiple > 1 else real
            costs.append(int(costs_N[block.start:block.stop].sum()))
        mean = sum(costs) / len(costs)
        self.imbalance = max(self.imbalance, max(costs) / mean if mean else 1.0)

    def report(self) -> dict:
        return {"images_per_microbatch": self.images, "patches_per_microbatch": self.patches,
                "tokens_per_microbatch": self.tokens,
                "tower_padding_fraction": round(1 - self.real / self.computed, 6) if self.computed else 0.0,
                "max_over_mean_cost_per_dp_rank": round(self.imbalance, 4)}


def example_view(item, index: Index | None, reader, rows_per_image: dict[str, int]) -> dict:
    """One read sample for a person: where it is from, its text with the label tokens marked,
    its label positions and image positions (decoded where the reader has a tokenizer)."""
    from mimo.data.text import LABEL_OPEN, LABEL_CLOSE, show_sample, true_runs

    tokenizer = getattr(reader, "tokenizer", None)
    decode = tokenizer.decode if tokenizer is not None else (lambda ids: " ".join(map(str, ids)))
    view = {"tokens": len(item.tokens), "label_tokens": sum(item.target), "labels_at": true_runs(item.target),
            "image_positions": {p: [[s, s + (item.image_rows[p][k] if p in item.image_rows else rows_per_image[p])]
                                    for k, s in enumerate(starts)] for p, starts in item.image_starts.items()},
            "text": show_sample(item.tokens, item.target, item.image_starts, rows_per_image, decode, item.image_rows),
            "legend": f"{LABEL_OPEN}...{LABEL_CLOSE}: label tokens (the loss predicts them); {{<placeholder> x N}}: N image positions"}
    if index is not None:
        entry = index.entries[item.id]
        view = {"shard": index.shards[entry.shard], "key": entry.key, **view}
    return view

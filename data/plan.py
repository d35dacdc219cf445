"""Planning: which samples form each global microbatch, from the index alone.

The sample stream is the valid samples of the index, epoch after epoch, each epoch in its
own seeded order. Global microbatches take samples from the stream in order while their
real tokens fit ``tokens_per_microbatch``; step s (1-based) trains microbatches
``(s-1)*M .. s*M-1``. All of this depends only on (index, data config, seed) — never on a
layout — so every rank, the one-process reference and a resumed run agree, and a resumed
run finds its place without reading any sample.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mimo.data.index import LOST, Entry, Index
from mimo.core.errors import DataError


@dataclass(frozen=True)
class PlannedSample:
    id: int  # entry number in the index
    tokens: int
    images: int
    image_starts: dict  # placeholder -> first position of each image
    # native placeholders: each image's rows and grid (t, h, w), as the index holds them
    image_rows: dict = field(default_factory=dict)
    image_grids: dict = field(default_factory=dict)

    def images_for(self, placeholder: str) -> int:
        """How many images this sample has for the encoder of ``placeholder``."""
        return len(self.image_starts.get(placeholder, ()))

    def rows_of(self, placeholder: str, rows_per_image: int) -> list[int]:
        """Rows of each of its images for one encoder: their own (native), else ``rows_per_image``."""
        own = self.image_rows.get(placeholder)
        return list(own) if own is not None else [rows_per_image] * self.images_for(placeholder)

    def positions(self, placeholder: str, rows_per_image: int) -> list[int]:
        """Positions of this sample's rows for one encoder, image after image."""
        return [s + r for s, n in zip(self.image_starts.get(placeholder, ()), self.rows_of(placeholder, rows_per_image))
                for r in range(n)]


@dataclass(frozen=True, eq=False)
class SampleArrays:
    """A global microbatch's samples as arrays, what placements and DP blocks read: each
    sample's tokens (``tokens_N``), and per placeholder each sample's images (``images_N``)
    and every image's first position, sample after sample (``image_start_I``). Every rank
    needs them for every microbatch, so plans hand them out whole, without per-sample objects."""

    tokens_N: np.ndarray
    images_N: dict = field(default_factory=dict)  # placeholder -> images per sample
    image_start_I: dict = field(default_factory=dict)  # placeholder -> first position of each image
    # native placeholders -> rows and grid (t, h, w) of each image, sample after sample
    image_rows_I: dict = field(default_factory=dict)
    image_grid_I3: dict = field(default_factory=dict)

    @classmethod
    def of_samples(cls, samples) -> "SampleArrays":
        """From ``PlannedSample``s, one by one (microbatches put together from samples)."""
        placeholders = sorted({p for s in samples for p in s.image_starts})
        starts = {p: [s.image_starts.get(p, ()) for s in samples] for p in placeholders}
        native = sorted({p for s in samples for p in s.image_rows})
        flat = lambda key, p: [x for s in samples for x in getattr(s, key).get(p, ())]  # noqa: E731
        return cls(np.array([s.tokens for s in samples], dtype=np.int64).reshape(-1),
                   {p: np.array(list(map(len, st)), dtype=np.int64).reshape(-1) for p, st in starts.items()},
                   {p: np.fromiter(itertools.chain.from_iterable(st), dtype=np.int64) for p, st in starts.items()},
                   {p: np.array(flat("image_rows", p), dtype=np.int64).reshape(-1) for p in native},
                   {p: np.array(flat("image_grids", p), dtype=np.int64).reshape(-1, 3) for p in native})

    @classmethod
    def of(cls, samples) -> "SampleArrays":
        """``samples`` if they are ``SampleArrays`` already, else ``of_samples``."""
        return samples if isinstance(samples, SampleArrays) else cls.of_samples(samples)

    def images_for(self, placeholder: str) -> np.ndarray:
        """Images per sample for the encoder of ``placeholder`` (``PlannedSample.images_for``)."""
        return self.images_N.get(placeholder, np.zeros(len(self.tokens_N), dtype=np.int64))

    def image_starts(self, placeholder: str) -> np.ndarray:
        return self.image_start_I.get(placeholder, np.zeros(0, dtype=np.int64))

    def image_rows(self, placeholder: str, rows_per_image: int) -> np.ndarray:
        """Rows of each image for the encoder of ``placeholder``: their own (native), else
        ``rows_per_image`` each."""
        own = self.image_rows_I.get(placeholder)
        if own is not None:
            return own
        return np.full(int(self.images_for(placeholder).sum()), rows_per_image, dtype=np.int64)

    def image_layout(self, placeholder: str, rows_per_image: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What a bridge of ``placeholder``'s images is planned from (``mimo.bridges.plan.
        image_bridge_plans``): tokens per sample, images per sample, each image's start and rows."""
        return (self.tokens_N, self.images_for(placeholder), self.image_starts(placeholder),
                self.image_rows(placeholder, rows_per_image))

    def image_grids(self, placeholder: str) -> np.ndarray:
        """``[I, 3]`` grids of a native placeholder's images (none: empty)."""
        return self.image_grid_I3.get(placeholder, np.zeros((0, 3), dtype=np.int64))

    def rows_per_sample(self, placeholder: str, rows_per_image: int) -> np.ndarray:
        """Each sample's image rows for the encoder of ``placeholder``."""
        return self.per_sample(placeholder, self.image_rows(placeholder, rows_per_image))

    def per_sample(self, placeholder: str, values_I: np.ndarray) -> np.ndarray:
        """Each sample's sum of a value per image of ``placeholder`` (images sample after sample)."""
        images_N = self.images_for(placeholder)
        return np.bincount(np.repeat(np.arange(len(images_N)), images_N), weights=values_I,
                           minlength=len(images_N)).astype(np.int64)


class _IndexColumns:
    """The index's per-entry numbers as arrays (built once per plan): tokens, and per
    placeholder where each entry's image starts lie in one flat array (CSR)."""

    def __init__(self, index: Index):
        entries = index.entries
        self.tokens_E = np.array([e.tokens for e in entries], dtype=np.int64)
        self.patches_E = np.array([entry_patches(e) for e in entries], dtype=np.int64)
        placeholders = sorted({p for e in entries for p in e.image_starts})
        self.offset_E1, self.start_J, self.rows_J, self.grid_J3 = {}, {}, {}, {}
        for p in placeholders:
            starts = [e.image_starts.get(p, ()) for e in entries]
            self.offset_E1[p] = np.concatenate([[0], np.cumsum(list(map(len, starts)))]).astype(np.int64)
            self.start_J[p] = np.fromiter(itertools.chain.from_iterable(starts), dtype=np.int64)
        for p in sorted({p for e in entries for p in e.image_rows}):  # native placeholders, aligned with starts
            self.rows_J[p] = np.fromiter(itertools.chain.from_iterable(e.image_rows.get(p, ()) for e in entries), dtype=np.int64)
            grids = list(itertools.chain.from_iterable(e.image_grids.get(p, ()) for e in entries))
            self.grid_J3[p] = np.array(grids, dtype=np.int64).reshape(-1, 3)

    def arrays(self, ids_N: np.ndarray) -> SampleArrays:
        images, starts, rows, grids = {}, {}, {}, {}
        for p, offset_E1 in self.offset_E1.items():
            first_N = offset_E1[ids_N]
            images[p] = offset_E1[ids_N + 1] - first_N
            # the images, sample after sample: image i of the microbatch, the k-th of its
            # sample n, is entry first[n] + k = i + (first[n] - the images before sample n)
            shift_N = first_N - np.cumsum(images[p]) + images[p]
            take_I = np.repeat(shift_N, images[p]) + np.arange(int(images[p].sum()))
            starts[p] = self.start_J[p][take_I]
            if p in self.rows_J:
                rows[p], grids[p] = self.rows_J[p][take_I], self.grid_J3[p][take_I]
        return SampleArrays(self.tokens_E[ids_N], images, starts, rows, grids)


def entry_patches(e: Entry) -> int:
    """Tower patches of an entry's native images (each grid's t * h * w), all towers together."""
    return sum(t * h * w for grids in e.image_grids.values() for t, h, w in grids)


class DataPlan:
    def __init__(self, index: Index, tokens_per_microbatch: int, max_sample_tokens: int, seed: int, shuffle: bool = True,
                 patches_per_microbatch: int | None = None):
        self.index = index
        self.tokens_per_microbatch = tokens_per_microbatch
        # the second budget of a microbatch: native towers' patches (None: none)
        self.patches_per_microbatch = patches_per_microbatch
        self.seed, self.shuffle = seed, shuffle
        self.skipped = Counter(index.bad_counts())
        if index.shard_lost:
            self.skipped[LOST] = sum(index.shard_lost.values())
        self.valid: list[int] = []
        self.too_long: list[int] = []  # entry ids of the samples longer than max_sample_tokens
        for i, e in enumerate(index.entries):
            if e.bad:
                continue
            if e.tokens > max_sample_tokens:
                self.skipped["too long"] += 1
                self.too_long.append(i)
                continue
            if patches_per_microbatch is not None and entry_patches(e) > patches_per_microbatch:
                self.skipped["too many patches"] += 1
                continue
            self.valid.append(i)
        if not self.valid:
            raise DataError(f"no usable sample in {len(index.entries)} indexed (skipped: {dict(self.skipped)})")
        if all(index.entries[i].tokens == 0 for i in self.valid):  # a microbatch would never fill
            raise DataError(f"every usable sample of the {len(index.entries)} indexed has 0 tokens (empty text, "
                            f"no images): nothing to train on")
        self._starts: list[int] = [0]  # stream position where each microbatch starts
        self._columns: _IndexColumns | None = None
        self._orders: dict[int, np.ndarray] = {}  # a few recent epochs' orders
        # the data pipeline's step thread and the training thread (metrics) both ask for microbatches
        self._lock = threading.Lock()

    # ---- the stream ----
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self.valid)
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:  # an array: microbatches are sliced out of it whole
            order = self._orders[epoch] = np.array(self._epoch_order(epoch), dtype=np.int64)
            if len(self._orders) > 3:  # keep a few epochs: positions only move forward
                del self._orders[min(self._orders)]
        return order

    def _stream(self, pos: int) -> int:
        epoch, off = divmod(pos, len(self.valid))
        return int(self._order(epoch)[off])

    def sample(self, entry_id: int) -> PlannedSample:
        e: Entry = self.index.entries[entry_id]
        return PlannedSample(entry_id, e.tokens, e.images, e.image_starts, e.image_rows, e.image_grids)

    def _stream_ids(self, lo: int, hi: int) -> np.ndarray:
        """The entry ids at stream positions ``lo .. hi-1`` (one slice per epoch touched)."""
        parts = [np.zeros(0, dtype=np.int64)]
        while lo < hi:
            epoch, off = divmod(lo, len(self.valid))
            take = min(hi - lo, len(self.valid) - off)
            parts.append(self._order(epoch)[off : off + take])
            lo += take
        return np.concatenate(parts)

    def _end(self, columns: "_IndexColumns", pos: int) -> int:
        """Where the microbatch from stream position ``pos`` ends: it takes samples while their
        tokens fit (a first sample always), read a window of the stream at a time (the last
        microbatch's samples and a quarter more: usually one window)."""
        last = self._starts[-1] - self._starts[-2] if len(self._starts) > 1 else 0
        width = max(64, last + last // 4 + 16)
        while True:
            ids_W = self._stream_ids(pos, pos + width)
            used_W = np.cumsum(columns.tokens_E[ids_W])
            fit = int(np.searchsorted(used_W, self.tokens_per_microbatch, "right"))
            if self.patches_per_microbatch is not None:  # both budgets hold
                fit = min(fit, int(np.searchsorted(np.cumsum(columns.patches_E[ids_W]), self.patches_per_microbatch, "right")))
            if fit < width:  # one more sample while none has counted yet (a first sample, or zeros)
                return pos + fit + (fit == 0 or int(used_W[fit - 1]) == 0)
            width *= 4

    def _ids(self, k: int) -> np.ndarray:
        """The entry ids of global microbatch k (0-based): samples in stream order, never split."""
        columns = self._columns_built()  # before the lock: it takes it
        with self._lock:
            while len(self._starts) <= k + 1:
                self._starts.append(self._end(columns, self._starts[-1]))
            return self._stream_ids(self._starts[k], self._starts[k + 1])

    def microbatch(self, k: int) -> list[PlannedSample]:
        """Global microbatch k (0-based): samples in stream order, never split."""
        return [self.sample(i) for i in self._ids(k).tolist()]

    def microbatch_arrays(self, k: int) -> SampleArrays:
        """Global microbatch k as ``SampleArrays``, gathered from the index's columns."""
        return self._columns_built().arrays(self._ids(k))

    def _columns_built(self) -> _IndexColumns:
        with self._lock:
            if self._columns is None:
                self._columns = _IndexColumns(self.index)
            return self._columns

    def step(self, step: int, micro_batches: int) -> list[list[PlannedSample]]:
        """The global microbatches of training step ``step`` (1-based)."""
        if step < 1:
            raise DataError(f"steps are 1-based, got {step}")
        return [self.microbatch((step - 1) * micro_batches + i) for i in range(micro_batches)]

    def skipped_counts(self) -> dict[str, int]:
        return dict(self.skipped)

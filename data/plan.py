"""Planning: which samples form each global microbatch, from the index alone.

The sample stream is the valid samples of the index, epoch after epoch, each epoch in its
own seeded order. Global microbatches take samples from the stream in order while their
real tokens fit ``tokens_per_microbatch``; step s (1-based) trains microbatches
``(s-1)*M .. s*M-1``. All of this depends only on (index, data config, seed) — never on a
layout — so every rank, the one-process reference and a resumed run agree, and a resumed
run finds its place without reading any sample.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass

from mimo.data.index import Entry, Index
from mimo.core.errors import DataError


@dataclass(frozen=True)
class PlannedSample:
    id: int  # entry number in the index
    tokens: int
    images: int
    image_starts: dict  # placeholder -> first position of each image

    def images_for(self, placeholder: str) -> int:
        """How many images this sample has for the encoder of ``placeholder``."""
        return len(self.image_starts.get(placeholder, ()))

    def positions(self, placeholder: str, rows_per_image: int) -> list[int]:
        """Positions of this sample's rows for one encoder, image after image."""
        return [s + r for s in self.image_starts.get(placeholder, ()) for r in range(rows_per_image)]


class DataPlan:
    def __init__(self, index: Index, tokens_per_microbatch: int, max_sample_tokens: int, seed: int, shuffle: bool = True):
        self.index = index
        self.tokens_per_microbatch = tokens_per_microbatch
        self.seed, self.shuffle = seed, shuffle
        self.skipped = Counter(index.bad_counts())
        self.valid: list[int] = []
        self.too_long: list[int] = []  # entry ids of the samples longer than max_sample_tokens
        for i, e in enumerate(index.entries):
            if e.bad:
                continue
            if e.tokens > max_sample_tokens:
                self.skipped["too long"] += 1
                self.too_long.append(i)
                continue
            self.valid.append(i)
        if not self.valid:
            raise DataError(f"no usable sample in {len(index.entries)} indexed (skipped: {dict(self.skipped)})")
        self._starts: list[int] = [0]  # stream position where each microbatch starts
        self._orders: dict[int, list[int]] = {}  # a few recent epochs' orders
        # the data pipeline's step thread and the training thread (metrics) both ask for microbatches
        self._lock = threading.Lock()

    # ---- the stream ----
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self.valid)
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _stream(self, pos: int) -> int:
        epoch, off = divmod(pos, len(self.valid))
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = self._epoch_order(epoch)
            if len(self._orders) > 3:  # keep a few epochs: positions only move forward
                del self._orders[min(self._orders)]
        return order[off]

    def sample(self, entry_id: int) -> PlannedSample:
        e: Entry = self.index.entries[entry_id]
        return PlannedSample(entry_id, e.tokens, e.images, e.image_starts)

    def microbatch(self, k: int) -> list[PlannedSample]:
        """Global microbatch k (0-based): samples in stream order, never split."""
        with self._lock:
            while len(self._starts) <= k + 1:
                pos, used = self._starts[-1], 0
                while True:
                    t = self.index.entries[self._stream(pos)].tokens
                    if used and used + t > self.tokens_per_microbatch:
                        break
                    used, pos = used + t, pos + 1
                self._starts.append(pos)
            return [self.sample(self._stream(p)) for p in range(self._starts[k], self._starts[k + 1])]

    def step(self, step: int, micro_batches: int) -> list[list[PlannedSample]]:
        """The global microbatches of training step ``step`` (1-based)."""
        if step < 1:
            raise DataError(f"steps are 1-based, got {step}")
        return [self.microbatch((step - 1) * micro_batches + i) for i in range(micro_batches)]

    def skipped_counts(self) -> dict[str, int]:
        return dict(self.skipped)

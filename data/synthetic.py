"""``data.source: synthetic``: seeded random samples, no files, for benchmarks and smoke runs.

Every sample is ``images_per_sample`` images (each image's rows for every encoder, encoder
after encoder) followed by ``text_tokens`` random text tokens, and carries loss on every text
token. Global microbatch k holds ``samples_per_microbatch`` samples, drawn from one seeded
``torch.Generator`` in this order per microbatch: the text lengths, then each sample's token
ids, then each encoder's pixels ``[samples * images, C, S, S]`` (standard normal). With one
encoder, one image per sample and ``seed: 1`` this is exactly the stream of
``../shared/bench/hf_llava_baseline.py`` (its ``batch()``), so mimo trains on the very samples
the Hugging Face baseline trains on.

The stream depends only on the data config (never on a layout), like the index-based plan;
microbatch k is found by replaying the generator from the nearest cached state. Asking for
microbatch k starts drawing the next few in a background thread, so a training step rarely
waits for a draw (about 10 ms of CPU for the benchmark's 8 images).

Token ids: text uses ``1 .. vocab-3``; image positions hold ``vocab-1`` (they are replaced
by image rows in the LLM's first stage); pad is 0.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from mimo.data.config import SyntheticData
from mimo.data.pack import PackItem
from mimo.data.pipeline import ReadSample
from mimo.data.plan import PlannedSample, SampleArrays
from mimo.core.errors import DataError

PAD_ID = 0
AHEAD = 3  # microbatches drawn ahead in the background (the pipeline reads up to 2 ahead)


@dataclass(frozen=True)
class SyntheticEncoder:
    """What the generator needs of one encoder: its placeholder, rows per image, pixel shape."""

    name: str
    placeholder: str
    rows_per_image: int
    channels: int
    image_size: int


@dataclass
class _Microbatch:
    tokens: list[list[int]]  # per sample
    pixels: dict[str, torch.Tensor]  # encoder -> [samples * images, C, S, S]


class SyntheticStream:
    """The generated microbatches (thread-safe: reader threads share one stream)."""

    def __init__(self, spec: SyntheticData, encoders: list[SyntheticEncoder], vocab: int, seed: int,
                 samples_per_microbatch: int, text_tokens: tuple[int, int], cache: int = 8):
        if vocab < 4:
            raise DataError(f"synthetic data needs a vocab of at least 4 token ids, got {vocab}")
        self.spec, self.encoders, self.vocab, self.seed = spec, encoders, vocab, seed
        self.samples = samples_per_microbatch
        self.lo, self.hi = text_tokens
        self.images = spec.images_per_sample
        self.image_token = vocab - 1
        self.prefix = self.images * sum(e.rows_per_image for e in encoders)  # image rows before the text
        self._states: dict[int, torch.Tensor] = {}  # microbatch -> generator state before it
        self._cache: OrderedDict[int, _Microbatch] = OrderedDict()
        self._cache_size = max(cache, AHEAD + 2)
        # a producer thread draws microbatches in order, up to AHEAD past the furthest one asked
        # for; readers wait only for a microbatch not drawn yet, and replay one evicted earlier
        self._cond = threading.Condition()
        self._next = 0  # the producer's next microbatch
        self._wanted = -1  # the furthest microbatch asked for
        self._producer: threading.Thread | None = None

    def image_starts(self) -> dict[str, list[int]]:
        """Every sample's image positions per placeholder (the same for every sample)."""
        starts: dict[str, list[int]] = {e.placeholder: [] for e in self.encoders}
        pos = 0
        for _ in range(self.images):
            for e in self.encoders:
                starts[e.placeholder].append(pos)
                pos += e.rows_per_image
        return starts

    def _draw(self, g: torch.Generator) -> _Microbatch:
        lens = torch.randint(self.lo, self.hi + 1, (self.samples,), generator=g).tolist()
        tokens = [torch.randint(1, self.vocab - 2, (n,), generator=g).tolist() for n in lens]
        pixels = {e.name: torch.randn(self.samples * self.images, e.channels, e.image_size, e.image_size, generator=g)
                  for e in self.encoders}
        return _Microbatch(tokens, pixels)

    def _produce(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            with self._cond:
                while self._next > self._wanted + AHEAD:
                    self._cond.wait()
                k = self._next
                self._states[k] = g.get_state()
            mb = self._draw(g)  # outside the lock: readers of drawn microbatches never wait on it
            with self._cond:
                self._put(k, mb)
                self._next = k + 1
                self._cond.notify_all()

    def _put(self, k: int, mb: _Microbatch) -> None:
        self._cache[k] = mb
        self._cache.move_to_end(k)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def microbatch(self, k: int) -> _Microbatch:
        if k < 0:
            raise DataError(f"microbatches are numbered from 0, got {k}")
        with self._cond:
            if self._producer is None:
                self._producer = threading.Thread(target=self._produce, name="mimo-synthetic", daemon=True)
                self._producer.start()
            if k > self._wanted:
                self._wanted = k
                self._cond.notify_all()
            while k not in self._cache and k >= self._next:
                self._cond.wait()
            if k in self._cache:
                self._cache.move_to_end(k)
                return self._cache[k]
            state = self._states[k]  # drawn before and evicted since: replay it
        g = torch.Generator()
        g.set_state(state)
        mb = self._draw(g)
        with self._cond:
            self._put(k, mb)
        return mb


class SyntheticPlan:
    """The ``DataPlan`` of synthetic data: microbatch k's samples (ids ``k*S + i``)."""

    index = None

    def __init__(self, stream: SyntheticStream):
        self.stream = stream

    def sample(self, k: int, i: int, text: int) -> PlannedSample:
        return PlannedSample(k * self.stream.samples + i, self.stream.prefix + text, self.stream.images, self.stream.image_starts())

    def microbatch(self, k: int) -> list[PlannedSample]:
        mb = self.stream.microbatch(k)
        return [self.sample(k, i, len(t)) for i, t in enumerate(mb.tokens)]

    def microbatch_arrays(self, k: int) -> SampleArrays:
        """``microbatch(k)`` as ``SampleArrays``: every sample has the same images."""
        text_N = np.fromiter(map(len, self.stream.microbatch(k).tokens), dtype=np.int64)
        n, starts = len(text_N), self.stream.image_starts()
        return SampleArrays(self.stream.prefix + text_N, {p: np.full(n, len(st), dtype=np.int64) for p, st in starts.items()},
                            {p: np.tile(np.asarray(st, dtype=np.int64), n) for p, st in starts.items()})

    def step(self, step: int, micro_batches: int) -> list[list[PlannedSample]]:
        if step < 1:
            raise DataError(f"steps are 1-based, got {step}")
        return [self.microbatch((step - 1) * micro_batches + i) for i in range(micro_batches)]

    def skipped_counts(self) -> dict[str, int]:
        return dict(Counter())


class SyntheticReader:
    """``SampleReader`` of synthetic data: the sample's tokens (image positions first) and pixels."""

    pad_id = PAD_ID

    def __init__(self, stream: SyntheticStream):
        self.stream = stream

    def read(self, s: PlannedSample):
        st = self.stream
        k, i = divmod(s.id, st.samples)
        mb = st.microbatch(k)
        text = mb.tokens[i]
        tokens = [st.image_token] * st.prefix + text
        target = [False] * st.prefix + [True] * len(text)
        lo = i * st.images
        pixels = {name: p[lo : lo + st.images].reshape(st.images, -1) for name, p in mb.pixels.items()}
        return ReadSample(PackItem(s.id, tokens, target, st.image_starts()), pixels)

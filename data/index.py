"""``mimo prepare-data``: one pass over the shards that writes an index beside them (or in ``data.index_dir``).

Per sample the index holds where its files lie, its token count for the configured
tokenizer, template and encoders (image rows included), where each image's rows start, and
validation: a bad sample is listed with its reason and never planned. The index carries a
fingerprint of everything it depends on (shard sizes and times, tokenizer files, template,
placeholders and rows per image); a stale index is rebuilt, with a message saying why.
Every later step is planned from the index alone, without reading the shards.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from mimo.data.config import shard_paths
from mimo.data.shards import decode_image, image_keys, parse_text, read_files, scan_shard, video_keys
from mimo.data.native_images import NativePlaceholder, grid_from_bytes
from mimo.data.native_video import VideoLayout, layout_from_bytes
from mimo.data.text import IMAGE, TextEncoder, TokenizedSample, load_tokenizer, turns_from_caption, turns_from_json
from mimo.core.errors import DataError

log = logging.getLogger("mimo.data")
# 2: images map to encoders by placeholder (mimo.data.text); 3: a cut tar's last sample is "truncated";
# 4: an empty caption or answer is bad; earlier verdicts differ
# 5: native-resolution images: each image's grid and rows; 6: videos (a slot per temporal patch)
INDEX_VERSION = 6


@dataclass(frozen=True)
class TextSpec:
    """What token counts depend on: tokenizer, template, and rows per image per placeholder."""

    tokenizer: str
    template: str
    rows_per_image: tuple[tuple[str, int], ...]  # (placeholder, rows), in encoder order; 0 for native ones
    native: tuple[NativePlaceholder, ...] = ()  # the placeholders whose rows follow each image's grid

    @property
    def placeholders(self) -> list[str]:
        return [p for p, _ in self.rows_per_image]

    def mrope_merge(self) -> dict[str, int]:
        """Native placeholder -> its tower's merge size (whose images take 3-D positions)."""
        return {n.placeholder: n.image.merge for n in self.native}

    def text_encoder(self, tokenizer=None) -> TextEncoder:
        return TextEncoder(tokenizer if tokenizer is not None else load_tokenizer(self.tokenizer), self.template,
                           dict(self.rows_per_image), self.native)

    def file_rows(self, image_bytes: list[bytes]) -> tuple[dict[str, list[list[int]]], dict[str, list[int]]]:
        """Per native placeholder, the grid and the rows of each image file, from its header
        (``DataError`` for an image its spec cannot take: every file is checked against every
        native encoder, whichever it feeds)."""
        grids = {n.placeholder: [list(grid_from_bytes(b, n.image)) for b in image_bytes] for n in self.native}
        return grids, {n.placeholder: [n.rows(g) for g in grids[n.placeholder]] for n in self.native}

    @property
    def video(self) -> NativePlaceholder | None:
        """The native placeholder whose tower takes videos (one at most)."""
        return next((n for n in self.native if n.video is not None), None)

    def video_layouts(self, video_bytes: list[bytes]) -> list[VideoLayout]:
        """How each video file enters the sample, from its container's header (``DataError`` for
        a video that cannot: unreadable, too short, or no tower takes videos)."""
        if not video_bytes:
            return []
        taker = self.video
        if taker is None:
            raise DataError(f"video not taken: the sample holds {len(video_bytes)} video file(s) and no encoder takes "
                            f"videos (a native tower's 'video' section)")
        return [layout_from_bytes(b, taker.image, taker.video) for b in video_bytes]


@dataclass
class SampleText:
    """What one sample's files give before any pixel: its tokens, its image and video files (in
    order), each video's layout, and each native slot's grid."""

    tokens: TokenizedSample
    images: list[str]
    videos: list[str]
    layouts: list[VideoLayout]
    slot_grids: dict[str, list[list[int]]]


def sample_text(files: dict[str, bytes], encoder: TextEncoder, spec: TextSpec) -> SampleText:
    """Tokens and slots of a sample from its files (``DataError`` with the reason if it is bad):
    the one reading the index and the pipeline's reader share."""
    kind, text = parse_text(files)
    images, videos = image_keys(files), video_keys(files)
    grids, rows = spec.file_rows([files[ext] for ext in images])
    layouts = spec.video_layouts([files[ext] for ext in videos])
    taker = spec.video
    turns = (turns_from_json(text) if kind == "json" else
             turns_from_caption(text, spec.placeholders, len(images), len(videos),
                                taker.video_placeholder if taker is not None else ""))
    tok = encoder.encode(turns, len(images), rows, layouts)
    slot_grids = {p: [grids[p][f] if k == IMAGE else layouts[f].grids[t] for k, f, t in tok.slot_files[p]]
                  for p in grids}
    return SampleText(tok, images, videos, layouts, slot_grids)


@dataclass
class Entry:
    shard: int
    key: str
    files: dict[str, tuple[int, int]] = field(default_factory=dict)
    tokens: int = 0
    images: int = 0
    image_starts: dict[str, list[int]] = field(default_factory=dict)
    bad: str | None = None
    # native placeholders: each image's grid (t, h, w) and rows, in the order of its starts
    image_grids: dict[str, list[list[int]]] = field(default_factory=dict)
    image_rows: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Index:
    shards: list[str]
    entries: list[Entry]
    fingerprint: str
    shard_errors: dict[str, str] = field(default_factory=dict)
    # damaged shard -> how many samples it lost (estimated: ``estimate_lost``; mimo.data.skipped)
    shard_lost: dict[str, int] = field(default_factory=dict)

    def bad_counts(self) -> Counter:
        return Counter(reason_kind(e.bad) for e in self.entries if e.bad)

    def to_json(self) -> dict:
        return {
            "version": INDEX_VERSION,
            "fingerprint": self.fingerprint,
            "shards": self.shards,
            "shard_errors": self.shard_errors,
            "shard_lost": self.shard_lost,
            "shard_stats": {s: _shard_stat(s) for s in self.shards if os.path.isfile(s)},
            "entries": [[e.shard, e.key, e.files, e.tokens, e.images, e.image_starts, e.bad, e.image_grids, e.image_rows]
                        for e in self.entries],
        }

    @classmethod
    def from_json(cls, obj: dict) -> "Index":
        entries = [
            Entry(s, k, {x: tuple(v) for x, v in f.items()}, t, n, starts, bad, grids, rows)
            for s, k, f, t, n, starts, bad, grids, rows in obj["entries"]
        ]
        return cls(obj["shards"], entries, obj["fingerprint"], obj.get("shard_errors", {}), obj.get("shard_lost", {}))

    def samples_per_shard(self) -> Counter:
        return Counter(self.shards[e.shard] for e in self.entries)


LOST = "lost in damaged shards"  # the count key of the samples damaged shards lost (Index.shard_lost)


def reason_kind(reason: str) -> str:
    """'corrupt image: cannot identify ...' -> 'corrupt image' (the count key)."""
    return reason.split(":", 1)[0]


# ---------------------------------------------------------------------------
def fingerprint(shards: list[str], spec: TextSpec) -> str:
    h = hashlib.sha256(f"v{INDEX_VERSION}|{spec.template}|{spec.rows_per_image}|{spec.native}".encode())
    for path in shards:
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode())
    for name in sorted(os.listdir(spec.tokenizer)):
        full = os.path.join(spec.tokenizer, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                h.update(name.encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def index_path(pattern: str, spec: TextSpec, index_dir: str | None = None) -> str:
    """In ``index_dir`` (default: beside the first shard), named after the pattern and keyed by
    tokenizer and template, so that switching either keeps the other's index:
    'd/train-{0..3}.tar' -> 'd/train-0..3.chatml-1a2b3c4d.mimo-index.json'; the key hashes the
    pattern's and the tokenizer's absolute paths and the template. A pattern that is not a name
    plus at most one numeric range (a brace list, a glob, braces in folders) is named 'shards'."""
    directory, base = os.path.split(pattern)
    base = base[:-4] if base.endswith(".tar") else base
    if re.fullmatch(r"[\w.-]*(\{\d+\.\.\d+\})?[\w.-]*", base) and not re.search(r"[{}*?\[\]]", directory):
        name = base.replace("{", "").replace("}", "") or "shards"
    else:
        name = "shards"
        shards = shard_paths(pattern)
        directory = os.path.dirname(shards[0]) if shards else "."
    key = hashlib.sha256(f"{os.path.abspath(pattern)}|{os.path.abspath(spec.tokenizer)}|{spec.template}".encode()).hexdigest()[:8]
    return os.path.join(index_dir or directory, f"{name}.{spec.template}-{key}.mimo-index.json")


def _check_writable(path: str) -> None:
    """A DataError naming the place and the way out, before a whole pass over the shards."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data index folder {directory!r}: {e.strerror or e}; set data.index_dir to a "
                        f"writable folder") from None
    if not os.access(directory, os.W_OK):
        raise DataError(f"cannot write the data index {path!r}: {directory!r} is not writable (read-only dataset "
                        f"storage?); set data.index_dir to a writable folder") from None


def index_sample(files: dict[str, bytes], encoder: TextEncoder, spec: TextSpec) -> tuple[TokenizedSample, int, dict]:
    """A sample's tokens (``TokenizedSample``: length, image starts and rows), its image files
    and its native slots' grids; DataError with the reason if it is bad. Images are decoded here
    (a corrupt one is a bad sample); videos only read from their container's header (decoding
    every frame of a video corpus at index time would cost as much as an epoch): a video whose
    frames fail to decode is a counted read failure of the step that reads it."""
    for ext in image_keys(files):
        decode_image(files[ext])
    read = sample_text(files, encoder, spec)
    return read.tokens, len(read.images), read.slot_grids


def _scan_one(args) -> tuple[int, list[Entry], str | None]:
    shard_id, path, spec = args
    encoder = spec.text_encoder()
    locations, error = scan_shard(path)
    entries = []
    for loc in locations:
        entry = Entry(shard_id, loc.key, dict(loc.files))
        try:
            sample, entry.images, entry.image_grids = index_sample(read_files(path, loc), encoder, spec)
            entry.tokens, entry.image_starts, entry.image_rows = len(sample), sample.image_starts, sample.image_rows
        except DataError as e:
            entry.bad = str(e)
        entries.append(entry)
    if error is not None and entries:
        # the sample the tar ended in may have lost files: that is its verdict, whatever its
        # remaining files look like (e.g. a conversation whose image was cut off)
        last = entries[-1]
        last.bad = error if not last.bad else f"{error} ({last.bad})"
    return shard_id, entries, error


def estimate_lost(index: Index, previous: dict[str, int] | None = None) -> dict[str, int]:
    """Samples each damaged shard lost: its count in the index this one replaces (``previous``:
    shard -> samples) where that was more, else the median count of the intact shards (shards are
    written at one size) less its own; shards with no estimate are left out (still named by
    ``shard_errors``)."""
    counts = index.samples_per_shard()
    intact = sorted(counts[s] for s in index.shards if s not in index.shard_errors)
    median = intact[len(intact) // 2] if intact else None
    lost = {}
    for shard in index.shard_errors:
        before = (previous or {}).get(shard)
        expected = before if before is not None and before > counts[shard] else median
        if expected is not None and expected > counts[shard]:
            lost[shard] = expected - counts[shard]
    return lost


def build_index(pattern: str, spec: TextSpec, workers: int = 2) -> Index:
    shards = shard_paths(pattern)
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        raise DataError(f"missing shard {missing[0]!r} (of {pattern!r})")
    load_tokenizer(spec.tokenizer)  # fail early with a clear message
    jobs = [(i, p, spec) for i, p in enumerate(shards)]
    results = {}
    if workers > 1 and len(shards) > 1:
        with cf.ProcessPoolExecutor(min(workers, len(shards)), mp_context=mp.get_context("spawn")) as pool:
            for shard_id, entries, error in pool.map(_scan_one, jobs):
                results[shard_id] = (entries, error)
    else:
        for job in jobs:
            shard_id, entries, error = _scan_one(job)
            results[shard_id] = (entries, error)
    entries = [e for i in range(len(shards)) for e in results[i][0]]
    errors = {shards[i]: results[i][1] for i in range(len(shards)) if results[i][1]}
    return Index(shards, entries, fingerprint(shards, spec), errors)


def prepare(pattern: str, spec: TextSpec, workers: int = 2, rebuild: bool = False, index_dir: str | None = None) -> tuple[Index, str]:
    """Load the index for ``pattern``, building or rebuilding it when missing or stale.

    Returns the index and what happened ('loaded', 'built', 'rebuilt: <why>')."""
    path = index_path(pattern, spec, index_dir)
    shards = shard_paths(pattern)
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        raise DataError(f"missing shard {missing[0]!r} (of {pattern!r})")
    want = fingerprint(shards, spec)
    status, previous = "built", None
    if os.path.isfile(path) and not rebuild:
        try:
            with open(path) as f:
                obj = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            obj, status = None, f"rebuilt: the old index was unreadable ({e})"
        if obj is not None:
            if obj.get("version") == INDEX_VERSION and obj.get("fingerprint") == want:
                return Index.from_json(obj), "loaded"
            status = "rebuilt: " + _what_changed(obj, shards)
            log.info("index %s is stale; %s", path, status)
            previous = _samples_per_shard(obj)
    _check_writable(path)
    index = build_index(pattern, spec, workers)
    index.shard_lost = estimate_lost(index, previous)
    tmp = f"{path}.{os.getpid()}.tmp"  # concurrent builders each write whole files, then rename
    try:
        with open(tmp, "w") as f:
            json.dump(index.to_json(), f)
        os.replace(tmp, path)
    except OSError as e:
        raise DataError(f"cannot write the data index {path!r}: {e.strerror or e}; set data.index_dir to a writable folder") from None
    return index, status


def _samples_per_shard(obj: dict) -> dict[str, int] | None:
    """Shard -> samples of a stored index (any version that lists shards and entries)."""
    try:
        return dict(Counter(obj["shards"][e[0]] for e in obj["entries"]))
    except (KeyError, IndexError, TypeError):
        return None


def _what_changed(obj: dict, shards: list[str]) -> str:
    """Why a stored index is stale, as far as it tells: the shards whose size or time changed
    (named), else the tokenizer, template or encoders."""
    stored = obj.get("shard_stats") or {}
    changed = [s for s in shards if stored.get(s) != _shard_stat(s)]
    if stored and changed:
        named = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        return f"shard(s) changed since it was written: {named}"
    return "shards, tokenizer, template or encoders changed since it was written"


def _shard_stat(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def load_index(pattern: str, spec: TextSpec, index_dir: str | None = None) -> Index:
    """The current index, or DataError if it is missing or stale (no rebuild)."""
    path = index_path(pattern, spec, index_dir)
    if not os.path.isfile(path):
        raise DataError(f"no data index at {path!r}: run `mimo prepare-data CONFIG`")
    with open(path) as f:
        obj = json.load(f)
    if obj.get("fingerprint") != fingerprint(shard_paths(pattern), spec):
        raise DataError(f"the data index {path!r} is stale (shards, tokenizer, template or encoders changed): run `mimo prepare-data CONFIG`")
    return Index.from_json(obj)

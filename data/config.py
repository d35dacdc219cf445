"""The ``data:`` section of a config, and shard-pattern expansion."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import Literal

from mimo.core.schema import at_least, join_path



@dataclass
class SyntheticData:
    """``data.synthetic``: the shape of the random samples of ``source: synthetic`` (mimo.data.synthetic)."""

    samples_per_microbatch: int | None = None  # None: tokens_per_microbatch // max_sample_tokens (at least 1)
    text_tokens: list[int] | None = None  # [lo, hi] text tokens per sample, uniform; None: [1, what max_sample_tokens leaves]
    images_per_sample: int = 1

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "samples_per_microbatch")
        problems += at_least(self, path, 0, "images_per_sample")
        t = self.text_tokens
        if t is not None and (len(t) != 2 or not 1 <= t[0] <= t[1]):
            problems.append(f"{join_path(path, 'text_tokens')}: must be [lo, hi] with 1 <= lo <= hi, got {t}")
        return problems


@dataclass
class DataConfig:
    source: Literal["webdataset", "synthetic"] = "webdataset"  # synthetic: random samples, no files
    shards: str | None = None  # WebDataset tar files; braces expand: "train-{000000..000031}.tar"
    tokenizer: str | None = None  # a Hugging Face tokenizer directory
    # how conversations become text; tokenizer: the tokenizer's own chat_template, its {% generation %}
    # blocks carrying the loss (mimo.data.text)
    template: Literal["plain", "vicuna", "chatml", "tokenizer"] = "vicuna"
    # where the data index is written (e.g. when the shards are on read-only storage); None: beside the shards
    index_dir: str | None = None
    tokens_per_microbatch: int = 4096  # global (all DP ranks together), layout-independent
    max_sample_tokens: int = 2048  # longer samples are skipped as too long
    # native-resolution towers: at most this many patches (all towers' images, all DP ranks) in a
    # microbatch beside its tokens (a sample with more alone is skipped: "too many patches"); None: no bound
    patches_per_microbatch: int | None = None
    # `mimo train` stops before step 1 when more than this share of the samples would be dropped
    # (bad, too long, lost in a damaged shard: mimo.data.skipped), naming the main reason
    max_skipped_fraction: float = 0.01
    seed: int = 0  # sample order (epochs are reshuffled with seed + epoch)
    shuffle: bool = True
    workers: int = 2  # background reader threads per reading rank
    prefetch: int = 2  # microbatches read ahead per reading rank
    synthetic: SyntheticData = field(default_factory=SyntheticData)  # used by source: synthetic only

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "tokens_per_microbatch", "max_sample_tokens", "workers", "prefetch")
        if self.patches_per_microbatch is not None and self.patches_per_microbatch < 1:
            problems.append(f"{join_path(path, 'patches_per_microbatch')}: at least 1 (or null: no bound), got "
                            f"{self.patches_per_microbatch}")
        if not 0 <= self.max_skipped_fraction <= 1:
            problems.append(f"{join_path(path, 'max_skipped_fraction')}: a share in [0, 1], got {self.max_skipped_fraction}")
        if not problems and self.max_sample_tokens > self.tokens_per_microbatch:
            problems.append(
                f"{join_path(path, 'max_sample_tokens')}: {self.max_sample_tokens} is more than "
                f"tokens_per_microbatch={self.tokens_per_microbatch}; such a sample fits no microbatch"
            )
        if self.source == "webdataset":
            for name in ("shards", "tokenizer"):
                if getattr(self, name) is None:
                    problems.append(f"{join_path(path, name)}: required when data.source is 'webdataset'")
            if self.shards is not None:
                problems += missing_shards(self.shards, join_path(path, "shards"))
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            problems.append(f"{join_path(path, 'tokenizer')}: no directory {self.tokenizer!r}")
        return problems


def expand_braces(pattern: str) -> list[str]:
    """WebDataset-style brace expansion: 'a-{00..02}.tar' -> a-00, a-01, a-02; '{x,y}' alternatives."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        lo, hi = r.group(1), r.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    return [head + c + rest for c in choices for rest in expand_braces(tail)]


def shard_paths(pattern: str) -> list[str]:
    """The shard files a pattern names, in order (braces expanded, globs sorted)."""
    out: list[str] = []
    for name in expand_braces(pattern):
        out.extend(sorted(glob.glob(name)) if glob.has_magic(name) else [name])
    return out


def missing_shards(pattern: str, key: str) -> list[str]:
    names = expand_braces(pattern)
    missing = [n for n in names if not (glob.glob(n) if glob.has_magic(n) else os.path.isfile(n))]
    if len(missing) == len(names):
        return [f"{key}: no file matches {pattern!r}"]
    if missing:  # all of them named (up to a few), so that one look fixes them
        named = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return [f"{key}: {len(missing)} of {len(names)} shards of {pattern!r} are missing: {named}"]
    return []

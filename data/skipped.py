"""What a run does not train on, accounted for: every sample the index marks bad, every sample
longer than ``data.max_sample_tokens``, and every damaged shard with the samples it lost.

One report serves ``prepare-data`` (printed), ``mimo train`` (printed when the index is built or
rebuilt, the full list written to the run directory, and ``data.max_skipped_fraction`` enforced
before step 1) and ``check-config``. The samples a damaged shard lost are not in the index:
they are estimated from that shard's count in the index it replaced, else from the median count
of the intact shards (shards are written at one size); a shard with no estimate still counts as
named, never silently.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from mimo.core.errors import DataError
from mimo.data.index import LOST, Index, reason_kind
from mimo.data.plan import DataPlan


@dataclass(frozen=True)
class Dropped:
    shard: str
    key: str
    reason: str  # the full reason; its kind (text before ':') is the count key


@dataclass
class SkipReport:
    samples: int  # indexed samples plus those damaged shards lost (estimated)
    dropped: list[Dropped] = field(default_factory=list)
    shards: dict[str, str] = field(default_factory=dict)  # damaged shard -> its error
    lost: dict[str, int] = field(default_factory=dict)  # damaged shard -> samples lost (estimated)
    by_reason: dict[str, int] = field(default_factory=dict)  # the plan's counts (DataPlan.skipped_counts)

    @classmethod
    def of(cls, plan: DataPlan, max_sample_tokens: int) -> "SkipReport":
        index: Index = plan.index
        dropped = [Dropped(index.shards[e.shard], e.key, e.bad) for e in index.entries if e.bad]
        dropped += [Dropped(index.shards[index.entries[i].shard], index.entries[i].key,
                            f"too long: {index.entries[i].tokens} tokens > data.max_sample_tokens={max_sample_tokens}")
                    for i in plan.too_long]
        lost = dict(index.shard_lost)
        return cls(len(index.entries) + sum(lost.values()), dropped, dict(index.shard_errors), lost, plan.skipped_counts())

    def counts(self) -> dict[str, int]:
        """Dropped samples per reason kind, most first (the damaged shards' lost samples under ``LOST``)."""
        return dict(Counter(self.by_reason).most_common())

    @property
    def fraction(self) -> float:
        return sum(self.counts().values()) / max(self.samples, 1)

    def lines(self, examples: int = 3) -> list[str]:
        """Per reason its count and the first few samples; every damaged shard by name."""
        out = []
        for kind, count in self.counts().items():
            if kind == LOST:
                continue
            first = [d for d in self.dropped if reason_kind(d.reason) == kind][:examples]
            out.append(f"{kind}: {count} sample(s), e.g. " + "; ".join(f"{d.shard}:{d.key} ({d.reason})" for d in first))
        return out + self.shard_lines()

    def shard_lines(self) -> list[str]:
        """Every damaged shard by name, with its error and the samples it lost."""
        return [f"damaged shard {shard}: {error}; " + (f"about {n} sample(s) lost" if (n := self.lost.get(shard))
                                                        else "samples lost: unknown")
                for shard, error in self.shards.items()]

    def write(self, path: str) -> None:
        """The full list, one JSON object a line (shard, key, reason; damaged shards with their estimate)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for d in self.dropped:
                f.write(json.dumps({"shard": d.shard, "key": d.key, "reason": d.reason}) + "\n")
            for shard, error in self.shards.items():
                f.write(json.dumps({"shard": shard, "key": None, "reason": f"damaged shard: {error}",
                                    "lost_estimate": self.lost.get(shard)}) + "\n")
        os.replace(tmp, path)

    def check(self, max_fraction: float) -> None:
        """DataError when more than ``max_fraction`` of the samples would be dropped, naming the
        main reason (and every damaged shard)."""
        counts = self.counts()
        dropped = sum(counts.values())
        if dropped <= max_fraction * self.samples:
            return
        kind, count = next(iter(counts.items()))
        if kind == LOST:
            main = f"damaged shards lose about {count}: " + "; ".join(f"{s} ({e})" for s, e in self.shards.items())
        else:
            first = next(d for d in self.dropped if reason_kind(d.reason) == kind)
            main = f"{kind} ({count}; e.g. {first.shard}:{first.key}: {first.reason})"
            if self.shards:
                main += "; damaged shards: " + ", ".join(self.shards)
        every = ", ".join(f"{k} {n}" for k, n in counts.items())
        raise DataError(f"data: {dropped} of {self.samples} samples ({self.fraction:.1%}) would be dropped ({every}), more than "
                        f"data.max_skipped_fraction={max_fraction:g}; mainly {main}. Fix the data or the config (or raise "
                        f"data.max_skipped_fraction; `mimo prepare-data CONFIG` lists every dropped sample)")

"""The hybrid LLM's layer pattern: one symbol per layer, optional ``|`` between pipeline stages.

    M  Mamba-2            G  Gated DeltaNet     *  attention
    -  MLP                E  MoE                +  multi-head latent attention (MLA)
    D  DeepSeek sparse attention (DSA: MLA over the keys a lightning indexer picks)
    |  explicit pipeline stage boundary

``"M*-M*-"`` is six layers. With ``|`` the user fixes the stages (their count must equal pp);
without it the layers are split into pp contiguous stages that minimise the largest stage
cost (``LAYER_COST``; an MoE layer costs its active FLOPs, see ``layer_costs``), no stage empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from mimo.core.errors import ConfigError, MimoError

LAYER_KINDS: dict[str, str] = {"M": "mamba", "G": "gdn", "*": "attention", "-": "mlp", "E": "moe", "+": "mla", "D": "dsa"}
STAGE_BOUNDARY = "|"

# Relative cost of one layer of each kind, for the automatic pipeline split. All 1.0 for now:
# at typical sizes the kinds are within a small factor of each other, and a plain layer count
# is what users expect from "balanced". Measured costs can replace these later.
LAYER_COST: dict[str, float] = {"mamba": 1.0, "gdn": 1.0, "attention": 1.0, "mlp": 1.0, "moe": 1.0, "mla": 1.0, "dsa": 1.0}


def layer_costs(arch) -> dict[str, float]:
    """``LAYER_COST`` of one architecture (a ``HybridArch``): an MoE layer costs its active
    parameters (router, topk experts, shared expert, latent projections: what one token's
    FLOPs follow) over those of the dense MLP layer of the same arch, the layer it stands in
    for. E.g. 8 experts, top-2 of inner size ffn/2 and no shared expert cost about 1; a shared
    expert of size ffn adds 1. Other kinds stay 1.0."""
    moe = getattr(arch, "moe", None)
    if moe is None:
        return LAYER_COST
    mlp = (3 if arch.mlp_act == "swiglu" else 2) * arch.hidden * arch.ffn
    active = moe.active_params(arch.hidden)
    if mlp <= 0 or active <= 0:  # sizes that validation reports
        return LAYER_COST
    return {**LAYER_COST, "moe": active / mlp}

_SYMBOL_HELP = ("M (Mamba-2), G (Gated DeltaNet), * (attention), + (multi-head latent attention), - (MLP), E (MoE), "
                "| (stage boundary)")


@dataclass(frozen=True)
class LayerSpec:
    index: int  # 0-based layer number in the whole model
    kind: str  # a value of LAYER_KINDS


@dataclass(frozen=True)
class LayerPattern:
    text: str
    layers: tuple[LayerSpec, ...]
    explicit_stage_sizes: tuple[int, ...] | None  # layers per stage when the text has '|'
    cost: Mapping[str, float] = field(default_factory=lambda: LAYER_COST, compare=False, hash=False)  # per kind, automatic split

    @property
    def kinds(self) -> set[str]:
        return {layer.kind for layer in self.layers}

    def stages(self, pp: int, cost: Mapping[str, float] | None = None) -> list[tuple[LayerSpec, ...]]:
        """The layers of each of the ``pp`` pipeline stages (automatic split: by ``cost``, else
        the pattern's own); ConfigError if that is impossible."""
        n, cost = len(self.layers), self.cost if cost is None else cost
        if self.explicit_stage_sizes is not None:
            sizes = list(self.explicit_stage_sizes)
            if len(sizes) != pp:
                raise ConfigError(
                    f"the pattern {self.text!r} has {len(sizes)} pipeline stages ('|'-separated) "
                    f"but pp is {pp}; make them equal, or drop the '|' to split automatically"
                )
        else:
            if pp > n:
                raise ConfigError(
                    f"pp={pp} pipeline stages need at least {pp} layers, but the pattern "
                    f"{self.text!r} has {n}"
                )
            sizes = balanced_split([cost[layer.kind] for layer in self.layers], pp)
        out, start = [], 0
        for size in sizes:
            out.append(self.layers[start : start + size])
            start += size
        return out


def parse_pattern(text: str, cost: Mapping[str, float] = LAYER_COST) -> LayerPattern:
    """Parse a pattern (``cost``: of each kind, for ``stages``); ConfigError lists every bad
    symbol by its 1-based position."""
    problems = []
    layers: list[LayerSpec] = []
    stage_sizes: list[int] = []
    in_stage = 0
    for pos, symbol in enumerate(text, start=1):
        if symbol == STAGE_BOUNDARY:
            stage_sizes.append(in_stage)
            in_stage = 0
        elif symbol in LAYER_KINDS:
            layers.append(LayerSpec(len(layers), LAYER_KINDS[symbol]))
            in_stage += 1
        else:
            problems.append(f"unknown symbol {symbol!r} at position {pos} of {text!r}; symbols: {_SYMBOL_HELP}")
    stage_sizes.append(in_stage)
    if not layers and not problems:
        problems.append(f"the pattern {text!r} has no layers; symbols: {_SYMBOL_HELP}")
    explicit = STAGE_BOUNDARY in text
    if explicit and layers:
        empty = [i + 1 for i, size in enumerate(stage_sizes) if size == 0]
        if empty:
            problems.append(
                f"pipeline stage {', '.join(map(str, empty))} of {text!r} is empty; "
                f"every '|'-separated stage needs at least one layer"
            )
    if problems:
        raise ConfigError(problems)
    return LayerPattern(text, tuple(layers), tuple(stage_sizes) if explicit else None, cost)


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous non-empty blocks of ``costs`` minimising the largest block sum.

    Among the splits with that smallest maximum, the most even one (least sum of squared block
    costs) is taken, and of those the one with the lightest later blocks (the last stage also
    carries the output head and the loss). Dynamic programming over prefixes, O(parts * n^2):
    patterns have at most a few hundred layers.
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise ConfigError(f"cannot split {n} layers into {parts} non-empty pipeline stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    block = lambda j, i: prefix[i] - prefix[j]  # noqa: E731  cost of layers j..i-1
    inf = float("inf")
    tol = 1e-9 * max(1.0, prefix[n])

    def table(score, combine):
        # t[k][i]: best score of the first i layers as k blocks
        t = [[inf] * (n + 1) for _ in range(parts + 1)]
        t[0][0] = 0.0
        for k in range(1, parts + 1):
            for i in range(k, n + 1):
                t[k][i] = min(combine(t[k - 1][j], score(j, i)) for j in range(k - 1, i))
        return t

    largest = table(block, max)[parts][n]
    # second pass: evenness, over the blocks that respect the optimal maximum
    even = table(lambda j, i: block(j, i) ** 2 if block(j, i) <= largest + tol else inf, lambda a, b: a + b)
    sizes, i = [], n
    for k in range(parts, 0, -1):  # walk back from the last stage, preferring short last blocks
        target = even[k][i]
        j = max(
            j for j in range(k - 1, i)
            if block(j, i) <= largest + tol and even[k - 1][j] + block(j, i) ** 2 <= target + tol * max(1.0, target)
        )
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def with_stages(blocks: Sequence[str], stages: Iterable[int] | None) -> str:
    """The pattern of ``blocks`` (the symbols of each Hugging Face decoder layer, or one symbol
    per layer), with ``|`` after each stage's blocks (``stages``: blocks per stage, as an
    importer's ``pattern_stages``; None: no boundaries)."""
    if stages is None:
        return "".join(blocks)
    sizes = list(stages)
    if sum(sizes) != len(blocks):
        raise MimoError(f"stage sizes {sizes} do not add up to the {len(blocks)} decoder layers")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return "|".join("".join(blocks[s : s + n]) for s, n in zip(starts, sizes))

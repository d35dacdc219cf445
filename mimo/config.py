"""The whole run's config: YAML -> overrides -> dataclasses -> every problem, before any process.

Each component owns its section's dataclass (``mimo.encoders.config``, ``mimo.llm.config``,
``mimo.grid.ParallelConfig``); this module adds the data and train sections and the checks
that span modules: rank ranges against the world and against each other, placeholders,
data sizes against the LLM. Relative paths in the config are relative to the working
directory of the process (as every command resolves them).
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import itertools
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from mimo.encoders.config import EncoderModuleConfig
from mimo.errors import ConfigError, LayoutError
from mimo.llm.config import LLMModuleConfig
from mimo.schema import apply_overrides, at_least, convert, join_path, load_yaml, validate_tree

ModuleConfig = EncoderModuleConfig | LLMModuleConfig

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


@dataclass
class DataConfig:
    source: Literal["webdataset", "synthetic"] = "webdataset"  # synthetic: random samples, no files
    shards: str | None = None  # WebDataset tar files; braces expand: "train-{000000..000031}.tar"
    tokenizer: str | None = None  # a Hugging Face tokenizer directory
    tokens_per_microbatch: int = 4096  # global (all DP ranks together), layout-independent
    max_sample_tokens: int = 2048  # longer samples are skipped as too long
    seed: int = 0

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "tokens_per_microbatch", "max_sample_tokens")
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
                problems += _missing_shards(self.shards, join_path(path, "shards"))
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            problems.append(f"{join_path(path, 'tokenizer')}: no directory {self.tokenizer!r}")
        return problems


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    every: int | None = None  # steps between checkpoints; None: only at the end of training
    keep: int | None = None  # how many recent checkpoints to keep; None: all

    def validate(self, path: str) -> list[str]:
        return at_least(self, path, 1, "every", "keep")


@dataclass
class TrainConfig:
    micro_batches: int = 1  # global microbatches per step
    steps: int = 100
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    grad_clip: float | None = 1.0  # max global gradient norm; None: no clipping
    seed: int = 0  # parameter initialisation and dropout
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "micro_batches", "steps")
        problems += at_least(self, path, 0, "weight_decay", "warmup_steps")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{join_path(path, name)}: must be > 0, got {value}")
        return problems


@dataclass
class MimoConfig:
    world_size: int
    modules: dict[str, ModuleConfig]
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    # ---- views ----
    @property
    def llm_name(self) -> str:
        return next(name for name, m in self.modules.items() if isinstance(m, LLMModuleConfig))

    @property
    def llm(self) -> LLMModuleConfig:
        return self.modules[self.llm_name]

    @property
    def encoders(self) -> dict[str, EncoderModuleConfig]:
        return {name: m for name, m in self.modules.items() if isinstance(m, EncoderModuleConfig)}

    def rank_range(self, name: str) -> range:
        return self.modules[name].parallel.rank_range(self.world_size)

    def layout_rows(self) -> list[dict[str, Any]]:
        """One row per module: module, kind, ranks, tp, cp, dp, pp, colocated_with."""
        rows = []
        for name, module in self.modules.items():
            par, ranks = module.parallel, self.rank_range(name)
            rows.append(
                {
                    "module": name,
                    "kind": module.kind,
                    "ranks": f"{ranks.start}:{ranks.stop}",
                    "tp": par.tp,
                    "cp": par.cp,
                    "dp": par.dp,
                    "pp": par.pp,
                    "colocated_with": [o for o in self.modules if o != name and self.rank_range(o) == ranks],
                }
            )
        return rows

    def as_dict(self) -> dict[str, Any]:
        """Plain data (defaults filled in), e.g. to record beside a checkpoint."""
        return dataclasses.asdict(self)

    # ---- checks spanning modules (each module checked itself already) ----
    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "world_size")
        problems += self._module_set()
        if not problems:
            problems += self._rank_ranges()
        placeholders: dict[str, str] = {}
        for name, enc in self.encoders.items():
            other = placeholders.setdefault(enc.placeholder, name)
            if other != name:
                problems.append(
                    f"modules.{name}.placeholder: {enc.placeholder!r} is already the placeholder of "
                    f"modules.{other}; each encoder needs its own"
                )
        llms = [name for name, m in self.modules.items() if isinstance(m, LLMModuleConfig)]
        if len(llms) == 1:
            max_len = self.modules[llms[0]].arch.max_seq_len
            if self.data.max_sample_tokens > max_len:
                problems.append(
                    f"data.max_sample_tokens: {self.data.max_sample_tokens} is more than "
                    f"modules.{llms[0]}.arch.max_seq_len={max_len}"
                )
        return problems

    def _module_set(self) -> list[str]:
        problems = [
            f"modules.{name}: module names must be letters, digits, '_' or '-' (they appear in key paths)"
            for name in self.modules
            if not _MODULE_NAME.match(name)
        ]
        llms = [name for name, m in self.modules.items() if isinstance(m, LLMModuleConfig)]
        if len(llms) != 1:
            found = ", ".join(llms) if llms else "none"
            problems.append(f"modules: needs exactly one LLM module (kind: hybrid); found {found}")
        return problems

    def _rank_ranges(self) -> list[str]:
        problems, ranges = [], {}
        for name, module in self.modules.items():
            par, key = module.parallel, f"modules.{name}.parallel"
            try:
                ranks = par.rank_range(self.world_size)
            except LayoutError:
                continue  # reported by ParallelConfig.validate
            if ranks.stop > self.world_size:
                problems.append(f"{key}.ranks: {par.ranks!r} exceeds world_size={self.world_size} (ranks 0:{self.world_size})")
                continue
            ranges[name] = ranks
            if min(par.tp, par.cp, par.dp, par.pp) >= 1 and par.size != len(ranks):
                where = f"ranks {par.ranks!r} hold" if par.ranks is not None else "the whole world (no parallel.ranks) holds"
                problems.append(
                    f"{key}: tp*cp*dp*pp = {par.tp}*{par.cp}*{par.dp}*{par.pp} = {par.size}, "
                    f"but {where} {len(ranks)} ranks"
                )
        for (a, ra), (b, rb) in itertools.combinations(ranges.items(), 2):
            shared = set(ra) & set(rb)
            if shared and ra != rb:
                problems.append(
                    f"modules.{b}.parallel.ranks: {_show_range(rb)} partially overlaps modules.{a}.parallel.ranks "
                    f"{_show_range(ra)}; two modules share either all their ranks (colocated) or none"
                )
        used = set().union(*ranges.values()) if ranges else set()
        unused = [r for r in range(self.world_size) if r not in used]
        if unused and len(ranges) == len(self.modules):
            which = f"ranks {_compress(unused)} are" if len(unused) > 1 else f"rank {unused[0]} is"
            problems.append(
                f"world_size: {which} used by no module (world_size={self.world_size}); "
                f"shrink world_size or widen a module's parallel.ranks"
            )
        return problems


# ---------------------------------------------------------------- loading


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> MimoConfig:
    """Read a YAML config, apply dotted ``key=value`` overrides, convert and validate it.

    Raises ConfigError listing every problem, each naming its key path.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    return config_from_dict(load_yaml(text, source=str(path)), overrides, source=str(path))


def config_from_dict(raw: Any, overrides: Iterable[str] = (), source: str = "config") -> MimoConfig:
    """Like ``load_config`` for already-parsed YAML (``raw`` is not modified)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    problems = apply_overrides(raw, overrides, MimoConfig)
    config, more = convert(MimoConfig, raw)
    problems += more
    if config is not None:
        problems += validate_tree(config)
    if problems:
        raise ConfigError(problems)
    return config


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


def _missing_shards(pattern: str, key: str) -> list[str]:
    names = expand_braces(pattern)
    missing = [n for n in names if not (glob.glob(n) if glob.has_magic(n) else os.path.isfile(n))]
    if len(missing) == len(names):
        return [f"{key}: no file matches {pattern!r}"]
    if missing:
        return [f"{key}: {len(missing)} of {len(names)} shards of {pattern!r} are missing, e.g. {missing[0]!r}"]
    return []


def _show_range(r: range) -> str:
    return f"'{r.start}:{r.stop}'"


def _compress(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0:3, 5'."""
    parts = []
    for _, group in itertools.groupby(enumerate(ranks), key=lambda iv: iv[1] - iv[0]):
        run = [r for _, r in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}:{run[-1] + 1}")
    return ", ".join(parts)


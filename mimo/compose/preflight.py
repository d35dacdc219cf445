"""What a run loads, checked before any process starts: ``check_inputs(config)`` (issue 53).

A valid config may still name inputs that fail only once ``mimo train`` has started its ranks:
an ``init.hf`` checkpoint of another family or other sizes, a tokenizer folder without a
tokenizer, shards whose samples the index would drop (a placeholder typo drops every
conversation). ``check_inputs`` loads what it can of them without starting anything, each
check by the same code the late path runs:

* ``init.hf`` of every module: an encoder's by ``mimo.encoders.hf_import.check_hf`` (the
  import's checks on meta tensors), the LLM's by ``mimo.llm.hf.check_hf_checkpoint`` (what
  ``load_hf_checkpoint`` checks on every rank); config.json and the safetensors headers only,
  no tensor is read. A LLaVA directory is read by both (its tower, its language model).
* the tokenizer (``data.source: webdataset``): loaded as the pipeline loads it, without torch
  where it has ``tokenizer.json`` (``mimo.data.tokenizer.read_tokenizer``); what the config
  asks of it (vocab, special tokens, template markers) is checked when the config loads
  (``config_tokenizer_problems``), a folder without tokenizer files included.
* ``lora.init`` of every module: the PEFT directory read as the ranks read it, and every
  adapter in it read by some module of the run (``_check_lora_init``).
* a config with a native-resolution encoder (``kind: qwen3_vl``) gets no data check: its one
  problem (``MimoConfig.trainable_problems``) is reported instead, after the ``init.hf`` checks.
* a sample of the shards: the first samples of each shard (up to ``SAMPLES`` in all, spread
  over the shards), each validated as the indexer does (``mimo.data.index.index_sample``),
  and samples over ``data.max_sample_tokens`` counted as the plan does. The dropped share
  is reported per reason; above ``data.max_skipped_fraction`` it is an error naming the
  main reason. A placeholder in the samples' text that no encoder has is named as such.

Each check prints one line through ``echo`` as it finishes; every problem is collected and
raised together as one ``ConfigError``. Only the ``init.hf`` checks import torch (the
importers' own code); the tokenizer and shard checks stay torch-free.

``mimo check-config`` calls it after validating the config; ``mimo train``'s launcher calls it
before indexing and starting ranks, without the shard sample (``samples=0``: the index it
builds reads every sample, and ``mimo.data.skipped`` accounts for them).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from mimo.compose.config import MimoConfig
from mimo.core.errors import ConfigError, DataError, MimoError
from mimo.data.config import shard_paths
from mimo.compose.data_spec import rows_per_image, text_spec
from mimo.data.index import TextSpec, index_sample
from mimo.data.shards import parse_text, read_files, scan_shard
from mimo.data.text import COUNTS_DIFFER, TextEncoder
from mimo.data.tokenizer import facts_of, read_tokenizer
from mimo.encoders.config import EncoderModuleConfig, NativeEncoderModuleConfig
from mimo.llm.config import LLMModuleConfig

SAMPLES = 200  # shard samples read at most
_TAG = re.compile(r"<[A-Za-z_][\w.-]{0,31}>")  # what a placeholder looks like: <image>, <img>, <video_1>


@dataclass
class InputsReport:
    """One line per check (``lines``), every problem (``problems``: ConfigError's), and what
    each check found (``init_hf`` by module, ``tokenizer``, ``shards``), as ``as_dict`` gives them."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    init_hf: dict[str, dict[str, Any]] = field(default_factory=dict)
    lora_init: dict[str, dict[str, Any]] = field(default_factory=dict)  # by directory
    tokenizer: dict[str, Any] | None = None
    shards: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"init_hf": self.init_hf, "lora_init": self.lora_init, "tokenizer": self.tokenizer, "shards": self.shards,
                "problems": list(self.problems)}

    def raise_problems(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)


def check_inputs(config: MimoConfig, samples: int = SAMPLES, echo: Callable[[str], Any] | None = None,
                 raise_errors: bool = True) -> InputsReport:
    """Check what ``config`` loads (module doc): a line per check through ``echo`` as it
    finishes; ConfigError listing every problem (unless ``raise_errors`` is false: then they
    are in the report's ``problems``)."""
    report = InputsReport()

    def line(text: str) -> None:
        report.lines.append(text)
        if echo is not None:
            echo(text)

    for name, module in config.modules.items():
        if module.init.hf is None:
            continue
        key = f"modules.{name}.init.hf"
        try:
            info = (_check_encoder_hf(module, key) if isinstance(module, (EncoderModuleConfig, NativeEncoderModuleConfig))
                    else _check_llm_hf(module, key))
        except Exception as e:  # noqa: BLE001 - foreign files: a broken one is a problem to report, never a traceback
            message = str(e) if isinstance(e, MimoError) else f"cannot read it as a checkpoint ({type(e).__name__}: {e})"
            report.init_hf[name] = {"ok": False, "path": module.init.hf, "error": message}
            report.problems.append(_naming(key, module.init.hf, message))
            line(f"init.hf modules.{name}: FAILED")
            continue
        report.init_hf[name] = {"ok": True, "path": module.init.hf, **info}
        line(f"init.hf modules.{name}: ok ({info['summary']})")
        for note in info.get("notes", ()):
            line(f"  note: {note}")
    _check_lora_init(config, report, line)
    native = config.trainable_problems()
    if native:  # no data path for a native-resolution encoder yet: one line, no data check
        report.problems += native
        line(f"data: FAILED ({len(native)} native-resolution encoder{'s' if len(native) > 1 else ''}: no data path yet)")
    elif config.data.source == "webdataset" and config.data.tokenizer and config.data.shards:
        encoder = _check_tokenizer(config, report, line)
        if encoder is not None and samples:  # samples=0: `mimo train`, whose index reads every sample
            _check_shards(config, encoder, samples, report, line)
    if raise_errors:
        report.raise_problems()
    return report


def _naming(key: str, path: str, message: str) -> str:
    """``key: message``, key and directory named once (the importers' messages mostly name the directory)."""
    if message.startswith(key):
        return message
    return f"{key}: {message}" if path in message else f"{key}: {path!r}: {message}"


# ---------------------------------------------------------------- init.hf


def _layers(n: int) -> str:
    return f"{n} layer{'' if n == 1 else 's'}"


def _check_encoder_hf(enc: EncoderModuleConfig | NativeEncoderModuleConfig, key: str) -> dict[str, Any]:
    if enc.native:
        from mimo.encoders.config import NATIVE_TOWERS

        weights = NATIVE_TOWERS[enc.kind].hf_module().import_hf(enc.init.hf, enc.arch, shapes_only=True)
        whole = weights.meta["config"].get("model_type")
        return {"summary": f"{whole}'s vision tower, {enc.arch.depth} blocks, {len(enc.arch.deepstack_layers)} deepstack "
                           f"levels", "family": enc.kind, "model_type": whole, "layers": enc.arch.depth, "notes": []}
    from mimo.encoders.hf_import import check_hf

    weights = check_hf(enc.init.hf, enc.arch)
    family = weights.meta.get("family")
    whole = (weights.meta.get("config") or {}).get("model_type")
    what = f"{whole}'s {family} tower" if whole not in (None, f"{family}_vision_model", family) else family
    notes = [f"position embedding resampled {a} -> {b} ({key} is at another image size)" for a, b in weights.resampled.values()]
    return {"summary": f"{what}, {_layers(enc.arch.layers)}", "family": family, "model_type": whole,
            "layers": enc.arch.layers, "notes": notes}


def _check_llm_hf(llm: LLMModuleConfig, key: str) -> dict[str, Any]:
    from mimo.llm.hf import check_hf_checkpoint

    checked = check_hf_checkpoint(llm.arch, llm.init.hf, source=f"{key}: {llm.init.hf!r}")
    what = f"llava: {checked.model_type}" if checked.llava else checked.model_type
    return {"summary": f"{what}, {_layers(checked.layers)}", "model_type": checked.model_type, "llava": checked.llava,
            "layers": checked.layers, "notes": list(checked.differences)}


# ---------------------------------------------------------------- tokenizer


def _check_lora_init(config: MimoConfig, report: InputsReport, line) -> None:
    """Each PEFT directory some module's ``lora.init`` names, read by every module naming it as
    its ranks will read it (``compose.adapters``); an adapter of it that no module reads (the
    tower's, where only the LLM names the directory) is a problem: nothing is dropped silently."""
    by_dir: dict[str, list[str]] = {}
    for name, module in config.modules.items():
        if module.lora is not None and module.lora.init:
            by_dir.setdefault(os.path.realpath(module.lora.init), []).append(name)
    if not by_dir:
        return
    from mimo.compose.adapters import adapter_layout
    from mimo.compose.peft import module_row_blocks, peft_modules, read_peft_modules

    for directory, names in by_dir.items():
        try:
            used: set[str] = set()
            for name in names:
                cfg, llm = config.modules[name], name == config.llm_name
                used |= read_peft_modules(directory, name, adapter_layout(cfg, name, llm), module_row_blocks(cfg, llm))[1]
            unread = [m for m in peft_modules(directory) if m not in used]
            if unread:
                raise MimoError(f"lora.init {directory}: adapts {', '.join(unread[:3])}{' ...' if len(unread) > 3 else ''}, "
                                f"which no module of the run reads ({', '.join(f'modules.{n}' for n in names)} "
                                f"{'names' if len(names) == 1 else 'name'} it): give the module they belong to the same "
                                f"lora.init and targets")
        except Exception as e:  # noqa: BLE001 - a foreign directory: a problem to report, never a traceback
            message = str(e) if isinstance(e, MimoError) else f"cannot read it ({type(e).__name__}: {e})"
            report.lora_init[directory] = {"ok": False, "modules": names, "error": message}
            report.problems.append(message)
            line(f"lora.init {directory}: FAILED")
            continue
        report.lora_init[directory] = {"ok": True, "modules": names, "adapted": len(used)}
        line(f"lora.init {directory}: ok ({len(used)} adapted modules read by {', '.join(names)})")


def _check_tokenizer(config: MimoConfig, report: InputsReport, line) -> TextEncoder | None:
    """The tokenizer loaded as the pipeline loads it (torch-free with tokenizer.json), and the
    pipeline's text encoder over it; None (a problem reported) if it does not load."""
    path = config.data.tokenizer
    try:
        tokenizer = read_tokenizer(path)
        encoder = text_spec(config).text_encoder(tokenizer)
    except DataError as e:
        message = str(e)
        report.problems.append(message if message.startswith("data.tokenizer") else f"data.tokenizer: {message}")
        report.tokenizer = {"ok": False, "path": path, "error": message}
        line("tokenizer: FAILED")
        return None
    facts = facts_of(tokenizer)
    own = {p: facts.single_id(p) is not None for p in rows_per_image(config)}
    report.tokenizer = {"ok": True, "path": path, "tokens": facts.size, "template": config.data.template,
                        "placeholder_tokens": own}
    shown = ", ".join(f"{p!r} {'one token' if single else 'not one token (image positions take the pad id)'}"
                      for p, single in own.items())
    line(f"tokenizer: ok ({facts.size} tokens, template {config.data.template}" + (f"; {shown}" if shown else "") + ")")
    return encoder


# ---------------------------------------------------------------- shards


@dataclass
class ShardSample:
    """What the first samples of the shards say: each sample's verdict (None: usable), the
    damaged shards read, and per failing sample the tags in its text no encoder has."""

    shards: int  # in data.shards
    read: int = 0  # shards sampled
    verdicts: list[tuple[str, str, str | None]] = field(default_factory=list)  # (shard, key, reason or None)
    damaged: dict[str, str] = field(default_factory=dict)  # shard -> error
    stray_tags: Counter = field(default_factory=Counter)  # tag -> failing (counts differ) samples that use it
    counts_differ: int = 0  # samples failing with COUNTS_DIFFER

    @property
    def sampled(self) -> int:
        return len(self.verdicts)

    def dropped(self) -> list[tuple[str, str, str]]:
        return [(s, k, r) for s, k, r in self.verdicts if r is not None]

    def by_reason(self) -> dict[str, int]:
        """Dropped samples per reason kind (the text before ':', as the index counts), most first."""
        return dict(Counter(r.split(":", 1)[0] for _, _, r in self.dropped()).most_common())


def _chosen(shards: list[str], samples: int) -> tuple[list[str], int]:
    """(shards to read, samples from each): every shard's first few, or where there are more
    shards than samples, one from each of ``samples`` shards spread over them."""
    if len(shards) >= samples:
        return [shards[i * len(shards) // samples] for i in range(samples)], 1
    return shards, math.ceil(samples / len(shards))


def _text_of(files: dict[str, bytes]) -> str:
    try:
        kind, text = parse_text(files)
    except DataError:
        return ""
    if kind == "txt":
        return text
    turns = text.get("conversations") if isinstance(text, dict) else None
    return "\n".join(t["value"] for t in turns or () if isinstance(t, dict) and isinstance(t.get("value"), str))


def sample_shards(pattern: str, encoder: TextEncoder, spec: TextSpec, max_sample_tokens: int,
                  samples: int = SAMPLES) -> ShardSample:
    """The first samples of the shards of ``pattern`` (``_chosen``), each validated as the
    indexer validates it (``index_sample``; a cut tar's last sample takes the tar's error, as
    there) and counted too long as the plan counts it. A shard that yields no sample at all
    counts the samples asked of it as dropped, with its error."""
    shards = [s for s in shard_paths(pattern) if os.path.isfile(s)]
    out = ShardSample(len(shards))
    if not shards or samples < 1:
        return out
    chosen, per = _chosen(shards, samples)
    for path in chosen:
        if out.sampled >= samples:
            break
        want = min(per, samples - out.sampled)
        locations, error = scan_shard(path, limit=want)
        out.read += 1
        if error is not None:
            out.damaged[path] = error
            if not locations:
                out.verdicts += [(path, "?", error)] * want
                continue
        for i, loc in enumerate(locations):
            reason, files = None, {}
            try:
                files = read_files(path, loc)
                sample, _, _ = index_sample(files, encoder, spec)
                tokens = len(sample)
                if tokens > max_sample_tokens:
                    reason = f"too long: {tokens} tokens > data.max_sample_tokens={max_sample_tokens}"
            except DataError as e:
                reason = str(e)
                if reason.startswith(COUNTS_DIFFER):
                    out.counts_differ += 1
                    out.stray_tags.update({t for t in _TAG.findall(_text_of(files)) if t not in spec.placeholders})
            if error is not None and i == len(locations) - 1:
                reason = error if reason is None else f"{error} ({reason})"
            out.verdicts.append((path, loc.key, reason))
    return out


def stray_placeholder(sample: ShardSample, config: MimoConfig) -> str | None:
    """The placeholder the samples' text uses that no encoder has (a typo in the config or the
    data), when it explains at least half of the samples whose placeholder and image counts
    differ; None otherwise."""
    if not sample.stray_tags:
        return None
    tag, n = sample.stray_tags.most_common(1)[0]
    if 2 * n < sample.counts_differ:
        return None
    have = ", ".join(f"modules.{name}.placeholder is {e.placeholder!r}" for name, e in config.encoders.items())
    fix = ""
    if len(config.encoders) == 1:
        fix = f" (set modules.{next(iter(config.encoders))}.placeholder: {tag!r}, or fix the data)"
    return (f"the samples' text uses {tag!r} ({n} of {sample.sampled} sampled), no encoder has that placeholder: "
            f"{have or 'the config has no encoder'}{fix}")


def _check_shards(config: MimoConfig, encoder: TextEncoder, samples: int, report: InputsReport, line) -> None:
    d = config.data
    limit = d.max_skipped_fraction
    sample = sample_shards(d.shards, encoder, text_spec(config), d.max_sample_tokens, samples)
    dropped = sample.dropped()
    share = len(dropped) / sample.sampled if sample.sampled else 0.0
    counts = sample.by_reason()
    stray = stray_placeholder(sample, config)
    report.shards = {"sampled": sample.sampled, "shards_read": sample.read, "shards": sample.shards,
                     "dropped": len(dropped), "fraction": share, "by_reason": counts, "damaged": dict(sample.damaged),
                     "max_skipped_fraction": limit, "stray_placeholder": stray}
    if not sample.sampled:
        report.problems.append(f"data.shards: no sample in {sample.shards} shard(s) of {d.shards!r}")
        line("shards: FAILED (no sample)")
        return
    where = f"{sample.read} of {sample.shards} shards" if sample.read < sample.shards else f"{sample.shards} shard(s)"
    found = f"{sample.sampled} sampled from {where}, {share:.1%} would be dropped"
    if share > limit:
        kind = next(iter(counts))
        shard, key, reason = next(x for x in dropped if x[2].split(":", 1)[0] == kind)
        example = f"{kind}: {counts[kind]}, e.g. {shard}:{key}: {reason}"
        main = f"{stray} ({example})" if stray and kind == COUNTS_DIFFER else example
        damaged = "; damaged shards: " + ", ".join(sample.damaged) if sample.damaged else ""
        report.problems.append(
            f"data.shards: {len(dropped)} of {sample.sampled} sampled samples ({share:.1%}) would be dropped, more than "
            f"data.max_skipped_fraction={limit:g}; mainly {main}{damaged}. Fix the data or the config (or raise "
            f"data.max_skipped_fraction; `mimo prepare-data CONFIG` indexes every sample and lists the dropped ones)")
        line(f"shards: FAILED ({found})")
        return
    detail = ", ".join(f"{k}: {n}" for k, n in counts.items())
    line(f"shards: {found}" + (f" ({detail})" if detail else ""))
    if stray:
        line(f"  note: {stray}")

"""What the data pipeline needs of a tokenizer, checked before anything starts.

``tokenizer_problems`` lists every mismatch between a tokenizer and a config: an LLM vocab
smaller than the tokenizer (ids past the embedding), a missing or multi-token special token the
template needs, template markers that are not single tokens, a ``template: tokenizer`` without a
chat template or without ``{% generation %}`` marks. ``special_ids`` gives the ids the pipeline
uses: the id at image positions (the placeholder's own token, else pad, else eos; the LLM
replaces those embeddings with image rows, so any real token works, never an arbitrary 0) and
the padding id (pad, else eos).

``read_tokenizer`` reads a tokenizer directory with the ``tokenizers`` library and its JSON
files only (check-config must not import torch, which transformers does) into a ``FileTokenizer``:
what the pipeline's ``TextEncoder`` uses of a Hugging Face fast tokenizer, so check-config can
tokenize sample shards as the index does. ``read_facts`` gives its facts (a directory without
``tokenizer.json`` is loaded with transformers); ``facts_of`` gives the same facts of a loaded
Hugging Face tokenizer (what the pipeline uses). A directory with no tokenizer files at all is
one clear error when loaded (``missing_tokenizer_files``: by check-config and by the run), naming
the files expected.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mimo.core.errors import DataError

SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TokenizerFacts:
    size: int  # ids 0..size-1 (len(tokenizer): added tokens included)
    specials: dict[str, str]  # e.g. {"eos_token": "</s>"}: the special tokens that are set
    chat_template: str | None
    encode: Callable[[str], list[int]] = field(compare=False)  # ids of a text, no special tokens added

    def single_id(self, text: str) -> int | None:
        """The id of ``text`` when it is exactly one token, else None."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None


@dataclass(frozen=True)
class SpecialIds:
    image: dict[str, int]  # placeholder -> the token id at its image positions
    pad: int


def facts_of(tokenizer) -> TokenizerFacts:
    """The facts of a loaded Hugging Face tokenizer."""
    specials = {k: getattr(tokenizer, k) for k in SPECIALS if isinstance(getattr(tokenizer, k, None), str)}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    size = max([len(tokenizer), *(i + 1 for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})])
    return TokenizerFacts(size, specials, template, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])


class FileTokenizer:
    """A ``tokenizer.json`` directory read with the ``tokenizers`` library (no transformers, no
    torch), with what the pipeline uses of a Hugging Face fast tokenizer: the special tokens
    (``eos_token``, ``bos_token_id``, ``special_tokens_map``), ``chat_template``,
    ``added_tokens_decoder``, ``len()``, ``backend_tokenizer`` and ``tok(text,
    add_special_tokens=False)["input_ids"]``. Token ids are the backend's, as the fast tokenizer's."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        try:
            self.backend_tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
            config = _read_json(os.path.join(path, "tokenizer_config.json"))
            special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers and json raise many kinds; the user needs the path
            raise DataError(f"cannot load a tokenizer from {path!r}: {e}") from None
        self.special_tokens_map: dict[str, str] = {}
        for key in SPECIALS:
            value = config.get(key, special_map.get(key))
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                self.special_tokens_map[key] = value
        self.added_tokens_decoder = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()}
        self.chat_template = _chat_template(path, config)

    def __getattr__(self, name: str):  # bos_token, eos_token, ...: None where unset, as transformers has it
        if name in SPECIALS:
            return self.special_tokens_map.get(name)
        if name.endswith("_token_id") and name[: -len("_id")] in SPECIALS:
            text = self.special_tokens_map.get(name[: -len("_id")])
            return None if text is None else self.backend_tokenizer.token_to_id(text)
        raise AttributeError(name)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}


def read_tokenizer(path: str):
    """The directory's tokenizer as the pipeline uses it: a ``FileTokenizer`` (no torch) where it
    has ``tokenizer.json``, else loaded with transformers (which imports torch)."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return FileTokenizer(path)
    return load_tokenizer(path)


def read_facts(path: str) -> TokenizerFacts:
    """The facts of a tokenizer directory, without transformers where it has ``tokenizer.json``."""
    return facts_of(read_tokenizer(path))


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _chat_template(path: str, config: dict) -> str | None:
    """Where transformers keeps it: chat_template.jinja, chat_template.json, or tokenizer_config.json."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def special_ids(facts: TokenizerFacts, placeholders: Sequence[str], where: str = "data.tokenizer") -> tuple[SpecialIds | None, list[str]]:
    """The pipeline's ids (module doc), or None and what is missing."""
    pad = next((i for i in (_special_id(facts, "pad_token"), _special_id(facts, "eos_token")) if i is not None), None)
    problems = [] if pad is not None else [f"{where}: has neither a pad_token nor an eos_token (one token each); "
                                           "packing pads with one of them: set pad_token in its tokenizer_config.json"]
    image = {}
    for p in placeholders:
        own = facts.single_id(p)
        image[p] = own if own is not None else pad
    return (SpecialIds(image, pad) if pad is not None else None), problems


def _special_id(facts: TokenizerFacts, key: str) -> int | None:
    text = facts.specials.get(key)
    return facts.single_id(text) if text else None


def tokenizer_problems(facts: TokenizerFacts, template: str, placeholders: Sequence[str], vocab: int | None = None,
                       vocab_key: str = "arch.vocab", where: str = "data.tokenizer") -> list[str]:
    """Every mismatch between the tokenizer and what the config asks of it (module doc)."""
    problems = []
    if vocab is not None and facts.size > vocab:
        problems.append(f"{vocab_key}: {vocab} is less than the tokenizer's {facts.size} tokens ({where}, added tokens "
                        f"included); ids up to {facts.size - 1} would index past the embedding: set {vocab_key} >= {facts.size}")
    for key, text in facts.specials.items():
        if key != "unk_token" and facts.single_id(text) is None:
            problems.append(f"{where}: its {key} {text!r} is not one token (it encodes to {facts.encode(text)})")
    if template in ("plain", "vicuna") and "eos_token" not in facts.specials:
        problems.append(f"{where}: has no eos_token; template {template!r} ends every answer with it (so the model learns "
                        f"to stop): set eos_token in its tokenizer_config.json")
    if template == "chatml":
        for marker in CHATML_MARKERS:
            if facts.single_id(marker) is None:
                problems.append(f"{where}: template 'chatml' needs {marker!r} as one token, the tokenizer encodes it to "
                                f"{facts.encode(marker)}; add it as a special token or pick another data.template")
    if template == "tokenizer":
        if not facts.chat_template:
            problems.append(f"{where}: data.template is 'tokenizer' but the tokenizer has no chat_template; pick plain, "
                            f"vicuna or chatml, or save one with the tokenizer")
        elif not GENERATION_MARK.search(facts.chat_template):
            problems.append(f"{where}: data.template is 'tokenizer' but its chat_template has no {{% generation %}} ... "
                            f"{{% endgeneration %}} around the assistant's text, so which tokens carry the loss is unknown; "
                            f"add them, or pick plain, vicuna or chatml")
    problems += special_ids(facts, placeholders, where)[1]
    return problems


# what AutoTokenizer loads a tokenizer from: tokenizer.json (fast), or a vocabulary file of a slow one
# (sentencepiece's tokenizer.model / spiece.model, BPE's vocab.json + merges.txt, WordPiece's vocab.txt;
# any *.model, *.tiktoken or vocab.* counts, so that no rarer layout is refused)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def _is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_FILES or name.endswith((".model", ".tiktoken")) or name.startswith("vocab.")


def missing_tokenizer_files(path: str) -> str | None:
    """What is wrong with a tokenizer directory that holds no tokenizer file (None if it holds
    one): the files expected and those it has, instead of the complaint transformers makes about
    whatever tokenizer class it falls back to (sentencepiece, typically)."""
    try:
        found = sorted(os.listdir(path))
    except OSError:
        found = []
    if any(_is_tokenizer_file(f) and os.path.isfile(os.path.join(path, f)) for f in found):
        return None
    has = (f"it holds {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}" if found else "it is empty")
    return (f"{path!r} holds no tokenizer: expected tokenizer.json (what a fast tokenizer's save_pretrained writes), "
            f"or a slow tokenizer's tokenizer_config.json with its vocabulary (tokenizer.model, vocab.json + merges.txt, "
            f"or vocab.txt); {has}")


def config_tokenizer_problems(tokenizer: str | None, template: str, placeholders: Sequence[str], vocab: int,
                              vocab_key: str) -> list[str]:
    """The config check: the tokenizer directory's problems (none to report when it is unset or
    absent: the data section reports that; nor when it holds no tokenizer files yet: loading it
    reports that, naming the files expected, and check-config loads it: mimo.compose.preflight)."""
    if not tokenizer or not any(os.path.isfile(os.path.join(tokenizer, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return []
    try:
        facts = read_facts(tokenizer)
    except DataError as e:
        return [f"data.tokenizer: {e}"]
    return tokenizer_problems(facts, template, placeholders, vocab, vocab_key, where=f"data.tokenizer {tokenizer!r}")


def load_tokenizer(path: str):
    missing = missing_tokenizer_files(path) if os.path.isdir(path) else None
    if missing:
        raise DataError(missing)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the user needs the path
        raise DataError(f"cannot load a tokenizer from {path!r}: {e}") from None

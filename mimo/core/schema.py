"""Plain dicts (from YAML) -> nested config dataclasses, collecting every problem at once.

A component declares its config as dataclasses with type hints; this module converts and
checks them generically, naming each problem by its dotted key path:

* unknown keys (with the nearest valid name), wrong types, missing required keys;
* semantic checks: a dataclass may define ``validate(self, path) -> list[str]`` that looks at
  its own fields (and its children's, for cross-field rules); ``validate_tree`` calls it
  after its children's, once its part of the tree converted cleanly (a bad value elsewhere
  does not hide a section's own problems: the clean siblings of a failed part are validated).

Supported hints: bool, int, float (ints accepted), str, None, Any, ``Literal[...]``,
``X | Y``, ``list[X]``, ``dict[str, X]``, nested dataclasses, and tagged unions of
dataclasses (each with a ``kind: Literal[...]`` field; the mapping's ``kind`` picks one).
``bool`` is never accepted as an int.

YAML is read with YAML 1.2 scalar rules (see ``load_yaml``), and ``key=value`` overrides
are applied to the raw dict before conversion (``apply_overrides``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
from typing import Any, Iterable, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from mimo.core.errors import ConfigError

_NoneType = type(None)


# ---------------------------------------------------------------- YAML


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: ``ranks: 2:6`` stays the string '2:6' (YAML 1.1 reads
    it as the base-60 integer 126), ``lr: 2e-5`` is a float (1.1 needs a dot), and
    ``yes/no/on/off`` stay strings."""


_TAG = "tag:yaml.org,2002:"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_TAG + "bool", _TAG + "int", _TAG + "float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    _TAG + "bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Yaml12Loader.add_implicit_resolver(
    _TAG + "int", re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$"), list("-+0123456789")
)
_Yaml12Loader.add_implicit_resolver(
    _TAG + "float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)?\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str, source: str = "<yaml>") -> Any:
    """Parse YAML text (YAML 1.2 scalars); a syntax error becomes a ConfigError naming ``source``."""
    try:
        return yaml.load(text, Loader=_Yaml12Loader)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None


def parse_scalar(text: str) -> Any:
    """An override's value, read as YAML: '5' -> 5, '2e-5' -> 2e-05, 'true' -> True, '[tower]' -> ['tower']."""
    return load_yaml(text, source=f"value {text!r}")


# ---------------------------------------------------------------- paths and messages


def join_path(path: str, *keys: str) -> str:
    """``join_path("modules.vision", "arch", "heads")`` -> 'modules.vision.arch.heads'."""
    return ".".join(p for p in (path, *keys) if p)


def _where(path: str) -> str:
    return path or "(top level)"


def closest(given: Any, valid: Iterable[str]) -> str | None:
    """The valid name nearest to a misspelt one, if any is close."""
    close = difflib.get_close_matches(str(given), list(valid), n=1, cutoff=0.6)
    return close[0] if close else None


def _did_you_mean(given: Any, valid: Iterable[str]) -> str:
    close = closest(given, valid)
    return f"; did you mean {close!r}?" if close else ""


def _unknown_key(path: str, key: Any, valid: Iterable[str]) -> str:
    valid = list(valid)
    hint = _did_you_mean(key, valid) or (f"; valid keys: {', '.join(valid)}" if valid else "")
    return f"{join_path(path, str(key))}: unknown key{hint}"


def _describe(tp: Any) -> str:
    """How a type reads in a message: 'an integer', 'a string or null', ..."""
    origin = get_origin(tp)
    if tp is Any:
        return "anything"
    if tp is _NoneType:
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin is Literal:
        names = [repr(a) for a in get_args(tp)]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is list or origin is list:
        return "a list"
    if tp is dict or origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    """How a given value reads in a message: "string 'abc'", 'integer 3', 'a list'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, str):
        text = value if len(value) <= 60 else value[:57] + "..."
        return f"string {text!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def at_least(obj: Any, path: str, minimum: int | float, *names: str) -> list[str]:
    """Problems for each named numeric field of ``obj`` below ``minimum`` (None is skipped)."""
    out = []
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            out.append(f"{join_path(path, name)}: must be >= {minimum}, got {value}")
    return out


def tp_divides(tp: int, sizes: dict[str, int | None], path: str) -> list[str]:
    """One problem naming every ``arch.<size>`` that ``tp`` does not divide (None/<1 skipped)."""
    bad = [f"arch.{name}={size}" for name, size in sizes.items() if size is not None and size >= 1 and size % tp]
    return [f"{path}: tp={tp} must divide {', '.join(bad)}"] if bad else []


# ---------------------------------------------------------------- conversion


def convert(cls: Any, data: Any, path: str = "") -> tuple[Any, list[str]]:
    """Convert ``data`` to type ``cls``: (value, problems); value is None when there are problems."""
    problems: list[str] = []
    value = _convert(cls, data, path, problems)
    return (None if problems else value), problems


def from_dict(cls: Any, data: Any, path: str = "") -> Any:
    """Convert and validate; raises ConfigError listing every problem."""
    value, problems = convert(cls, data, path)
    if not problems:
        problems = validate_tree(value, path)
    if problems:
        raise ConfigError(problems)
    return value


def validate_tree(obj: Any, path: str = "") -> list[str]:
    """Run every ``validate(path)`` hook in a converted tree, children before parents."""
    problems: list[str] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            problems += validate_tree(getattr(obj, f.name), join_path(path, f.name))
        hook = getattr(obj, "validate", None)
        if callable(hook):
            problems += hook(path)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            problems += validate_tree(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            problems += validate_tree(item, join_path(path, str(key)))
    return problems


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _kind_tags(cls: Any) -> tuple:
    """The ``kind`` values a dataclass accepts (its ``kind: Literal[...]`` field), else ()."""
    if not dataclasses.is_dataclass(cls):
        return ()
    hint = get_type_hints(cls).get("kind")
    return get_args(hint) if get_origin(hint) is Literal else ()


def _tagged_options(tp: Any) -> list | None:
    """The members of a tagged union of dataclasses, or None if ``tp`` is not one."""
    if not _is_union(tp):
        return None
    options = [a for a in get_args(tp) if a is not _NoneType]
    if len(options) > 1 and all(_kind_tags(a) for a in options):
        return options
    return None


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if _is_union(tp):
        return _convert_union(tp, value, path, problems)
    if origin is Literal:
        allowed = get_args(tp)
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        hint = _did_you_mean(value, [str(a) for a in allowed]) if isinstance(value, str) else ""
        problems.append(f"{_where(path)}: must be {_describe(tp)}; got {_show(value)}{hint}")
        return None
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path, problems)
    if tp is list or origin is list:
        if not isinstance(value, list):
            return _wrong_type(tp, value, path, problems)
        (item_tp,) = get_args(tp) or (Any,)
        return _convert_items([(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)], problems)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            return _wrong_type(tp, value, path, problems)
        _, value_tp = get_args(tp) or (str, Any)
        for key in value:
            if not isinstance(key, str):
                problems.append(f"{join_path(path, str(key))}: keys must be strings, got {_show(key)}")
        keys = [key for key in value if isinstance(key, str)]
        return dict(zip(keys, _convert_items([(value_tp, value[key], join_path(path, key)) for key in keys], problems)))
    if _scalar_ok(tp, value):
        return float(value) if tp is float else value
    return _wrong_type(tp, value, path, problems)


_FLOAT_TEXT = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


def _scalar_ok(tp: Any, value: Any) -> bool:
    if tp is _NoneType:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        # A quoted "2e-5" is clearly meant as a number.
        if isinstance(value, str):
            return bool(_FLOAT_TEXT.match(value.strip()))
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    raise TypeError(f"mimo.core.schema does not support the type hint {tp!r}")


def _wrong_type(tp: Any, value: Any, path: str, problems: list[str]) -> None:
    problems.append(f"{_where(path)}: expected {_describe(tp)}, got {_show(value)}")
    return None


def _convert_union(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    args = get_args(tp)
    if value is None and _NoneType in args:
        return None
    tagged = _tagged_options(tp)
    if tagged is not None:
        return _convert_tagged(tagged, value, path, problems)
    options = [a for a in args if a is not _NoneType]
    if len(options) == 1 and options[0] not in (bool, int, float, str):
        return _convert(options[0], value, path, problems)
    for option in options:  # first option that takes the value cleanly wins
        trial: list[str] = []
        out = _convert(option, value, path, trial)
        if not trial:
            return out
    return _wrong_type(tp, value, path, problems)


def _convert_tagged(options: list, value: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(value, dict):
        return _wrong_type(dict, value, path, problems)
    by_tag = {tag: cls for cls in options for tag in _kind_tags(cls)}
    tags = ", ".join(repr(t) for t in by_tag)
    kind_path = join_path(path, "kind")
    if "kind" not in value:
        problems.append(f"{kind_path}: missing required key (one of {tags})")
        return None
    kind = value["kind"]
    if not isinstance(kind, str) or kind not in by_tag:
        hint = _did_you_mean(kind, list(by_tag)) if isinstance(kind, str) else ""
        problems.append(f"{kind_path}: unknown kind {_show(kind)}; expected one of {tags}{hint}")
        return None
    return _convert_dataclass(by_tag[kind], value, path, problems)


def _init_fields(cls: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _convert_dataclass(cls: Any, value: Any, path: str, problems: list[str]) -> Any:
    if value is None:  # an empty YAML section ("init:") means "all defaults"
        value = {}
    if not isinstance(value, dict):
        return _wrong_type(cls, value, path, problems)
    fields = _init_fields(cls)
    hints = get_type_hints(cls)
    before = len(problems)
    for key in value:
        if key not in fields:
            problems.append(_unknown_key(path, key, fields))
    for name, f in fields.items():
        if name not in value and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{join_path(path, name)}: missing required key")
    given = [name for name in fields if name in value]
    converted = _convert_items([(hints[name], value[name], join_path(path, name)) for name in given], problems, since=before)
    if len(problems) > before:
        return None  # never build a dataclass from bad parts (its __post_init__ may rely on types)
    return cls(**dict(zip(given, converted)))


def _convert_items(items: list[tuple[Any, Any, str]], problems: list[str], since: int | None = None) -> list[Any]:
    """Convert the parts of one container, each (type, raw value, path). When the container has
    a problem (a part failed, or one found since ``problems[since]``), it is not built and its
    validate hooks never run: the parts that did convert are validated here instead, so that one
    bad value does not hide its siblings' problems."""
    before, out, clean = len(problems) if since is None else since, [], []
    for tp, raw, path in items:
        mark = len(problems)
        out.append(_convert(tp, raw, path, problems))
        if len(problems) == mark:
            clean.append((out[-1], path))
    if len(problems) > before:
        for value, path in clean:
            problems += validate_tree(value, path)
    return out


# ---------------------------------------------------------------- overrides


def apply_overrides(raw: dict, overrides: Iterable[str], cls: Any) -> list[str]:
    """Set each dotted ``key=value`` in ``raw`` (in place); paths are checked against ``cls``.

    Values are read as YAML scalars (``train.steps=5``, ``data.source=synthetic``,
    ``modules.vision.freeze=[tower]``). Returns the problems (a bad override changes nothing).
    """
    problems = []
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override {text!r}: expected key=value, e.g. train.steps=5")
            continue
        try:
            value = parse_scalar(value_text)
        except ConfigError as e:
            problems.append(f"override {text!r}: {e}")
            continue
        problem = _set_path(raw, key.split("."), value, cls)
        if problem:
            problems.append(f"override {text!r}: {problem}")
    return problems


def _field_type(tp: Any, node: dict, key: str, path: str) -> tuple[Any, str | None]:
    """Type of ``key`` inside a value of type ``tp`` (whose raw form is ``node``), or a problem."""
    if _is_union(tp):
        tagged = _tagged_options(tp)
        if tagged is None:
            options = [a for a in get_args(tp) if a is not _NoneType]
            if len(options) != 1:
                return None, f"{_where(path)}: is {_describe(tp)}; set it as a whole"
            tp = options[0]
        else:  # the raw "kind" picks the member; without one, any member's keys are fine
            picked = [c for c in tagged if node.get("kind") in _kind_tags(c)] or tagged
            for cls in picked:
                if key in _init_fields(cls):
                    return get_type_hints(cls)[key], None
            names = {n for cls in picked for n in _init_fields(cls)}
            return None, _unknown_key(path, key, sorted(names))
    if tp is Any:
        return Any, None
    if dataclasses.is_dataclass(tp):
        fields = _init_fields(tp)
        if key not in fields:
            return None, _unknown_key(path, key, fields)
        return get_type_hints(tp)[key], None
    if tp is dict or get_origin(tp) is dict:
        return (get_args(tp) or (str, Any))[1], None
    return None, f"{_where(path)}: is {_describe(tp)}; it has no key {key!r}"


def _set_path(root: dict, keys: list[str], value: Any, cls: Any) -> str | None:
    # First check the whole path (a bad override must change nothing), then set it.
    node: Any = root
    tp, path = cls, ""
    for key in keys[:-1] if keys else []:
        tp, problem = _field_type(tp, node, key, path)
        if problem:
            return problem
        path = join_path(path, key)
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            node = {}
        elif not isinstance(node, dict):
            return f"{path}: is {_show(node)} in the config, not a mapping"
    _, problem = _field_type(tp, node, keys[-1], path)
    if problem:
        return problem
    node = root
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value
    return None

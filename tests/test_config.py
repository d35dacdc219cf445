"""Config system: schema conversion, layer patterns, whole-config checks and `mimo check-config`.

Broken configs live in tests/configs/broken/*.yaml; each names the messages it must produce
in ``# expect:`` lines (and extra command-line overrides in an ``# args:`` line).
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from mimo.commands.cli import main
from mimo.compose.config import MimoConfig, config_from_dict, load_config
from mimo.data.config import expand_braces
from mimo.core.errors import ConfigError
from mimo.llm.pattern import LAYER_COST, LayerSpec, balanced_split, parse_pattern
from mimo.core.schema import apply_overrides, convert, from_dict, load_yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "configs" / "examples").glob("*.yaml"))
BROKEN = sorted((ROOT / "tests" / "configs" / "broken").glob("*.yaml"))


def header(path: Path, tag: str) -> list[str]:
    prefix = f"# {tag}: "
    return [line[len(prefix) :] for line in path.read_text().splitlines() if line.startswith(prefix)]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mimo", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- valid examples


def test_there_are_examples():
    assert {p.stem for p in EXAMPLES} >= {"colocated", "noncolocated", "single"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid_in_process(path, demo_cwd, monkeypatch):
    monkeypatch.chdir(demo_cwd)  # the LLaVA stage examples name the demo data
    config = load_config(path)
    assert isinstance(config, MimoConfig)
    rows = config.layout_rows()
    assert {r["module"] for r in rows} == set(config.modules)
    covered = set()
    for r in rows:
        a, b = map(int, r["ranks"].split(":"))
        assert r["tp"] * r["cp"] * r["dp"] * r["pp"] == b - a
        covered |= set(range(a, b))
    assert covered == set(range(config.world_size))


def test_layout_rows_say_who_is_colocated():
    colocated = {r["module"]: r for r in load_config(ROOT / "configs/examples/colocated.yaml").layout_rows()}
    assert colocated["vision"]["colocated_with"] == ["language"]
    assert (colocated["vision"]["tp"], colocated["language"]["tp"]) == (1, 2)
    split = {r["module"]: r for r in load_config(ROOT / "configs/examples/noncolocated.yaml").layout_rows()}
    assert split["language"] | {"colocated_with": None} == {
        "module": "language", "kind": "hybrid", "ranks": "2:6", "tp": 2, "cp": 1, "dp": 1, "pp": 2, "colocated_with": None,
        "experts": None,
    }
    assert split["vision"]["colocated_with"] == []


def test_layout_rows_show_the_folded_expert_layout(demo_cwd, monkeypatch):
    from mimo.commands.cli import format_layout

    monkeypatch.chdir(demo_cwd)  # the config names the demo data
    lang = "modules.language."
    config = load_config(ROOT / "tests/configs/moe_tp.yaml", [lang + "parallel.ep=2", lang + "parallel.etp=1"])
    rows = {r["module"]: r for r in config.layout_rows()}
    assert rows["language"]["experts"] == {"etp": 1, "ep": 2, "edp": 2} and rows["vision"]["experts"] is None
    table = format_layout(list(rows.values()))
    assert "experts etp x ep x edp" in table.splitlines()[0] and "1 x 2 x 2" in table


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_pass_check_config_cli(path, demo_cwd, monkeypatch):
    monkeypatch.chdir(demo_cwd)
    proc = run_cli("check-config", str(path), cwd=demo_cwd)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "module" in proc.stdout and "colocated with" in proc.stdout  # the table
    result = last_json(proc.stdout)
    assert result["ok"] is True
    assert [m["module"] for m in result["modules"]] == list(load_config(path).modules)


def test_check_config_does_not_import_torch(tmp_path):
    code = (
        "import sys; from mimo.commands.cli import main; "
        f"rc = main(['check-config', {str(EXAMPLES[0])!r}]); "
        "assert rc == 0; assert 'torch' not in sys.modules, 'check-config imported torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_overrides_change_the_layout(capsys):
    path = str(ROOT / "configs/examples/noncolocated.yaml")
    rc = main(["check-config", path, "modules.language.parallel.pp=1", "modules.language.parallel.dp=2", "train.steps=5"])
    assert rc == 0
    rows = {m["module"]: m for m in last_json(capsys.readouterr().out)["modules"]}
    assert (rows["language"]["pp"], rows["language"]["dp"]) == (1, 2)
    config = load_config(path, ["train.steps=5", "train.lr=2e-5", "modules.vision.freeze=[tower, projector]"])
    assert (config.train.steps, config.train.lr) == (5, 2e-5)
    assert config.modules["vision"].freeze == ["tower", "projector"]


# ---------------------------------------------------------------- broken configs


def test_there_are_enough_broken_configs():
    assert len(BROKEN) >= 14
    for path in BROKEN:
        assert header(path, "expect"), f"{path.name} has no '# expect:' line"


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_config_fails_cleanly_via_cli(path, tmp_path):
    extra = " ".join(header(path, "args")).split()
    proc = run_cli("check-config", str(path), *extra, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output
    result = last_json(proc.stdout)
    assert result["ok"] is False and result["errors"]
    for expected in header(path, "expect"):
        assert expected in proc.stderr, f"{expected!r} not in:\n{proc.stderr}"
        assert any(expected in e for e in result["errors"])


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_config_fails_in_process(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in the configs must not exist
    extra = " ".join(header(path, "args")).split()
    with pytest.raises(ConfigError) as info:
        load_config(path, extra)
    text = "\n".join(info.value.problems)
    for expected in header(path, "expect"):
        assert expected in text


def test_usage_errors_exit_2_with_json(capsys):
    assert main([]) == 2
    assert last_json(capsys.readouterr().out)["ok"] is False
    assert main(["check-config"]) == 2
    assert main(["check-config", "/no/such/config.yaml"]) == 2
    out = capsys.readouterr()
    assert "/no/such/config.yaml: cannot read the config" in out.err
    assert main(["check-config", str(EXAMPLES[0]), "no-equals-sign"]) == 2
    assert "expected key=value" in capsys.readouterr().err


# ---------------------------------------------------------------- whole-config rules


def small_config(**changes) -> dict:
    raw = load_yaml((ROOT / "configs/examples/noncolocated.yaml").read_text())
    raw.update(changes)
    return raw


def problems_of(raw, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, overrides)
    return info.value.problems


def test_data_section_defaults_to_webdataset_which_needs_files():
    raw = small_config()
    del raw["data"]
    problems = problems_of(raw)
    assert any(p.startswith("data.shards: required") for p in problems)
    assert any(p.startswith("data.tokenizer: required") for p in problems)


def test_webdataset_shards_and_tokenizer_on_disk(tmp_path):
    (tmp_path / "tok").mkdir()
    for i in range(3):
        (tmp_path / f"train-{i:04d}.tar").write_bytes(b"")
    data = {"shards": str(tmp_path / "train-{0000..0003}.tar"), "tokenizer": str(tmp_path / "tok"), "max_sample_tokens": 256}
    problems = problems_of(small_config(data=data))
    assert problems == [f"data.shards: 1 of 4 shards of {data['shards']!r} are missing: {str(tmp_path / 'train-0003.tar')!r}"]
    (tmp_path / "train-0003.tar").write_bytes(b"")
    assert config_from_dict(small_config(data=data)).data.tokenizer == str(tmp_path / "tok")


def test_expand_braces():
    assert expand_braces("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert expand_braces("{x,y}/{8..10}") == ["x/8", "x/9", "x/10", "y/8", "y/9", "y/10"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_init_directories(tmp_path):
    raw = small_config()
    raw["modules"]["language"]["init"] = {"hf": str(tmp_path)}
    raw["modules"]["vision"]["init"] = {"hf": str(tmp_path / "missing")}
    assert problems_of(raw) == [f"modules.vision.init.hf: no directory {str(tmp_path / 'missing')!r}"]


def test_unquoted_rank_ranges_are_strings():
    # YAML 1.1 would read 2:6 as the base-60 integer 126
    raw = load_yaml("world_size: 6\nmodules:\n  l: {kind: hybrid, arch: {pattern: '*-', hidden: 8, heads: 2, vocab: 16}, parallel: {dp: 4, ranks: 2:6}}\n"
                    "  v: {kind: vit, arch: {image_size: 8, patch: 4, hidden: 8, layers: 2, heads: 2, mlp: 8}, parallel: {dp: 2, ranks: 0:2}}\n"
                    "data: {source: synthetic, tokens_per_microbatch: 64, max_sample_tokens: 32}\n")
    config = config_from_dict(raw)
    assert config.modules["l"].parallel.ranks == "2:6"
    assert config.llm_name == "l" and list(config.encoders) == ["v"]


def test_derived_llm_defaults_are_filled_in():
    arch = load_config(ROOT / "configs/examples/single.yaml").llm.arch
    assert (arch.kv_heads, arch.head_dim, arch.ffn) == (2, 16, 256)
    assert arch.mamba_heads == 2 * 64 // 16
    assert (arch.gdn_heads, arch.gdn_v_heads, arch.gdn_head_dim, arch.gdn_v_head_dim) == (4, 4, 16, 16)


def test_llm_stages_follow_pp():
    config = load_config(ROOT / "configs/examples/noncolocated.yaml")
    stages = config.llm.stages()
    assert [[layer.kind for layer in s] for s in stages] == [["mamba", "attention", "mlp"], ["gdn", "attention", "mlp"]]


# ---------------------------------------------------------------- schema


@dataclass
class Inner:
    size: int
    ratio: float = 1.0
    name: str | None = None


@dataclass
class KindA:
    kind: Literal["a"]
    inner: Inner


@dataclass
class KindB:
    kind: Literal["b"]
    flag: bool = False


@dataclass
class Outer:
    inner: Inner
    items: list[Inner] = field(default_factory=list)
    mode: Literal["x", "y"] = "x"
    layer: int | Literal["last"] = -1
    parts: dict[str, KindA | KindB] = field(default_factory=dict)


def test_schema_converts_nested_values():
    raw = {"inner": {"size": 3, "ratio": 2}, "items": [{"size": 1}], "layer": "last",
           "parts": {"p": {"kind": "a", "inner": {"size": 5}}, "q": {"kind": "b"}}}
    out, problems = convert(Outer, raw)
    assert problems == []
    assert out.inner == Inner(3, 2.0) and isinstance(out.inner.ratio, float)
    assert out.items == [Inner(1)] and out.layer == "last"
    assert isinstance(out.parts["p"], KindA) and out.parts["q"] == KindB("b")


def test_schema_reports_every_problem_with_its_path():
    raw = {
        "inner": {"size": True, "sise": 2, "ratio": "fast"},
        "items": [{"size": 1}, {"name": 4}],
        "mode": "z",
        "layer": 1.5,
        "parts": {"p": {"kind": "c"}, "q": {"kind": "b", "flag": 1}, "r": {"inner": {}}},
        "extra": 1,
    }
    _, problems = convert(Outer, raw)
    assert sorted(problems) == sorted([
        "extra: unknown key; valid keys: inner, items, mode, layer, parts",
        "inner.sise: unknown key; did you mean 'size'?",
        "inner.size: expected an integer, got boolean true",
        "inner.ratio: expected a number, got string 'fast'",
        "items[1].name: expected a string or null, got integer 4",
        "items[1].size: missing required key",
        "mode: must be 'x' or 'y'; got string 'z'",
        "layer: expected an integer or 'last', got number 1.5",
        "parts.p.kind: unknown kind string 'c'; expected one of 'a', 'b'",
        "parts.q.flag: expected true or false, got integer 1",
        "parts.r.kind: missing required key (one of 'a', 'b')",
    ])


def test_schema_missing_section_and_empty_section():
    assert convert(Outer, {})[1] == ["inner: missing required key"]
    assert convert(Outer, {"inner": None})[1] == ["inner.size: missing required key"]
    assert convert(Outer, {"inner": [1]})[1] == ["inner: expected a mapping, got a list"]


def test_schema_quoted_float_is_a_number():
    out, problems = convert(Inner, {"size": 1, "ratio": "2e-5"})
    assert problems == [] and out.ratio == 2e-5


@dataclass
class Child:
    n: int

    def validate(self, path):
        return [f"{path}.n: odd"] if self.n % 2 else []


@dataclass
class Parent:
    a: Child
    b: Child

    def validate(self, path):
        return ["parent: checked last"]


def test_from_dict_runs_validate_hooks_children_first():
    with pytest.raises(ConfigError) as info:
        from_dict(Parent, {"a": {"n": 1}, "b": {"n": 3}})
    assert info.value.problems == ["a.n: odd", "b.n: odd", "parent: checked last"]


def test_overrides_follow_the_schema():
    raw = {"inner": {"size": 1}, "parts": {"p": {"kind": "b"}}}
    problems = apply_overrides(
        raw,
        ["inner.ratio=0.5", "mode=y", "parts.p.flag=true", "parts.new.kind=a", "parts.new.inner.size=7", "items=[{size: 2}]"],
        Outer,
    )
    assert problems == []
    out, problems = convert(Outer, raw)
    assert problems == [] and out.inner.ratio == 0.5 and out.parts["p"].flag is True
    assert out.parts["new"].inner.size == 7 and out.items == [Inner(2)]


def test_bad_overrides_are_reported_and_change_nothing():
    raw = {"inner": {"size": 1}, "parts": {"p": {"kind": "b"}}}
    before = repr(raw)
    problems = apply_overrides(
        raw, ["inner.sise=2", "inner.size.x=1", "parts.p.flg=1", "nothing", "mode.deeper.still=1", "new.x=1"], Outer
    )
    assert problems == [
        "override 'inner.sise=2': inner.sise: unknown key; did you mean 'size'?",
        "override 'inner.size.x=1': inner.size: is integer 1 in the config, not a mapping",
        "override 'parts.p.flg=1': parts.p.flg: unknown key; did you mean 'flag'?",
        "override 'nothing': expected key=value, e.g. train.steps=5",
        "override 'mode.deeper.still=1': mode: is 'x' or 'y'; it has no key 'deeper'",
        "override 'new.x=1': new: unknown key; valid keys: inner, items, mode, layer, parts",
    ]
    assert repr(raw) == before


def test_yaml_uses_1_2_scalars():
    assert load_yaml("a: 2:6\nb: 2e-5\nc: on\nd: 1_000\ne: .5\nf: true") == {
        "a": "2:6", "b": 2e-5, "c": "on", "d": 1000, "e": 0.5, "f": True,
    }


# ---------------------------------------------------------------- layer patterns


def test_parse_pattern_kinds_and_indices():
    p = parse_pattern("MG*-E")
    assert p.layers == (
        LayerSpec(0, "mamba"), LayerSpec(1, "gdn"), LayerSpec(2, "attention"), LayerSpec(3, "mlp"), LayerSpec(4, "moe"),
    )
    assert p.explicit_stage_sizes is None


def test_explicit_stage_boundaries():
    p = parse_pattern("M*-|M*|-")
    assert p.explicit_stage_sizes == (3, 2, 1)
    stages = p.stages(3)
    assert [[layer.index for layer in s] for s in stages] == [[0, 1, 2], [3, 4], [5]]
    with pytest.raises(ConfigError, match="has 3 pipeline stages .* but pp is 2"):
        p.stages(2)


@pytest.mark.parametrize(
    "text, message",
    [
        ("M*x-", "unknown symbol 'x' at position 3"),
        ("", "has no layers"),
        ("|M*", "pipeline stage 1 of '|M\\*' is empty"),
        ("M*||-", "pipeline stage 2 of"),
        ("M*|", "pipeline stage 2 of"),
    ],
)
def test_bad_patterns(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_pattern(text)


def test_every_bad_symbol_is_reported():
    with pytest.raises(ConfigError) as info:
        parse_pattern("a*b")
    assert [p.split(" of ")[0] for p in info.value.problems] == [
        "unknown symbol 'a' at position 1", "unknown symbol 'b' at position 3",
    ]


def test_impossible_split():
    with pytest.raises(ConfigError, match="pp=4 pipeline stages need at least 4 layers"):
        parse_pattern("M*-").stages(4)
    with pytest.raises(ConfigError):
        balanced_split([1.0, 1.0], 3)


def brute_force_best(costs: list[float], parts: int) -> tuple[float, float]:
    """(smallest largest block, then smallest sum of squared block costs) over all splits."""
    n, best = len(costs), (float("inf"), float("inf"))
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        blocks = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        best = min(best, (round(max(blocks), 9), round(sum(c * c for c in blocks), 9)))
    return best


def test_balanced_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        costs = [rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(n)]
        parts = rng.randint(1, n)
        sizes = balanced_split(costs, parts)
        assert len(sizes) == parts and sum(sizes) == n and min(sizes) >= 1
        bounds = list(itertools.accumulate([0, *sizes]))
        blocks = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        want_max, want_squares = brute_force_best(costs, parts)
        assert max(blocks) == pytest.approx(want_max)
        assert sum(c * c for c in blocks) == pytest.approx(want_squares)


def test_default_costs_give_even_stages():
    assert set(LAYER_COST.values()) == {1.0}
    assert [len(s) for s in parse_pattern("M*-" * 4).stages(4)] == [3, 3, 3, 3]
    assert [len(s) for s in parse_pattern("M*-M*-M").stages(3)] == [3, 2, 2]


def test_parallel_sizes_and_rank_syntax_are_checked():
    problems = problems_of(small_config(), ["modules.language.parallel.tp=0", "modules.vision.parallel.ranks=2:0"])
    assert "modules.language.parallel.tp: must be >= 1, got 0" in problems
    assert any(p.startswith("modules.vision.parallel.ranks: rank range '2:0'") for p in problems)


# ---------------------------------------------------------------- every shipped config, the README


ALL_CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


@pytest.fixture(scope="module")
def demo_cwd(tmp_path_factory) -> Path:
    """A working directory holding what `mimo demo` writes (configs name demo-data/...), small."""
    from mimo.data.demo import make_demo_data
    from mimo.commands.demo import DEMO_DATA_DIR

    cwd = tmp_path_factory.mktemp("configs_cwd")
    make_demo_data(str(cwd / DEMO_DATA_DIR), train_samples=16, heldout_samples=2, shard_size=2)
    return cwd


def test_the_shipped_configs_are_all_found():
    names = {str(p.relative_to(ROOT / "configs")) for p in ALL_CONFIGS}
    assert {"demo.yaml", "examples/llava-stage1.yaml", "examples/llava-stage2.yaml", "examples/hybrid-mamba-gdn.yaml"} <= names


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_passes_check_config(path, demo_cwd):
    proc = run_cli("check-config", str(path), cwd=demo_cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert last_json(proc.stdout)["ok"] is True


def _config_fields(cls, seen=None) -> dict[str, set[str]]:
    """Every field of every config dataclass reachable from ``cls``: class name -> field names."""
    import dataclasses
    import typing

    seen = {} if seen is None else seen
    if cls.__name__ in seen:
        return seen
    seen[cls.__name__] = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        stack = [hints[f.name]]
        while stack:
            tp = stack.pop()
            if dataclasses.is_dataclass(tp):
                _config_fields(tp, seen)
            stack += typing.get_args(tp)
    return seen


def test_readme_documents_every_config_key():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Config reference", 1)[1].split("\n## ", 1)[0]
    fields = _config_fields(MimoConfig)
    assert {"MimoConfig", "EncoderModuleConfig", "LLMModuleConfig", "HybridArch", "VitArch", "DataConfig", "TrainConfig",
            "EvalConfig", "CheckpointConfig", "ParallelConfig", "RopeScaling"} <= set(fields)
    missing = sorted(f"{cls}.{name}" for cls, names in fields.items() for name in names if f"`{name}`" not in section
                     and f"`arch.{name}`" not in section)
    assert not missing, f"README.md's config reference does not mention: {', '.join(missing)}"


def test_cuda_graphs_need_compile_and_encoders_at_tp_1_without_recompute():
    """``train.cuda_graphs`` replays the vision blocks' kernels as captured: without
    ``train.compile`` there are no graphs, a TP collective inside a block or a recompute in
    the backward cannot replay; each is named. The accepted form passes."""
    ok = ["train.compile=true", "train.cuda_graphs=true"]
    config_from_dict(small_config(), ok)
    assert problems_of(small_config(), ["train.cuda_graphs=true"]) == [
        "train.cuda_graphs: the graphs are torch.compile's; set train.compile: true too"]
    problems = problems_of(small_config(), ok + ["modules.vision.parallel.tp=2", "modules.vision.parallel.dp=1",
                                                  "modules.vision.recompute=full"])
    assert len(problems) == 2
    assert problems[0].startswith("train.cuda_graphs: modules.vision.parallel.tp > 1 puts TP collectives")
    assert problems[1].startswith("train.cuda_graphs: modules.vision recomputes its blocks")
    assert problems_of(small_config(), ok + ["train.recompute=selective"])[0].startswith(
        "train.cuda_graphs: modules.vision recomputes its blocks")

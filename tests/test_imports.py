"""Import direction (docs/design.md §1): base (mimo/core, mimo/parallel) -> encoders/llm/bridges ->
schedules -> data -> mimo/compose -> mimo/training -> mimo/commands, read from the folders.

Parses every module's imports (including those inside functions) and checks that none
reaches "up", and that nothing anywhere imports a top-level folder by its bare name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"mimo": "mimo", "encoders": "mimo.encoders", "llm": "mimo.llm", "bridges": "mimo.bridges", "data": "mimo.data", "schedules": "mimo.schedules"}
# The parts are folders, lowest first; each may import the parts listed for it (and itself).
# The base is mimo/core and mimo/parallel; the composition is mimo/compose -> mimo/training ->
# mimo/commands. Only the top-level package files (mimo/__init__, __main__) sit above all.
BASE = ("mimo.core", "mimo.parallel")
ALLOWED = {
    "base": {"base"},
    "mimo.encoders": {"base"},
    "mimo.llm": {"base"},
    "mimo.bridges": {"base"},
    "mimo.data": {"base", "mimo.bridges", "mimo.schedules"},
    "mimo.schedules": {"base", "mimo.bridges"},
    "mimo.compose": {"base", "mimo.encoders", "mimo.llm", "mimo.bridges", "mimo.data", "mimo.schedules"},
    "mimo.training": {"base", "mimo.encoders", "mimo.llm", "mimo.bridges", "mimo.data", "mimo.schedules", "mimo.compose"},
    "mimo.commands": {"base", "mimo.encoders", "mimo.llm", "mimo.bridges", "mimo.data", "mimo.schedules", "mimo.compose",
                      "mimo.training"},
    "top": set(ALL := ("base", "mimo.encoders", "mimo.llm", "mimo.bridges", "mimo.data", "mimo.schedules",
                        "mimo.compose", "mimo.training", "mimo.commands")),
}
PARTS = ("mimo.encoders", "mimo.llm", "mimo.bridges", "mimo.data", "mimo.schedules", "mimo.compose", "mimo.training",
         "mimo.commands")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = FOLDERS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    for b in BASE:
        if module == b or module.startswith(b + "."):
            return "base"
    for sub in PARTS:
        if module == sub or module.startswith(sub + "."):
            return sub
    return "top"


def test_every_module_lives_in_a_part_folder():
    """A new file directly under mimo/ would escape the direction check: only the package's
    own entry files may sit there."""
    loose = sorted(p.name for p in (ROOT / "mimo").glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert not loose, f"modules directly under mimo/ (put them into a part folder): {loose}"


def project_files():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def imported_names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or "", node.level


def test_there_are_modules_to_check():
    assert len(list(project_files())) >= 10


@pytest.mark.parametrize("path", list(project_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path):
    me = module_name(path)
    my_part = part_of(me)
    bad = []
    for lineno, name, level in imported_names(ast.parse(path.read_text(), str(path))):
        if level:
            bad.append(f"line {lineno}: relative import; write mimo.* in full")
            continue
        if name.split(".")[0] != "mimo":
            continue
        target = part_of(name)
        if target != my_part and target not in ALLOWED[my_part]:
            bad.append(f"line {lineno}: {me} ({my_part}) imports {name} ({target})")
    assert not bad, "\n".join(bad)


def test_no_bare_imports_of_top_level_folders():
    bare = {"encoders", "llm", "bridges", "data", "schedules"}
    offenders = []
    for path in [*project_files(), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py")]:
        for lineno, name, level in imported_names(ast.parse(path.read_text(), str(path))):
            if not level and name.split(".")[0] in bare:
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: import {name}")
    assert not offenders, "\n".join(offenders)


def test_the_checker_catches_violations(tmp_path):
    tree = ast.parse("import mimo.compose.config\nfrom mimo.llm import x\nfrom . import y\n")
    names = list(imported_names(tree))
    assert [(n, lvl) for _, n, lvl in names] == [("mimo.compose.config", 0), ("mimo.llm", 0), ("", 1)]
    assert part_of("mimo.compose.config") == "mimo.compose" and "mimo.compose" not in ALLOWED["base"]
    assert part_of("mimo.parallel.grid") == "base" and part_of("mimo.core.errors") == "base"
    assert "mimo.commands" not in ALLOWED["mimo.training"] and "mimo.training" not in ALLOWED["mimo.compose"]
    assert part_of("mimo.llm.pattern") == "mimo.llm" and "mimo.llm" not in ALLOWED["mimo.encoders"]


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (at the top or inside functions), from
    ``{module name: source}``; ``from a import b`` counts ``a.b`` when that is a module."""
    graph = {m: set() for m in files}
    for me, source in files.items():
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in targets:
                while name and name not in files:  # mimo.x.y.attr -> the module mimo.x.y
                    name = name.rpartition(".")[0]
                if name and name != me:
                    graph[me].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """Modules that import each other (even lazily, inside a function) are one module split
    in two: a cycle means the split is wrong."""
    files = {module_name(p): p.read_text() for p in project_files()}
    assert not cycles(import_graph(files))


def test_the_cycle_checker_finds_a_lazy_cycle():
    files = {"mimo.a": "import mimo.b\n", "mimo.b": "def f():\n    from mimo.a import g\n", "mimo.c": "from mimo.a import x\n"}
    assert cycles(import_graph(files)) == [["mimo.a", "mimo.b"]]
    assert cycles(import_graph({**files, "mimo.b": "x = 1\n"})) == []

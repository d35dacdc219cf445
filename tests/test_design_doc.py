"""The code's references to the design document (docs/design.md §8) point at sections it has.

Comments and docstrings cite ``docs/design.md §N`` or ``§N.M`` (several at once read
``docs/design.md §8, §9``). Every cited number must be the number of a heading of
docs/design.md (``## N. Title`` or ``### N.M Title``), and the old citation form (``DESIGN``
and the section sign: a document outside the repository) must not come back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
NUMBER = r"\d+(?:\.\d+)*"
# "docs/design.md §2", "docs/design.md §8, §9", "docs/design.md §2.6 and §9.2"
REFERENCE = re.compile(rf"docs/design\.md\s+§{NUMBER}(?:(?:\s*,\s*|\s+and\s+|\s+or\s+)§{NUMBER})*")
HEADING = re.compile(rf"^#{{2,6}}\s+({NUMBER})\.?\s+\S", re.MULTILINE)
OLD_NAME = re.compile(r"DESIGN\s*§")
SKIP_DIRS = {"build", "dist", "__pycache__", "runs", "demo-data", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini"}


def repo_files(root: Path, suffixes) -> list[Path]:
    """The repository's files with those suffixes, outside hidden folders and build output."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIP_DIRS or d.endswith(".egg-info"))]
        out.extend(Path(folder) / f for f in files if Path(f).suffix in suffixes)
    return sorted(out)


def headings(doc_text: str) -> set[str]:
    """The section numbers of a design document: ``## 2. Core`` -> "2", ``### 2.6 Packed`` -> "2.6"."""
    return set(HEADING.findall(doc_text))


def references(text: str) -> list[tuple[int, str]]:
    """(line, section number) of every ``docs/design.md §N`` reference in a file's text."""
    out = []
    for m in REFERENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out.extend((line, n) for n in re.findall(rf"§({NUMBER})", m.group(0)))
    return out


def dangling(root: Path, doc: Path) -> list[str]:
    """``file:line: §N`` for every reference in the .py files under ``root`` to a section that
    ``doc`` has no heading for."""
    have = headings(doc.read_text(encoding="utf-8"))
    bad = []
    for path in repo_files(root, {".py"}):
        for line, number in references(path.read_text(encoding="utf-8", errors="replace")):
            if number not in have:
                bad.append(f"{path.relative_to(root)}:{line}: docs/design.md §{number} (no such heading)")
    return bad


def old_names(root: Path) -> list[str]:
    bad = []
    for path in repo_files(root, TEXT_SUFFIXES):
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OLD_NAME.search(line):
                bad.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    return bad


def test_the_design_doc_has_numbered_sections():
    have = headings(DOC.read_text(encoding="utf-8"))
    top = sorted(int(n) for n in have if "." not in n)
    assert top == list(range(1, len(top) + 1)) and len(top) >= 9, f"sections 1..N expected, found {top}"
    orphans = sorted(n for n in have if "." in n and n.rsplit(".", 1)[0] not in have)
    assert not orphans, f"subsections without their section: {orphans}"


def test_every_reference_names_a_section_of_the_design_doc():
    refs = [r for p in repo_files(ROOT, {".py"}) for r in references(p.read_text(encoding="utf-8", errors="replace"))]
    assert len(refs) >= 20, f"only {len(refs)} references found: is the pattern still right?"
    bad = dangling(ROOT, DOC)
    assert not bad, "references to sections docs/design.md does not have:\n" + "\n".join(bad)


def test_nothing_cites_the_old_design_document():
    bad = old_names(ROOT)
    assert not bad, "cite docs/design.md §N instead of the old form:\n" + "\n".join(bad)


def test_the_checker_catches_a_missing_section(tmp_path):
    cite = "docs/design" + ".md §"  # split, so that this file itself cites nothing
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "design.md"
    doc.write_text("# t\n\n## 1. One\n\n### 1.2 Sub\n\n## 2. Two\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(f'"""See {cite}1.2 and §2."""\nx = 1  # {cite}2, §99\n')
    (tmp_path / "pkg" / "b.py").write_text(f"# {cite}1.3\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "c.py").write_text(f"# {cite}77\n")
    assert headings(doc.read_text()) == {"1", "1.2", "2"}
    assert dangling(tmp_path, doc) == [f"pkg/a.py:2: {cite}99 (no such heading)", f"pkg/b.py:1: {cite}1.3 (no such heading)"]
    old = "DESIGN" + " §"
    (tmp_path / "pkg" / "c.yaml").write_text(f"# {old}2\n")
    assert old_names(tmp_path) == [f"pkg/c.yaml:1: # {old}2"]

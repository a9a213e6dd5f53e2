"""docs/architecture.md's module tables name every module of the package, and nothing gone (and
bench/README.md every script in bench/).

Each table of "Module by module" sits under a heading naming its folder (### `kvcache/` — ...; "Top
level" is the package itself); the first column of a row names files (`tiered.py`) or a folder
(`needles/`) relative to it, and a folder's row names each of its modules (`runner.py`). An
`__init__.py` that only re-exports (docstring, imports, `__all__`) needs no line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashmemory"
DOC = ROOT / "docs" / "architecture.md"


def _named() -> tuple[set[str], set[str]]:
    """The paths the tables' first column names, relative to the package ("engine/core.py",
    "tools/needles/"), and the modules named in all (those plus the ones a folder's row names)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Module by module", 1)[1].split("\n## ", 1)[0]
    first: set[str] = set()
    modules: set[str] = set()
    folder = None
    for line in section.splitlines():
        heading = re.match(r"### (?:`([^`]+)`|Top level)", line)
        if heading:
            folder = heading.group(1) or ""
        elif line.startswith("| `") and folder is not None:
            for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
                first.add(folder + name)
                if name.endswith("/"):  # a folder's row: the modules it names in its text
                    modules.update(folder + name + n for n in re.findall(r"`([\w/]+\.py)`", line))
    return first, first | modules


def _needs_a_line(path: Path) -> bool:
    if path.name != "__init__.py":
        return True
    body = ast.parse(path.read_text()).body[1:]  # after the docstring
    reexports = (isinstance(node, (ast.Import, ast.ImportFrom)) or _is_all(node) for node in body)
    return not all(reexports)


def _is_all(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__")


def test_every_module_is_named_in_the_architecture_tables():
    named = _named()[1]
    paths = {path.relative_to(PACKAGE).as_posix(): path for path in PACKAGE.rglob("*.py")}
    missing = sorted(rel for rel, path in paths.items()
                     if rel not in named and _needs_a_line(path))
    assert missing == [], "add a line for each to its table in docs/architecture.md"


def test_every_path_the_tables_name_exists():
    gone = sorted(n for n in _named()[0] if not (PACKAGE / n).exists())
    assert gone == [], "remove or rename these lines of docs/architecture.md"


def test_bench_readme_lists_every_script_once():
    text = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `([\w.]+\.py)` \|", text, flags=re.MULTILINE)
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert sorted(listed) == scripts, "one row per bench/ script in bench/README.md"

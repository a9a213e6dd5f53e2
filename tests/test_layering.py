"""The package's import graph (walked from the source, imports inside functions included): no cycle, nothing
imports upward (cli -> serve/tools -> engine -> {model, kvcache} -> config), and the parts meant to run without
torch (the KV control plane, the scheduler) do not import it.
And flashmemory/tools/ uses the engine and the cache by their public names (named exceptions)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flashmemory"

# Rank of each top-level part: a module may import its own part or a lower rank, never a higher one.
RANKS = {
    "flashmemory.errors": 0, "flashmemory.version": 0, "flashmemory.settings": 0, "flashmemory.config": 0,
    "flashmemory.kv_settings": 0, "flashmemory.spec_settings": 0,
    "flashmemory.guardrail_settings": 0,
    "flashmemory.seed_names": 0, "flashmemory.native_build": 0, "flashmemory.rss": 0,
    "flashmemory.cpu_features": 0,
    "flashmemory.snapshot_format": 0,
    "flashmemory.config_args": 0,
    "flashmemory.kvcache": 1, "flashmemory.model": 1, "flashmemory.guardrail": 1,
    "flashmemory.engine": 2,
    "flashmemory.serve": 3, "flashmemory.tools": 3, "flashmemory.pipeline": 3,
    "flashmemory.cli": 4, "flashmemory.__main__": 4, "flashmemory": 4,
}
TORCH_FREE = ("flashmemory.rss", "flashmemory.snapshot_format", "flashmemory.kvcache.manager",
              "flashmemory.engine.scheduler", "flashmemory.engine.sequence",
              "flashmemory.engine.scheduling_policy", "flashmemory.engine.budget_controller")
# Inside the KV cache: who may not import whom (the composition root, tiered.py, imports them all).
KVCACHE_FORBIDDEN = {
    "flashmemory.kvcache.manager": ("flashmemory.kvcache.",),  # the control plane stands alone
    "flashmemory.kvcache.levels": ("flashmemory.kvcache.native", "flashmemory.kvcache.prefetch",
                                   "flashmemory.kvcache.read", "flashmemory.kvcache.attention"),
    "flashmemory.kvcache.read": ("flashmemory.kvcache.prefetch", "flashmemory.kvcache.attention",
                                 "flashmemory.kvcache.native", "flashmemory.kvcache.tiered"),
    "flashmemory.kvcache.native": ("flashmemory.kvcache.levels", "flashmemory.kvcache.prefetch",
                                   "flashmemory.kvcache.read", "flashmemory.kvcache.attention"),
    "flashmemory.kvcache.prefetch": ("flashmemory.kvcache.attention", "flashmemory.kvcache.tiered",
                                     "flashmemory.kvcache.placement"),
    "flashmemory.kvcache.attention": ("flashmemory.kvcache.prefetch", "flashmemory.kvcache.tiered",
                                      "flashmemory.kvcache.levels"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if path.name == "__init__.py" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (an imported name resolves to the longest module it names)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in _imports(path):
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    return graph


def _rank(module: str) -> int:
    best = max((k for k in RANKS if module == k or module.startswith(k + ".")), key=len)
    return RANKS[best]


def test_every_module_has_a_layer():
    for module in _modules():
        assert any(module == k or module.startswith(k + ".") for k in RANKS), f"{module} has no layer in RANKS"


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} (layer {_rank(m)}) imports {t} (layer {_rank(t)})"
              for m, targets in _graph().items() for t in targets if _rank(t) > _rank(m)]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_nothing_imports_the_cli_but_the_entry_point():
    importers = [m for m, targets in _graph().items() if "flashmemory.cli" in targets and m != "flashmemory.__main__"]
    assert importers == []


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_the_control_plane_and_the_scheduler_do_not_need_torch(prefix):
    modules = _modules()
    for module, path in modules.items():
        if module == prefix or module.startswith(prefix + "."):
            heavy = {n for n in _imports(path) if n.split(".")[0] in ("torch", "numpy")}
            assert not heavy, f"{module} imports {sorted(heavy)}"
            inner = {t for t in _graph()[module] if not any(t == p or t.startswith(p + ".") for p in TORCH_FREE)
                     and t.startswith("flashmemory.") and t not in ("flashmemory.errors",)}
            assert not inner, f"{module} imports {sorted(inner)}, which may need torch"


@pytest.mark.parametrize("part", sorted(KVCACHE_FORBIDDEN))
def test_kv_cache_parts_import_only_what_they_sit_on(part):
    graph = _graph()
    for module, targets in graph.items():
        if module == part or module.startswith(part + "."):
            bad = [t for t in targets for f in KVCACHE_FORBIDDEN[part]
                   if (t == f or t.startswith(f if f.endswith(".") else f + ".")) and not t.startswith(part)]
            assert bad == [], f"{module} imports {bad}"



# flashmemory/tools/ drives the engine and the cache by their public names only. Each exception is
# named with why it is one; an exception that no longer occurs fails too, so the lists stay true.
STDLIB_SUBPARSERS = "argparse names add_subparsers()'s type only privately (a type hint)"
TOOLS_PRIVATE_NAMES = {
    ("flashmemory.tools.doctor.checks", "lib._name"):
        "doctor's kernel check: ctypes.CDLL keeps the loaded library's path only in _name",
    ("flashmemory.tools.bench.command", "argparse._SubParsersAction"):
        STDLIB_SUBPARSERS,
    ("flashmemory.tools.diagnose.command", "argparse._SubParsersAction"):
        STDLIB_SUBPARSERS,
    ("flashmemory.tools.doctor.command", "argparse._SubParsersAction"):
        STDLIB_SUBPARSERS,
}
# What a tool may import of the cache: its contract and the names it publishes.
TOOLS_CACHE_SURFACE = {
    "flashmemory.kvcache.interface": "the KVCache contract (KVCache, ForwardBatch)",
    "flashmemory.kvcache.config": "the cache's settings and storage dtypes",
    "flashmemory.kvcache.snapshot": "the KV snapshot file format (bench compares snapshots)",
    "flashmemory.kvcache.manager.blocks.Level": "the level names",
    "flashmemory.kvcache.read.choice":
        "the choice observer contract (LayerChoice): what selection chose, for tools that "
        "watch it (the needle probe)",
}
# The tools that look inside the cache on purpose.
TOOLS_CACHE_INTERNALS = {
    "flashmemory.tools.mats":
        "MATS tests the cache: it checks block tables, codecs and levels against a shadow model "
        "and injects faults below the interface",
    "flashmemory.tools.doctor.checks":
        "doctor's kernel checks build and load kvcache/native to say whether the kernels run here",
    "flashmemory.tools.access_traces":
        "records the prefetcher's access traces and trains its heat predictor (kvcache/prefetch)",
    "flashmemory.tools.diagnose":
        "diagnose times the cache's parts from inside (reader, placement, levels, prefetcher) and "
        "maps each level's slots",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names(path: Path) -> list[str]:
    """Underscore names `path` reaches on something other than self or cls, or imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.module}.{a.name}" for a in node.names if _is_private(a.name)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1):
            name = node.args[1]
            if isinstance(name, ast.Constant) and _is_private(str(name.value)):
                found.append(ast.unparse(node))
    return found


def _tool_modules() -> dict[str, Path]:
    return {m: p for m, p in _modules().items() if m.startswith("flashmemory.tools")}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_tools_use_only_public_names_of_the_engine_and_the_cache():
    found = {(m, name) for m, path in _tool_modules().items() for name in _private_names(path)}
    assert sorted(found - set(TOOLS_PRIVATE_NAMES)) == [], "use (or add) a public method instead"
    assert sorted(set(TOOLS_PRIVATE_NAMES) - found) == [], "an exception that no longer occurs"


def _cache_names(path: Path) -> list[str]:
    """What `path` imports of the cache, each name in full (a module, or module.name)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [f"{node.module}.{a.name}" for a in node.names]
    return [n for n in names if n.startswith("flashmemory.kvcache.")]


def test_tools_import_only_the_public_surface_of_the_cache():
    bad, used = [], set()
    for module, path in _tool_modules().items():
        names = _cache_names(path)
        exception = [p for p in TOOLS_CACHE_INTERNALS if _under(module, [p])]
        if exception:
            used.update(exception if names else [])
            continue
        bad += [f"{module} imports {n}" for n in names if not _under(n, TOOLS_CACHE_SURFACE)]
    assert bad == [], "reach the cache through TOOLS_CACHE_SURFACE (or make what it needs public)"
    assert sorted(set(TOOLS_CACHE_INTERNALS) - used) == [], "an exception that no longer occurs"

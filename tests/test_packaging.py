"""The distribution: its name is ours (flashmemory-runtime, import name flashmemory), its console scripts point at
real functions, and the package data it declares (C sources, heat-predictor weights) exists. The wheel and sdist
themselves are built and installed in a clean venv by the commands in docs/packaging.md."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_distribution_is_flashmemory_runtime_and_the_import_name_flashmemory():
    assert PROJECT["project"]["name"] == "flashmemory-runtime"
    assert PROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["flashmemory*"]
    assert importlib.import_module("flashmemory").FlashMemoryEngine


def test_the_console_scripts_name_functions_that_exist():
    scripts = PROJECT["project"]["scripts"]
    assert set(scripts) == {"flashmemory", "flashmemory-test"}
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_every_package_data_pattern_matches_files_and_every_data_file_is_declared():
    declared = PROJECT["tool"]["setuptools"]["package-data"]
    matched = set()
    for package, patterns in declared.items():
        folder = ROOT / package.replace(".", "/")
        for pattern in patterns:
            files = sorted(folder.glob(pattern))
            assert files, f"{package}: {pattern} matches nothing"
            matched.update(files)
    data = {p for p in (ROOT / "flashmemory").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
            and "__pycache__" not in p.parts}
    assert data <= matched, f"data files the wheel would miss: {sorted(map(str, data - matched))}"


def test_the_torch_pin_is_the_one_the_setup_installs():
    assert "torch==2.13.0" in PROJECT["project"]["dependencies"]
    assert '"torch==2.13.0"' in (ROOT / "scripts" / "setup.sh").read_text()

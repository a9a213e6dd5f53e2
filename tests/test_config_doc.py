"""docs/configuration.md: generated from EngineConfig and ServerConfig, committed, and current."""

from __future__ import annotations

from pathlib import Path

from flashmemory.config import EngineConfig
from flashmemory.config_args import env_names, option_strings
from flashmemory.tools.config_doc import REGENERATE_COMMAND, render_markdown
from flashmemory.serve.config import ServerConfig
from flashmemory.settings import field_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_committed_configuration_reference_is_current():
    committed = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert committed == render_markdown(), (
        f"docs/configuration.md is not what the code renders; regenerate it with `{REGENERATE_COMMAND}` "
        "(from the repository root) and commit it")


def test_the_reference_lists_every_setting_with_its_flag_and_variable():
    doc = render_markdown()
    for cls in (EngineConfig, ServerConfig):
        for name in field_names(cls):
            row = next((line for line in doc.splitlines() if line.startswith(f"| `{name}` |")), None)
            assert row is not None, name
            assert all(f"`{flag}`" in row for flag in option_strings(cls, name)), name
            assert all(f"`{var}`" in row for var in env_names(cls, name)), name


def test_the_reference_says_how_to_regenerate_it_in_its_first_line():
    assert REGENERATE_COMMAND in render_markdown().splitlines()[0]

"""The configuration reference (docs/configuration.md), rendered from EngineConfig's and ServerConfig's Settings.

Regenerate it with: python -m flashmemory.tools.config_doc > docs/configuration.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from flashmemory.config import EngineConfig
from flashmemory.config_args import engine_placement_names, env_names, option_strings
from flashmemory.serve.config import DEFAULT_MAX_NUM_SEQS, ServerConfig
from flashmemory.settings import default_of, describe_range, field_names, setting_of

REGENERATE_COMMAND = "python -m flashmemory.tools.config_doc > docs/configuration.md"

_INTRO = """\
Every engine setting is a keyword of `FlashMemoryEngine(...)` (and a field of `EngineConfig`) and a flag of
`flashmemory generate`, `flashmemory trace` and the server (`flashmemory serve`, `python -m flashmemory.serve`);
`flashmemory eval` takes `--model`, `--dtype` and `--threads`. The server also reads every setting from its
environment variable (switches take 1/0, true/false, yes/no or on/off); the command line wins, and a bad
variable stops the server with an error that names it. A setting not given keeps the default below; a value
outside its bounds is a `ConfigError` that says what to use."""

_SERVER_NOTE = "The server also takes the model as a positional argument (same as `--model-path`)."


def render_markdown() -> str:
    """The whole reference: a header line, the introduction, then one table per group of settings."""
    parts = [f"<!-- Generated from EngineConfig and ServerConfig; do not edit. Regenerate: {REGENERATE_COMMAND} -->",
             "", "# Configuration reference", "", _INTRO, ""]
    groups = [("Engine: where and how the model runs", EngineConfig, engine_placement_names(), ""),
              ("KV hierarchy", EngineConfig, EngineConfig.kv_field_names(), ""),
              ("Server", ServerConfig, field_names(ServerConfig), _SERVER_NOTE)]
    for title, cls, names, note in groups:
        parts += [f"## {title}", ""] + ([note, ""] if note else []) + _table(cls, names) + [""]
    return "\n".join(parts)


def _table(cls: type, names: Sequence[str]) -> list[str]:
    rows = ["| Setting | Flag | Environment variable | Default | Unit, bounds | Description |",
            "|---|---|---|---|---|---|"]
    for name in names:
        cells = [f"`{name}`", _flags(cls, name), ", ".join(f"`{v}`" for v in env_names(cls, name)),
                 _default(cls, name), describe_range(setting_of(cls, name)), setting_of(cls, name).help]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows


def _flags(cls: type, name: str) -> str:
    spellings = list(option_strings(cls, name))
    if setting_of(cls, name).negatable:
        spellings += [f"--no-{f[2:]}" for f in spellings]
    return ", ".join(f"`{f}`" for f in spellings)


def _default(cls: type, name: str) -> str:
    text = f"`{_plain(default_of(cls, name))}`"
    if cls is EngineConfig and name == "max_num_seqs":
        text += f" (server: `{DEFAULT_MAX_NUM_SEQS}`)"
    return text


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m flashmemory.tools.config_doc", description="Print the configuration "
                            f"reference as markdown: {REGENERATE_COMMAND}").parse_args(argv)
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command-line flags and FLASHMEMORY_* variables generated from the config dataclasses' Settings, and the way back
from parsed flags to config keyword arguments (stdlib + argparse only; the CLI and the server both use it)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flashmemory.config import EngineConfig
from flashmemory.errors import ConfigError
from flashmemory.settings import default_of, describe_range, field_names, field_type, parse_text, setting_of

ENV_PREFIX = "FLASHMEMORY_"


@dataclass(frozen=True)
class Flag:
    """One generated flag: the config class and field it sets, and its argparse dest."""

    cls: type
    name: str
    dest: str


def option_strings(cls: type, name: str) -> tuple[str, ...]:
    """The flag's spellings: the Setting's, else --field-name."""
    return setting_of(cls, name).flags or ("--" + name.replace("_", "-"),)


def dest_of(cls: type, name: str) -> str:
    return setting_of(cls, name).dest or name


def env_names(cls: type, name: str) -> tuple[str, ...]:
    """FLASHMEMORY_<FIELD> first, then the older names still accepted (FLASHMEMORY_THREADS)."""
    return (ENV_PREFIX + name.upper(), *setting_of(cls, name).env_aliases)


def engine_placement_names() -> list[str]:
    """EngineConfig's fields on where and how the model runs (the ones before the KV hierarchy)."""
    kv = set(EngineConfig.kv_field_names())
    return [n for n in field_names(EngineConfig) if n not in kv]


def add_engine_flags(p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> list[Flag]:
    """--model-path/--model, --device, --dtype, --max-seq-len, --threads; unset ones leave EngineConfig's defaults."""
    return add_flags(p, EngineConfig, engine_placement_names(), "engine", defaults)


def add_kv_flags(p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> list[Flag]:
    """Every KV-hierarchy field as a flag named after it (--kv-precision, --no-cold-zone, --block-size, ...)."""
    return add_flags(p, EngineConfig, EngineConfig.kv_field_names(), "KV hierarchy", defaults)


def add_flags(p: argparse.ArgumentParser, cls: type, names: Iterable[str], title: str,
              defaults: Mapping[str, Any] | None = None) -> list[Flag]:
    """One flag per field in a new argument group. A flag not given leaves its `defaults` entry in the namespace,
    else None, which config_kwargs leaves out so that the dataclass default applies."""
    defaults = defaults or {}
    group = p.add_argument_group(title)
    added = []
    for name in names:
        default = defaults.get(name)
        shown = default if name in defaults else default_of(cls, name)
        group.add_argument(*option_strings(cls, name), **_argparse_options(cls, name, default, shown))
        added.append(Flag(cls, name, dest_of(cls, name)))
    return added


def dataclass_defaults(cls: type, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The dataclass's defaults, for flags whose namespace should hold them when not given (the server's)."""
    return {n: default_of(cls, n) for n in (field_names(cls) if names is None else names)}


def _argparse_options(cls: type, name: str, default: Any, shown: Any) -> dict[str, Any]:
    s, kind = setting_of(cls, name), field_type(cls, name)
    options: dict[str, Any] = {"dest": dest_of(cls, name), "default": default, "help": flag_help(cls, name, shown)}
    if kind.is_bool and s.negatable:
        options["action"] = argparse.BooleanOptionalAction
    elif kind.is_bool:
        options.update(action="store_const", const=not option_strings(cls, name)[0].startswith("--no-"))
    elif kind.types == (str,) and s.choices:
        options["choices"] = list(s.choices)
    else:
        # None (text) for str and for "auto"|int, which config_kwargs converts
        options.update(type=kind.numeric, metavar=name.upper())
    return options


def flag_help(cls: type, name: str, shown_default: Any) -> str:
    """The Setting's help plus unit, bounds and default: "newest tokens kept in L0 (tokens, >= 1; default: 2048)"."""
    s, kind = setting_of(cls, name), field_type(cls, name)
    details = [describe_range(s, with_choices=kind.types != (str,))]
    if kind.is_bool and shown_default is not None:
        details.append(f"default: {'on' if shown_default else 'off'}")
    elif shown_default is not None:
        details.append(f"default: {shown_default}")
    details = [d for d in details if d]
    text = s.help + (f" ({'; '.join(details)})" if details else "")
    return text.replace("%", "%%")  # argparse formats help with %


def config_kwargs(args: argparse.Namespace, cls: type, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Keyword arguments of `cls` from the flags that hold a value; a field whose flag is absent or None is left
    out, so the dataclass default applies. Text for an "auto"|int field becomes its value here."""
    out = {}
    for name in field_names(cls) if names is None else names:
        value = getattr(args, dest_of(cls, name), None)
        if value is None:
            continue
        if isinstance(value, str) and field_type(cls, name).types == (int, str):
            value = parse_text(cls, name, value, f"{option_strings(cls, name)[0]} {value!r}")
        out[name] = value
    return out


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keywords for the engine flags set on the command line (or by a variable)."""
    return config_kwargs(args, EngineConfig)


def env_value(cls: type, name: str, environ: Mapping[str, str]) -> Any:
    """The value the environment gives field `name` (None when no variable is set); a bad one is a ConfigError
    naming the variable."""
    found = {var: environ[var] for var in env_names(cls, name) if var in environ}
    if len(set(found.values())) > 1:
        given = " and ".join(f"{var}={raw!r}" for var, raw in found.items())
        raise ConfigError(f"{given} disagree; set only {env_names(cls, name)[0]}")
    if not found:
        return None
    var, raw = next(iter(found.items()))
    return parse_text(cls, name, raw, f"{var}={raw!r}")


def apply_env_defaults(p: argparse.ArgumentParser, flags: Iterable[Flag], environ: Mapping[str, str]) -> None:
    """Take FLASHMEMORY_<FIELD> as the default of each flag (the command line wins). A bad variable is kept in
    `env_errors` and raised by check_env_errors when the command runs, not while the parser is built."""
    defaults: dict[str, Any] = {}
    errors: list[str] = []
    for flag in flags:
        try:
            value = env_value(flag.cls, flag.name, environ)
        except ConfigError as e:
            errors.append(str(e))
            continue
        if value is not None:
            defaults[flag.dest] = value
    p.set_defaults(**defaults, env_errors=errors)


def check_env_errors(args: argparse.Namespace) -> None:
    errors = getattr(args, "env_errors", [])
    if errors:
        raise ConfigError("; ".join(errors))

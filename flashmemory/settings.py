"""Setting: the documentation of a config dataclass field (help, unit, bounds, choices, flag), and the checks,
text parsing and wording it drives for EngineConfig and ServerConfig alike (stdlib only)."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from flashmemory.errors import ConfigError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """What one config field means and accepts; flags, variables, checks and docs are all read from it."""

    help: str  # one line: what the value does (and what None means, where None is allowed)
    unit: str | None = None  # "tokens", "MiB", "GiB", "bytes", "seconds", "fraction", ...
    ge: float | None = None  # inclusive lower bound
    gt: float | None = None  # exclusive lower bound
    le: float | None = None  # inclusive upper bound
    lt: float | None = None  # exclusive upper bound
    choices: tuple[Any, ...] = ()  # the only values accepted (exact match); a str field's flag enforces them
    flags: tuple[str, ...] = ()  # CLI spellings where they differ from --field-name ("--no-x" turns a bool off)
    dest: str | None = None  # argparse dest where it differs from the field name (kept for older callers)
    env_aliases: tuple[str, ...] = ()  # older variable names accepted besides FLASHMEMORY_<FIELD>
    negatable: bool = False  # a bool flag that comes as --x / --no-x


@dataclass(frozen=True)
class FieldType:
    """The Python types a field takes, read from its annotation (`int | str | None` -> (int, str), optional)."""

    types: tuple[type, ...]
    optional: bool

    @property
    def is_bool(self) -> bool:
        return self.types == (bool,)

    @property
    def numeric(self) -> type | None:
        """int or float when the field is a plain number (the kind bounds apply to), else None."""
        return self.types[0] if self.types in ((int,), (float,)) else None


def setting(default: Any, help: str, *, repr: bool = True, **meta: Any) -> Any:
    """A dataclass field whose default is `default` and whose metadata is Setting(help, **meta)."""
    return dataclasses.field(default=default, repr=repr, metadata={"setting": Setting(help, **meta)})


def setting_of(cls: type, name: str) -> Setting:
    meta = cls.__dataclass_fields__[name].metadata  # type: ignore[attr-defined]
    assert "setting" in meta, f"{cls.__name__}.{name} is declared without setting(...)"
    return meta["setting"]


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def default_of(cls: type, name: str) -> Any:
    return cls.__dataclass_fields__[name].default  # type: ignore[attr-defined]


def field_types(cls: type) -> dict[str, FieldType]:
    """Every field's FieldType, read from the class's annotations."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        members = typing.get_args(hint) if union else (hint,)
        out[name] = FieldType(tuple(t for t in members if t is not type(None)), type(None) in members)
    return out


def field_type(cls: type, name: str) -> FieldType:
    return field_types(cls)[name]


def check_settings(obj: Any, cls: type | None = None) -> None:
    """Raise ConfigError for the first field of `obj` outside its type, bounds or choices; `cls`
    (default: obj's class) is the dataclass whose fields are checked (a base, where a subclass
    adds fields that are not settings)."""
    cls = cls or type(obj)
    kinds = field_types(cls)
    for name in field_names(cls):
        s, kind, value = setting_of(cls, name), kinds[name], getattr(obj, name)
        if value is None and kind.optional:
            continue
        if s.choices:
            if not any(value == c and type(value) is type(c) for c in s.choices):
                raise ConfigError(f"{name}={value!r}: use {_alternatives(s.choices)}" + _unit(s))
        elif kind.numeric is not None and not _within(value, kind.numeric, s):
            raise ConfigError(f"{name}={value!r} must be {requirement(s, kind)}" + _unit(s)
                              + (", or None" if kind.optional else ""))


def _within(value: Any, number: type, s: Setting) -> bool:
    accepted = (int,) if number is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, accepted):
        return False
    return ((s.ge is None or value >= s.ge) and (s.gt is None or value > s.gt)
            and (s.le is None or value <= s.le) and (s.lt is None or value < s.lt))


def requirement(s: Setting, kind: FieldType) -> str:
    """What a value must be, in words: "a positive integer", "a number in (0, 1]", "an integer >= 0"."""
    noun = "an integer" if kind.numeric is int else "a number"
    positive = s.gt == 0 or (kind.numeric is int and s.ge == 1)
    if positive and s.le is None and s.lt is None:
        return f"a positive {noun.split()[-1]}"
    bounds = describe_bounds(s)
    return f"{noun} {bounds}" if bounds else noun


def describe_bounds(s: Setting) -> str:
    """The bounds as ">= 0", "> 0" or "in (0, 1]"; empty when there are none."""
    low = (f"[{s.ge}" if s.ge is not None else f"({s.gt}" if s.gt is not None else None)
    high = (f"{s.le}]" if s.le is not None else f"{s.lt})" if s.lt is not None else None)
    if low and high:
        return f"in {low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]
    return ""


def describe_range(s: Setting, *, with_choices: bool = True) -> str:
    """Unit, bounds and choices for help texts and the reference: "MiB, > 0", "tokens, one of auto, 8, 16"."""
    parts = [s.unit] if s.unit else []
    if s.choices and with_choices:
        parts.append("one of " + ", ".join(str(c) for c in s.choices))
    elif not s.choices and describe_bounds(s):
        parts.append(describe_bounds(s))
    return ", ".join(parts)


def parse_text(cls: type, name: str, raw: str, label: str) -> Any:
    """The value a flag or environment variable's text means for field `name`; `label` names the source in errors
    (e.g. "FLASHMEMORY_PORT='x'" or "--block-size 'x'")."""
    kind, s = field_type(cls, name), setting_of(cls, name)
    if kind.is_bool:
        flag = raw.strip().lower()
        if flag not in _TRUE + _FALSE:
            raise ConfigError(f"{label}: use 1/0, true/false, yes/no or on/off")
        return flag in _TRUE
    if kind.types == (int, str):  # a number, or one of the words among the choices ("auto")
        words = [c for c in s.choices if isinstance(c, str)]
        if raw in words:
            return raw
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{label}: use {_alternatives(words)} or a number" + _unit(s)) from None
    if kind.numeric is not None:
        try:
            return kind.numeric(raw)
        except ValueError:
            raise ConfigError(f"{label} is not a valid {kind.numeric.__name__}") from None
    if s.choices and raw not in s.choices:
        raise ConfigError(f"{label}: use one of {', '.join(map(str, s.choices))}")
    return raw


def _alternatives(choices: tuple[Any, ...] | list[Any]) -> str:
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _unit(s: Setting) -> str:
    return f" ({s.unit})" if s.unit else ""

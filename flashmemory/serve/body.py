"""parse_body: a raw request body -> a validated request model, or a 400 that names the problem.

Checked in this order, each before the step it protects: the nesting depth and the number of arrays
and objects (before parsing, which recurses and builds one object each), UTF-8 and JSON syntax
(numbers must be finite: no NaN or Infinity), that every string is valid Unicode (a lone surrogate
such as "\\ud800" cannot be tokenized or written back as UTF-8), and the request model's strict
types (no true for an integer, no "yes" for a boolean, no 3.0 for an integer).

Every step is linear in the body and stops at the first problem (issue 24: a 64 KB body of escaped
quotes took 13 s, an 8 MiB array of floats a minute); app.py runs it in a worker thread for bodies
above 64 KiB.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from flashmemory.serve.api_errors import APIError

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; an OpenAI request needs about 6
# Arrays and objects in all; a request needs a few per message or prompt. Each is a Python object
# that every full garbage collection walks, contents and all, while more are built: 8 MiB of token
# ids took 0.6 s as 80,000 lists, 0.3 s as 10,000 or fewer.
MAX_JSON_CONTAINERS = 20_000

_BRACKET_STEP = np.zeros(256, dtype=np.int8)  # +1 where a bracket opens, -1 where it closes
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1
_QUOTE = ord('"')
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
# Digits -> "0", e/E -> "e", signs -> "+", the rest -> " ": where to look for a huge number.
_NUMBER_SHAPE = bytes(ord("0") if chr(b).isdigit() else ord("e") if chr(b) in "eE" else ord("+")
                      if chr(b) in "+-" else ord(" ") for b in range(128)) + b" " * 128
# A lone surrogate can only come from an escape (strict UTF-8 decoding refuses encoded ones).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_nesting(raw: bytes) -> tuple[int, int]:
    """How deeply arrays and objects nest in `raw`, and how many there are (brackets in strings do
    not count).

    Byte replacements and vectorized passes, no parsing, no recursion: 10-30 ms per 8 MiB whatever
    the bytes are (the regex over strings it replaces was quadratic on a run of escaped quotes).
    """
    # Drop escaped backslashes, then escaped quotes: a run of n backslashes leaves n % 2, so every
    # quote left delimits a string; then all but quotes and brackets. NOTE: the UTF-8 bytes of
    # non-ASCII characters are >= 0x80: never a quote or a bracket.
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    codes = np.frombuffer(text, dtype=np.uint8)
    steps = _BRACKET_STEP.take(codes)
    steps *= ~np.logical_xor.accumulate(codes == _QUOTE)  # True from an opening quote to its close
    total = np.int32 if len(codes) < 2**31 else np.int64  # the depth never exceeds the length
    return int(np.cumsum(steps, dtype=total).max(initial=0)), int(np.count_nonzero(steps == 1))


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON body -> request model; any problem is a 400 naming the offending field or limit."""
    depth, num_containers = json_nesting(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests arrays and objects {depth} deep; this server "
                       f"accepts at most {MAX_JSON_DEPTH} levels", code="invalid_value")
    if num_containers > MAX_JSON_CONTAINERS:
        raise APIError(400, f"the request body holds {num_containers} arrays and objects; this "
                       f"server accepts at most {MAX_JSON_CONTAINERS} (a request needs a few per "
                       "message or prompt)", code="invalid_value")
    has_surrogate_escape = _SURROGATE_ESCAPE.search(raw) is not None
    may_overflow = _may_overflow(raw)
    checked = has_surrogate_escape or may_overflow or b"NaN" in raw or b"Infinity" in raw
    data = _load_json(raw, checked)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if has_surrogate_escape or may_overflow:
        bad = _first_invalid_value(data, strings=has_surrogate_escape, numbers=may_overflow)
        if bad is not None:
            path, problem = bad
            raise APIError(400, f"{path}: {problem}", param=path.split(".")[0],
                           code="invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _describe(e, data)
        raise APIError(400, message, param=param, code="invalid_value") from None


def _load_json(raw: bytes, checked: bool) -> Any:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
    if checked:
        return _load_json_checked(text)
    try:
        # jiter (pydantic's parser, in Rust): 3-4 times faster than json.loads on numbers. Its
        # string cache only slows a body parsed once (700,000 distinct keys: 0.5 s against 0.27).
        return from_json(text, allow_inf_nan=False, cache_strings=False)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def _load_json_checked(text: str) -> Any:
    """json.loads, for a body that may hold what jiter reports less well: a lone surrogate (refused
    without naming its field), NaN or Infinity (refused without naming them), an integer of more
    than 4300 digits, a number beyond a float's range (turned into infinity, found afterwards)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # NaN or Infinity, or an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {_number_problem(e)}") from None
    except RecursionError:  # NOTE: json_nesting keeps this from happening; never a 500 if it does
        raise APIError(400, "the request body nests too deeply (at most "
                       f"{MAX_JSON_DEPTH} levels)") from None


def _may_overflow(raw: bytes) -> bool:
    """Whether `raw` may hold a number beyond a float's range: a 3-digit exponent or 309 digits in
    a row (inside strings too: that only costs the checked parse)."""
    shape = raw.translate(_NUMBER_SHAPE)  # C loops: a fifth of a regex's time
    return b"e000" in shape or b"e+000" in shape or b"0" * 309 in shape


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _number_problem(e: ValueError) -> str:
    message = str(e)
    if "digits" in message:  # Python's int conversion limit; its message names a Python setting
        return "an integer in the body has too many digits"
    return message


_LONE_SURROGATE = ("the string is not valid Unicode (it holds a lone UTF-16 surrogate such as "
                   "\\ud800); send text that can be encoded as UTF-8")
_OUT_OF_RANGE = "the number is out of range (beyond 1.8e308, the largest float); send a finite one"
_NUMBER_TYPES = frozenset({int, float, bool, type(None)})


def _first_invalid_value(data: dict[str, Any], strings: bool,
                         numbers: bool) -> tuple[str, str] | None:
    """The dotted path and problem of the first string (key or value) holding a lone surrogate
    (when `strings`) or number beyond a float's range, which parsing made infinite (`numbers`).
    """
    # Depth first in document order, an iterator per open container: no per-element path built.
    stack: list[tuple[tuple, Any]] = [((), iter(data.items()))]
    while stack:
        path, items = stack[-1]
        for key, value in items:
            kind = type(value)
            if strings and type(key) is str and not _is_unicode(key):
                return ".".join(map(str, path)) or "body", _LONE_SURROGATE
            if kind is str:
                if strings and not _is_unicode(value):
                    return ".".join(map(str, (*path, key))), _LONE_SURROGATE
            elif kind is float:
                if numbers and not math.isfinite(value):
                    return ".".join(map(str, (*path, key))), _OUT_OF_RANGE
            elif kind is dict:
                stack.append(((*path, key), iter(value.items())))
                break
            elif kind is list and not _finite_numbers_only(value):
                stack.append(((*path, key), enumerate(value)))
                break
        else:
            stack.pop()
    return None


def _finite_numbers_only(items: list) -> bool:
    """Whether `items` holds only finite numbers, booleans and nulls (C loops: a third of a walk).
    """
    return (set(map(type, items)) <= _NUMBER_TYPES and math.inf not in items
            and -math.inf not in items)


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe(e: ValidationError, data: dict[str, Any]) -> tuple[str, str | None]:
    """A one-line message for the first invalid field, and that field's top-level name (OpenAI's `param`)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = first["loc"]
    param = str(loc[0]) if loc else None
    # A field with several accepted types (prompt, stop, content) reports one error per type, each under the
    # type's name: name them all. (A dict there holds fields, whose errors are reported one at a time.)
    same = [err["loc"] for err in errors if err["loc"][:1] == loc[:1]]
    prefix = _common_prefix(same)
    value = _value_at(data, prefix)
    kinds = list(dict.fromkeys(x[len(prefix)] for x in same if len(x) > len(prefix)))
    if len(kinds) > 1 and not isinstance(value, dict) and all(isinstance(k, str) for k in kinds):
        where = ".".join(str(x) for x in prefix)
        return f"{where}: expected {' or '.join(kinds)}, got {json_kind(value)}", param
    where = ".".join(str(x) for x in loc) or "body"
    bound = next(((op, first["ctx"][key]) for key, op in _BOUNDS.items() if key in first.get("ctx", {})), None)
    if bound is not None:
        op, limit = bound
        limit = f"{limit:.7g}" if isinstance(limit, float) else str(limit)
        return f"{where}: must be {op} {limit}, got {shown_json(first['input'])}", param
    if first["type"] == "missing":
        return f"{where}: {first['msg']}", param
    return f"{where}: {first['msg']}, got {shown_json(first['input'])}", param


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def shown_json(value: Any) -> str:
    """A JSON value as the client wrote it (scalars, cut at 40 characters), or its kind."""
    if isinstance(value, (list, dict)):
        return json_kind(value)
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in words: "a string", "a float", "null"."""
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _value_at(data: Any, path: tuple) -> Any:
    for key in path:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data

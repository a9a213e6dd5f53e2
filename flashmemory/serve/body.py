"""parse_body: a raw request body -> a validated request model, or a 400 that names the problem.

Checked in this order, each before the step it protects: the nesting depth (before json.loads, whose recursion
a deep body would exhaust), UTF-8 and JSON syntax (numbers must be finite: no NaN or Infinity), that every string
is valid Unicode (a lone surrogate such as "\\ud800" cannot be tokenized or written back as UTF-8), and the
request model's strict types (no true for an integer, no "yes" for a boolean, no 3.0 for an integer).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from flashmemory.serve.api_errors import APIError

MAX_JSON_DEPTH = 64  # arrays and objects inside each other; an OpenAI request needs about 6

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = np.zeros(256, dtype=np.int32)  # +1 where a bracket opens, -1 where it closes
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in `raw` (brackets inside strings do not count); no parsing, no recursion."""
    # NOTE: UTF-8 continuation bytes are >= 0x80, so a bracket byte outside a string is always a bracket.
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_A_BRACKET)
    if not brackets:
        return 0
    # About 30 ms per MiB of brackets; json.loads takes longer than that to build what they describe.
    return int(np.cumsum(_BRACKET_STEP.take(np.frombuffer(brackets, dtype=np.uint8))).max())


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON body -> request model; any problem is a 400 naming the offending field or limit."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests arrays and objects {depth} deep; this server accepts at most "
                       f"{MAX_JSON_DEPTH} levels", code="invalid_value")
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    bad = _invalid_string_path(data)
    if bad is not None:
        raise APIError(400, f"{bad}: the string is not valid Unicode (it holds a lone UTF-16 surrogate such as "
                       "\\ud800); send text that can be encoded as UTF-8", param=bad.split(".")[0],
                       code="invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _describe(e, data)
        raise APIError(400, message, param=param, code="invalid_value") from None


def _load_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # a constant or a number refused below, or an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {_number_problem(e)}") from None
    except RecursionError:  # NOTE: json_depth keeps this from happening; never a 500 if it does
        raise APIError(400, f"the request body nests too deeply (at most {MAX_JSON_DEPTH} levels)") from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def _number_problem(e: ValueError) -> str:
    message = str(e)
    if "digits" in message:  # Python's int conversion limit; its message names a Python setting
        return "an integer in the body has too many digits"
    return message


def _invalid_string_path(data: dict[str, Any]) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate; None when there is none."""
    # Strict UTF-8 decoding already refused encoded surrogates, so only a \uD800-\uDFFF escape can make one.
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                child = f"{path}.{key}" if path else str(key)
                if not _is_unicode(key):
                    return path or "body"
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in reversed(list(enumerate(value))))
    return None


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
        return f"{'.'.join(str(x) for x in prefix)}: expected {' or '.join(kinds)}, got {_json_type(value)}", param
    where = ".".join(str(x) for x in loc) or "body"
    bound = next(((op, first["ctx"][key]) for key, op in _BOUNDS.items() if key in first.get("ctx", {})), None)
    if bound is not None:
        op, limit = bound
        limit = f"{limit:.7g}" if isinstance(limit, float) else str(limit)
        return f"{where}: must be {op} {limit}, got {_shown(first['input'])}", param
    if first["type"] == "missing":
        return f"{where}: {first['msg']}", param
    return f"{where}: {first['msg']}, got {_shown(first['input'])}", param


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _shown(value: Any) -> str:
    """A JSON value as the client wrote it (scalars), or its kind (arrays, objects)."""
    if isinstance(value, (list, dict)):
        return _json_type(value)
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
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

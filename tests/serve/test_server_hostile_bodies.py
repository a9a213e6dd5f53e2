"""Bodies built to be expensive to parse (issue 24): each is a 400 naming its problem in well
under a second, and a stream served meanwhile keeps its pace. Before the fix, 64 KB of escaped
quotes froze the server for 13 s, and an 8 MiB array of floats for a minute (and 6 GB)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from flashmemory.serve.body import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH
from tests.serve.test_server_concurrency import _slow_model
from tests.serve.test_server_errors import error_of

MAX_BODY_BYTES = 8 * 2**20  # the default --max-body-bytes: the largest body a client can send
FAST_S = 1.0  # generous: a bound on complexity, not a benchmark (0.01-0.6 s a case here)
# On a loaded machine the bound grows with the time to move a plain body of the same size and
# to parse as many bytes of numbers (about 0.15 s here when idle): a quadratic parse (13 s for
# 64 KB before the fix) is still far beyond it, a busy CI runner is not.
LOAD_FACTOR = 8
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _fill(head: bytes, item: bytes, tail: bytes) -> Callable[[], bytes]:
    """A body of head, then `item` repeated, then tail: as close to 8 MiB as whole items allow."""
    return lambda: head + item * ((MAX_BODY_BYTES - len(head) - len(tail)) // len(item)) + tail


def _numbered_keys(head: bytes, tail: bytes) -> Callable[[], bytes]:
    """A body with an object of distinct keys, each holding a string where a number belongs."""
    n = (MAX_BODY_BYTES - len(head) - len(tail)) // len(b'"1000000":"x",')
    return lambda: head + b",".join(b'"%d":"x"' % i for i in range(n)) + tail


ESCAPED_QUOTES_64KB = b'{"prompt":"' + b'\\"' * 32_000  # unterminated: issue 24's 13 s body
FLOAT_PROMPT = _fill(b'{"prompt":[', b"1.5,", b"1.5]}")
TOKEN_ID_LIST = b"[" + b"1," * 255 + b"1],"  # 16,300 of them fill 8 MiB: under the container cap
CHECKED_PARSE = b'{"x":"NaN 1e999 \\ud83d\\ude00","prompt":['  # takes json.loads and a walk

HOSTILE = {  # id: (route, body, param, a fragment of the message)
    "escaped-quotes-64KB": (COMPLETIONS, lambda: ESCAPED_QUOTES_64KB, None, "not valid JSON"),
    "escaped-quotes-8MiB": (COMPLETIONS, _fill(b'{"prompt":"', b'\\"', b""), None,
                            "not valid JSON"),
    "float-prompt": (COMPLETIONS, FLOAT_PROMPT, "prompt",
                     "prompt[0] is a float (1.5); prompt must be a string, a list of strings"),
    "unclosed-nesting": (COMPLETIONS, _fill(b'{"prompt":', b"[", b""), None,
                         f"at most {MAX_JSON_DEPTH} levels"),
    "two-million-empty-arrays": (COMPLETIONS, _fill(b'{"prompt":[', b"[],", b"[]]}"), None,
                                 f"at most {MAX_JSON_CONTAINERS}"),
    "token-id-lists-bad-at-the-end": (COMPLETIONS,
                                      _fill(b'{"prompt":[', TOKEN_ID_LIST, b'[1,"x"]]}'),
                                      "prompt", '][1] is a string ("x"); prompt must be'),
    "strings-then-an-integer": (COMPLETIONS, _fill(b'{"prompt":[', b'"a",', b"1]}"), "prompt",
                                "is an integer (1) but prompt[0] is a string"),
    "integer-stop-strings": (COMPLETIONS, _fill(b'{"prompt":"hi","stop":[', b"1,", b"1]}"), "stop",
                             "stop"),
    "integer-messages": (CHAT, _fill(b'{"messages":[', b"1,", b"1]}"), "messages", "messages.0"),
    "string-logit-biases": (COMPLETIONS, _numbered_keys(b'{"prompt":"hi","logit_bias":{', b"}}"),
                            "logit_bias", "logit_bias"),
    "float-tokens": ("/detokenize", _fill(b'{"tokens":[', b"1.5,", b"1.5]}"), "tokens",
                     "tokens[0] is a float (1.5)"),
    "float-prompt-on-the-checked-parse": (COMPLETIONS, _fill(CHECKED_PARSE, b"1.5,", b"1.5]}"),
                                          "prompt", "prompt[0] is a float (1.5)"),
    "lone-surrogate-after-4M-token-ids": (COMPLETIONS,
                                          _fill(b'{"prompt":[', b"1,", b'1],"model":"\\ud800"}'),
                                          "model", "lone UTF-16 surrogate"),
}


def _plain_body_s(http: httpx.Client, size: int) -> float:
    """This machine's pace now: the longer of sending a valid body of `size` bytes (a long string
    nobody reads) through the server and parsing `size` bytes of floats with json.loads here."""
    head = b'{"tokens":[],"pad":"'
    raw = head + b"a" * (size - len(head) - 2) + b'"}'
    start = time.monotonic()
    assert post_raw(http, "/detokenize", raw).status_code == 200
    sent = time.monotonic() - start
    floats = b"[" + b"1.5," * (size // 4 - 1) + b"1.5]"
    start = time.monotonic()
    json.loads(floats)
    return max(sent, time.monotonic() - start)


def post_raw(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_body_is_a_400_naming_the_problem_in_well_under_a_second(http, case):
    path, build, param, fragment = HOSTILE[case]
    raw = build()
    assert len(raw) <= MAX_BODY_BYTES
    limit = max(FAST_S, LOAD_FACTOR * _plain_body_s(http, len(raw)))
    start = time.monotonic()
    r = post_raw(http, path, raw)
    elapsed = time.monotonic() - start
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == param and fragment in err["message"], err
    assert elapsed < limit, f"{len(raw)} bytes took {elapsed:.2f} s (limit {limit:.2f} s)"
    assert http.get("/health").status_code == 200


def test_a_stream_keeps_its_pace_while_hostile_bodies_are_parsed(tiny_server, http):
    arrivals: list[float] = []
    stop = threading.Event()
    body = {"model": "tiny", "prompt": "Alice was", "max_tokens": 240, "ignore_eos": True,
            "stream": True}

    def read_stream() -> None:
        with httpx.Client(base_url=tiny_server.url, timeout=30) as client:
            with client.stream("POST", COMPLETIONS, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.monotonic())
                    if stop.is_set():
                        return  # leaving closes the connection: the engine aborts the sequence

    bodies = [ESCAPED_QUOTES_64KB, FLOAT_PROMPT()] * 2
    limit = max(FAST_S, LOAD_FACTOR * _plain_body_s(http, len(bodies[1])))
    model = _slow_model(tiny_server, 0.02)  # 240 tokens take 4.8 s or more: longer than the bodies
    reader = threading.Thread(target=read_stream)
    try:
        reader.start()
        assert tiny_server.wait_until(lambda: len(arrivals) >= 3), "the stream did not start"
        begin = time.monotonic()
        for raw in bodies:
            assert post_raw(http, COMPLETIONS, raw).status_code == 400
        end = time.monotonic()
        assert tiny_server.wait_until(lambda: arrivals[-1] > end + 0.1), "the stream stopped"
    finally:
        stop.set()
        reader.join(30)
        del model.forward
    window = [t for t in arrivals if begin - 1 <= t <= end + 1]
    gaps = [b - a for a, b in zip(window, window[1:])]
    assert max(gaps) < limit, f"the stream stalled {max(gaps):.2f} s while bodies were parsed"
    assert tiny_server.wait_until(tiny_server.kv_idle)

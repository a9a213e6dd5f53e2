"""Traffic: the mixed client load MATS-3 keeps on a server — short and long prompts, streaming and not, clients
that give up part-way, and a few bad requests that must be refused with a 4xx — and what each request saw.

Latency is measured at the client: time to first token (TTFT) and the gaps between streamed tokens (inter-token
latency, ITL) on streaming requests; end-to-end time on all of them.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

WORDS = (
    "the sea river mountain city light small quiet old new bright long story garden winter summer morning night "
    "letter window door road bridge market station library teacher student doctor farmer music paper stone water "
    "fire wind cloud forest island harbor village castle tower clock table chair kitchen bread apple orange coffee "
    "walks reads writes builds opens closes carries finds keeps remembers explains watches follows answers travels "
    "because although while after before during between across under above near far slowly quickly carefully "
    "gently suddenly finally often never always sometimes together alone every each many few several"
).split()
KIND_WEIGHTS = {  # relative frequency of each kind of request
    "chat": 60, "long": 10, "stream_abort": 8, "plain_abort": 5, "bad": 5,
}
STREAM_PROBABILITY = 0.5  # of a chat or long request being streamed
LONG_PROMPT_FRACTION = (0.15, 0.4)  # a long prompt's tokens, as a fraction of min(max_model_len, LONG_PROMPT_CAP)
LONG_PROMPT_CAP = 1536  # so long prompts are 230-610 tokens on an 8K model: past a small window and warm span
PLAIN_ABORT_AFTER_S = (0.2, 0.6)  # a client waiting for a plain answer gives up after this long
REQUEST_TIMEOUT_S = 300.0


@dataclass
class RequestRecord:
    """One request as the client saw it."""

    kind: str
    started_s: float  # since the load began
    streamed: bool = False
    expected_failure: bool = False  # a bad request: must be refused with a 4xx
    status: int | None = None  # the HTTP status (None: no response, e.g. the client gave up)
    aborted: bool = False  # the client gave up on purpose
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    num_tokens: int = 0
    error: str | None = None  # what went wrong that should not have

    @property
    def ok(self) -> bool:
        return self.error is None


class Traffic:
    """Owns the client threads that keep one server under a mixed load, and every request's record."""

    def __init__(self, url: str, model_id: str, max_model_len: int, tokens_per_word: float, concurrency: int,
                 seed: int) -> None:
        self.url = url
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.tokens_per_word = tokens_per_word
        self.concurrency = concurrency
        self.seed = seed
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self.started = time.monotonic()
        kinds = list(KIND_WEIGHTS)
        self._kinds, self._weights = kinds, [KIND_WEIGHTS[k] for k in kinds]

    # ---- driving ------------------------------------------------------------------------------------------------

    def run(self, until: float, stop: threading.Event) -> list[threading.Thread]:
        """Start the client threads (they stop at `until` or when `stop` is set); returns them, running."""
        self.started = time.monotonic()
        threads = [threading.Thread(target=self._client, args=(i, until, stop), name=f"mats-client-{i}", daemon=True)
                   for i in range(self.concurrency)]
        for t in threads:
            t.start()
        return threads

    def _client(self, index: int, until: float, stop: threading.Event) -> None:
        rng = random.Random(self.seed * 7919 + index)
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
            while time.monotonic() < until and not stop.is_set():
                record = self.one(client, rng.choices(self._kinds, self._weights)[0], rng)
                with self._lock:
                    self.records.append(record)

    def one(self, client: httpx.Client, kind: str, rng: random.Random) -> RequestRecord:
        """Send one request of `kind` and record what came back."""
        record = RequestRecord(kind, time.monotonic() - self.started)
        started = time.monotonic()
        try:
            if kind == "bad":
                self._bad(client, rng, record)
            elif kind == "plain_abort":
                self._plain_abort(client, rng, record)
            else:
                streamed = kind == "stream_abort" or rng.random() < STREAM_PROBABILITY
                path, body = self._body(kind, rng)
                if streamed:
                    self._stream(client, path, body, record, rng.randint(1, 3) if kind == "stream_abort" else None)
                else:
                    self._plain(client, path, body, record)
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}"
        record.e2e_s = time.monotonic() - started
        return record

    # ---- request bodies -----------------------------------------------------------------------------------------

    def _text(self, rng: random.Random, num_words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."

    def _body(self, kind: str, rng: random.Random) -> tuple[str, dict]:
        if kind == "long":
            cap = min(self.max_model_len, LONG_PROMPT_CAP)
            num_tokens = int(cap * rng.uniform(*LONG_PROMPT_FRACTION))
            prompt = self._text(rng, max(8, int(num_tokens / self.tokens_per_word)))
            return "/v1/completions", {"model": self.model_id, "prompt": prompt, "max_tokens": rng.randint(4, 12),
                                       "ignore_eos": True, "temperature": 0.7, "seed": rng.randint(0, 2**30)}
        content = f"Tell me about {self._text(rng, rng.randint(6, 30))}"
        max_tokens = rng.randint(16, 48) if kind == "stream_abort" else rng.randint(4, 16)
        return "/v1/chat/completions", {"model": self.model_id, "messages": [{"role": "user", "content": content}],
                                        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7,
                                        "seed": rng.randint(0, 2**30)}

    # ---- the kinds of requests ----------------------------------------------------------------------------------

    def _plain(self, client: httpx.Client, path: str, body: dict, record: RequestRecord) -> None:
        response = client.post(path, json=body)
        record.status = response.status_code
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return
        record.num_tokens = int(response.json().get("usage", {}).get("completion_tokens", 0))

    def _stream(self, client: httpx.Client, path: str, body: dict, record: RequestRecord,
                abort_after: int | None) -> None:
        record.streamed = True
        body = {**body, "stream": True}
        started = time.monotonic()
        last = None
        with client.stream("POST", path, json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                response.read()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    return
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = f"error chunk: {chunk['error'].get('message', chunk['error'])}"
                    return
                if not _is_token(chunk):
                    continue
                now = time.monotonic()
                if last is None:
                    record.ttft_s = now - started
                else:
                    record.itl_s.append(now - last)
                last = now
                record.num_tokens += 1
                if abort_after is not None and record.num_tokens >= abort_after:
                    record.aborted = True  # leaving the block closes the connection: the server must abort
                    return
        if abort_after is None:
            record.error = "the stream ended without data: [DONE]"

    def _plain_abort(self, client: httpx.Client, rng: random.Random, record: RequestRecord) -> None:
        path, body = self._body("chat", rng)
        body["max_tokens"] = rng.randint(32, 64)
        try:
            response = client.post(path, json=body, timeout=rng.uniform(*PLAIN_ABORT_AFTER_S))
        except httpx.TimeoutException:
            record.aborted = True
            return
        record.status = response.status_code  # it answered before the client gave up: fine if a 200
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {response.text[:200]}"

    def _bad(self, client: httpx.Client, rng: random.Random, record: RequestRecord) -> None:
        """A request the server must refuse with a 4xx (never a 5xx, never a 200)."""
        record.expected_failure = True
        messages = [{"role": "user", "content": "hello"}]
        bodies = [
            ("/v1/chat/completions", {"model": self.model_id, "messages": messages, "max_tokens": 0}),
            ("/v1/chat/completions", {"model": "no-such-model", "messages": messages}),
            ("/v1/chat/completions", {"model": self.model_id, "messages": messages, "temperature": -1}),
            ("/v1/completions", {"model": self.model_id, "prompt": "hello", "logprobs": 2}),
            ("/v1/completions", {"model": self.model_id, "prompt": "", "max_tokens": 4}),
        ]
        choice = rng.randrange(len(bodies) + 1)
        if choice == len(bodies):  # not JSON at all
            response = client.post("/v1/chat/completions", content=b"{not json",
                                   headers={"Content-Type": "application/json"})
        else:
            path, body = bodies[choice]
            response = client.post(path, json=body)
        record.status = response.status_code
        if not 400 <= response.status_code < 500:
            record.error = f"a bad request got HTTP {response.status_code}, not a 4xx: {response.text[:200]}"


def _is_token(chunk: dict) -> bool:
    """A streamed chunk carrying generated text (not the chat role header, not the usage chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    delta = choices[0].get("delta")
    if delta is not None:
        return "role" not in delta and "content" in delta
    return "text" in choices[0]

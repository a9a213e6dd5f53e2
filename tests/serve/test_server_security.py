"""API key on every route but /health (never logged), loopback by default, refusal of a public host without a key."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from flashmemory.errors import ConfigError, FlashMemoryError
from flashmemory.serve.config import ServerConfig
from flashmemory.serve.launcher import build_parser, run_server
from tests.serve.conftest import TINY_KV, free_port, live_server

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_server(tiny_llama):
    with live_server(dict(model_path=str(tiny_llama), **TINY_KV), api_key=KEY, served_model_name="tiny") as server:
        yield server


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                                              ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"),
                                              ("GET", "/no/such/route")])
def test_every_route_but_health_needs_the_key(keyed_server, method, path):
    with httpx.Client(base_url=keyed_server.url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            r = http.request(method, path, headers=headers, json={})
            assert r.status_code == 401, headers
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
            assert KEY not in r.text
        assert http.get("/health").status_code == 200


def test_the_right_key_works_with_the_openai_client(keyed_server, caplog):
    caplog.set_level(logging.DEBUG)
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert KEY not in caplog.text


def test_default_host_is_loopback_and_port_8000():
    args = build_parser().parse_args([])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert ServerConfig().host == "127.0.0.1"


def test_a_public_host_without_a_key_is_refused():
    with pytest.raises(ConfigError, match="refusing to listen on 0.0.0.0 without an API key"):
        ServerConfig(host="0.0.0.0")
    ServerConfig(host="0.0.0.0", api_key=KEY)
    ServerConfig(host="0.0.0.0", allow_unauthenticated=True)
    ServerConfig(host="::1")  # IPv6 loopback
    with pytest.raises(FlashMemoryError, match="refusing to listen"):
        run_server(build_parser().parse_args(["--host", "10.1.2.3"]))


def test_the_key_is_not_in_the_config_repr_or_the_startup_log(tiny_llama, caplog):
    caplog.set_level(logging.DEBUG)
    assert KEY not in repr(ServerConfig(api_key=KEY))
    # A model whose budget cannot work: the server starts, logs, fails to load and exits with the reason.
    args = build_parser().parse_args([str(tiny_llama), "--api-key", KEY, "--port", str(free_port()),
                                      "--max-gpu-memory-mb", "1", "--log-level", "debug"])
    with pytest.raises(FlashMemoryError, match="could not be loaded: max_gpu_memory_mb=1 is too small"):
        run_server(args)
    assert "API key: required" in caplog.text and KEY not in caplog.text

"""GET /health says "degraded", with the reason and no file path, while a KV level is not what
it should be (its cold-zone file deleted and not re-creatable); requests are still answered, and
it says "ok" again once it is."""

from __future__ import annotations

import errno
import os

import httpx

from flashmemory.kvcache.levels.cold_file import ColdFile
from tests.serve.conftest import TINY_KV, live_server


def _raise(error: Exception):
    def fail(*args, **kwargs):
        raise error
    return fail


PROMPT = {"prompt": "Alice was beginning to get very tired of sitting by her sister " * 3,
          "max_tokens": 4, "temperature": 0}


def test_deleted_cold_file_makes_health_degraded_until_it_is_recreated(tiny_llama, tmp_path,
                                                                        monkeypatch):
    kwargs = dict(model_path=str(tiny_llama), **TINY_KV, cold_zone_dir=str(tmp_path),
                  persist_cache=True)
    with live_server(kwargs) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        expected = http.post("/v1/completions", json=PROMPT).json()["choices"][0]["text"]
        assert http.get("/health").json() == {"status": "ok"}
        no_space = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(ColdFile, "_new_persistent_file", _raise(no_space))
        os.unlink(tmp_path / "kv-cache.cold")
        assert server.wait_until(lambda: http.get("/health").json()["status"] == "degraded")
        r = http.get("/health")
        assert r.status_code == 200 and "cannot be re-created" in r.json()["reasons"][0]
        assert str(tmp_path) not in r.text and ".cold" not in r.text
        answer = http.post("/v1/completions", json=PROMPT)  # still served, and the same
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
        monkeypatch.undo()
        server.worker.engine.cache.disk_pool.file._retry_at = 0.0  # the next try is due
        assert server.wait_until(lambda: http.get("/health").json() == {"status": "ok"})
        assert (tmp_path / "kv-cache.cold").exists()

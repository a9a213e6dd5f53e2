"""A local stand-in for the Hugging Face Hub: the few routes huggingface_hub calls (a model's
info with file sizes, its file tree, a file's resolve URL for HEAD and GET), served on 127.0.0.1
from files on disk; repos may be gated. Point huggingface_hub at it as HF_ENDPOINT does (see the
`hub` fixture in test_hub)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, Path]  # name in the repo -> file served
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                hub.requests.append(f"{self.command} {self.path}")

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                self.log_message()
                path = self.path.split("?")[0].strip("/")
                if path.startswith("api/models/"):
                    return self._info(path[len("api/models/"):])
                parts = path.split("/")
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._file("/".join(parts[:2]), "/".join(parts[4:]))
                self._reply(404, b"{}")

            def _repo(self, name: str) -> Repo | None:
                repo = hub.repos.get(name)
                if repo is None:
                    self._reply(404, b'{"error": "Repository not found"}', code="RepoNotFound")
                elif repo.gated and not self.headers.get("authorization"):
                    self._reply(401, b'{"error": "gated"}', code="GatedRepo")
                    return None
                return repo

            def _info(self, rest: str) -> None:
                name = "/".join(rest.split("/")[:2])
                repo = self._repo(name)
                if repo is not None and "/tree/" in rest:  # list_repo_tree (snapshot_download)
                    tree = [{"type": "file", "path": f, "size": p.stat().st_size,
                             "oid": hashlib.sha1(f.encode()).hexdigest()}
                            for f, p in repo.files.items()]
                    self._reply(200, json.dumps(tree).encode())
                elif repo is not None:
                    siblings = [{"rfilename": f, "size": p.stat().st_size}
                                for f, p in repo.files.items()]
                    body = json.dumps({"id": name, "sha": COMMIT, "siblings": siblings}).encode()
                    self._reply(200, body)

            def _file(self, name: str, filename: str) -> None:
                repo = self._repo(name)
                if repo is None:
                    return
                source = repo.files.get(filename)
                if source is None:
                    return self._reply(404, b"{}", code="EntryNotFound")
                size = source.stat().st_size
                etag = hashlib.sha1(f"{filename}:{size}".encode()).hexdigest()
                self.send_response(200)
                for k, v in (("ETag", f'"{etag}"'), ("X-Repo-Commit", COMMIT),
                             ("Content-Length", str(size)),
                             ("Content-Type", "application/octet-stream")):
                    self.send_header(k, v)
                self.end_headers()
                if self.command == "GET":
                    with open(source, "rb") as f:
                        shutil.copyfileobj(f, self.wfile)

            def _reply(self, status: int, body: bytes, code: str | None = None) -> None:
                self.send_response(status)
                if code is not None:
                    self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        self.server.shutdown()

"""A minimal in-process fake of the Hugging Face Hub HTTP API, for push_to_hub tests without network.

It serves exactly the endpoints that `PreTrainedModel.push_to_hub` (transformers 5.x, huggingface_hub 1.x/2.x) uses:

  POST /api/repos/create                               create a model repo (409 if it exists, as the Hub does)
  HEAD|GET /{repo_id}/resolve/{revision}/{filename}    file download (404 + X-Error-Code: EntryNotFound if absent)
  POST /api/validate-yaml                              README metadata check (always valid)
  POST /api/models/{repo_id}/preupload/{revision}      answers uploadMode "regular" for every file
  POST /api/models/{repo_id}/commit/{revision}         NDJSON commit; "file" items (inline base64) are stored
  GET /api/models/{repo_id}[/revision/{revision}]      model_info (id, sha, siblings), asked for by a no-op commit

Anything else -- another path, an "lfsFile" commit item, a missing/wrong bearer token on a write -- is answered
with HTTP 400 and recorded in `FakeHub.errors`, so that a client which swallows the error still fails the test
(tests assert `hub.errors == []`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Commit:
    oid: str
    summary: str
    files: dict[str, bytes]  # files added by this commit (path -> content)


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes] = field(default_factory=dict)  # current tree of the main branch
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> str:
        return self.commits[-1].oid if self.commits else "0" * 40


class FakeHub:
    def __init__(self, token: str = "hf_dummy"):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status) of every request served
        self.errors: list[str] = []  # everything the fake did not expect
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                hub._dispatch(self, "GET")

            def do_HEAD(self):
                hub._dispatch(self, "HEAD")

            def do_POST(self):
                hub._dispatch(self, "POST")

            def do_PUT(self):
                hub._dispatch(self, "PUT")

            def do_DELETE(self):
                hub._dispatch(self, "DELETE")

            def do_PATCH(self):
                hub._dispatch(self, "PATCH")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- helpers -----------------------------------------------------------------------------------------------
    def paths_requested(self, method: str | None = None) -> list[str]:
        return [p for m, p, _ in self.requests if method is None or m == method]

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, method: str, status: int, body: bytes = b"",
              content_type: str = "application/json", headers: dict[str, str] | None = None) -> None:
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if method != "HEAD" and body:
            h.wfile.write(body)

    def _json(self, h, method, status, obj, headers=None):
        self._send(h, method, status, json.dumps(obj).encode(), headers=headers)

    def _fail(self, h, method, path, why: str):
        self.errors.append(f"{method} {path}: {why}")
        self._json(h, method, 400, {"error": f"fake hub: {why}"}, headers={"X-Error-Message": f"fake hub: {why}"})
        return 400

    def _authorized(self, h) -> bool:
        return h.headers.get("Authorization") == f"Bearer {self.token}"

    def _read_body(self, h) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(h.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    h.rfile.readline()
                    break
                chunks.append(h.rfile.read(size))
                h.rfile.readline()
            return b"".join(chunks)
        n = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(n) if n else b""

    # -- routing -----------------------------------------------------------------------------------------------
    def _dispatch(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(h.path).path
        try:
            body = self._read_body(h) if method in ("POST", "PUT", "PATCH") else b""
            with self._lock:
                status = self._route(h, method, path, body)
        except Exception as e:  # a bug in the fake, or a payload it cannot parse: fail loudly
            self.errors.append(f"{method} {path}: fake hub crashed: {e!r}")
            try:
                self._json(h, method, 400, {"error": f"fake hub crashed: {e!r}"})
            except Exception:
                pass
            status = 400
        self.requests.append((method, path, status))

    def _route(self, h, method: str, path: str, body: bytes) -> int:
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(h, method, path, body)
        if method == "POST" and path == "/api/validate-yaml":
            self._json(h, method, 200, {"errors": [], "warnings": []})
            return 200
        m = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<op>preupload|commit)/(?P<rev>[^/]+)", path)
        if method == "POST" and m:
            repo = self.repos.get(unquote(m["repo"]))
            if not self._authorized(h):
                return self._fail(h, method, path, "missing or wrong bearer token")
            if repo is None:
                self._json(h, method, 404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"})
                self.errors.append(f"{method} {path}: repo does not exist")
                return 404
            if unquote(m["rev"]) != "main":
                return self._fail(h, method, path, f"only the main branch is supported, got {m['rev']!r}")
            if m["op"] == "preupload":
                return self._preupload(h, method, repo, body)
            return self._commit(h, method, path, repo, body)
        m = re.fullmatch(r"/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/]+))?", path)
        if method == "GET" and m:  # model_info / repo_info (create_commit asks for it when nothing changed)
            return self._model_info(h, method, path, unquote(m["repo"]), unquote(m["rev"] or "main"))
        m = re.fullmatch(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        if method in ("GET", "HEAD") and m:
            return self._resolve(h, method, path, unquote(m["repo"]), unquote(m["rev"]), unquote(m["file"]))
        return self._fail(h, method, path, "unknown endpoint")

    def _create_repo(self, h, method, path, body) -> int:
        if not self._authorized(h):
            return self._fail(h, method, path, "missing or wrong bearer token")
        payload = json.loads(body)
        if payload.get("type", "model") != "model":
            return self._fail(h, method, path, f"only model repos are supported, got {payload.get('type')!r}")
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if "/" not in repo_id:
            return self._fail(h, method, path, f"repo id without a namespace: {repo_id!r}")
        if repo_id in self.repos:  # what the Hub answers; create_repo(exist_ok=True) accepts it
            self._json(h, method, 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"})
            return 409
        self.repos[repo_id] = Repo(repo_id)
        self._json(h, method, 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})
        return 200

    def _preupload(self, h, method, repo: Repo, body: bytes) -> int:
        payload = json.loads(body)
        files = []
        for f in payload["files"]:
            content = repo.files.get(f["path"])
            files.append({"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                          "oid": _git_oid(content) if content is not None else None})
        self._json(h, method, 200, {"files": files, "commitOid": repo.head})
        return 200

    def _commit(self, h, method, path, repo: Repo, body: bytes) -> int:
        if h.headers.get("Content-Type", "").split(";")[0] != "application/x-ndjson":
            return self._fail(h, method, path, f"commit payload is not NDJSON: {h.headers.get('Content-Type')!r}")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            return self._fail(h, method, path, "commit payload does not start with a header item")
        added: dict[str, bytes] = {}
        for item in lines[1:]:
            key, value = item.get("key"), item.get("value", {})
            if key == "file" and value.get("encoding") == "base64":
                added[value["path"]] = base64.b64decode(value["content"])
            else:  # lfsFile, deletedFile, copies, ...: not expected for a plain push of small files
                return self._fail(h, method, path, f"unsupported commit item {key!r}")
        oid = hashlib.sha1(repo.head.encode() + json.dumps(sorted(added)).encode() + body).hexdigest()
        repo.files.update(added)
        repo.commits.append(Commit(oid, lines[0]["value"].get("summary", ""), added))
        self._json(h, method, 200, {"commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{oid}", "commitOid": oid,
                                    "pullRequestUrl": None, "success": True})
        return 200

    def _model_info(self, h, method, path, repo_id, rev) -> int:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._json(h, method, 404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"})
            return 404
        if rev not in ("main", repo.head):
            return self._fail(h, method, path, f"unknown revision {rev!r}")
        self._json(h, method, 200, {"id": repo_id, "modelId": repo_id, "sha": repo.head, "private": False,
                                    "siblings": [{"rfilename": f} for f in sorted(repo.files)]})
        return 200

    def _resolve(self, h, method, path, repo_id, rev, filename) -> int:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._json(h, method, 404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"})
            return 404
        if rev not in ("main", repo.head):
            self._json(h, method, 404, {"error": "Invalid rev id"}, headers={"X-Error-Code": "RevisionNotFound"})
            return 404
        content = repo.files.get(filename)
        if content is None:
            self._json(h, method, 404, {"error": "Entry not found"},
                       headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.head})
            return 404
        etag = _git_oid(content)
        self._send(h, method, 200, content, content_type="application/octet-stream",
                   headers={"ETag": f'"{etag}"', "X-Repo-Commit": repo.head})
        return 200


def _git_oid(content: bytes) -> str:
    """The git blob sha1 that the Hub reports as a regular file's oid/etag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()

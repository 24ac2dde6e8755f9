"""A stand-in Hugging Face Hub on the loopback: the part of the Hub's HTTP API huggingface_hub
uses to list a model repository and fetch its files.

- GET /api/models/ORG/NAME[/revision/REV]: id, sha (the commit), gated, siblings with size,
  blobId and lfs {sha256, size, pointerSize}.
- HEAD and GET /ORG/NAME/resolve/REV/PATH: X-Repo-Commit, ETag (sha256 for LFS files, git's
  blob id for others), X-Linked-Etag / X-Linked-Size for LFS files, Content-Length,
  Accept-Ranges; `Range: bytes=A-[B]` answered with 206 and Content-Range.
- Errors as the Hub sends them: 404 + X-Error-Code RepoNotFound / RevisionNotFound /
  EntryNotFound; 401 + GatedRepo for a gated repository's files without the token.

Faults to test against: `truncate_once` paths get their next whole-file GET cut off halfway
(Content-Length promises the whole file); `corrupt` paths are served with their last
byte changed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_stand_in_token"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".onnx", ".msgpack", ".png")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class StandInRepo:
    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    commit: str = field(init=False)

    def __post_init__(self):
        digest = hashlib.sha1(self.repo_id.encode())
        for path in sorted(self.files):
            digest.update(path.encode() + hashlib.sha1(self.files[path]).digest())
        self.commit = digest.hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_blob_id(data)

    def sibling(self, path: str) -> dict:
        data = self.files[path]
        entry = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
        if self.is_lfs(path):
            entry["lfs"] = {"sha256": self.etag(path), "size": len(data), "pointerSize": 134}
        return entry


class StandInHub:
    """Repositories served at `url` once started; `requests` records (method, repo id, path,
    Range header) of every resolve/ request."""

    def __init__(self):
        self.repos: dict[str, StandInRepo] = {}
        self.requests: list[tuple[str, str, str, str | None]] = []
        self.truncate_once: set[tuple[str, str]] = set()
        self.corrupt: set[tuple[str, str]] = set()
        self._server: ThreadingHTTPServer | None = None

    def add(self, repo_id: str, files: dict[str, bytes], gated: bool = False) -> StandInRepo:
        self.repos[repo_id] = StandInRepo(repo_id, dict(files), gated)
        return self.repos[repo_id]

    def add_folder(self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None,
                   gated: bool = False) -> StandInRepo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add(repo_id, {**files, **(extra or {})}, gated)

    def whole_file_gets(self, repo_id: str) -> list[str]:
        """Paths fetched by GET without a range (a download from the start), in order."""
        return [p for m, r, p, rng in self.requests if m == "GET" and r == repo_id and rng is None]

    def ranged_gets(self, repo_id: str) -> list[tuple[str, str]]:
        return [(p, rng) for m, r, p, rng in self.requests
                if m == "GET" and r == repo_id and rng is not None]

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "StandInHub":
        hub = self

        class Handler(_Handler):
            stand_in = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Handler(BaseHTTPRequestHandler):
    stand_in: StandInHub

    def log_message(self, *args) -> None:   # quiet: pytest shows failures, not access logs
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        parts = [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            rev = parts[5] if len(parts) >= 6 and parts[4] == "revision" else "main"
            self._model_info(f"{parts[2]}/{parts[3]}", rev)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
        else:
            self._error(404, "EntryNotFound", "not part of the stand-in hub")

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, repo_id: str, rev: str) -> StandInRepo | None:
        repo = self.stand_in.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        elif rev not in ("main", repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        else:
            return repo
        return None

    def _model_info(self, repo_id: str, rev: str) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit,
                           "private": False, "gated": "manual" if repo.gated else False,
                           "siblings": [repo.sibling(p) for p in sorted(repo.files)]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        self.stand_in.requests.append((self.command, repo_id, path, self.headers.get("Range")))
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must "
                        f"have access to it and be authenticated to access it. Please log in.")
            return
        if path not in repo.files:
            self._error(404, "EntryNotFound", f"{path} does not exist on \"{rev}\"")
            return
        data = repo.files[path]
        if (repo_id, path) in self.stand_in.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start, end, status = 0, len(data) - 1, 200
        wanted = self.headers.get("Range")
        if wanted:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, status = int(first), 206
            end = min(int(last), len(data) - 1) if last else len(data) - 1
            if start >= len(data):
                self._error(416, "RangeNotSatisfiable", "range not satisfiable")
                return
        self.send_response(status)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{repo.etag(path)}"')
        if repo.is_lfs(path):
            self.send_header("X-Linked-Etag", f'"{repo.etag(path)}"')
            self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end + 1 - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if head:
            return
        body = data[start:end + 1]
        if not wanted and (repo_id, path) in self.stand_in.truncate_once:
            self.stand_in.truncate_once.discard((repo_id, path))
            body = body[:len(body) // 2]     # the connection drops halfway through
            self.close_connection = True
        self.wfile.write(body)

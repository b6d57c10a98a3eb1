"""`recipe download` against a local stand-in for the Hugging Face Hub.

The server implements the calls huggingface_hub's snapshot_download makes (read from its installed source):
  GET  /api/models/{repo}/revision/{rev}        repo info with `sha` (the commit)
  GET  /api/models/{repo}/tree/{commit}         recursive file listing
  HEAD /{repo}/resolve/{commit}/{path}          ETag, X-Repo-Commit, Content-Length
  GET  /{repo}/resolve/{commit}/{path}          the bytes, honouring `Range: bytes=N-` with 206
Errors carry the X-Error-Code header the real Hub sends (GatedRepo, RepoNotFound, RevisionNotFound).
The client runs as a subprocess with HF_ENDPOINT pointing here (huggingface_hub reads it at import).
"""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_testsecret_DO_NOT_PRINT"

FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 8}',
    "model.safetensors": bytes(range(256)) * 1200,  # 300 KiB
    "README.md": b"# tiny\n",
    "original/consolidated.00.pth": b"\x00" * 5000,
}
# huggingface_hub writes what it received in DOWNLOAD_CHUNK_SIZE (10 MiB) pieces, so a resumable cut needs a
# file of a few chunks: cut at 1.25 chunks, the client keeps 1 chunk and asks for the rest with a Range.
BIG = "shards/model-00001.safetensors"
FILES[BIG] = bytes(range(256)) * (DOWNLOAD_CHUNK_SIZE * 5 // 2 // 256)


class FakeHub:
    """Repos, their access mode, and a log of the requests seen (method, path, headers)."""

    def __init__(self) -> None:
        self.repos = {"org/tiny": "public", "org/gated": "gated"}
        self.truncate_once: set[str] = set()  # files whose first GET is cut halfway (connection dropped)
        self.requests: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()


def make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

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

        def _json(self, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _repo_ok(self, repo: str) -> bool:
            mode = hub.repos.get(repo)
            if mode is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return False
            return True

        def do_GET(self) -> None:
            self._handle()

        def do_HEAD(self) -> None:
            self._handle()

        def _handle(self) -> None:
            path = self.path.split("?", 1)[0]
            with hub.lock:
                hub.requests.append((self.command, path, dict(self.headers)))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                repo, rev = m.groups()
                if not self._repo_ok(repo):
                    return
                if rev not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return self._json({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in FILES]})
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                if not self._repo_ok(m.group(1)):
                    return
                entries = [
                    {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in FILES.items()
                ]
                return self._json(entries)
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                repo, rev, file = m.groups()
                if not self._repo_ok(repo):
                    return
                auth = self.headers.get("Authorization", "")
                if hub.repos[repo] == "gated" and auth != f"Bearer {TOKEN}":
                    return self._error(
                        401, "GatedRepo", f"Access to model {repo} is restricted. You must be authenticated."
                    )
                if file not in FILES:
                    return self._error(404, "EntryNotFound", f"{file} does not exist")
                return self._send_file(FILES[file], file)
            self._error(404, "NotFound", "unknown route")

        def _send_file(self, data: bytes, file: str) -> None:
            start = 0
            rng = self.headers.get("Range")
            if rng and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", rng)):
                start = int(m.group(1))
            self.send_response(206 if start else 200)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            with hub.lock:
                cut = file in hub.truncate_once and not start
                hub.truncate_once.discard(file)
            if cut:
                # send half the promised bytes and drop the connection, as a flaky network would
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(data[start:])

    return Handler


@pytest.fixture
def hub():
    """A FakeHub served on 127.0.0.1 (free port) in a thread; shut down after the test."""
    state = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def download(endpoint: str, tmp_path: Path, *args: str, env_extra: dict | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf_home"),  # no saved token, no shared cache
        # our server never sends Xet headers; disabling Xet keeps the client on plain HTTP regardless
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        NO_PROXY="127.0.0.1,localhost",
    )
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "llm_recipe.cli.main", "download", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("recipe: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def test_download_files_with_ignore_patterns(hub, tmp_path):
    out = tmp_path / "model"
    proc = download(
        hub.endpoint,
        tmp_path,
        "org/tiny",
        "--output-dir",
        str(out),
        "--ignore-patterns",
        "original/*",
        "*.md",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out.resolve())
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == FILES[name]
    assert not (out / "original").exists() and not (out / "README.md").exists()
    # ignored files were never requested
    assert not any("original/" in p or p.endswith("README.md") for _, p, _ in hub.requests)


def test_interrupted_transfer_resumes_with_range(hub, tmp_path):
    hub.truncate_once.add(BIG)
    out = tmp_path / "model"
    proc = download(
        hub.endpoint, tmp_path, "org/tiny", "--output-dir", str(out), "--ignore-patterns", "original/*"
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / BIG).read_bytes() == FILES[BIG]
    ranges = [h.get("Range") for m, p, h in hub.requests if m == "GET" and p.endswith(BIG)]
    # the second GET asked only for what was missing after the first (complete) chunk
    assert ranges == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-"]


def test_second_download_skips_complete_files(hub, tmp_path):
    out = tmp_path / "model"
    assert (
        download(
            hub.endpoint, tmp_path, "org/tiny", "--output-dir", str(out), "--ignore-patterns", "shards/*"
        ).returncode
        == 0
    )
    hub.requests.clear()
    proc = download(
        hub.endpoint, tmp_path, "org/tiny", "--output-dir", str(out), "--ignore-patterns", "shards/*"
    )
    assert proc.returncode == 0, proc.stderr
    assert not [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]


def test_gated_repo_says_accept_license_and_token(hub, tmp_path):
    err = one_error_line(download(hub.endpoint, tmp_path, "org/gated", "--output-dir", str(tmp_path / "g")))
    assert "'org/gated' is gated" in err
    assert f"{hub.endpoint}/org/gated" in err and "--hf-token" in err and "HF_TOKEN" in err


def test_token_from_env_or_flag_is_sent_and_never_printed(hub, tmp_path):
    proc = download(
        hub.endpoint,
        tmp_path,
        "org/gated",
        "--output-dir",
        str(tmp_path / "a"),
        env_extra={"HF_TOKEN": TOKEN},
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "a" / "config.json").read_bytes() == FILES["config.json"]
    proc2 = download(
        hub.endpoint, tmp_path, "org/gated", "--output-dir", str(tmp_path / "b"), "--hf-token", TOKEN
    )
    assert proc2.returncode == 0, proc2.stderr
    for p in (proc, proc2):
        assert TOKEN not in p.stdout + p.stderr
    assert not any(TOKEN in f.read_text(errors="ignore") for f in tmp_path.rglob("*") if f.is_file())


def test_missing_repo_says_check_id(hub, tmp_path):
    err = one_error_line(download(hub.endpoint, tmp_path, "org/nope", "--output-dir", str(tmp_path / "n")))
    assert "repo 'org/nope' not found" in err and "check the repo id" in err and "HF_TOKEN" in err


def test_missing_revision(hub, tmp_path):
    proc = download(
        hub.endpoint, tmp_path, "org/tiny", "--output-dir", str(tmp_path / "r"), "--revision", "v9"
    )
    err = one_error_line(proc)
    assert "revision 'v9' not found in 'org/tiny'" in err


def test_an_endpoint_that_is_no_url_is_one_line(tmp_path):
    """HF_ENDPOINT=notaurl ended in httpx's UnsupportedProtocol traceback."""
    err = one_error_line(download("notaurl", tmp_path, "org/tiny", "--output-dir", str(tmp_path / "o")))
    assert err == "recipe: error: HF_ENDPOINT 'notaurl' must be a URL starting with https:// (or http://)"
    assert not (tmp_path / "o").exists()


def test_unreachable_endpoint_says_offline(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = one_error_line(
        download(f"http://127.0.0.1:{port}", tmp_path, "org/tiny", "--output-dir", str(tmp_path / "o"))
    )
    assert "unreachable" in err and "HF_ENDPOINT" in err and "local path" in err

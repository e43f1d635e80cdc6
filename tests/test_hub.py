"""qkv.models.hub against a local HTTP server standing in for the Hugging Face Hub.

The server (127.0.0.1, a free port) answers the requests huggingface_hub makes: the
model listing ``GET /api/models/{repo}/revision/{rev}?blobs=true`` and the file
resolution ``HEAD``/``GET /{repo}/resolve/{rev}/{name}``, with the headers the Hub sends
(``X-Repo-Commit``, ``ETag``, ``Content-Length``; ``X-Linked-Size``, ``X-Linked-Etag`` and
a ``Location`` redirect for LFS files), and records every request. ``HF_ENDPOINT`` points
at it and ``HF_HOME``/``HF_HUB_CACHE`` at a temporary folder in every test, so nothing
reaches the internet or the real cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("huggingface_hub")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from huggingface_hub import constants  # noqa: E402

from qkv.models.hub import fetch_model, is_repo_id  # noqa: E402

REPO = "owner/tiny"
NEEDED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "model.safetensors"}


def weights(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return safetensors_torch.save({"embed.weight": torch.randn(8, 4, generator=gen),
                                   "norm.weight": torch.ones(4)})


def tiny_files() -> dict[str, bytes]:
    """A transformers-style repository: what an import needs and what it must not fetch."""
    return {
        "config.json": json.dumps({"model_type": "llama", "vocab_size": 8,
                                   "hidden_size": 4}).encode(),
        "generation_config.json": json.dumps({"eos_token_id": 2}).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE"}}).encode(),
        "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"}).encode(),
        "special_tokens_map.json": json.dumps({"eos_token": "</s>"}).encode(),
        "model.safetensors": weights(0),
        # Never to be requested:
        "pytorch_model.bin": b"\x80\x04 a pickle",
        "model.gguf": b"GGUF....",
        "onnx/model.onnx": b"onnx",
        "README.md": b"# tiny",
    }


class FakeHub:
    """The repositories the server knows and the requests it received."""

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.interrupt: str | None = None  # a file whose GET stops halfway with a Ctrl-C
        self.released = threading.Event()
        self.main_thread = threading.main_thread().ident

    def add(self, repo: str, files: dict[str, bytes], *, lfs=("model.safetensors",),
            status: int | None = None, error_code: str | None = None,
            extra: list[dict] | None = None, sizes: dict[str, int] | None = None) -> str:
        sha = hashlib.sha1(repo.encode()).hexdigest()
        self.repos[repo] = {"files": files, "lfs": set(lfs), "sha": sha, "status": status,
                            "error_code": error_code, "extra": extra or [],
                            "sizes": sizes or {}}
        return sha

    def fetched(self) -> set[str]:
        """The file names whose contents were requested (HEAD or GET)."""
        names = set()
        for _, path in self.requests:
            parts = path.strip("/").split("/")
            if len(parts) > 4 and parts[2] == "resolve":
                names.add("/".join(parts[4:]))
        return names


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.answer(body=False)

    def do_GET(self) -> None:
        self.answer(body=True)

    def send(self, code: int, headers: dict[str, str], data: bytes, body: bool) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        # No kept-alive connection outlives a stopped server.
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        if body:
            self.wfile.write(data)

    def error(self, code: int, error_code: str | None, body: bool, commit: str = "") -> None:
        headers = {"Content-Type": "application/json"}
        if error_code:
            headers["X-Error-Code"] = error_code
        if commit:
            headers["X-Repo-Commit"] = commit
        self.send(code, headers, json.dumps({"error": error_code or "error"}).encode(), body)

    def answer(self, body: bool) -> None:
        hub: FakeHub = self.server.hub  # type: ignore[attr-defined]
        path = unquote(urlsplit(self.path).path)
        hub.requests.append((self.command, path))
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            repo, _, revision = rest.partition("/revision/")
            self.listing(hub, repo, revision or "main", body)
            return
        if path.startswith("/cdn/"):
            for repo in hub.repos.values():
                for name, data in repo["files"].items():
                    if hashlib.sha256(data).hexdigest() == path[len("/cdn/"):]:
                        self.file(hub, name, data, {"ETag": f'"{path[5:]}"'}, body)
                        return
            self.error(404, None, body)
            return
        parts = path.strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            self.error(404, None, body)
            return
        repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        repo = self.repo(hub, repo_id, revision, body)
        if repo is None:
            return
        if name not in repo["files"]:
            self.error(404, "EntryNotFound", body, repo["sha"])
            return
        data = repo["files"][name]
        headers = {"X-Repo-Commit": repo["sha"]}
        if name in repo["lfs"]:
            sha256 = hashlib.sha256(data).hexdigest()
            headers.update({"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"',
                            "X-Linked-Size": str(len(data)), "Location": self.cdn(sha256)})
            self.send(302, headers, b"", body)
            return
        headers["ETag"] = f'"{hashlib.sha1(data).hexdigest()}"'
        self.file(hub, name, data, headers, body)

    def cdn(self, sha256: str) -> str:
        """Where the Hub redirects an LFS file: another host (here the same server under
        the name localhost), so that huggingface_hub takes the file's metadata from the
        redirect itself, as it does with the Hub's CDN."""
        return f"http://localhost:{self.server.server_address[1]}/cdn/{sha256}"

    def file(self, hub: FakeHub, name: str, data: bytes, headers: dict, body: bool) -> None:
        if not (body and hub.interrupt == name):
            self.send(200, headers, data, body)
            return
        # Half the file, then a Ctrl-C in the test's main thread while it reads the rest.
        self.send_response(200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        signal.pthread_kill(hub.main_thread, signal.SIGINT)
        hub.released.wait(10)
        self.close_connection = True

    def repo(self, hub: FakeHub, repo_id: str, revision: str, body: bool) -> dict | None:
        repo = hub.repos.get(repo_id)
        if repo is None:
            self.error(404, "RepoNotFound", body)
            return None
        if repo["status"] is not None:
            self.error(repo["status"], repo["error_code"], body)
            return None
        if revision not in ("main", repo["sha"]):
            self.error(404, "RevisionNotFound", body)
            return None
        return repo

    def listing(self, hub: FakeHub, repo_id: str, revision: str, body: bool) -> None:
        repo = self.repo(hub, repo_id, revision, body)
        if repo is None:
            return
        siblings = []
        for name, data in repo["files"].items():
            size = repo["sizes"].get(name, len(data))
            sibling = {"rfilename": name, "size": size,
                       "blobId": hashlib.sha1(data).hexdigest()}
            if name in repo["lfs"]:
                sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": size,
                                  "pointerSize": 134}
            siblings.append(sibling)
        info = {"_id": "0", "id": repo_id, "modelId": repo_id, "sha": repo["sha"],
                "private": False, "siblings": siblings + repo["extra"]}
        self.send(200, {"Content-Type": "application/json"}, json.dumps(info).encode(), body)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running fake Hub with ``HF_ENDPOINT`` and the caches pointed at it and tmp_path."""
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.hub = fake  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub read HF_HUB_OFFLINE when it was imported.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def stop() -> None:
        if fake.server is not None:
            fake.server.shutdown()
            fake.server.server_close()
            fake.server = None

    fake.server = server  # type: ignore[attr-defined]
    fake.stop = stop  # type: ignore[attr-defined]
    yield fake
    fake.released.set()
    stop()


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_fetch_downloads_only_the_import_files(hub, tmp_path):
    files = tiny_files()
    sha = hub.add(REPO, files)
    lines: list[str] = []
    folder = fetch_model(REPO, log=lines.append)
    assert hub.fetched() == NEEDED
    assert not any(".bin" in path or "gguf" in path or "onnx" in path
                   for _, path in hub.requests)
    assert folder.parent.name == "snapshots" and folder.name == sha
    assert folder.resolve().is_relative_to((tmp_path / "hf" / "hub").resolve())
    assert sorted(p.name for p in folder.iterdir()) == sorted(NEEDED)
    for name in NEEDED:
        assert (folder / name).read_bytes() == files[name]
    loaded = safetensors_torch.load_file(folder / "model.safetensors")
    assert loaded["embed.weight"].shape == (8, 4)
    assert len(lines) == 1 and REPO in lines[0] and "6 to download" in lines[0]


def test_fetch_sharded_weights_follows_the_index(hub):
    files = tiny_files()
    del files["model.safetensors"]
    files["model-00001-of-00002.safetensors"] = weights(1)
    files["model-00002-of-00002.safetensors"] = weights(2)
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "c": "model-00001-of-00002.safetensors"}}).encode()
    # A shard of another format and an unlisted safetensors copy are not fetched.
    files["consolidated.safetensors"] = weights(3)
    hub.add(REPO, files, lfs=("model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors"))
    folder = fetch_model(REPO, revision="main")
    shards = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert hub.fetched() == (NEEDED - {"model.safetensors"}) | shards | {
        "model.safetensors.index.json"}
    for shard in shards:
        assert (folder / shard).read_bytes() == files[shard]


@pytest.mark.parametrize("offline", ["server stopped", "HF_HUB_OFFLINE=1", "library offline",
                                     "hub down"])
def test_second_fetch_works_from_the_cache_offline(hub, monkeypatch, offline):
    sha = hub.add(REPO, tiny_files())
    first = fetch_model(REPO)
    if offline == "hub down":
        hub.repos[REPO]["status"] = 503
    else:
        hub.stop()
    if offline == "HF_HUB_OFFLINE=1":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elif offline == "library offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    lines: list[str] = []
    assert fetch_model(REPO, log=lines.append) == first
    assert (first / "model.safetensors").read_bytes() == tiny_files()["model.safetensors"]
    assert len(lines) == 1 and "cached" in lines[0]
    # By the commit hash too; a revision never fetched is not in the cache.
    assert fetch_model(REPO, revision=sha) == first
    with pytest.raises(ConnectionError, match="cannot reach"):
        fetch_model(REPO, revision="v2")


@pytest.mark.parametrize("offline", ["server stopped", "HF_HUB_OFFLINE=1", "hub down"])
def test_offline_with_an_empty_cache_is_one_line_naming_the_folder_form(hub, monkeypatch,
                                                                       offline):
    hub.add(REPO, tiny_files(), status=503 if offline == "hub down" else None)
    if offline == "server stopped":
        hub.stop()
    elif offline == "HF_HUB_OFFLINE=1":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError) as caught:
        fetch_model(REPO)
    text = one_line(caught.value)
    assert text.startswith(f"cannot reach the Hugging Face Hub to download {REPO} (")
    assert text.endswith("download it elsewhere and pass the folder: qkv lm import FOLDER")
    if offline == "HF_HUB_OFFLINE=1":
        assert "HF_HUB_OFFLINE" in text and hub.requests == []
    if offline == "hub down":
        assert "503" in text


@pytest.mark.parametrize("status, code, kind, words", [
    (404, "RepoNotFound", FileNotFoundError, "no such model repository"),
    (401, None, PermissionError, "HTTP 401"),
    (401, "RepoNotFound", PermissionError, "private, gated"),
    (403, "GatedRepo", PermissionError, "gated"),
])
def test_missing_private_or_gated_repo_is_one_line(hub, status, code, kind, words):
    hub.add(REPO, tiny_files(), status=status, error_code=code)
    with pytest.raises(kind) as caught:
        fetch_model(REPO)
    text = one_line(caught.value)
    assert REPO in text and words in text
    assert hub.fetched() == set()


def test_unknown_repo_and_missing_revision_are_one_line(hub):
    hub.add(REPO, tiny_files())
    with pytest.raises(FileNotFoundError) as caught:
        fetch_model("owner/other")
    assert "owner/other" in one_line(caught.value)
    with pytest.raises(ValueError) as caught:
        fetch_model(REPO, revision="v9")
    text = one_line(caught.value)
    assert REPO in text and "'v9'" in text and "revision" in text
    assert hub.fetched() == set()


@pytest.mark.parametrize("name", ["../evil", "sub/../../evil", "/etc/passwd", "a\\..\\b",
                                  "sub//x", "./config.json"])
def test_a_listing_with_an_escaping_name_is_refused(hub, name):
    hub.add(REPO, tiny_files(), extra=[{"rfilename": name, "size": 4}])
    with pytest.raises(ValueError) as caught:
        fetch_model(REPO)
    assert repr(name) in one_line(caught.value)
    assert hub.fetched() == set()


@pytest.mark.parametrize("shard, shown", [("../evil.safetensors", "'../evil.safetensors'"),
                                          ("model.bin", "'model.bin'"),
                                          (["a.safetensors"], "a list")])
def test_an_index_naming_a_bad_shard_is_refused(hub, shard, shown):
    files = tiny_files()
    del files["model.safetensors"]
    files["model.safetensors.index.json"] = json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": shard}}).encode()
    files["model-1.safetensors"] = weights(1)
    hub.add(REPO, files)
    with pytest.raises(ValueError) as caught:
        fetch_model(REPO)
    assert shown in one_line(caught.value)
    assert hub.fetched() == {"model.safetensors.index.json"}


def test_oversized_weights_are_refused_before_any_download(hub):
    hub.add(REPO, tiny_files(), sizes={"model.safetensors": 10**14})
    with pytest.raises(ValueError) as caught:
        fetch_model(REPO)
    assert "100,000,000,000,000 bytes" in one_line(caught.value)
    assert hub.fetched() == set()
    # The same bound, given by the caller.
    hub.add(REPO, tiny_files())
    size = len(tiny_files()["model.safetensors"])
    with pytest.raises(ValueError, match=f"{size:,} bytes, more than the {size - 1:,}"):
        fetch_model(REPO, max_bytes=size - 1)
    assert hub.fetched() == set()


def test_a_repo_without_safetensors_is_refused(hub):
    files = tiny_files()
    del files["model.safetensors"]
    hub.add(REPO, files)
    with pytest.raises(ValueError) as caught:
        fetch_model(REPO)
    text = one_line(caught.value)
    assert "safetensors" in text and "pytorch_model.bin" in text
    assert hub.fetched() == set()


def test_ctrl_c_mid_download_leaves_no_half_file(hub, monkeypatch):
    files = tiny_files()
    files["model.safetensors"] = weights(0) + b" " * 200_000  # several network reads
    hub.add(REPO, files)
    hub.interrupt = "model.safetensors"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            fetch_model(REPO)
    finally:
        signal.signal(signal.SIGINT, previous)
        hub.released.set()
    cache = Path(os.environ["HF_HUB_CACHE"])
    # The Ctrl-C came during the weights: the small files are in the snapshot already.
    snapshot = next(cache.glob("models--owner--tiny/snapshots/*"))
    assert (snapshot / "config.json").read_bytes() == files["config.json"]
    assert not (snapshot / "model.safetensors").exists()
    # No file anywhere in the cache by the weights' name; only an '.incomplete' blob,
    # if any, holds the part that arrived.
    for path in cache.rglob("*"):
        if path.is_file() and path.stat().st_size >= len(files["model.safetensors"]) // 2:
            assert path.name.endswith(".incomplete"), path
    assert not any(p.name == "model.safetensors" for p in cache.rglob("*"))
    # Offline, the half-fetched snapshot is not taken for a model.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match="cannot reach"):
        fetch_model(REPO)
    # Online again, the fetch completes and the weights are whole.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.interrupt = None
    folder = fetch_model(REPO)
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_bad_ids_and_revisions_are_refused_before_any_request(hub):
    hub.add(REPO, tiny_files())
    for bad in ("owner", "a/b/c", "owner/na me", "../x/y", ""):
        with pytest.raises(ValueError, match="owner/name"):
            fetch_model(bad)
    for bad in ("../../x", "a b", "", "/main", "main/", "x\n"):
        with pytest.raises(ValueError, match="revision"):
            fetch_model(REPO, revision=bad)
    assert hub.requests == []


def test_is_repo_id_follows_the_hub_naming_rule_and_prefers_paths(tmp_path, monkeypatch):
    # Hugging Face's rule: owner/name, ASCII letters, digits, '-', '_', '.', at most 96
    # characters, starting and ending with a letter or digit, no '--' or '..'.
    good = ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B", "a/b",
            "google/gemma-3-270m-it", "o_1/m.v2", "x/" + "a" * 96]
    bad = ["gpt2", "a/b/c", "./a/b", "/a/b", "~/a/b", "a/b.gguf ", "a--b/c", "a/b..c",
           "-a/b", "a/b-", "a/.b", "a/b.gguf", "a/b.GGUF", "x/" + "a" * 97, "a/b c",
           "a\\b", "é/b", "a/", "/b", ""]
    assert [g for g in good if not is_repo_id(g)] == []
    assert [b for b in bad if is_repo_id(b)] == []
    # An existing path always wins.
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("owner/model")
    (tmp_path / "owner" / "model").mkdir(parents=True)
    assert not is_repo_id("owner/model")


def test_without_huggingface_hub_the_error_names_the_extra_and_the_folder_form(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError) as caught:
        fetch_model(REPO)
    text = one_line(caught.value)
    assert "qkv[hf]" in text and "qkv lm import FOLDER" in text

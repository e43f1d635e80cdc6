"""qkv.models.hub against a local HTTP server standing in for the Hugging Face Hub.

The server (127.0.0.1, a free port) answers the requests huggingface_hub makes: the
model listing ``GET /api/models/{repo}/revision/{rev}?blobs=true`` and the file
resolution ``HEAD``/``GET /{repo}/resolve/{rev}/{name}``, with the headers the Hub sends
(``X-Repo-Commit``, ``ETag``, ``Content-Length``; ``X-Linked-Size``, ``X-Linked-Etag`` and
a ``Location`` redirect for LFS files), and records every request. ``HF_ENDPOINT`` points
at it and ``HF_HOME``/``HF_HUB_CACHE`` at a temporary folder in every test (and
conftest's ``no_downloads`` keeps huggingface_hub's token and cache paths in another), and
a socket may connect to the loopback address only, so nothing reaches the internet or the
real cache.

The end-to-end tests serve a real tiny model, a transformers ``LlamaForCausalLM`` saved
with ``save_pretrained`` beside a byte-level BPE tokenizer, and run ``qkv lm import
owner/tiny`` on it: the run must compute transformers' logits and tokenize as
transformers does, from files the server sent, and again offline from the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
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

from qkv.cli import main  # noqa: E402
from qkv.models.hub import fetch_model, is_repo_id  # noqa: E402

REPO = "owner/tiny"
# How an offline error without a cached copy ends: the import's other forms.
OTHER_FORMS = ("download it elsewhere and pass its local folder or a .gguf file instead: "
               "qkv lm import FOLDER or qkv lm import FILE.gguf")
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
    """The repositories the server knows and the requests it received.

    A repository is a set of commits (each any files) and refs (branches, tags) naming
    them; its ``status``/``error_code``, when set, answer every request for it.
    """

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.interrupt: str | None = None  # a file whose GET stops halfway with a Ctrl-C
        self.released = threading.Event()
        self.main_thread = threading.main_thread().ident

    def add(self, repo: str, files: dict[str, bytes], *, lfs=("model.safetensors",),
            status: int | None = None, error_code: str | None = None,
            extra: list[dict] | None = None, sizes: dict[str, int] | None = None,
            refs: tuple[str, ...] = ("main",)) -> str:
        """Serve ``files`` as a commit of ``repo`` that ``refs`` then name (earlier commits
        stay, by their hash and the refs not moved); return the commit hash. ``lfs``: the
        files stored in LFS (a redirect to the CDN); ``extra``: more listing entries;
        ``sizes``: sizes the listing gives instead of the true ones."""
        digest = hashlib.sha1(repo.encode())
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha1(files[name]).digest())
        sha = digest.hexdigest()
        entry = self.repos.setdefault(repo, {"commits": {}, "refs": {}})
        entry["commits"][sha] = {"files": files, "lfs": set(lfs), "sha": sha,
                                 "extra": extra or [], "sizes": sizes or {}}
        entry["refs"].update(dict.fromkeys(refs, sha))
        entry.update(status=status, error_code=error_code)
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
                for commit in repo["commits"].values():
                    for name, data in commit["files"].items():
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
        """The commit ``revision`` (a ref or a commit hash) names, or ``None`` answered."""
        repo = hub.repos.get(repo_id)
        if repo is None:
            self.error(404, "RepoNotFound", body)
            return None
        if repo["status"] is not None:
            self.error(repo["status"], repo["error_code"], body)
            return None
        sha = repo["refs"].get(revision, revision)
        if sha not in repo["commits"]:
            self.error(404, "RevisionNotFound", body)
            return None
        return repo["commits"][sha]

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


def loopback_only(connect):
    """``socket.connect`` refusing any internet address but 127.0.0.1 and ::1."""
    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
                "127.0.0.1", "::1"):
            raise AssertionError(f"a test tried to connect to {address}")
        return connect(sock, address)
    return guarded


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
    monkeypatch.setattr(socket.socket, "connect", loopback_only(socket.socket.connect))
    monkeypatch.setattr(socket.socket, "connect_ex", loopback_only(socket.socket.connect_ex))

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
    with pytest.raises(ConnectionError, match="offline"):
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
    assert text.startswith(f"cannot download {REPO}: offline, or the Hugging Face Hub is "
                           "unreachable (")
    assert text.endswith(OTHER_FORMS)
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
    with pytest.raises(ConnectionError, match="offline"):
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
    assert "qkv[hf]" in text and "qkv lm import FOLDER or qkv lm import FILE.gguf" in text


def test_the_tests_connect_to_the_loopback_address_only(hub, monkeypatch):
    # 192.0.2.1 is reserved for documentation: the guard refuses it before a packet leaves.
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1")
    with pytest.raises(AssertionError, match="192.0.2.1"):
        fetch_model(REPO)


# ---------------------------------------------------------------------------------------
# qkv lm import owner/tiny, end to end: a real tiny model served by the fake Hub.

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3,
          "Attention is all you need; queries, keys and values. " * 3]
VOCAB = 300
# What the import reads of the served repository; it serves more (UNREAD) too.
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"}
UNREAD = {"pytorch_model.bin": b"\x80\x04 a pickle", "model.gguf": b"GGUF....",
          "onnx/model.onnx": b"onnx", "README.md": b"# tiny", ".gitattributes": b"*"}


class Tiny:
    """A transformers model and the files of its repository."""

    def __init__(self, model, files: dict[str, bytes], tokenizer_file: Path) -> None:
        self.model = model
        self.files = files
        self.tokenizer_file = tokenizer_file

    def logits(self, ids):
        with torch.no_grad():
            return self.model(ids).logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[int, Tiny]:
    """Two tiny Llama models (seeds 0 and 1) sharing one byte-level BPE tokenizer."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = {}
    for seed in (0, 1):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=None, eos_token_id=SPECIALS.index("<|im_end|>"))
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():  # norms off their initial ones, as a trained model's are
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(f"tiny{seed}")
        model.save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}))
        files = {p.name: p.read_bytes() for p in folder.iterdir()}
        assert set(files) == MODEL_FILES
        out[seed] = Tiny(model, files, folder / "tokenizer.json")
    return out


def ids(seed: int = 0):
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def import_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["lm", "import", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv lm: error: "), err
    return lines[0]


def test_import_of_a_repo_id_runs_like_transformers_and_again_offline(hub, tiny, tmp_path,
                                                                      monkeypatch, capsys):
    from transformers import PreTrainedTokenizerFast

    from qkv.tasks.lm import LanguageModel

    model = tiny[0]
    sha = hub.add(REPO, {**model.files, **UNREAD})
    run = tmp_path / "run"
    code, out, err = import_cli(capsys, REPO, "--run-dir", str(run))
    assert code == 0, err
    assert f"{REPO} at {sha[:12]}: 5 files" in out
    # Every file came from the server, and only the ones the import reads.
    assert hub.fetched() == MODEL_FILES
    assert hub.requests[0] == ("GET", f"/api/models/{REPO}")  # the listing, then files
    weights_sha256 = hashlib.sha256(model.files["model.safetensors"]).hexdigest()
    assert ("GET", f"/cdn/{weights_sha256}") in hub.requests  # the LFS weights' redirect
    cache = (tmp_path / "hf" / "hub").resolve()
    lm = LanguageModel.load(run)
    assert lm.settings.extra["repo_id"] == REPO and "source" not in lm.settings.extra
    assert lm.title == f"llama from {REPO}"
    assert any(cache in p.parents for p in cache.rglob("model.safetensors"))

    torch.testing.assert_close(lm.model(ids()), model.logits(ids()), atol=1e-4, rtol=0)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(model.tokenizer_file),
                                        chat_template=CHATML)
    for text in ("The quick brown fox <|im_end|> ünïcode", "queries, keys and values"):
        assert lm.tokenizer.encode(text) == reference.encode(text)
    chat = reference.apply_chat_template([{"role": "user", "content": "Hi fox"}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    assert lm.encode_prompt("Hi fox", chat=True).tolist() == [chat]
    assert lm.tokenizer.eos_token_ids == [reference.convert_tokens_to_ids("<|im_end|>")]

    # Offline, the same repo id imports from the cache: the server stopped, then
    # HF_HUB_OFFLINE as well.
    hub.stop()
    for i, offline in enumerate(("server stopped", "HF_HUB_OFFLINE=1")):
        if offline == "HF_HUB_OFFLINE=1":
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        again = tmp_path / f"offline{i}"
        code, out, err = import_cli(capsys, REPO, "--run-dir", str(again))
        assert code == 0, err
        assert "using the cached" in out and sha in out
        lm = LanguageModel.load(again)
        torch.testing.assert_close(lm.model(ids(1)), model.logits(ids(1)), atol=1e-4, rtol=0)
    assert hub.fetched() == MODEL_FILES


def test_revision_pins_a_commit_and_an_unknown_one_is_one_line(hub, tiny, tmp_path, capsys):
    from qkv.tasks.lm import LanguageModel

    old = hub.add(REPO, tiny[0].files, refs=("main", "v1"))
    new = hub.add(REPO, tiny[1].files)  # main moves on; v1 and the old commit stay
    assert old != new
    assert not torch.allclose(tiny[0].logits(ids()), tiny[1].logits(ids()), atol=1e-2)
    for revision, want in ((old, 0), ("v1", 0), (None, 1)):
        run = tmp_path / f"run-{revision}"
        pin = [] if revision is None else ["--revision", revision]
        code, out, err = import_cli(capsys, REPO, "--run-dir", str(run), *pin)
        assert code == 0, err
        lm = LanguageModel.load(run)
        assert lm.settings.extra["revision"] == (new if want else old)
        torch.testing.assert_close(lm.model(ids()), tiny[want].logits(ids()), atol=1e-4,
                                   rtol=0)
    hub.requests.clear()
    run = tmp_path / "unknown"
    code, out, err = import_cli(capsys, REPO, "--run-dir", str(run), "--revision", "v9")
    assert code == 2
    line = one_error_line(err)
    assert REPO in line and "'v9'" in line and "revision" in line
    assert hub.fetched() == set() and not run.exists()


@pytest.mark.parametrize("offline", ["server stopped", "HF_HUB_OFFLINE=1"])
def test_import_offline_with_an_empty_cache_is_one_line_naming_the_other_forms(
        hub, tiny, tmp_path, monkeypatch, capsys, offline):
    hub.add(REPO, tiny[0].files)
    if offline == "server stopped":
        hub.stop()
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    code, out, err = import_cli(capsys, REPO, "--run-dir", str(run))
    assert code == 2
    line = one_error_line(err)
    assert f"cannot download {REPO}: offline" in line and line.endswith(OTHER_FORMS)
    if offline == "HF_HUB_OFFLINE=1":
        assert "HF_HUB_OFFLINE is set" in line and hub.requests == []
    assert not run.exists()
    assert not any(p.is_file() for p in (tmp_path / "hf").rglob("*"))


def test_import_of_a_missing_repo_is_one_line(hub, tiny, tmp_path, capsys):
    hub.add(REPO, tiny[0].files)
    run = tmp_path / "run"
    code, out, err = import_cli(capsys, "owner/missing", "--run-dir", str(run))
    assert code == 2
    line = one_error_line(err)
    assert "owner/missing" in line and "no such model repository" in line and "404" in line
    assert hub.requests == [("GET", "/api/models/owner/missing")]
    assert not run.exists()

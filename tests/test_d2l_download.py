"""``qkv.d2l``'s DATA_HUB, download and download_extract, against a local HTTP server."""

import hashlib
import http.server
import io
import threading
import zipfile
from pathlib import Path

import pytest

from qkv import d2l
from qkv.data.translate import DownloadError


@pytest.fixture
def server(tmp_path):
    """Serve the folder ``tmp_path/www`` on 127.0.0.1; yields (base_url, www, request log)."""
    www = tmp_path / "www"
    www.mkdir()
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(www), **kwargs)

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", www, requests
    httpd.shutdown()
    httpd.server_close()


def sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def test_download_verifies_and_caches(server, tmp_path):
    base, www, requests = server
    data = b"hello, d2l\n" * 100
    (www / "hello.txt").write_bytes(data)
    folder = tmp_path / "data"
    path = d2l.download(base + "hello.txt", str(folder), sha1(data))
    assert Path(path) == folder / "hello.txt" and Path(path).read_bytes() == data
    assert requests == ["/hello.txt"]
    # cache hit: the file's SHA-1 matches, the server is not asked again
    assert d2l.download(base + "hello.txt", str(folder), sha1(data)) == path
    assert requests == ["/hello.txt"]
    # a changed cached file is fetched again
    Path(path).write_bytes(b"tampered")
    d2l.download(base + "hello.txt", str(folder), sha1(data))
    assert Path(path).read_bytes() == data and len(requests) == 2


def test_download_refuses_wrong_sha1_and_leaves_nothing(server, tmp_path):
    base, www, _ = server
    (www / "hello.txt").write_bytes(b"not what was promised")
    folder = tmp_path / "data"
    with pytest.raises(DownloadError, match="SHA-1 mismatch"):
        d2l.download(base + "hello.txt", str(folder), sha1(b"something else"))
    assert list(folder.iterdir()) == []


def test_data_hub_name_default_folder_and_extract(server, tmp_path, monkeypatch):
    base, www, _ = server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("toy/fra.txt", "Go.\tVa !\n")
    (www / "toy.zip").write_bytes(buf.getvalue())
    monkeypatch.setitem(d2l.DATA_HUB, "toy", (base + "toy.zip", sha1(buf.getvalue())))
    assert d2l.DATA_HUB["fra-eng"] == (
        d2l.DATA_URL + "fra-eng.zip", "94646ad1522d915e7b0f9296181140edcf86a4f5")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # d2l's default folder is ../data; the archive is extracted next to itself
    data_dir = d2l.download_extract("toy")
    assert Path(data_dir).resolve() == tmp_path / "data" / "toy"
    assert (Path(data_dir) / "fra.txt").read_text() == "Go.\tVa !\n"
    assert Path(d2l.download_extract("toy", "toy/fra.txt")).read_text() == "Go.\tVa !\n"


def test_download_extract_uses_a_replaced_download(server, tmp_path, monkeypatch):
    """The training script redirects d2l.download to its own folder; extraction follows."""
    base, www, _ = server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("toy/a.txt", "a")
    (www / "toy.zip").write_bytes(buf.getvalue())
    monkeypatch.setitem(d2l.DATA_HUB, "toy", (base + "toy.zip", sha1(buf.getvalue())))
    original = d2l.download
    mine = tmp_path / "mine"
    monkeypatch.setattr(d2l, "download",
                        lambda url, folder=str(mine), sha1_hash=None: original(url, folder,
                                                                               sha1_hash))
    assert Path(d2l.download_extract("toy")) == mine / "toy"
    assert (mine / "toy" / "a.txt").read_text() == "a"


def test_download_extract_refuses_escaping_members(server, tmp_path, monkeypatch):
    base, www, _ = server
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("../evil.txt", "x")
    (www / "evil.zip").write_bytes(buf.getvalue())
    monkeypatch.setitem(d2l.DATA_HUB, "evil", (base + "evil.zip", sha1(buf.getvalue())))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(DownloadError, match="refusing to extract"):
        d2l.download_extract("evil")
    assert not (tmp_path / "evil.txt").exists()


@pytest.fixture
def fra_eng_hub(server, tmp_path, monkeypatch):
    """``DATA_HUB['fra-eng']`` served locally; qkv's own cache path made to fail loudly, and
    ``QKV_FRA_ENG`` unset. Yields the corpus text."""
    base, www, requests = server
    text = "Go.\tVa !\nHi.\tSalut !\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("fra-eng/fra.txt", text)
    (www / "fra-eng.zip").write_bytes(buf.getvalue())
    monkeypatch.setitem(d2l.DATA_HUB, "fra-eng", (base + "fra-eng.zip", sha1(buf.getvalue())))
    monkeypatch.delenv("QKV_FRA_ENG", raising=False)

    def no_qkv_cache(*args, **kwargs):
        raise AssertionError("read_data_nmt took qkv's cache, not the replaced download")

    monkeypatch.setattr(d2l.translate, "download_fra_eng", no_qkv_cache)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return text


def test_read_data_nmt_goes_through_a_replaced_download(fra_eng_hub, tmp_path, monkeypatch):
    """As in d2l: read_data_nmt -> download_extract('fra-eng') -> download('fra-eng'), each
    looked up on the module, so a script that redirects d2l.download moves the data."""
    original, calls = d2l.download, []
    mine = tmp_path / "mine"

    def download_to_mine(url, folder=str(mine), sha1_hash=None):
        calls.append(url)
        return original(url, folder=folder, sha1_hash=sha1_hash)

    monkeypatch.setattr(d2l, "download", download_to_mine)
    assert d2l.read_data_nmt() == fra_eng_hub
    assert calls == ["fra-eng"]
    assert (mine / "fra-eng.zip").is_file()
    assert (mine / "fra-eng" / "fra.txt").read_text(encoding="utf-8") == fra_eng_hub
    # load_data_nmt reads through read_data_nmt, so it follows too
    _, src_vocab, _ = d2l.load_data_nmt(2, 4)
    assert calls == ["fra-eng", "fra-eng"]
    assert src_vocab["."] != src_vocab.unk  # "." twice: kept with min_freq=2


def test_read_data_nmt_goes_through_a_replaced_download_extract(fra_eng_hub, tmp_path,
                                                                monkeypatch):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "fra.txt").write_text("A.\tB.\n", encoding="utf-8")
    calls = []
    monkeypatch.setattr(d2l, "download_extract",
                        lambda name, folder_=None: calls.append(name) or str(folder))
    assert d2l.read_data_nmt() == "A.\tB.\n"
    assert calls == ["fra-eng"]


def test_qkv_fra_eng_wins_over_a_replaced_download(fra_eng_hub, tmp_path, monkeypatch):
    """The env var names a local file: nothing is downloaded, whatever d2l.download is."""
    local = tmp_path / "fra.txt"
    local.write_text("Local.\tLocal.\n", encoding="utf-8")
    monkeypatch.setenv("QKV_FRA_ENG", str(local))

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded although QKV_FRA_ENG is set")

    monkeypatch.setattr(d2l, "download", no_download)
    assert d2l.read_data_nmt() == "Local.\tLocal.\n"


def test_read_data_nmt_without_replacement_uses_qkv_cache(fra_eng_hub, tmp_path,
                                                          monkeypatch):
    """With d2l's own download in place, the corpus comes from qkv's verified cache
    (not ../data), as the module docstring says."""
    path = tmp_path / "cache" / "fra.txt"
    path.parent.mkdir()
    path.write_text("Cached.\tCache.\n", encoding="utf-8")
    monkeypatch.setattr(d2l.translate, "download_fra_eng", lambda *a, **k: path)
    assert d2l.read_data_nmt() == "Cached.\tCache.\n"
    assert not (tmp_path / "data").exists()

"""Tests for qkv.data.translate: text -> pairs -> vocab -> tensors -> loaders, and download.

Nothing here touches the network: downloads go to an http.server on 127.0.0.1 in a thread,
and an autouse fixture fails any connection to another host.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import socket
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data import translate as tr
from qkv.data.translate import (
    FRA_ENG_SHA1,
    FRA_ENG_URL,
    DownloadError,
    TranslationData,
    Vocab,
    build_array,
    download_fra_eng,
    load_corpus,
    load_data_nmt,
    preprocess,
    read_pairs,
    truncate_pad,
)

# The first lines of fra.txt, as d2l shows them (attribution column included).
RAW = (
    "Go.\tVa !\tCC-BY 2.0 (France) Attribution: tatoeba.org #2877272 (CM) & #1158250 (Wittydev)\n"
    "Hi.\tSalut !\tCC-BY 2.0\n"
    "Run!\tCours\u202f!\tCC-BY 2.0\n"
    "Run!\tCourez\u202f!\tCC-BY 2.0\n"
    "Who?\tQui ?\tCC-BY 2.0\n"
    "Wow!\tÇa alors\u202f!\tCC-BY 2.0\n"
)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Refuse any connection that is not to this machine (urllib goes through here)."""
    real = socket.create_connection

    def guarded(address, *args, **kwargs):
        assert address[0] in ("127.0.0.1", "localhost"), f"test tried to reach {address}"
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", guarded)
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


# ----------------------------------------------------------------------------
# preprocess / read_pairs / load_corpus


def test_preprocess_matches_reference_behaviour():
    assert preprocess("Go.\tVa !") == "go .\tva !"
    assert preprocess("Cours\u202f!") == "cours !"
    assert preprocess("Je\xa0suis là!") == "je suis là !"
    assert preprocess("Hello, World.") == "hello , world ."
    assert preprocess("va !") == "va !"  # already spaced: no double space
    assert preprocess(".hi") == ".hi"  # position 0 is left alone
    assert preprocess("wait...") == "wait . . ."


def test_read_pairs_tokens_and_extra_columns():
    src, tgt = read_pairs(preprocess(RAW))
    assert src == [["go", "."], ["hi", "."], ["run", "!"], ["run", "!"], ["who", "?"], ["wow", "!"]]
    assert tgt[0] == ["va", "!"]
    assert tgt[2] == ["cours", "!"]
    assert tgt[5] == ["ça", "alors", "!"]


def test_read_pairs_skips_malformed_and_drops_empty_tokens():
    text = "\n\na  b\tc\r\nno tab here\n\tonly target\nonly source\t\nx\ty\n"
    src, tgt = read_pairs(text)
    assert src == [["a", "b"], ["x"]]
    assert tgt == [["c"], ["y"]]


@pytest.mark.parametrize("k", [0, 1, 5, 600])
def test_read_pairs_reads_exactly_num_examples(k):
    text = "".join(f"s{i}\tt{i}\n" for i in range(700))
    src, tgt = read_pairs(text, num_examples=k)
    assert len(src) == len(tgt) == k  # the reference read k + 1
    if k:
        assert src[-1] == [f"s{k - 1}"]


def test_read_pairs_num_examples_beyond_corpus_and_negative():
    assert len(read_pairs("a\tb\nc\td\n", num_examples=10)[0]) == 2
    with pytest.raises(ValueError, match="num_examples"):
        read_pairs("a\tb", num_examples=-1)


def test_load_corpus_reads_utf8_and_drops_bom(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes("\ufeffÇa\tva\n".encode())
    assert load_corpus(p) == "Ça\tva\n"
    assert load_corpus(str(p)) == "Ça\tva\n"


def test_read_corpus_gives_the_sha256_and_checks_it(tmp_path):
    p = tmp_path / "c.txt"
    data = "\ufeffa\tb\r\nc\td\re\tf\n".encode()
    p.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    # the text as reading in text mode gives it (universal newlines, no BOM)
    assert tr.read_corpus(p) == ("a\tb\nc\td\ne\tf\n", digest)
    assert tr.read_corpus(p, sha256=digest)[1] == digest
    with pytest.raises(tr.CorpusChangedError, match="has changed since the run") as e:
        tr.read_corpus(p, sha256="0" * 64)
    assert "c.txt" in str(e.value) and digest[:16] in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_load_corpus_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt") as e:
        load_corpus(missing)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="directory") as e:
        load_corpus(tmp_path)
    assert str(tmp_path) in str(e.value)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ça\tva".encode("latin-1"))
    with pytest.raises(ValueError, match="UTF-8") as e:
        load_corpus(bad)
    assert "latin1.txt" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------
# Vocab


def test_vocab_order_unk_reserved_then_frequency_with_first_seen_ties():
    lines = [["b", "a", "c"], ["a", "d", "c"], ["e"]]
    v = Vocab(lines, reserved_tokens=["<pad>", "<bos>", "<eos>"])
    # a and c (2 each) come first, a before c as it was seen first; then the single ones
    # b, d, e in first-seen order.
    assert v.idx_to_token == ["<unk>", "<pad>", "<bos>", "<eos>", "a", "c", "b", "d", "e"]
    assert v.token_to_idx == {t: i for i, t in enumerate(v.idx_to_token)}
    assert v.token_freqs == [("a", 2), ("c", 2), ("b", 1), ("d", 1), ("e", 1)]
    assert v.unk == 0 and v["<unk>"] == 0
    assert len(v) == 9


def test_vocab_min_freq_and_unknown_tokens():
    v = Vocab(["x", "x", "y", "z", "z", "z"], min_freq=2)
    assert v.idx_to_token == ["<unk>", "z", "x"]
    assert v["y"] == v.unk and v["never"] == v.unk
    assert v[["z", "y", "x"]] == [1, 0, 2]
    assert v[("x",)] == [2]
    assert "z" in v and "y" not in v


def test_vocab_flat_and_nested_agree_and_corpus_token_equal_to_reserved():
    nested = [["<eos>", "a"], ["a"]]
    flat = ["<eos>", "a", "a"]
    v1 = Vocab(nested, reserved_tokens=["<eos>"])
    v2 = Vocab(flat, reserved_tokens=["<eos>"])
    assert v1.idx_to_token == v2.idx_to_token == ["<unk>", "<eos>", "a"]
    assert len(Vocab()) == 1


def test_vocab_rejects_bad_reserved_tokens_and_str():
    with pytest.raises(ValueError, match="<unk>"):
        Vocab(["a"], reserved_tokens=["<unk>"])
    with pytest.raises(ValueError, match="duplicates"):
        Vocab(["a"], reserved_tokens=["<pad>", "<pad>"])
    with pytest.raises(TypeError):
        Vocab("abc")


def test_vocab_to_tokens_int_list_tensor():
    v = Vocab([["a", "b", "b"]], reserved_tokens=["<pad>"])
    assert v.to_tokens(2) == "b"
    assert v.to_tokens([2, 3, 0]) == ["b", "a", "<unk>"]
    assert v.to_tokens(torch.tensor(3)) == "a"
    assert v.to_tokens(torch.tensor([1, 2])) == ["<pad>", "b"]
    assert v.to_tokens(torch.tensor([[2], [3]])) == [["b"], ["a"]]
    with pytest.raises(IndexError, match="out of range"):
        v.to_tokens(4)
    with pytest.raises(IndexError):
        v.to_tokens(-1)


def test_vocab_json_round_trip():
    v = Vocab([["je", "suis", "je"], ["suis", "là"]], reserved_tokens=["<pad>", "<bos>", "<eos>"])
    d = json.loads(json.dumps(v.to_dict()))
    w = Vocab.from_dict(d)
    assert w.idx_to_token == v.idx_to_token
    assert w.token_to_idx == v.token_to_idx
    assert w.token_freqs == v.token_freqs
    assert w[["je", "là", "?"]] == v[["je", "là", "?"]]
    assert Vocab.from_dict(["<unk>", "a"]).idx_to_token == ["<unk>", "a"]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"idx_to_token": ["a", "<unk>"]}, "index 0"),
        ({"idx_to_token": []}, "index 0"),
        ({"idx_to_token": ["<unk>", "a", "a"]}, "duplicate token 'a'"),
        ({"idx_to_token": ["<unk>", 3]}, "list of strings"),
        ({"idx_to_token": "<unk>"}, "list of strings"),
        ({}, "list of strings"),
        ({"idx_to_token": ["<unk>"], "token_freqs": [["a"]]}, "token_freqs"),
        ({"idx_to_token": ["<unk>"], "token_freqs": {"a": 1}}, "token_freqs"),
        ({"idx_to_token": ["<unk>"], "token_freqs": [["a", -1]]}, r"counts in \[0, "),
        ({"idx_to_token": ["<unk>"], "token_freqs": [["a", True]]}, "token_freqs"),
        ({"idx_to_token": ["<unk>"], "colour": 1}, "unknown key.*'colour'"),
        (42, "dict or a list"),
    ],
)
def test_vocab_from_dict_validates(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        Vocab.from_dict(bad)
    assert "\n" not in str(e.value)


def test_vocab_from_dict_finds_a_late_duplicate_quickly():
    # 200,000 tokens with the duplicate at the very end: one pass, not a quadratic search
    tokens = ["<unk>", *(f"t{i}" for i in range(200_000)), "t5"]
    with pytest.raises(ValueError, match="duplicate token 't5'"):
        Vocab.from_dict({"idx_to_token": tokens})


@settings(max_examples=50, deadline=None)
@given(
    lines=st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=6), max_size=8),
    min_freq=st.integers(0, 3),
)
def test_vocab_property_ids_round_trip(lines, min_freq):
    v = Vocab(lines, min_freq=min_freq, reserved_tokens=["<pad>"])
    counts = {}
    for line in lines:
        for tok in line:
            counts[tok] = counts.get(tok, 0) + 1
    assert len(set(v.idx_to_token)) == len(v)
    for tok, c in counts.items():
        expected = tok if c >= min_freq else "<unk>"
        assert v.to_tokens(v[tok]) == expected
    freqs = [c for _, c in v.token_freqs]
    assert freqs == sorted(freqs, reverse=True)


# ----------------------------------------------------------------------------
# truncate_pad / build_array


def test_truncate_pad():
    assert truncate_pad([5, 6, 7], 5, 1) == [5, 6, 7, 1, 1]
    assert truncate_pad([5, 6, 7], 2, 1) == [5, 6]
    assert truncate_pad([5, 6], 2, 1) == [5, 6]
    line = [5]
    truncate_pad(line, 3, 0)
    assert line == [5]  # input untouched
    with pytest.raises(ValueError, match="num_steps"):
        truncate_pad([1], 0, 0)


def test_build_array_appends_eos_pads_and_counts_valid_len():
    v = Vocab([["a", "b"], ["c"]], reserved_tokens=["<pad>", "<bos>", "<eos>"])
    lines = [["a", "b"], ["c"], ["a", "b", "c", "a"], []]
    array, valid_len = build_array(lines, v, num_steps=4)
    pad, eos = v["<pad>"], v["<eos>"]
    assert array.shape == (4, 4) and array.dtype == torch.int64
    assert valid_len.shape == (4,) and valid_len.dtype == torch.int64
    assert array[0].tolist() == [v["a"], v["b"], eos, pad]
    assert array[1].tolist() == [v["c"], eos, pad, pad]
    assert array[2].tolist() == v[["a", "b", "c", "a"]]  # truncated: <eos> cut off
    assert array[3].tolist() == [eos, pad, pad, pad]
    assert valid_len.tolist() == [3, 2, 4, 1]
    assert torch.equal(valid_len, (array != pad).sum(1))


def test_build_array_empty_and_missing_specials():
    v = Vocab(reserved_tokens=["<pad>", "<eos>"])
    array, valid_len = build_array([], v, 5)
    assert array.shape == (0, 5) and valid_len.shape == (0,)
    with pytest.raises(ValueError, match="<eos>"):
        build_array([["a"]], Vocab(reserved_tokens=["<pad>"]), 5)


# ----------------------------------------------------------------------------
# TranslationData


def _toy_pairs(n=20):
    src = [["s", str(i % 4), "w" + str(i)] for i in range(n)]
    tgt = [["t", str(i % 3)] for i in range(n)]
    return src, tgt


def test_from_pairs_no_held_out_keeps_order_and_shapes():
    src, tgt = _toy_pairs()
    data = TranslationData.from_pairs(src, tgt, num_steps=6)
    X, X_len, Y, Y_len = data.train
    assert X.shape == (20, 6) and Y.shape == (20, 6)
    assert X_len.tolist() == [4] * 20 and Y_len.tolist() == [3] * 20
    assert [s for s, _ in data.train_pairs] == src
    assert data.src_vocab.idx_to_token[:4] == ["<unk>", "<pad>", "<bos>", "<eos>"]
    # min_freq=2: the one-off words "w<i>" are unknown.
    assert data.src_vocab["w3"] == data.src_vocab.unk
    assert data.src_vocab.to_tokens(X[5, :3]) == ["s", "1", "<unk>"]
    assert all(t.shape[0] == 0 for t in data.valid)
    assert data.valid[0].shape == (0, 6)
    assert list(data.valid_loader(4)) == []


@pytest.mark.parametrize("held_out, k", [(0.25, 5), (3, 3), (0.0, 0), (19, 19)])
def test_from_pairs_held_out_split_is_a_partition(held_out, k):
    src, tgt = _toy_pairs()
    data = TranslationData.from_pairs(src, tgt, num_steps=6, held_out=held_out, seed=1)
    assert len(data.valid_pairs) == data.valid[0].shape[0] == k
    assert len(data.train_pairs) == data.train[0].shape[0] == 20 - k
    together = sorted(data.train_pairs + data.valid_pairs, key=lambda p: int(p[0][2][1:]))
    assert together == list(zip(src, tgt, strict=True))


def test_from_pairs_split_deterministic_under_seed():
    src, tgt = _toy_pairs(50)

    def held(seed):
        return TranslationData.from_pairs(src, tgt, held_out=0.2, seed=seed).valid_pairs

    assert held(0) == held(0)
    assert held(0) != held(1)


def test_from_pairs_vocab_from_training_split_only():
    src = [[f"s{i}"] for i in range(6)]
    tgt = [[f"t{i}"] for i in range(6)]
    data = TranslationData.from_pairs(src, tgt, min_freq=1, held_out=2, seed=0)
    for s, t in data.train_pairs:
        assert s[0] in data.src_vocab and t[0] in data.tgt_vocab
    for s, t in data.valid_pairs:
        assert s[0] not in data.src_vocab and t[0] not in data.tgt_vocab
    assert len(data.src_vocab) == 4 + 4
    assert data.valid[0][:, 0].tolist() == [data.src_vocab.unk] * 2


def test_from_pairs_reuses_given_vocabs():
    src, tgt = _toy_pairs()
    first = TranslationData.from_pairs(src, tgt)
    again = TranslationData.from_pairs(
        src[:5], tgt[:5], src_vocab=first.src_vocab, tgt_vocab=first.tgt_vocab
    )
    assert again.src_vocab is first.src_vocab and again.tgt_vocab is first.tgt_vocab
    assert torch.equal(again.train[0], first.train[0][:5])


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"held_out": 1.0}, ValueError),
        ({"held_out": 20}, ValueError),
        ({"held_out": -1}, ValueError),
        ({"held_out": True}, TypeError),
    ],
)
def test_from_pairs_rejects_bad_held_out(kwargs, exc):
    src, tgt = _toy_pairs()
    with pytest.raises(exc):
        TranslationData.from_pairs(src, tgt, **kwargs)


def test_from_pairs_rejects_mismatch_and_empty():
    with pytest.raises(ValueError, match="2 source and 1 target"):
        TranslationData.from_pairs([["a"], ["b"]], [["c"]])
    with pytest.raises(ValueError, match="no sentence pairs"):
        TranslationData.from_pairs([], [])


def test_loaders_batches_cover_the_splits():
    src, tgt = _toy_pairs()
    data = TranslationData.from_pairs(src, tgt, num_steps=6, held_out=6)
    batches = list(data.train_loader(4, shuffle=False))
    assert len(batches) == 4 and len(batches[0]) == 4
    X, X_len, Y, Y_len = batches[0]
    assert X.shape == (4, 6) and X_len.shape == (4,) and Y.shape == (4, 6) and Y_len.shape == (4,)
    for i, want in enumerate(data.train):
        assert torch.equal(torch.cat([b[i] for b in batches]), want)
    valid = list(data.valid_loader(4))
    assert torch.equal(torch.cat([b[0] for b in valid]), data.valid[0])

    def order(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.cat([b[0] for b in data.train_loader(5, generator=g)])

    assert torch.equal(order(3), order(3))
    assert sorted(order(3).tolist()) == sorted(data.train[0].tolist())


def test_load_data_nmt_from_file_reads_exactly_num_examples(tmp_path):
    corpus = tmp_path / "fra.txt"
    corpus.write_text(RAW * 150, encoding="utf-8")  # 900 pairs
    train_iter, src_vocab, tgt_vocab = load_data_nmt(batch_size=64, num_steps=8, path=corpus)
    sizes = [X.shape[0] for X, _, _, _ in train_iter]
    assert sum(sizes) == 600
    X, X_len, Y, Y_len = next(iter(train_iter))
    assert X.shape == (64, 8) and Y.shape == (64, 8)
    assert src_vocab.idx_to_token[:4] == ["<unk>", "<pad>", "<bos>", "<eos>"]
    assert tgt_vocab["cours"] != tgt_vocab.unk
    assert set(src_vocab.idx_to_token[4:]) == {"go", "hi", "run", "who", "wow", ".", "!", "?"}


def test_load_data_nmt_without_path_downloads(tmp_path, monkeypatch):
    corpus = tmp_path / "fra.txt"
    corpus.write_text(RAW * 2, encoding="utf-8")
    monkeypatch.setattr(tr, "download_fra_eng", lambda: corpus)
    train_iter, _, tgt_vocab = load_data_nmt(batch_size=4, num_steps=5, num_examples=10)
    assert sum(X.shape[0] for X, *_ in train_iter) == 10
    assert "salut" in tgt_vocab


# ----------------------------------------------------------------------------
# download_fra_eng, against a local server


def _zip_bytes(members: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in members.items():
            zf.writestr(name, text)
    return buf.getvalue()


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # keep test output clean
        pass


@pytest.fixture
def server(tmp_path):
    """Serve tmp_path/www on 127.0.0.1; yields (base_url, www_dir, list of request paths)."""
    www = tmp_path / "www"
    www.mkdir()
    requests: list[str] = []

    class Counting(_Handler):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Counting, directory=str(www))
    )
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", www, requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


FRA_TXT = "Go.\tVa !\tCC-BY\nHi.\tSalut !\tCC-BY\n"
GOOD_ZIP = _zip_bytes({"fra-eng/fra.txt": FRA_TXT, "fra-eng/_about.txt": "about"})


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.name.startswith("."))


def test_download_good_hash_then_cached_without_network(server, tmp_path):
    base, www, requests = server
    (www / "fra-eng.zip").write_bytes(GOOD_ZIP)
    cache = tmp_path / "cache"
    url = f"{base}/fra-eng.zip"
    path = download_fra_eng(cache, url=url, sha1=_sha1(GOOD_ZIP))
    assert path == cache / "fra-eng" / "fra.txt"
    assert path.read_text(encoding="utf-8") == FRA_TXT
    assert (cache / "fra-eng.zip").read_bytes() == GOOD_ZIP
    assert len(requests) == 1 and _leftovers(cache) == []
    # Second call: the cached zip has the right hash, so no request is made; even an
    # unreachable URL works, and a deleted text file is re-extracted from the cached zip.
    path.unlink()
    again = download_fra_eng(cache, url="http://127.0.0.1:9/fra-eng.zip", sha1=_sha1(GOOD_ZIP))
    assert again.read_text(encoding="utf-8") == FRA_TXT
    assert len(requests) == 1
    assert "!" in load_data_nmt(2, 4, num_examples=2, path=again)[2]


def test_download_bad_hash_raises_and_leaves_nothing(server, tmp_path):
    base, www, _ = server
    (www / "fra-eng.zip").write_bytes(GOOD_ZIP)
    cache = tmp_path / "cache"
    url = f"{base}/fra-eng.zip"
    with pytest.raises(DownloadError) as e:
        download_fra_eng(cache, url=url, sha1="0" * 40)
    msg = str(e.value)
    assert url in msg and "expected " + "0" * 40 in msg and _sha1(GOOD_ZIP) in msg
    assert "\n" not in msg
    assert isinstance(e.value, RuntimeError)
    assert list(cache.iterdir()) == []


def test_download_404_raises(server, tmp_path):
    base, _, requests = server
    cache = tmp_path / "cache"
    url = f"{base}/missing.zip"
    with pytest.raises(DownloadError, match="404") as e:
        download_fra_eng(cache, url=url, sha1=FRA_ENG_SHA1)
    assert url in str(e.value) and "\n" not in str(e.value)
    assert requests == ["/missing.zip"]
    assert list(cache.iterdir()) == []


def test_download_network_failure_raises(tmp_path):
    with socket.socket() as s:  # find a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/fra-eng.zip"
    with pytest.raises(DownloadError, match="cannot download") as e:
        download_fra_eng(tmp_path, url=url, sha1=FRA_ENG_SHA1, timeout=5)
    assert url in str(e.value)


@pytest.fixture
def hang_up_server():
    """A server on 127.0.0.1 that accepts each connection and closes it without a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve():
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    listener.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["404", "hang-up", "nothing listening"])
def test_download_failures_are_one_line_with_the_way_out(where, server, hang_up_server,
                                                         tmp_path):
    """Whatever goes wrong, one line: the URL tried, that the download failed and why, where
    fra.txt can go instead, and --data PATH; and an OSError, which the CLI reports."""
    base = {"404": server[0], "hang-up": hang_up_server,
            "nothing listening": f"http://127.0.0.1:{_closed_port()}"}[where]
    url = f"{base}/fra-eng.zip"
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError) as e:
        download_fra_eng(cache, url=url, sha1=FRA_ENG_SHA1, timeout=5)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, OSError)
    assert msg.startswith(f"cannot download {url}: ")
    assert ("HTTP 404" in msg) if where == "404" else ("the network failed" in msg)
    assert str(cache / "fra-eng" / "fra.txt") in msg and "--data PATH" in msg
    assert not (cache / "fra-eng.zip").exists()


def test_cli_train_on_fra_eng_without_network_is_one_line(tmp_path, monkeypatch, capsys):
    """`qkv translate train --data fra-eng` with the network down: exit 2, one line."""
    import qkv.tasks.translate
    from qkv.cli import main

    url = f"http://127.0.0.1:{_closed_port()}/fra-eng.zip"
    monkeypatch.setattr(qkv.tasks.translate, "download_fra_eng",
                        functools.partial(download_fra_eng, tmp_path / "cache", url=url))
    assert main(["translate", "train", "--data", "fra-eng", "--run-dir", str(tmp_path / "r"),
                 "--epochs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"qkv translate: error: cannot download {url}: the network failed")
    assert str(tmp_path / "cache" / "fra-eng" / "fra.txt") in err and "--data PATH" in err


def test_fra_txt_put_in_the_cache_by_hand_is_used(tmp_path):
    txt = tmp_path / "fra-eng" / "fra.txt"
    txt.parent.mkdir()
    txt.write_text(FRA_TXT, encoding="utf-8")
    # no zip in the cache: the file is used and the (unreachable) URL is never tried
    url = f"http://127.0.0.1:{_closed_port()}/fra-eng.zip"
    assert download_fra_eng(tmp_path, url=url) == txt
    assert tr.cached_fra_eng(tmp_path, url=url) == txt


def test_cached_fra_eng_never_downloads(server, tmp_path):
    base, www, requests = server
    (www / "fra-eng.zip").write_bytes(GOOD_ZIP)
    url = f"{base}/fra-eng.zip"
    with pytest.raises(FileNotFoundError) as e:
        tr.cached_fra_eng(tmp_path / "c", url=url, sha1=_sha1(GOOD_ZIP))
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "c" / "fra-eng" / "fra.txt") in msg
    assert "--data fra-eng" in msg and "--data PATH" in msg
    assert requests == []
    # a verified zip already in the cache is unpacked, still without a request
    download_fra_eng(tmp_path / "c", url=url, sha1=_sha1(GOOD_ZIP))
    (tmp_path / "c" / "fra-eng" / "fra.txt").unlink()
    path = tr.cached_fra_eng(tmp_path / "c", url=url, sha1=_sha1(GOOD_ZIP))
    assert path.read_text(encoding="utf-8") == FRA_TXT and len(requests) == 1


def test_download_replaces_corrupt_cached_zip(server, tmp_path):
    base, www, requests = server
    (www / "fra-eng.zip").write_bytes(GOOD_ZIP)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fra-eng.zip").write_bytes(b"truncated")
    path = download_fra_eng(cache, url=f"{base}/fra-eng.zip", sha1=_sha1(GOOD_ZIP).upper())
    assert path.read_text(encoding="utf-8") == FRA_TXT
    assert len(requests) == 1


@pytest.mark.parametrize(
    "members, match",
    [
        ({"../evil.txt": "x", "fra-eng/fra.txt": FRA_TXT}, "unsafe member '../evil.txt'"),
        ({"/abs/evil.txt": "x"}, "unsafe member"),
        ({"fra-eng/../../evil.txt": "x"}, "unsafe member"),
        ({"other/fra.txt": FRA_TXT}, "does not contain fra-eng/fra.txt"),
    ],
)
def test_download_rejects_unsafe_or_wrong_archives(server, tmp_path, members, match):
    base, www, _ = server
    data = _zip_bytes(members)
    (www / "fra-eng.zip").write_bytes(data)
    cache = tmp_path / "deep" / "cache"
    with pytest.raises(DownloadError, match=match):
        download_fra_eng(cache, url=f"{base}/fra-eng.zip", sha1=_sha1(data))
    assert not (tmp_path / "deep" / "evil.txt").exists()
    assert not (tmp_path / "evil.txt").exists()


def test_download_rejects_non_zip(server, tmp_path):
    base, www, _ = server
    data = b"<html>not a zip</html>"
    (www / "fra-eng.zip").write_bytes(data)
    with pytest.raises(DownloadError, match="not a valid zip"):
        download_fra_eng(tmp_path / "c", url=f"{base}/fra-eng.zip", sha1=_sha1(data))


def test_default_cache_dir_and_constants(monkeypatch, tmp_path):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "q"))
    assert tr.default_cache_dir() == tmp_path / "q"
    monkeypatch.delenv("QKV_CACHE")
    assert tr.default_cache_dir() == Path.home() / ".cache" / "qkv"
    assert FRA_ENG_URL == "http://d2l-data.s3-accelerate.amazonaws.com/fra-eng.zip"
    assert len(FRA_ENG_SHA1) == 40


@pytest.mark.parametrize("text, expected", [
    ("Go.", "go."),
    ("Hello, Tom. Are you here?", "hello, tom. are you here?"),
    ("Wait...", "wait..."),
    ("Va !", "va!"),  # French typography's space before "!" is not restored
    ("? Why", "? why"),
])
def test_detokenize_undoes_preprocess_split(text, expected):
    assert tr.detokenize(tr.preprocess(text).split()) == expected


def test_held_out_by_source_keeps_every_translation_of_a_sentence_together():
    from qkv.data.translate import held_out_indices

    # 30 source sentences, sentence j given (j % 3) + 1 translations: 60 pairs.
    src, tgt = [], []
    for j in range(30):
        for r in range(j % 3 + 1):
            src.append(["s", str(j)])
            tgt.append(["t", str(j), str(r)])
    data = TranslationData.from_pairs(src, tgt, held_out=10, seed=3, split_by="source")
    held = {tuple(s) for s, _ in data.valid_pairs}
    trained = {tuple(s) for s, _ in data.train_pairs}
    assert not held & trained
    # whole sentences are drawn until at least 10 pairs are out: at most 2 more
    assert 10 <= len(data.valid_pairs) <= 12
    for s in held:  # every translation of a held-out sentence is held out
        assert sum(tuple(p) == s for p, _ in data.valid_pairs) == int(s[1]) % 3 + 1
    assert len(data.valid_pairs) + len(data.train_pairs) == 60
    # deterministic under the seed, different under another
    again = held_out_indices(src, 10, seed=3, by="source")
    assert [src[i] for i in again] == [s for s, _ in data.valid_pairs]
    assert held_out_indices(src, 10, seed=4, by="source") != again
    # by pair: the plain random choice, which splits some sentence from a translation
    by_pair = held_out_indices(src, 10, seed=3)
    assert by_pair == sorted(torch.randperm(60, generator=torch.Generator().manual_seed(3))
                             [:10].tolist())


def test_held_out_by_source_never_takes_the_whole_corpus():
    from qkv.data.translate import held_out_indices

    # one sentence with five translations, one with one: holding out the big group would
    # leave one training pair, which is allowed; both groups would leave none.
    src = [["a"]] * 5 + [["b"]]
    chosen = held_out_indices(src, 4, seed=0, by="source")
    assert 0 < len(chosen) < 6
    with pytest.raises(ValueError, match="split by must be one of pair, source"):
        held_out_indices(src, 1, by="sentence")

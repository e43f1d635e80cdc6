"""qkv.viz and qkv view: the page's data against independent computations of the
models' attention, the page file, the local server and the command line.

The page's own behaviour in a browser is tested in test_viz_page.py (synthetic data)
and at the end of this file (real runs, real server).
"""

from __future__ import annotations

import json
import math
import re
import threading
import urllib.error
import urllib.request

import pytest
import torch

from qkv.cli import main
from qkv.data.tokenizers import get_tokenizer
from qkv.models.gpt import GPTConfig, GPTModel
from qkv.tasks.lm import LanguageModel, LMSettings
from qkv.tasks.translate import Translator
from qkv.viz import Exploration, decode_section, encode_section, explore, page_data
from qkv.viz.server import make_server
from test_translate import FAST, PAIRS

LM_TEXT = ("The cat sat on the mat. The dog sat on the log. " * 30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny language model and both translators, trained for a few steps."""
    root = tmp_path_factory.mktemp("viz")
    text = root / "story.txt"
    text.write_text(LM_TEXT, encoding="utf-8")
    corpus = root / "pairs.txt"
    corpus.write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS), encoding="utf-8")
    assert main(["lm", "train", "--text", str(text), "--run-dir", str(root / "lm"),
                 "--epochs", "1", "--context-length", "32", "--batch-size", "8",
                 "--no-progress", "--sample", ""]) == 0
    for model in ("bahdanau", "transformer"):
        assert main(["translate", "train", "--data", str(corpus), "--model", model,
                     "--run-dir", str(root / model), "--epochs", "3", *FAST]) == 0
    return root


def naive_attention(x: torch.Tensor, attn, *, causal: bool, valid: int | None = None
                    ) -> torch.Tensor:
    """``(heads, T, T)`` softmax(q k^T / sqrt(d)) in float64 from a MultiHeadAttention's
    projection weights, written out here rather than taken from the layer."""
    x = x.double()
    h, d = attn.num_heads, attn.head_dim

    def project(linear: torch.nn.Linear) -> torch.Tensor:
        out = x @ linear.weight.double().T
        if linear.bias is not None:
            out = out + linear.bias.double()
        return out.view(len(x), h, d).transpose(0, 1)  # (heads, T, d)

    q, k = project(attn.W_query), project(attn.W_key)
    scores = q @ k.transpose(1, 2) / math.sqrt(d)
    keep = torch.ones(len(x), len(x), dtype=torch.bool)
    if causal:
        keep = keep.tril()
    if valid is not None:
        keep[:, valid:] = False
    return scores.masked_fill(~keep, float("-inf")).softmax(-1)


def close_to_8_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """The page's 8-bit weights are exact to half a step of 1/255 of their row's max."""
    step = want.amax(-1, keepdim=True) / 510
    assert got.shape == want.shape
    assert bool(((got.double() - want).abs() <= step + 1e-6).all()), \
        (got.double() - want).abs().max()


# ---------------------------------------------------------------------------- encoding

def test_encoding_keeps_every_row_to_8_bits_and_stores_a_causal_map_as_a_triangle():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 3, 5, 7, generator=g).double().softmax(-1)
    section = encode_section("cross", "t", list("abcde"), list("ABCDEFG"), full)
    close_to_8_bits(decode_section(section), full)
    assert len(section["weights"]) == math.ceil(2 * 3 * 5 * 7 / 3) * 4  # base64 of bytes
    causal = torch.randn(2, 3, 6, 6, generator=g).masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")).double().softmax(-1)
    section = encode_section("self", "t", list("abcdef"), list("abcdef"), causal, causal=True)
    close_to_8_bits(decode_section(section), causal)
    assert len(section["weights"]) == math.ceil(2 * 3 * 21 / 3) * 4  # 21 = 6 * 7 / 2
    # Each row's largest weight is stored exactly (float32), so it reads back as itself.
    got = decode_section(section)
    torch.testing.assert_close(got.amax(-1), causal.amax(-1).float())


def test_encoding_refuses_what_is_not_an_attention_map():
    w = torch.full((1, 1, 2, 3), 1 / 3)
    with pytest.raises(ValueError, match="2 x 3 but there are 2 queries and 2 keys"):
        encode_section("x", "t", ["a", "b"], ["a", "b"], w)
    with pytest.raises(ValueError, match="as many queries as keys"):
        encode_section("x", "t", ["a", "b"], ["a", "b", "c"], w, causal=True)
    with pytest.raises(ValueError, match="finite and >= 0"):
        encode_section("x", "t", ["a", "b"], ["a", "b", "c"], w * float("nan"))
    with pytest.raises(ValueError, match="layers, heads, queries, keys"):
        encode_section("x", "t", ["a", "b"], ["a", "b", "c"], w[0])


# ---------------------------------------------------------------------------- models

def test_language_model_page_holds_each_layers_attention(runs):
    lm = LanguageModel.load(runs / "lm")
    data = page_data(lm, ["The cat sat"], run_dir=runs / "lm")
    assert data["model"]["kind"] == "lm" and data["version"] == 1
    (ex,) = data["examples"]
    (section,) = ex["sections"]
    assert section["queries"] == list("The cat sat") and section["causal"]
    cfg = lm.model.cfg
    assert (section["layers"], section["heads"]) == (cfg.n_layers, cfg.n_heads)
    # Layer 0 from the embeddings and the block's weights, in float64.
    ids = torch.tensor([lm.tokenizer.encode("The cat sat")])
    with torch.no_grad():
        x = lm.model.tok_emb(ids)[0] + lm.model.pos_emb.weight[: ids.shape[1]]
        block = lm.model.trf_blocks[0]
        want = naive_attention(block.norm1(x), block.att, causal=True)
    close_to_8_bits(decode_section(section)[0], want)


def test_bahdanau_page_is_the_alignment_of_its_translation(runs):
    translator = Translator.load(runs / "bahdanau")
    (result,) = translator.translate(["I lost."])
    (ex,) = page_data(translator, ["I lost."])["examples"]
    assert ex["output"] == result.text
    (section,) = ex["sections"]
    assert section["id"] == "alignment" and section["keys"] == result.source_tokens
    assert section["queries"][-1] == "<eos>" or len(section["queries"]) == len(result.tokens)
    close_to_8_bits(decode_section(section)[0, 0], result.attention.double())


def test_transformer_page_has_all_three_attentions_of_every_layer(runs):
    translator = Translator.load(runs / "transformer")
    (result,) = translator.translate(["He's calm."])
    (ex,) = page_data(translator, ["He's calm."])["examples"]
    encoder, decoder, cross = ex["sections"]
    c = translator.model.config
    for section in (encoder, decoder, cross):
        assert (section["layers"], section["heads"]) == (c.num_layers, c.num_heads)
    assert encoder["queries"] == encoder["keys"] == result.source_tokens
    assert decoder["causal"] and decoder["queries"][0] == "<bos>"
    assert cross["keys"] == result.source_tokens
    # Cross-attention of the last layer, averaged over heads, is what each decoding step
    # with the KV cache saw (another code path: one token at a time).
    mean = decode_section(cross)[-1].double().mean(0)
    torch.testing.assert_close(mean, result.attention.double(), atol=2 / 255, rtol=0)
    # Encoder layer 0 from the embeddings and the block's weights, in float64.
    model = translator.model
    src = torch.tensor([translator.src_vocab[result.source_tokens]])
    with torch.no_grad():
        x = model._embed(model.src_embedding, src)[0]  # noqa: SLF001 - the model's input
        block = model.encoder_blocks[0]
        want = naive_attention(block.ln1(x), block.attention, causal=False)
    close_to_8_bits(decode_section(encoder)[0], want)


def test_a_12_layer_12_head_page_of_256_tokens_stays_under_15_mb():
    cfg = GPTConfig(vocab_size=257, context_length=256, emb_dim=48, n_heads=12, n_layers=12,
                    drop_rate=0.0)
    lm = LanguageModel(GPTModel(cfg).init_weights().eval(), get_tokenizer("bytes"),
                       LMSettings(preset="tiny"))
    text = "abcdefgh" * 32  # 256 byte tokens
    page = explore(lm, text).html()
    assert len(page.encode()) < 15 * 2**20
    assert len(page.encode()) > 144 * 256 * 257 // 2  # every layer and head is there


# ---------------------------------------------------------------------------- explore

def test_explore_saves_a_page_and_shows_itself_in_a_notebook(runs, tmp_path):
    page = explore(runs / "lm", ["The cat", "A dog </script><b>"])
    assert isinstance(page, Exploration) and "2 text(s)" in repr(page)
    path = page.save(tmp_path / "sub" / "page.html")
    html = path.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "</script><b>" not in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing to fetch
    data = json.loads(re.search(
        r'<script id="qkv-data" type="application/json">(.*?)</script>', html, re.S)[1])
    assert [e["text"] for e in data["examples"]] == ["The cat", "A dog </script><b>"]
    frame = page._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "sandbox=" in frame
    with pytest.raises(TypeError, match="LanguageModel, a Translator or a run directory"):
        explore(torch.nn.Linear(2, 2), "x")
    with pytest.raises(ValueError, match="text is empty"):
        explore(runs / "lm", "  ")
    with pytest.raises(ValueError, match="context_length is 32"):
        explore(runs / "lm", "x" * 33)


# ---------------------------------------------------------------------------- CLI

def test_view_writes_a_page_and_refuses_bad_input_in_one_line(runs, tmp_path, capsys):
    out = tmp_path / "fr.html"
    assert main(["view", "--ckpt", str(runs / "transformer"), "--text", "Go.", "--text",
                 "I won.", "--html", str(out)]) == 0
    assert "written to" in capsys.readouterr().out and out.stat().st_size > 0
    cases = [
        (["--ckpt", str(tmp_path / "nothing"), "--text", "x", "--html", str(out)], "nothing"),
        (["--ckpt", str(runs / "lm"), "--html", str(out)], "--html needs at least one"),
        (["--ckpt", str(runs / "lm"), "--text", "x", "--html", str(tmp_path / "a.png")],
         "ending in .html"),
        (["--ckpt", str(runs / "lm"), "--text", "", "--html", str(out)], "text is empty"),
        (["--ckpt", str(runs / "lm"), "--text", "x", "--html", str(out), "--beam", "0"],
         "--beam must be >= 1"),
    ]
    for args, message in cases:
        assert main(["view", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------------------- server

@pytest.fixture(scope="module")
def server(runs):
    srv = make_server(LanguageModel.load(runs / "lm"), port=0, texts=["The cat"],
                      log=lambda line: None)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_server_answers_the_page_and_each_text_and_survives_bad_input(server):
    status, body = get(server + "/")
    assert status == 200 and b'<body data-mode="serve">' in body
    status, body = get(server + "/api/attention?text=" + urllib.request.quote("The dog"))
    assert status == 200
    ex = json.loads(body)["example"]
    assert ex["text"] == "The dog" and ex["sections"][0]["queries"] == list("The dog")
    for query, code, message in [("text=", 400, "text is empty"),
                                 ("text=" + "x" * 40, 400, "context_length is 32"),
                                 ("", 400, "give one text"),
                                 ("text=a&text=b", 400, "give one text")]:
        status, body = get(server + "/api/attention?" + query)
        assert (status, message in json.loads(body)["error"]) == (code, True), query
    status, body = get(server + "/nope")
    assert status == 404
    status, body = get(server + "/", headers={"Host": "evil.example:80"})
    assert status == 403
    assert get(server + "/api/attention?text=ok")[0] == 200  # still serving


def test_server_listens_on_the_loopback_only_and_says_when_its_port_is_taken(server, runs):
    assert server.startswith("http://127.0.0.1:")
    port = int(server.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} .*choose another"):
        make_server(LanguageModel.load(runs / "lm"), port=port)


# ---------------------------------------------------------------------------- browser

def _browser():
    import shutil

    playwright = pytest.importorskip("playwright.sync_api")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    return playwright, executable


def test_real_pages_work_in_a_browser_offline_and_live(runs, server, tmp_path):
    sync_api, executable = _browser()
    page_file = tmp_path / "lm.html"
    explore(runs / "lm", "The cat sat").save(page_file)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors, requests = [], []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri())
            page.wait_for_function("window.qkvReady === true", timeout=15_000)
            assert requests == [page_file.as_uri()]  # the page itself, nothing else
            queries = page.locator("text.token.query")
            assert queries.count() == len("The cat sat")
            queries.nth(4).hover()  # "c"
            assert page.locator("text.token.query.active").count() == 1
            assert page.locator("text.token.key.highlight").count() >= 1
            assert page.locator(".link.dim").count() > 0
            # Live: a new text through the real server redraws the page.
            page.goto(server + "/")
            page.wait_for_function("window.qkvReady === true", timeout=15_000)
            page.fill("#text-input", "A dog")
            page.click("#run")
            page.wait_for_function(
                "document.querySelectorAll('text.token.query').length === 5", timeout=15_000)
            page.fill("#text-input", "x" * 40)
            page.click("#run")
            page.wait_for_function(
                "document.querySelector('#error').textContent.includes('context_length')",
                timeout=15_000)
            assert page.locator("text.token.query").count() == 5  # the last good text stays
            # The browser itself logs the deliberate 400 answer; nothing else may appear.
            bad_request = "the server responded with a status of 400"
            assert [e for e in errors if bad_request not in e] == [], errors
        finally:
            browser.close()

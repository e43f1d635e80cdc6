"""qkv.viz and qkv view: the page's data against independent computations of the
models' attention, the page file, the local server and the command line.

The page's own behaviour in a browser is tested in test_viz_page.py (synthetic data)
and at the end of this file (real runs, real server).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.data.tokenizers import get_tokenizer
from qkv.models.gpt import GPTConfig, GPTModel
from qkv.tasks.lm import LanguageModel, LMSettings
from qkv.tasks.translate import Translator
from qkv.viz import Exploration, decode_section, encode_section, explore, page_data
from qkv.viz.data import DECADES, MAX_TEXT_CHARS
from qkv.viz.server import MAX_BODY_BYTES, make_server
from test_translate import FAST, PAIRS
from test_viz_page import HOSTILE

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


# The page's bytes are a log scale of DECADES decades in 254 steps: a weight within its
# range reads back within half a step, a factor 10 ** (DECADES / 508), of itself.
LOG_HALF_STEP = 10 ** (DECADES / 508) - 1  # 2.29%


def close_to_8_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """The page's 8-bit weights: each within 2.3% of itself from 1e-5 of its row's max
    up (float32 adds its own rounding), and below that under the range's floor."""
    assert got.shape == want.shape
    got = got.double()
    floor = want.amax(-1, keepdim=True) * 10.0 ** -DECADES
    inside = want >= floor
    rel = ((got - want).abs() / want.clamp_min(1e-300))[inside]
    assert bool((rel <= LOG_HALF_STEP + 1e-5).all()), rel.max()
    assert bool((got[~inside] <= floor.expand_as(got)[~inside] * (1 + LOG_HALF_STEP)).all())


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


def test_small_weights_beside_an_attention_sink_keep_their_precision():
    """Rows where the first key takes ~0.9 (an attention sink) and 255 others share the
    rest: a byte linear in w / row_max would read nearly every other weight as 0; the log
    bytes keep each within 2.3% of the float64 weight."""
    g = torch.Generator().manual_seed(1)
    logits = 0.3 * torch.randn(2, 3, 256, 256, generator=g, dtype=torch.float64)
    logits[..., 0] += 8.0
    w = logits.masked_fill(~torch.ones(256, 256, dtype=torch.bool).tril(),
                           float("-inf")).softmax(-1)
    assert float(w[:, :, 200:, 0].min()) > 0.8  # the sink dominates the long rows
    rest = w[:, :, 200:, 1:201]
    row_max = w[:, :, 200:].amax(-1, keepdim=True)
    # Nearly all of them would be 0 as linear bytes:
    assert float((rest / row_max * 255 < 0.5).double().mean()) > 0.95
    section = encode_section("self", "t", ["a"] * 256, ["a"] * 256, w, causal=True)
    got = decode_section(section).double()
    close_to_8_bits(got, w)
    assert bool((got[:, :, 200:, 1:201] > 0).all())
    rel = (got - w).abs() / w.clamp_min(1e-300)
    assert float(rel[w > 0].max()) <= LOG_HALF_STEP + 1e-5  # every weight here is in range


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
    with pytest.raises(ValueError, match="generated_from must be an index in 0..2, got 3"):
        encode_section("x", "t", ["a", "b"], ["a", "b", "c"], w, generated_from=3)


def test_signed_weights_keep_their_sign_and_their_layers_their_numbers():
    """A signed section (the delta rule's weights are not a softmax) stores magnitudes
    as any section does and one sign bit per stored entry; its layers keep the model's
    numbers."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64).tril()
    labels = list("abcdef")
    section = encode_section("delta", "t", labels, labels, w, causal=True, signed=True,
                             layer_ids=[0, 2])
    assert section["layer_ids"] == [0, 2]
    assert len(section["signs"]) == math.ceil(math.ceil(2 * 3 * 21 / 8) / 3) * 4
    got = decode_section(section).double()
    close_to_8_bits(got.abs(), w.abs())
    shown = got != 0
    assert bool((got[shown].sign() == w[shown].sign()).all())
    assert bool((w < 0).any() & (got < 0).any())
    with pytest.raises(ValueError, match="finite and >= 0"):
        encode_section("x", "t", labels, labels, w, causal=True)
    with pytest.raises(ValueError, match=r"layer_ids must name each of the 2 layers once"):
        encode_section("x", "t", labels, labels, w, causal=True, signed=True,
                       layer_ids=[1, 1])


def test_a_hybrid_model_page_has_a_section_per_kind_of_layer():
    """Gated DeltaNet layers (3 value heads) between gated softmax ones (2 heads): a
    section of the softmax layers and one of the DeltaNet layers' effective weights,
    each layer under its number in the model, the weights those the model's forward
    returns (signs included), and the page says what the DeltaNet weights are."""
    cfg = GPTConfig(vocab_size=257, context_length=64, emb_dim=32, n_heads=2, n_layers=3,
                    drop_rate=0.0, rope=True, norm="rmsnorm", mlp="swiglu", hidden_dim=48,
                    layout=[{"attention": "gated_deltanet"}, {"attention": "gated"},
                            {"attention": "gated_deltanet"}],
                    attention_options={"gated_deltanet": {"num_k_heads": 1, "head_k_dim": 8,
                                                          "num_v_heads": 3, "head_v_dim": 8},
                                       "gated": {"rotary_dim": 8}})
    torch.manual_seed(0)
    lm = LanguageModel(GPTModel(cfg).init_weights(0.2).eval(), get_tokenizer("bytes"),
                       LMSettings(preset="tiny"))
    data = page_data(lm, ["The cat sat on the mat"])
    assert "effective token-to-token weights" in data["model"]["name"]
    softmax, delta = data["examples"][0]["sections"]
    assert (softmax["id"], softmax["heads"], softmax["layer_ids"]) == ("self", 2, [1])
    assert "signs" not in softmax
    assert (delta["id"], delta["heads"], delta["layer_ids"]) == ("gated-deltanet", 3, [0, 2])
    assert "Gated DeltaNet" in delta["title"]
    ids = torch.tensor([lm.tokenizer.encode("The cat sat on the mat")])
    with torch.no_grad():
        _, weights = lm.model(ids, need_weights=True)
    want = torch.stack([weights[0][0], weights[2][0]]).double()
    got = decode_section(delta).double()
    assert bool((want < 0).any())  # the case the signs are for
    close_to_8_bits(got.abs(), want.abs())
    shown = got != 0
    assert bool((got[shown].sign() == want[shown].sign()).all())
    close_to_8_bits(decode_section(softmax)[0], weights[1][0])


# ---------------------------------------------------------------------------- models

def test_language_model_page_holds_each_layers_attention(runs):
    lm = LanguageModel.load(runs / "lm")
    data = page_data(lm, ["The cat sat"], run_dir=runs / "lm")
    assert data["model"]["kind"] == "lm" and data["version"] == 2
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


def test_a_language_model_page_shows_its_greedy_continuation_as_decoded_with_the_cache(runs):
    lm = LanguageModel.load(runs / "lm")
    prompt, n = "The cat", 6
    (ex,) = page_data(lm, [prompt], generate=n)["examples"]
    (section,) = ex["sections"]
    # The continuation is what `lm generate` prints (greedy, KV cache).
    assert ex["output"] == lm.generate(prompt, n).text
    ids = lm.tokenizer.encode(prompt)
    p = len(ids)
    assert section["generated_from"] == p and len(section["queries"]) == p + n
    assert "".join(section["queries"]) == prompt + ex["output"]
    full = torch.tensor([lm.tokenizer.encode(prompt + ex["output"])])
    assert full.shape[1] == p + n
    got = decode_section(section).double()
    model = lm.model
    with torch.no_grad():
        # Layer 0 of the whole sequence, from its embeddings and weights, in float64.
        x = model.tok_emb(full)[0] + model.pos_emb.weight[: p + n]
        block = model.trf_blocks[0]
        close_to_8_bits(got[0], naive_attention(block.norm1(x), block.att, causal=True))
        # Every layer's row of each generated token is the row it had when it was decoded
        # one token at a time with the KV cache (another code path than the full forward).
        _, whole = model(full, need_weights=True)
        caches = model.new_caches(1)
        logits, _ = model(full[:, :p], caches=caches, need_weights=True)
        for t in range(p, p + n):
            assert int(logits[0, -1].argmax()) == int(full[0, t])  # greedy
            logits, step = model(full[:, t : t + 1], caches=caches, need_weights=True)
            for layer in range(len(step)):
                row = step[layer][0, :, 0, : t + 1]  # (heads, keys so far)
                torch.testing.assert_close(row, whole[layer][0, :, t, : t + 1],
                                           atol=1e-6, rtol=1e-5)
                close_to_8_bits(got[layer, :, t, : t + 1], row.double())


def test_generate_is_bounded_by_the_context_and_refused_for_translators(runs):
    lm = LanguageModel.load(runs / "lm")
    (ex,) = page_data(lm, ["The"], generate=29)["examples"]  # 3 + 29 = the context, 32
    assert len(ex["sections"][0]["queries"]) == 32
    for bad, message in [(30, "generate 30: the prompt has 3 tokens and the model's "
                              "context_length is 32, so at most 29"),
                         (-1, "generate must be an integer in [0, 100,000], got -1"),
                         ("2", "generate must be an integer"),
                         (True, "generate must be an integer")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            page_data(lm, ["The"], generate=bad)
    (plain,) = page_data(lm, ["The"])["examples"]
    assert plain["output"] is None and plain["sections"][0]["generated_from"] is None
    translator = Translator.load(runs / "bahdanau")
    with pytest.raises(ValueError, match="only a language model continues its text"):
        explore(translator, "Go.", generate=3)


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
    torch.testing.assert_close(mean, result.attention.double(), atol=1e-5,
                               rtol=LOG_HALF_STEP)
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
         "--beam must be an integer in [1, 1,000]"),
        (["--ckpt", str(runs / "lm"), "--text", "x", "--html", str(out), "--beam", "1000000"],
         "--beam must be an integer in [1, 1,000]"),
        (["--ckpt", str(runs / "lm"), "--text", "x", "--html", str(out), "--generate", "-1"],
         "--generate must be an integer in [0, 100,000], got -1"),
        (["--ckpt", str(runs / "lm"), "--text", "x", "--html", str(out), "--generate",
          "10000000"], "--generate must be an integer in [0, 100,000]"),
        (["--ckpt", str(runs / "lm"), "--text", "The", "--html", str(out), "--generate", "30"],
         "the prompt has 3 tokens and the model's context_length is 32, so at most 29"),
        (["--ckpt", str(runs / "transformer"), "--text", "Go.", "--html", str(out),
          "--generate", "2"], "only a language model continues its text"),
        (["--ckpt", str(runs / "transformer"), "--serve", "--port", "0", "--generate", "2"],
         "only a language model continues its text"),
    ]
    for args, message in cases:
        assert main(["view", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    lm_page = tmp_path / "lm.html"
    assert main(["view", "--ckpt", str(runs / "lm"), "--text", "The cat", "--generate", "4",
                 "--html", str(lm_page)]) == 0
    data = json.loads(re.search(r'<script id="qkv-data" type="application/json">(.*?)</script>',
                                lm_page.read_text(encoding="utf-8"), re.S)[1])
    (section,) = data["examples"][0]["sections"]
    assert section["generated_from"] == 7 and len(section["queries"]) == 11


# ---------------------------------------------------------------------------- server

@contextlib.contextmanager
def running(srv):
    """``srv`` serving on a thread of its own; its address."""
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def server(runs):
    srv = make_server(LanguageModel.load(runs / "lm"), port=0, texts=["The cat"],
                      log=lambda line: None)
    with running(srv) as url:
        yield url


def get(url: str, headers: dict | None = None, data: bytes | None = None
        ) -> tuple[int, bytes]:
    """The status and body of a GET (a POST with ``data``)."""
    request = urllib.request.Request(url, headers=headers or {}, data=data)
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
    # The tokens to generate: in the query string or the JSON body.
    status, body = get(server + "/api/attention?text=The&generate=5")
    assert status == 200 and json.loads(body)["example"]["sections"][0]["generated_from"] == 3
    status, answer = post(server, {"text": "The cat", "generate": 2})
    assert status == 200 and len(answer["example"]["sections"][0]["queries"]) == 9
    for request, message in [({"text": "The", "generate": 30}, "so at most 29"),
                             ({"text": "The", "generate": "2"}, "generate must be an integer"),
                             ({"text": "The", "generate": -2}, "generate must be an integer"),
                             ({"text": "The", "n": 2}, "the body must be the JSON")]:
        status, answer = post(server, request)
        assert status == 400 and message in answer["error"], (request, answer)
    status, body = get(server + "/api/attention?text=The&generate=x")
    assert status == 400 and "generate must be an integer" in json.loads(body)["error"]
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


# ------------------------------------------------------ server: careless and hostile clients

def post(url: str, obj, *, content_type: str = "application/json") -> tuple[int, dict]:
    status, body = get(url + "/api/attention", headers={"Content-Type": content_type},
                       data=json.dumps(obj).encode())
    return status, json.loads(body)


def connect(url: str, data: bytes = b"", *, receive_buffer: int | None = None):
    """A raw connection to the server at ``url`` that has sent ``data`` (and may send
    more, or nothing)."""
    sock = socket.socket()
    if receive_buffer is not None:  # before connecting: it sets the window offered
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(data)
    return sock


def reply(sock) -> tuple[int, dict]:
    """The status and JSON body the server sent on ``sock``, read to its end."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def reset(sock) -> None:
    """Close ``sock`` the rude way: a TCP reset, as a killed browser tab does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def request_threads() -> list[threading.Thread]:
    # socketserver names each connection's thread after its target.
    return [t for t in threading.enumerate() if "process_request_thread" in t.name]


def test_idle_and_half_sent_connections_delay_no_one_and_texts_run_one_at_a_time(runs):
    # The server would wait five minutes for the stalled clients; urllib gives up on an
    # answer after 30 s: every answer below comes while the stalled ones still wait.
    srv = make_server(LanguageModel.load(runs / "lm"), port=0, texts=["The cat"],
                      timeout=300, log=lambda line: None)
    with running(srv) as url, contextlib.ExitStack() as stalled:
        idle = stalled.enter_context(connect(url))
        half_head = stalled.enter_context(connect(
            url, b"GET /api/attention?text=A%20cat HTTP/1.0\r\nHost: 127.0.0.1\r\n"))
        half_body = stalled.enter_context(connect(
            url, b"POST /api/attention HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 17\r\n\r\n{\"text\": "))
        assert get(url + "/")[0] == 200
        # Eight texts at once, each on its own connection: each answer is its own text's.
        texts = ["The dog", "A cat", "sat on", "the mat", "The log", "on the", "dog.", "mat"]
        answers: dict[str, tuple[int, dict]] = {}
        askers = [threading.Thread(target=lambda t=t: answers.update({t: post(url, {"text": t})}))
                  for t in texts]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()
        for text in texts:
            status, body = answers[text]
            assert status == 200, body
            assert body["example"]["text"] == text
            assert body["example"]["sections"][0]["queries"] == list(text)
        # The stalled clients finish their requests and are answered too.
        half_head.sendall(b"\r\n")
        status, body = reply(half_head)
        assert status == 200 and body["example"]["text"] == "A cat"
        half_body.sendall(b'"The"}\r\n')
        status, body = reply(half_body)
        assert status == 200 and body["example"]["text"] == "The"
        idle.sendall(b"GET /api/attention?text=ok HTTP/1.0\r\nHost: localhost\r\n\r\n")
        assert reply(idle)[0] == 200


def test_a_client_too_slow_to_send_its_request_is_cut_off(runs):
    logged: list[str] = []
    srv = make_server(LanguageModel.load(runs / "lm"), port=0, timeout=0.5,
                      log=logged.append)
    with running(srv) as url:
        idle = connect(url)
        half_body = connect(url, b"POST /api/attention HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: 99\r\n\r\n{")
        assert idle.recv(1) == b"" and half_body.recv(1) == b""  # closed, unanswered
        # A byte every 0.1 s of one endless header: no read waits long, the request
        # never ends; the deadline is for the whole request.
        trickle = connect(url, b"GET / HTTP/1.0\r\nX-Slow: ")
        with pytest.raises(OSError):
            for _ in range(300):
                trickle.sendall(b"z")
                time.sleep(0.1)
        assert get(url + "/api/attention?text=ok")[0] == 200
        for sock in (idle, half_body, trickle):
            sock.close()
    assert logged == []


def test_clients_that_go_away_leave_no_trace(runs, capfd):
    logged: list[str] = []
    srv = make_server(LanguageModel.load(runs / "lm"), port=0, log=logged.append)
    request = b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"
    with running(srv) as url:
        for _ in range(3):
            reset(connect(url, request))  # before the server read the request
            # While the page is being written: a small receive window keeps the
            # server's write waiting for this client when the reset comes.
            sock = connect(url, request, receive_buffer=1024)
            assert sock.recv(1) == b"H"
            reset(sock)
            # Gone halfway through sending its request.
            connect(url, b"GET / HT").close()
        assert get(url + "/")[0] == 200
        for _ in range(300):  # each connection's thread has seen its client go
            if not request_threads():
                break
            time.sleep(0.1)
        assert request_threads() == []
    assert logged == []
    assert capfd.readouterr().err == ""


def test_the_api_bounds_what_it_reads_and_says_so_in_one_line(server):
    port = server.rsplit(":", 1)[1]

    def sent(head: str, body: bytes = b"") -> tuple[int, str]:
        with connect(server, head.encode() + b"\r\n\r\n" + body) as sock:
            status, answer = reply(sock)
        assert set(answer) == {"error"} and "\n" not in answer["error"]
        return status, answer["error"]

    post_head = (f"POST /api/attention HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
                 "Content-Type: application/json")
    # A body over the limit is refused from its length alone, before it is sent.
    status, error = sent(post_head + f"\r\nContent-Length: {MAX_BODY_BYTES + 1}")
    assert status == 413 and f"at most {MAX_BODY_BYTES:,}" in error
    assert f"{MAX_TEXT_CHARS:,} characters" in error
    assert sent(post_head)[0] == 411
    assert sent(post_head + "\r\nContent-Length: 1_0", b"x" * 10)[0] == 400
    nested = b"[" * 100_000
    status, error = sent(post_head + f"\r\nContent-Length: {len(nested)}", nested)
    assert status == 400 and 'JSON {"text"' in error
    for body in (b'{"text": 3}', b'{"text": "a", "more": 1}', b'"just text"'):
        status, error = sent(post_head + f"\r\nContent-Length: {len(body)}", body)
        assert status == 400, body
    status, error = sent("POST /api/attention HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                         "Content-Type: text/plain\r\nContent-Length: 3", b"abc")
    assert status == 415 and "application/json" in error
    assert sent("PUT / HTTP/1.0\r\nHost: 127.0.0.1")[0] == 501
    status, error = sent("GET /api/attention?text=" + "x" * 70_000 + " HTTP/1.0")
    assert status == 414 and "POST /api/attention" in error
    # The text itself: at most MAX_TEXT_CHARS characters, however it is written.
    status, body = post(server, {"text": "x" * (MAX_TEXT_CHARS + 1)})
    assert status == 400 and f"at most {MAX_TEXT_CHARS:,}" in body["error"]
    # The longest text, in the widest characters and fully escaped, fits in the body.
    longest = json.dumps({"text": "\U0001f431" * MAX_TEXT_CHARS}).encode()
    assert len(longest) <= MAX_BODY_BYTES
    status, body = get(server + "/api/attention", headers={"Content-Type": "application/json"},
                       data=longest)
    assert status == 400 and "context_length is 32" in json.loads(body)["error"]
    status, body = post(server, {"text": "The dog"})
    assert status == 200 and body["example"]["text"] == "The dog"


def test_connections_beyond_the_limit_are_told_to_come_back(runs):
    srv = make_server(LanguageModel.load(runs / "lm"), port=0, max_connections=2,
                      log=lambda line: None)
    with running(srv) as url:
        first, second = connect(url), connect(url)
        with connect(url) as third:
            status, body = reply(third)
        assert status == 503 and "2 connections" in body["error"]
        first.close()
        second.close()
        for _ in range(300):  # their threads end when they see the connections close
            if not request_threads():
                break
            time.sleep(0.1)
        assert get(url + "/api/attention?text=ok")[0] == 200


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_view_serve_stops_on_sigterm_and_ctrl_c_in_one_line(runs, signum, code):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(qkv.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv", "view", "--ckpt", str(runs / "lm"), "--serve",
         "--port", "0", "--text", "The cat"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()  # flushed as soon as the server listens
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, (line, process.stderr.read() if process.poll() is not None else "")
        url = url[0]
        idle = connect(url)  # a client that stays connected does not hold the exit
        assert get(url + "/api/attention?text=The%20dog")[0] == 200
        reset(connect(url, b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"))
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
        idle.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == code
    assert err.strip() == "qkv view: interrupted", err


# ---------------------------------------------------------------------------- browser

def _browser():
    import shutil

    playwright = pytest.importorskip("playwright.sync_api")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    return playwright, executable


def _errors_of(page) -> list[str]:
    """The list the page's script errors and console errors are appended to as it runs."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    return errors


def test_real_pages_work_in_a_browser_offline_and_live(runs, server, tmp_path):
    sync_api, executable = _browser()
    page_file = tmp_path / "lm.html"
    explore(runs / "lm", "The cat sat").save(page_file)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors, requests = _errors_of(page), []
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
            # The generate field: "A dog" and 3 greedy tokens, marked as generated.
            assert page.input_value("#generate-input") == "0"
            page.fill("#generate-input", "3")
            page.click("#run")
            page.wait_for_function(
                "document.querySelectorAll('text.token.query').length === 8", timeout=15_000)
            assert page.locator("text.token.query.generated").count() == 3
            assert "Generated" in page.text_content("#example-output-label")
            page.fill("#generate-input", "0")
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


def test_hostile_texts_through_a_real_model_show_literally_in_file_and_served_pages(tmp_path):
    sync_api, executable = _browser()
    cfg = GPTConfig(vocab_size=257, context_length=64, emb_dim=16, n_heads=2, n_layers=2,
                    drop_rate=0.0)
    lm = LanguageModel(GPTModel(cfg).init_weights().eval(), get_tokenizer("bytes"),
                       LMSettings(preset="tiny"))
    page_file = tmp_path / "hostile.html"
    explore(lm, HOSTILE).save(page_file)
    srv = make_server(lm, port=0, texts=HOSTILE[::-1], log=lambda line: None)
    with sync_api.sync_playwright() as p, running(srv) as url:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors, dialogs = _errors_of(page), []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))

            def shows(text):
                assert page.text_content("#example-text") == text
                tokens = page.locator("text.token.query")
                assert tokens.count() == len(text.encode())  # one token per byte
                if text.isascii():  # a byte of a longer character shows as U+FFFD
                    assert "".join(tokens.all_text_contents()) == text
                tokens.nth(len(text.encode()) // 2).hover()
                assert page.locator("text.token.key.highlight").count() >= 1
                page.mouse.move(1, 1)

            for where, texts in ((page_file.as_uri(), HOSTILE), (url + "/", HOSTILE[::-1])):
                page.goto(where)
                page.wait_for_function("window.qkvReady === true", timeout=15_000)
                for n, text in enumerate(texts):
                    page.select_option("#example", str(n))
                    shows(text)
            # Typed into the served page's box, sent to the server and drawn.
            for text in ("</script><script>alert(1)</script>", "<!--<script>"):
                page.fill("#text-input", text)
                page.click("#run")
                page.wait_for_function(
                    f"document.querySelectorAll('text.token.query').length === {len(text)}",
                    timeout=15_000)
                shows(text)
            assert errors == [] and dialogs == []
        finally:
            browser.close()

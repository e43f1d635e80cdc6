"""The page of ``qkv view`` (``src/qkv/viz/page.html`` filled by
:func:`qkv.viz.page.render_page`), driven in headless Chromium through Playwright.

The data are synthetic: random softmax rows (causal for self-attention of an LM),
encoded here straight from the schema the page reads, so that the page is tested
against the schema and not against the encoder of :mod:`qkv.viz.data`.

Set ``QKV_VIZ_SHOTS=/some/dir`` to also save screenshots of every view there.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from qkv.viz.page import render_page

EVIL = "</script><b>x"
# Texts that end, or comment out, a script whose data is pasted in naively; "]]>" and
# "<![CDATA[" for an XML reading of the page, U+2028 and U+2029 for a JavaScript one.
# "<!--<script>" comes last: a "-->" after it would undo what it does to such a page.
HOSTILE = ["-->", "</script><script>alert(1)</script>", "<!--", "]]>", "<![CDATA[",
           "a\u2028b\u2029c", "&amp;</", "<!--<script>"]
LM_TOKENS = ["The", " cat", " sat", "\n", EVIL, "", "\U0001f431", " & <i>", "on", " the",
             " mat", "."]
SOURCE = ["le", "chat", "est", "assis", "sur", "le", "tapis", "<eos>"]
OUTPUT = ["the", "cat", "sat", "on", "the", "mat", "<eos>"]
FILE_SCHEMES = ("data:", "blob:", "about:")
SHOTS = os.environ.get("QKV_VIZ_SHOTS")


# --------------------------------------------------------------------------- the data --


def softmax_rows(rng, L, H, Q, K, causal, sharpness=2.5):
    logits = rng.standard_normal((L, H, Q, K)) * sharpness
    if causal:
        logits = np.where(np.tril(np.ones((Q, K), dtype=bool)), logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


DECADES = 5  # the schema's log range


def encode_section(sid, title, queries, keys, weights, causal, generated_from=None):
    """One section, as the schema says: per (layer, head, row), layer-major, the stored
    entries of the row (0..i when causal) as bytes on a log scale, 255 + round(254 /
    DECADES * log10(w / row_max)) (0 below the range), and row_max as little-endian
    float32."""
    L, H, Q, K = weights.shape
    row_max = weights.max(-1).astype("<f4")
    with np.errstate(divide="ignore"):
        ratio = np.log10(weights / row_max[..., None].astype(np.float64))
    q = np.clip(np.rint(255 + ratio * 254 / DECADES), 0, 255).astype(np.uint8)
    if causal:
        ti, tj = np.tril_indices(Q)
        stored = q[:, :, ti, tj]
    else:
        stored = q
    return {
        "id": sid, "title": title, "queries": list(queries), "keys": list(keys),
        "layers": L, "heads": H, "causal": causal, "decades": DECADES,
        "generated_from": generated_from,
        "weights": base64.b64encode(np.ascontiguousarray(stored).tobytes()).decode("ascii"),
        "row_max": base64.b64encode(row_max.tobytes()).decode("ascii"),
    }


def encode_signed_section(sid, title, tokens, weights, layer_ids):
    """A causal section of weights of either sign, as the schema says: the bytes and
    row_max of the magnitudes, ``signs`` one bit per stored entry (1: negative; packed
    eight to a byte, least significant bit first), ``layer_ids`` the model's layers."""
    sec = encode_section(sid, title, tokens, tokens, np.abs(weights), causal=True)
    ti, tj = np.tril_indices(len(tokens))
    bits = (weights[:, :, ti, tj] < 0).reshape(-1)
    sec["signs"] = base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode()
    sec["layer_ids"] = list(layer_ids)
    return sec


def decoded(weights):
    """What the page should show: the weights after the 8-bit round trip."""
    row_max = weights.max(-1).astype("<f4").astype(np.float64)
    with np.errstate(divide="ignore"):
        q = np.clip(np.rint(255 + np.log10(weights / row_max[..., None]) * 254 / DECADES),
                    0, 255)
    return np.where(q > 0, 10 ** ((q - 255) * DECADES / 254), 0) * row_max[..., None]


def lm_data(rng, tokens=LM_TOKENS, L=2, H=3):
    w = softmax_rows(rng, L, H, len(tokens), len(tokens), causal=True)
    sec = encode_section("self", "Self-attention", tokens, tokens, w, causal=True)
    data = {
        "version": 2,
        "model": {"kind": "lm", "name": f"GPT ({L} layers, {H} heads)", "run": "runs/tiny"},
        "examples": [{"text": "".join(tokens), "output": None, "sections": [sec]}],
    }
    return data, decoded(w)


def bahdanau_data(rng):
    w = softmax_rows(rng, 1, 1, len(OUTPUT), len(SOURCE), causal=False, sharpness=3.0)
    sec = encode_section("alignment", "Alignment (output -> source)", OUTPUT, SOURCE, w, False)
    data = {
        "version": 2,
        "model": {"kind": "bahdanau", "name": "Bahdanau seq2seq (GRU, additive attention)",
                  "run": None},
        "examples": [{"text": " ".join(SOURCE[:-1]), "output": " ".join(OUTPUT[:-1]),
                      "sections": [sec]}],
    }
    return data, decoded(w)


def transformer_data(rng):
    src, tgt = SOURCE, ["<bos>", *OUTPUT[:-1]]
    enc = softmax_rows(rng, 2, 2, len(src), len(src), causal=False)
    dec = softmax_rows(rng, 2, 2, len(tgt), len(tgt), causal=True)
    cross = softmax_rows(rng, 2, 2, len(tgt), len(src), causal=False)
    example = {
        "text": " ".join(src[:-1]), "output": " ".join(OUTPUT[:-1]),
        "sections": [
            encode_section("encoder", "Encoder self-attention", src, src, enc, False),
            encode_section("decoder", "Decoder self-attention", tgt, tgt, dec, True),
            encode_section("cross", "Cross-attention (decoder -> encoder)", tgt, src, cross,
                           False),
        ],
    }
    second = json.loads(json.dumps(example))
    second["text"] = "un autre exemple"
    data = {"version": 2, "model": {"kind": "transformer", "name": "Transformer", "run": None},
            "examples": [example, second]}
    return data, decoded(cross)


def shown(token):
    """A token as the page writes it."""
    if token == "":
        return "\u2205"
    for char, escape in (("\n", "\\n"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"),
                         (" ", "\u00b7")):
        token = token.replace(char, escape)
    return token


# ------------------------------------------------------------------------ the browser --


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="Playwright for Python is not installed")
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("no chromium executable on PATH")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


class Watch:
    """A page, with its console errors and every request it made."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: self.requests.append(r.url))

    def foreign_requests(self):
        own = self.page.url
        return [u for u in self.requests if u != own and not u.startswith(FILE_SCHEMES)]


@contextmanager
def opened(browser, tmp_path, data, *, title="qkv attention", name="page.html"):
    """The page, saved as a file and opened from it (what ``qkv view`` does)."""
    path = tmp_path / name
    path.write_text(render_page(data, title=title, mode="file"), encoding="utf-8")
    context = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 900})
    try:
        w = Watch(context.new_page())
        w.page.goto(path.as_uri())
        w.page.wait_for_function("window.qkvReady === true", timeout=10_000)
        yield w
        assert w.errors == []
        assert w.foreign_requests() == []
    finally:
        context.close()


def shot(page, name):
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def texts(page, selector):
    return page.locator(selector).all_text_contents()


def classes(page, selector):
    return page.eval_on_selector_all(selector, "els => els.map(e => e.getAttribute('class'))")


def highlighted(page, side):
    return page.eval_on_selector_all(
        f"text.token.{side}.highlight", "els => els.map(e => Number(e.dataset.index))")


def links(page):
    return page.eval_on_selector_all(
        ".link", "els => els.map(e => [Number(e.dataset.q), Number(e.dataset.k),"
                 " Number(e.dataset.head), e.classList.contains('dim'),"
                 " getComputedStyle(e).display !== 'none'])")


def set_view(page, view):
    page.select_option("#view", view)


# ----------------------------------------------------------------------------- tests --


def test_render_page_keeps_the_data_inert():
    data, _ = lm_data(np.random.default_rng(0))
    data["examples"] += [{**data["examples"][0], "text": text} for text in HOSTILE]
    html = render_page(data, title="a <title> & {{DATA}}", mode="file")
    assert html.count("</script>") == 2  # the page's own two script elements, no more
    assert "a &lt;title&gt; &amp; {{DATA}}" in html
    assert 'data-mode="file"' in html
    blob = re.search(r'<script id="qkv-data" type="application/json">(.*?)</script>', html, re.S)
    assert json.loads(blob[1]) == data
    # Nothing in the block is markup: no "<" (no tag, no comment), no ">" or "&".
    assert not set(blob[1]) & set("<>&\u2028\u2029")
    assert "{{" not in html.replace("{{DATA}}", "")


def test_head_view_tokens_and_hover(browser, tmp_path):
    data, w = lm_data(np.random.default_rng(1))
    with opened(browser, tmp_path, data, title="tiny LM") as watch:
        page = watch.page
        assert page.evaluate("document.body.dataset.mode") == "file"
        assert page.inner_text("h1") == "tiny LM"
        assert page.locator("#text-form").count() == 0
        assert page.locator("#example-output-box").is_hidden()
        assert page.input_value("#view") == "head"
        expected = [shown(t) for t in LM_TOKENS]
        assert texts(page, "text.token.query") == expected
        assert texts(page, "text.token.key") == expected
        assert EVIL in texts(page, "text.token.query")
        assert page.locator("b, i").count() == 0  # tokens never became HTML
        assert len(links(page)) > 0 and not any(d for *_, d, _v in links(page))

        layer, i = 1, 7
        page.select_option("#layer", str(layer))
        page.hover(f"text.token.query[data-index='{i}']")
        assert "active" in classes(page, f"text.token.query[data-index='{i}']")[0]
        keys = highlighted(page, "key")
        best = w[layer, :, i, :].max(0)
        assert int(best.argmax()) in keys
        assert all(k <= i for k in keys)  # causal: nothing after the query
        now = links(page)
        visible = [(q, k, d) for q, k, _h, d, v in now if v]
        assert any(q == i and not d for q, k, d in visible)
        assert all(d for q, k, d in visible if q != i)
        assert {k for q, k, d in visible if not d} >= set(keys)
        # The weights are printed next to the keys, the top one first.
        numbers = page.eval_on_selector_all(
            "g.weights text", "els => els.map(e => [Number(e.getAttribute('y')), e.textContent])")
        assert len(numbers) >= len(keys)
        top_key = int(best.argmax())
        y_top = float(page.get_attribute(f"text.token.key[data-index='{top_key}']", "y"))
        line = next(t for y, t in numbers if abs(y - y_top) < 0.01)
        assert float(line.split()[0]) == pytest.approx(best[top_key], abs=0.006)

        page.mouse.move(1, 1)
        assert highlighted(page, "key") == []
        assert page.locator(".token.active, .link.dim").count() == 0

        # A key token: the lines into it, from queries at or after it.
        j = 2
        page.hover(f"text.token.key[data-index='{j}']")
        queries = highlighted(page, "query")
        assert int(w[layer, :, :, j].max(0).argmax()) in queries
        assert all(q >= j for q in queries)
        assert all(d for q, k, _h, d, v in links(page) if v and k != j)
        shot(page, "lm_head_hover")

        # Head toggles.
        page.mouse.move(1, 1)
        page.uncheck("input.head-toggle[data-head='0']")
        assert {h for _q, _k, h, _d, _v in links(page)} <= {1, 2}
        page.click("#heads-none")
        assert links(page) == []
        page.click("#heads-all")
        assert {h for _q, _k, h, _d, _v in links(page)} == {0, 1, 2}


def test_model_view_opens_the_matrix(browser, tmp_path):
    data, w = lm_data(np.random.default_rng(2))
    with opened(browser, tmp_path, data) as watch:
        page = watch.page
        shot(page, "lm_head")
        set_view(page, "model")
        page.wait_for_selector("#model-panel[data-complete='true']")
        assert page.locator("canvas.thumb").count() == 2 * 3
        shot(page, "lm_model")
        page.click("canvas.thumb[data-layer='1'][data-head='2']")
        assert page.input_value("#view") == "matrix"
        assert page.input_value("#layer") == "1"
        assert page.input_value("#head") == "2"
        canvas = page.locator("canvas#matrix")
        assert canvas.is_visible()

        def hover_cell(i, j):
            box = canvas.bounding_box()
            geo = page.eval_on_selector("canvas#matrix", "c => c.dataset")
            cell = float(geo["cell"])
            page.mouse.move(box["x"] + float(geo["originX"]) + (j + 0.5) * cell,
                            box["y"] + float(geo["originY"]) + (i + 0.5) * cell)
            return page.inner_text("#tooltip")

        tip = hover_cell(6, 4)
        assert page.locator("#tooltip").is_visible()
        assert tip.startswith(f"{shown(LM_TOKENS[6])} \u2192 {shown(LM_TOKENS[4])}: ")
        value = float(re.search(r": ([0-9.e+-]+)", tip)[1])
        assert round(value, 2) == pytest.approx(round(w[1, 2, 6, 4], 2), abs=0.011)
        assert abs(value - w[1, 2, 6, 4]) < 0.001
        assert "masked" in hover_cell(2, 9)  # causal: a later token
        hover_cell(8, 3)
        shot(page, "lm_matrix")
        page.mouse.move(1, 1)
        assert page.locator("#tooltip").is_hidden()


@pytest.mark.parametrize("view", ["head", "model", "matrix"])
def test_exports(browser, tmp_path, view):
    data, _ = lm_data(np.random.default_rng(3))
    with opened(browser, tmp_path, data) as watch:
        page = watch.page
        set_view(page, view)
        if view == "head":
            page.hover("text.token.query[data-index='5']")
        for button, name in (("#export-svg", "svg"), ("#export-png", "png")):
            with page.expect_download() as info:
                page.click(button)
            download = info.value
            assert download.suggested_filename.endswith(f".{name}")
            path = tmp_path / f"{view}.{name}"
            download.save_as(path)
            body = path.read_bytes()
            if name == "svg":
                root = ET.fromstring(body)
                assert root.tag == "{http://www.w3.org/2000/svg}svg"
                found = "".join(root.itertext())
                if view != "model":
                    assert EVIL in found
            else:
                assert body[:8] == b"\x89PNG\r\n\x1a\n"
                assert len(body) > 1000


def test_bahdanau_alignment(browser, tmp_path):
    data, w = bahdanau_data(np.random.default_rng(4))
    with opened(browser, tmp_path, data, title="Bahdanau alignment") as watch:
        page = watch.page
        assert page.inner_text("#example-output") == " ".join(OUTPUT[:-1])
        assert page.locator("#section-tabs").is_hidden()
        assert texts(page, "text.token.query") == OUTPUT
        assert texts(page, "text.token.key") == SOURCE
        # One map: the matrix is under the lines.
        assert page.locator("canvas#matrix").is_visible()
        shot(page, "bahdanau_head")
        page.hover("text.token.query[data-index='1']")
        assert int(w[0, 0, 1].argmax()) in highlighted(page, "key")
        shot(page, "bahdanau_head_hover")
        set_view(page, "model")
        page.wait_for_selector("#model-panel[data-complete='true']")
        assert page.locator("canvas.thumb").count() == 1
        shot(page, "bahdanau_model")
        page.click("canvas.thumb")
        assert page.input_value("#view") == "matrix"
        shot(page, "bahdanau_matrix")


def test_transformer_sections_and_examples(browser, tmp_path):
    data, cross = transformer_data(np.random.default_rng(5))
    with opened(browser, tmp_path, data) as watch:
        page = watch.page
        tabs = page.locator("button.section-tab")
        assert tabs.count() == 3
        assert page.locator("#example option").count() == 2
        page.click("button.section-tab[data-section='cross']")
        assert texts(page, "text.token.query") == ["<bos>", *OUTPUT[:-1]]
        assert texts(page, "text.token.key") == SOURCE
        page.select_option("#layer", "1")
        page.hover("text.token.query[data-index='3']")
        assert int(cross[1, :, 3].max(0).argmax()) in highlighted(page, "key")
        page.mouse.move(1, 1)
        page.select_option("#example", "1")
        assert page.inner_text("#example-text") == "un autre exemple"
        assert page.get_attribute("button.section-tab[data-section='encoder']",
                                  "aria-selected") == "true"


def hostile_data(rng):
    """A Transformer's page whose every text, output and token is hostile (and the
    model's name and run too)."""
    examples = []
    for text in HOSTILE:
        src, tgt = [text, "<!--", "</script>", "<eos>"], ["<bos>", "]]>", text]
        examples.append({"text": text, "output": "<!--" + text, "sections": [
            encode_section("encoder", "Encoder self-attention", src, src,
                           softmax_rows(rng, 2, 2, 4, 4, causal=False), False),
            encode_section("decoder", "Decoder self-attention", tgt, tgt,
                           softmax_rows(rng, 2, 2, 3, 3, causal=True), True),
            encode_section("cross", "Cross-attention", tgt, src,
                           softmax_rows(rng, 2, 2, 3, 4, causal=False), False),
        ]})
    return {"version": 2,
            "model": {"kind": "transformer", "name": "<!--<script> model", "run": "runs/]]>"},
            "examples": examples}


def test_hostile_texts_show_as_text_and_every_example_and_tab_works(browser, tmp_path):
    data = hostile_data(np.random.default_rng(10))
    with opened(browser, tmp_path, data, title="<!--<script>") as watch:
        page = watch.page
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        assert page.evaluate("document.title") == "<!--<script>"
        assert "<!--<script> model" in page.text_content("#model-info")
        assert texts(page, "#example option") == [
            f"{n + 1}. {' '.join(text.split())}" for n, text in enumerate(HOSTILE)]
        for n, example in enumerate(data["examples"]):
            page.select_option("#example", str(n))
            assert page.text_content("#example-text") == example["text"]
            assert page.text_content("#example-output") == example["output"]
            for section in example["sections"]:
                page.click(f"button.section-tab[data-section='{section['id']}']")
                assert page.get_attribute(f"button.section-tab[data-section='{section['id']}']",
                                          "aria-selected") == "true"
                # Each token whole, in its tooltip (long labels are cut on screen).
                tips = texts(page, "g.tokens > g > title")
                for side, tokens in (("query", section["queries"]), ("key", section["keys"])):
                    assert [t.split(": ", 1)[1] for t in tips if t.startswith(side + " ")] \
                        == [shown(t) for t in tokens]
                page.hover("text.token.query[data-index='2']")
                assert page.locator("text.token.key.highlight").count() >= 1
                page.mouse.move(1, 1)
        assert dialogs == []
        assert page.evaluate("document.scripts.length") == 2


def test_empty_and_broken_data_are_reported_not_thrown(browser, tmp_path):
    data, _ = lm_data(np.random.default_rng(8))
    empty = {**data, "examples": []}
    with opened(browser, tmp_path, empty, name="empty.html") as watch:
        assert "no example" in watch.page.inner_text("#empty")
    no_tokens = json.loads(json.dumps(data))
    no_tokens["examples"][0]["sections"] = [
        {"id": "self", "title": "Self-attention", "queries": [], "keys": [], "layers": 1,
         "heads": 1, "causal": True, "decades": DECADES, "weights": "", "row_max": ""}]
    with opened(browser, tmp_path, no_tokens, name="no_tokens.html") as watch:
        assert "no tokens" in watch.page.inner_text("#empty")
        assert watch.page.is_disabled("#export-svg")
    broken = json.loads(json.dumps(data))
    broken["examples"][0]["sections"][0]["weights"] = "AAAA"
    with opened(browser, tmp_path, broken, name="broken.html") as watch:
        assert "should be the base64 of" in watch.page.inner_text("#error")


def test_notebook_iframe(browser, tmp_path):
    """``explore(...)`` in a notebook shows the page in a sandboxed srcdoc iframe (an
    opaque origin): hovering and exporting work there too."""
    from qkv.viz.explore import Exploration

    data, _ = lm_data(np.random.default_rng(9))
    outer = tmp_path / "notebook.html"
    outer.write_text("<!DOCTYPE html><body>" + Exploration(data, "nb")._repr_html_(),
                     encoding="utf-8")
    context = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 900})
    try:
        watch = Watch(context.new_page())
        watch.page.goto(outer.as_uri())
        frame = watch.page.frame_locator("iframe")
        frame.locator("text.token.query[data-index='3']").hover()
        assert frame.locator("text.token.key.highlight").count() > 0
        with watch.page.expect_download() as info:
            frame.locator("#export-png").click()
        path = tmp_path / "nb.png"
        info.value.save_as(path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert watch.errors == []
        assert watch.foreign_requests() == []
    finally:
        context.close()


def test_large_lm_page_is_quick(browser, tmp_path):
    rng = np.random.default_rng(6)
    tokens = [f" t{n}" if n % 7 else "\n" for n in range(256)]
    data, w = lm_data(rng, tokens=tokens, L=12, H=12)
    html = render_page(data, mode="file")
    assert len(html.encode()) < 15 * 2**20
    path = tmp_path / "large.html"
    path.write_text(html, encoding="utf-8")
    context = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 900})
    try:
        watch = Watch(context.new_page())
        page = watch.page
        start = time.monotonic()
        page.goto(path.as_uri())
        page.wait_for_function("window.qkvReady === true", timeout=10_000)
        assert time.monotonic() - start < 10
        assert page.locator("text.token.query").count() == 256
        assert page.locator(".link").count() <= 3000
        page.hover("text.token.query[data-index='200']")
        assert int(w[0, :, 200].max(0).argmax()) in highlighted(page, "key")
        shot(page, "large_head")
        page.mouse.move(1, 1)
        set_view(page, "model")
        page.wait_for_selector("#model-panel[data-complete='true']", timeout=20_000)
        assert page.locator("canvas.thumb").count() == 144
        shot(page, "large_model")
        page.click("canvas.thumb[data-layer='11'][data-head='11']")
        page.wait_for_selector("canvas#matrix")
        shot(page, "large_matrix")
        assert watch.errors == []
        assert watch.foreign_requests() == []
    finally:
        context.close()


def test_serve_mode(browser):
    rng = np.random.default_rng(7)
    first, _ = lm_data(rng)
    second, _ = lm_data(rng, tokens=["Hello", ",", " world"])
    page_html = render_page(first, title="qkv serve", mode="serve")
    asked: list[str] = []

    def answer(route):
        request = route.request
        assert (request.method, request.headers["content-type"]) == ("POST", "application/json")
        text = request.post_data_json["text"]
        asked.append(text)
        if text == "boom":
            route.abort()
        elif text == "bad":
            route.fulfill(status=400, content_type="application/json",
                          body=json.dumps({"error": "the text has no tokens"}))
        else:
            route.fulfill(status=200, content_type="application/json",
                          body=json.dumps({"example": second["examples"][0]}))

    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        watch = Watch(context.new_page())
        page = watch.page
        # Nothing leaves the machine: the page and its API are both answered here.
        page.route("http://qkv.test/", lambda r: r.fulfill(status=200, body=page_html,
                                                             content_type="text/html"))
        page.route("**/api/attention*", answer)
        page.goto("http://qkv.test/")
        page.wait_for_function("window.qkvReady === true")
        assert page.evaluate("document.body.dataset.mode") == "serve"
        assert page.locator("#error").is_hidden()

        page.fill("#text-input", "bad")
        page.click("#run")
        page.wait_for_selector("#error:visible")
        assert page.inner_text("#error") == "the text has no tokens"
        assert texts(page, "text.token.query") == [shown(t) for t in LM_TOKENS]

        page.fill("#text-input", "boom")
        page.click("#run")
        page.wait_for_function("document.querySelector('#error').textContent.includes('reach')")

        page.fill("#text-input", "Hello, world & more")
        page.click("#run")
        page.wait_for_function("document.querySelectorAll('text.token.query').length === 3")
        assert texts(page, "text.token.query") == ["Hello", ",", "\u00b7world"]
        assert page.locator("#error").is_hidden()
        assert asked == ["bad", "boom", "Hello, world & more"]
        # The browser reports the failed loads itself; anything else is the page's fault.
        assert [e for e in watch.errors if not e.startswith("Failed to load resource")] == []
    finally:
        context.close()


def sink_data(rng, tokens=LM_TOKENS, L=2, H=3, generated_from=8):
    """An LM section whose first key takes ~0.9 of every row (an attention sink), the
    tokens from ``generated_from`` on marked as generated."""
    Q = len(tokens)
    logits = 0.5 * rng.standard_normal((L, H, Q, Q))
    logits[..., 0] += 6.0
    logits = np.where(np.tril(np.ones((Q, Q), dtype=bool)), logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    w = e / e.sum(-1, keepdims=True)
    sec = encode_section("self", "Self-attention", tokens, tokens, w, True,
                         generated_from=generated_from)
    data = {"version": 2, "model": {"kind": "lm", "name": "GPT", "run": None},
            "examples": [{"text": "".join(tokens[:generated_from]),
                          "output": "".join(tokens[generated_from:]), "sections": [sec]}]}
    return data, decoded(w)


def legend_colour(page, s, ramp="#legend-grad"):
    """The colour the legend's ramp gives to strength ``s`` (its gradient's stops);
    ``ramp="#legend-neg"``: a signed section's ramp of negative weights."""
    stops = page.eval_on_selector_all(
        f"{ramp} stop", "els => els.map(e => [Number(e.getAttribute('offset')),"
                        " e.getAttribute('stop-color')])")
    stops = [(t, [int(c) for c in re.findall(r"\d+", colour)]) for t, colour in stops]
    for (t0, c0), (t1, c1) in zip(stops, stops[1:], strict=False):
        if t0 <= s <= t1:
            f = (s - t0) / (t1 - t0)
            return [a + (b - a) * f for a, b in zip(c0, c1, strict=True)]
    raise AssertionError(s)


def cell_colour(page, i, j):
    return page.evaluate(
        """([i, j]) => {
          const c = document.querySelector('canvas#matrix'), d = c.dataset;
          const k = c.width / parseFloat(c.style.width);
          const x = Math.round((+d.originX + (j + 0.5) * +d.cell) * k);
          const y = Math.round((+d.originY + (i + 0.5) * +d.cell) * k);
          return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3));
        }""", [i, j])


def test_colour_scales_legend_and_generated_tokens(browser, tmp_path):
    data, w = sink_data(np.random.default_rng(9))
    with opened(browser, tmp_path, data) as watch:
        page = watch.page
        # Generated tokens: marked in the head view, the example and the legend.
        assert page.input_value("#scale") == "linear"  # today's default
        gen = list(range(8, len(LM_TOKENS)))
        for side in ("query", "key"):
            assert page.eval_on_selector_all(
                f"text.token.{side}.generated", "els => els.map(e => +e.dataset.index)") == gen
        assert page.locator(".gen-rule").count() == 2
        assert page.text_content("#example-output-label") == "Generated (greedy, 4 tokens)"
        assert page.locator("#legend-generated").is_visible()
        assert "tokens 8\u201311 generated" in page.inner_text("#section-caption")
        # Linear: the sink takes nearly every line; log shows the other keys too.
        def others():
            return sum(1 for q, k, _h, _d, _v in links(page) if k != 0)
        linear_others = others()
        ticks = texts(page, "#legend-svg text.tick")
        assert ticks == ["0", "0.250", "0.500", "0.750", "1.000"]
        page.select_option("#scale", "log")
        assert others() > linear_others + 20
        assert texts(page, "#legend-svg text.tick") == ["0.0001", "0.001", "0.01", "0.1", "1"]
        assert "Log" in page.inner_text("#legend-text")
        shot(page, "sink_head_log")

        # The matrix view: each cell's colour is the legend's colour at the weight's place
        # on the scale, and the tooltip shows the weight itself.
        set_view(page, "matrix")
        page.select_option("#layer", "1")
        page.select_option("#head", "2")
        layer, h, i, j = 1, 2, 10, 5
        m = w[layer, h].max()
        v = w[layer, h, i, j]
        expect = {
            "linear": v / m,
            "log": min(1, max(0, 1 + np.log10(v / m) / 4)),
            "rest": min(1, v / w[layer, h, i, 1:].max()),
        }
        seen = {}
        for scale, s in expect.items():
            page.select_option("#scale", scale)
            got = cell_colour(page, i, j)
            want = legend_colour(page, s)
            assert all(abs(a - b) <= 3 for a, b in zip(got, want, strict=True)), \
                (scale, got, want, s)
            seen[scale] = got
        assert seen["linear"] != seen["log"] != seen["rest"]
        assert sum(seen["linear"]) > sum(seen["log"])  # a small weight: darker on log
        assert "first token" in page.inner_text("#legend-text")
        assert texts(page, "#legend-svg text.tick") == ["0%", "25%", "50%", "75%", "100%"]
        page.locator("canvas#matrix").scroll_into_view_if_needed()
        box = page.locator("canvas#matrix").bounding_box()
        geo = page.eval_on_selector("canvas#matrix", "c => c.dataset")
        cell = float(geo["cell"])
        page.mouse.move(box["x"] + float(geo["originX"]) + (j + 0.5) * cell,
                        box["y"] + float(geo["originY"]) + (i + 0.5) * cell)
        tip = page.inner_text("#tooltip")
        match = re.search(r": ([0-9.e+-]+)\n", tip)
        assert match, tip
        assert float(match[1]) == pytest.approx(v, rel=0.005)
        assert "generated query" in tip
        shot(page, "sink_matrix_rest")

        def exported_svg(name):
            with page.expect_download() as info:
                page.click("#export-svg")
            path = tmp_path / name
            info.value.save_as(path)
            return ET.fromstring(path.read_bytes())

        svg_ns = "{http://www.w3.org/2000/svg}"
        root = exported_svg("matrix.svg")
        green = [t.text for t in root.iter(f"{svg_ns}text") if t.get("fill") == "#1a7f37"]
        assert green == [shown(t) for t in LM_TOKENS[8:]] * 2  # rows, then columns
        assert len([p for p in root.iter(f"{svg_ns}path") if p.get("stroke") == "#1a7f37"]) == 1

        # The model view: the thumbnails follow the scale.
        def thumb_ink():
            page.wait_for_selector("#model-panel[data-complete='true']")
            return page.eval_on_selector(
                "canvas.thumb[data-layer='0'][data-head='0']",
                "c => c.getContext('2d').getImageData(0, 0, c.width, c.height).data"
                ".reduce((a, b, k) => a + (k % 4 === 3 ? 0 : 255 - b), 0)")
        set_view(page, "model")
        rest_ink = thumb_ink()
        page.select_option("#scale", "linear")
        linear_ink = thumb_ink()
        assert rest_ink > 2 * linear_ink
        assert "each map's largest" in page.inner_text("#legend-text")
        shot(page, "sink_model_linear")
        root = exported_svg("model.svg")
        rules = [p for p in root.iter(f"{svg_ns}path") if p.get("stroke") == "#1a7f37"]
        assert len(rules) == 2 * 3  # one per layer and head


def test_a_signed_section_shows_both_signs_and_its_layers_numbers(browser, tmp_path):
    """Weights that are not a softmax (the delta rule's, in Gated DeltaNet layers 0 and 2
    of a hybrid model): the colour of a cell is the blue ramp's for a positive weight and
    the red ramp's for a negative one, at its magnitude's place on the scale; the tooltip
    and the head view's dashed lines keep the sign; the layers keep their numbers."""
    rng = np.random.default_rng(4)
    Q = len(LM_TOKENS)
    signed = np.tril(rng.standard_normal((2, 3, Q, Q)))
    soft = softmax_rows(rng, 1, 2, Q, Q, causal=True)
    softmax_section = encode_section("self", "Causal self-attention", LM_TOKENS, LM_TOKENS,
                                     soft, True)
    softmax_section["layer_ids"] = [1]
    data = {"version": 2, "model": {"kind": "lm", "name": "hybrid", "run": None},
            "examples": [{"text": "".join(LM_TOKENS), "output": None, "sections": [
                softmax_section,
                encode_signed_section("delta", "Delta rule", LM_TOKENS, signed, [0, 2])]}]}
    magnitude = decoded(np.abs(signed))
    with opened(browser, tmp_path, data) as watch:
        page = watch.page
        assert texts(page, "#layer option") == ["Layer 1"]
        page.locator(".section-tab").nth(1).click()
        assert texts(page, "#layer option") == ["Layer 0", "Layer 2"]
        caption = page.inner_text("#section-caption")
        assert "2 layers (0, 2)" in caption and "not a softmax" in caption
        # the head view: a line is dashed exactly when its weight is negative
        page.select_option("#layer", "1")
        dashed = page.eval_on_selector_all(
            ".link", "els => els.map(e => [+e.dataset.q, +e.dataset.k, +e.dataset.head,"
                     " e.classList.contains('negative')])")
        assert dashed and any(d for *_, d in dashed) and not all(d for *_, d in dashed)
        assert all((signed[1, h, q, k] < 0) == d for q, k, h, d in dashed)
        assert "dashed" in page.inner_text("#legend-text")
        shot(page, "signed_head")

        set_view(page, "matrix")
        page.select_option("#head", "2")
        assert "blue positive, red negative" in page.inner_text("#legend-text")
        m = magnitude[1, 2].max()
        cells = [(i, j) for i in range(Q) for j in range(i + 1)
                 if magnitude[1, 2, i, j] > 0.05 * m]
        negative = next((i, j) for i, j in cells if signed[1, 2, i, j] < 0)
        positive = next((i, j) for i, j in cells if signed[1, 2, i, j] > 0)
        for scale in ("linear", "log"):
            page.select_option("#scale", scale)
            for (i, j), ramp in ((negative, "#legend-neg"), (positive, "#legend-grad")):
                v = magnitude[1, 2, i, j]
                s = v / m if scale == "linear" else min(1, max(0, 1 + np.log10(v / m) / 4))
                got, want = cell_colour(page, i, j), legend_colour(page, s, ramp)
                assert all(abs(a - b) <= 3 for a, b in zip(got, want, strict=True)), \
                    (scale, ramp, got, want)
        ticks = texts(page, "#legend-svg text.tick")
        assert ticks[0].startswith("\u2212") and ticks[2] != ticks[0]
        i, j = negative
        page.locator("canvas#matrix").scroll_into_view_if_needed()
        box = page.locator("canvas#matrix").bounding_box()
        geo = page.eval_on_selector("canvas#matrix", "c => c.dataset")
        cell = float(geo["cell"])
        page.mouse.move(box["x"] + float(geo["originX"]) + (j + 0.5) * cell,
                        box["y"] + float(geo["originY"]) + (i + 0.5) * cell)
        tip = page.inner_text("#tooltip")
        match = re.search(r": (-[0-9.e+-]+)\n", tip)
        assert match, tip
        assert float(match[1]) == pytest.approx(signed[1, 2, i, j], rel=0.03)
        assert "layer 2 " in tip
        shot(page, "signed_matrix")
        with page.expect_download() as info:
            page.click("#export-svg")
        assert info.value.suggested_filename == "qkv-delta-layer2-head2.svg"
        path = tmp_path / "signed.svg"
        info.value.save_as(path)
        assert "red negative" in path.read_text(encoding="utf-8")
        set_view(page, "model")
        page.wait_for_selector("#model-panel[data-complete='true']")
        assert texts(page, ".model-grid .axis.row") == ["layer 0", "layer 2"]
        shot(page, "signed_model")

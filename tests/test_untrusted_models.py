# ruff: noqa: E501 (the real templates below keep their publishers' long lines)
"""A downloaded model is untrusted input: its chat template and its tokenizer must not
hang qkv, take the machine's memory or print a Rust backtrace.

Each hostile model here is a tiny Llama made by the test with one field changed, as a
hostile publisher would change it: a chat template that loops for ever or builds a
string of a billion characters, a pre-tokenizer whose regular expression backtracks
without end on a run of ``a``. Run as a real ``python -m qkv`` process, each must end in
one line on stderr, exit status 2, within seconds and with bounded memory (its peak
RSS, children included, from ``wait4``). The same failures are checked where else a
template is rendered or a text tokenized: ``lm import`` (the template's probe), ``qkv
view`` and ``view --serve`` (which serves the next client as before) and ``lm train
--init``'s corpus. Real templates (SmolLM2's, Llama 3's, Qwen3's with tools and
thinking, Gemma 3's) still render exactly as transformers' ``apply_chat_template``
renders them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.data import chat as chat_module
from qkv.data.chat import (
    ChatTemplateError,
    ChatTemplateRefusedError,
    RenderLimits,
    chat_messages,
    check_chat_template,
    render_chat_template,
)
from qkv.data.tokenizers import SPECIAL_TOKEN_NAMES, HFTokenizer
from qkv.models.gpt import GPTConfig, GPTModel
from qkv.tasks.lm import LanguageModel, LMSettings
from qkv.training import save_checkpoint
from qkv.utils.native import LibraryPanic, library_call
from qkv.viz.server import make_server

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from test_open_tokenizers import (  # noqa: E402  (after the importorskips it needs)
    BYTE_LEVEL_SPECIALS,
    CHATML,
    LLAMA3,
    byte_level_tokenizer,
    llama3_tokenizer,
)
from test_viz import get, post, running  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"

# The issue's two templates, and the pre-tokenizer pattern with its text.
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 10**9 }}"
BACKTRACKING = "(a|aa)+b"
RUN_OF_A = "a" * 40

# ----------------------------------------------------------------------------
# Real templates, as transformers renders them

# Qwen3's: tools in the system turn, tool calls and responses, reasoning kept only after
# the last user query, and enable_thinking=False's empty think block.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
# Gemma 3's whole template: the system turn folded into the first user turn, content as
# a string or a list of text and image blocks.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather «today» in a city, <b>live</b>.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two tools.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "content": "18°C, clear"},
    {"role": "tool", "content": "14:05"},
    {"role": "assistant", "content": "<think>\nDone.\n</think>\n\nParis: 18°C at 14:05."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": None},
]
# (template, messages, tools, variables, add_generation_prompt)
REAL = {
    "smollm2": (CHATML, chat_messages("What is 2+2?"), None, {}, True),
    "smollm2-system": (CHATML, chat_messages("Hi", "Be brief.") + [
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
        None, {}, True),
    "llama3": (LLAMA3, chat_messages("What is the capital of France?"), None, {}, True),
    "llama3-system": (LLAMA3, chat_messages("Hi", "  Be brief.  "), None, {}, False),
    "qwen3": (QWEN3, chat_messages("Hi", "Be brief."), None, {}, True),
    "qwen3-no-thinking": (QWEN3, chat_messages("Hi"), None, {"enable_thinking": False}, True),
    "qwen3-tools": (QWEN3, chat_messages("Weather in Paris?", "You are terse."),
                    [WEATHER, TIME], {"enable_thinking": True}, True),
    "qwen3-tool-calls": (QWEN3, TOOL_CHAT, [WEATHER, TIME], {}, True),
    "qwen3-tool-calls-no-thinking": (QWEN3, TOOL_CHAT[:-1], [WEATHER], {
        "enable_thinking": False}, True),
    "gemma3": (GEMMA3, chat_messages("What is attention?"), None, {}, True),
    "gemma3-system-blocks": (GEMMA3, [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Hi "}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"}], None, {}, True),
}


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer over a byte-level BPE with ChatML's special tokens: the
    renderer under test is transformers' own ``apply_chat_template``."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(BYTE_LEVEL_SPECIALS),
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.mark.parametrize("case", list(REAL))
def test_real_templates_render_as_transformers_renders_them(reference, case):
    template, messages, tools, variables, prompt = REAL[case]
    want = reference.apply_chat_template(messages, chat_template=template, tools=tools,
                                         tokenize=False, add_generation_prompt=prompt,
                                         **variables)
    special = {k: v for k, v in reference.special_tokens_map.items()
               if k in SPECIAL_TOKEN_NAMES}
    got = render_chat_template(template, messages, special_tokens=special, tools=tools,
                               variables=variables, add_generation_prompt=prompt)
    assert got == want
    if tools:  # the template took the branch the case is for
        assert "<tools>" in got and "get_weather" in got
    if case == "qwen3-tool-calls":
        assert '"arguments": {"city": "Paris"}' in got and "<tool_response>\n14:05" in got
        # reasoning before the last query is dropped, after it kept (here: empty)
        assert "Two tools." not in got and "Done." not in got
        assert "Paris: 18°C at 14:05.<|im_end|>" in got
        assert "<think>\n\n</think>\n\nYou're welcome." in got
    if variables.get("enable_thinking") is False:
        assert got.endswith("<think>\n\n</think>\n\n")


def test_a_real_template_passes_its_probe_and_a_refusing_one_too():
    for template in (CHATML, LLAMA3, QWEN3, GEMMA3):
        check_chat_template(template, special_tokens={"bos_token": "<s>"})
    refusing = "{{ raise_exception('give me tools') }}"
    check_chat_template(refusing)  # it ran, within its limits
    with pytest.raises(ChatTemplateRefusedError, match="refuses this conversation: give me"):
        render_chat_template(refusing, chat_messages("hi"))


# ----------------------------------------------------------------------------
# The render's limits, each reached by a template that would otherwise hang or take
# the machine's memory (the render is a real process; the limits are made small to keep
# the test fast where the default would only take longer)

SMALL = RenderLimits(seconds=0.5, memory_bytes=160 * 2**20, chars=2**22)


@pytest.mark.parametrize("template, kind, named", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"
     "{% endfor %}", "size", "output passed the limit of 4,194,304 characters"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "time", r"time limit (\(|is )0.5 s of CPU time"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% set k = i * j %}"
     "{% endfor %}{% endfor %}", "time", r"time limit (\(|is )0.5 s"),
    # one power of 3.8 million digits (under the size limit), seconds of CPU in one
    # operation (which CPython interrupts between its steps for the timer)
    ("{% set x = 3 ** 8000000 %}", "time", r"time limit (\(|is )0.5 s"),
    (HUGE, "size", "a value of 1,000,000,000 characters, past the limit of 4,194,304"),
    ("{{ [0] * 10**9 }}", "size", "1,000,000,000 items"),
    ("{{ 2 ** (10**10) }}", "size", "a number of 3,010,299,957 digits"),
    ("{% set s = 'x' * 4000000 %}{{ s + s }}", "size", "8,000,000 characters"),
    ("{{ range(100000)|map('string')|join('x' * 100000) }}", "size", "10,000,388,890"),
    ("{{ ('x' * 1000)|replace('x', 'x' * 10000) }}", "size", "10,000,000 characters"),
    ("{{ ''.join(['x' * 4000000, 'y' * 4000000]) }}", "size", "8,000,000 characters"),
    ("{{ 'x'|center(10**9) }}", "size", "1,000,000,000 characters"),
    ("{{ 'x'.ljust(10**9) }}", "size", "1,000,000,000 characters"),
    ("{{ messages|tojson(indent=10**9) }}", "size", "an indentation of 1,000,000,000"),
    ("{{ '{:>999999999}'.format('x') }}", "memory", r"memory limit \(160 MiB\)"),
    ("{{ '%999999999s'|format('x') }}", "memory", r"memory limit \(160 MiB\)"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s }}", "memory", r"memory limit \(160 MiB\)"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed", "RecursionError"),
])
def test_a_template_that_reaches_a_limit_is_one_line_naming_it(template, kind, named):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, chat_messages("hi"), limits=SMALL)
    # (a machine too busy to give the render its CPU time stops it by the clock)
    assert time.monotonic() - start < SMALL.wall_seconds + 5
    assert info.value.kind == kind and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and re.search(named, str(info.value)), str(info.value)


def test_the_limits_are_declared_once_and_can_be_changed(monkeypatch):
    assert RenderLimits() == chat_module.CHAT_RENDER_LIMITS
    assert (RenderLimits().seconds, RenderLimits().memory_bytes, RenderLimits().chars) == (
        2.0, 512 * 2**20, 2**22)
    want = render_chat_template(CHATML, chat_messages("hi"))
    monkeypatch.setattr(chat_module, "CHAT_RENDER_LIMITS", RenderLimits(chars=len(want)))
    assert render_chat_template(CHATML, chat_messages("hi")) == want
    monkeypatch.setattr(chat_module, "CHAT_RENDER_LIMITS", RenderLimits(chars=len(want) - 1))
    with pytest.raises(ChatTemplateError, match=f"output passed the limit of {len(want) - 1}"):
        render_chat_template(CHATML, chat_messages("hi"))
    # a conversation larger than the limit is refused before any process starts
    with pytest.raises(ValueError, match="characters as JSON; a chat template is given at "
                                         f"most {len(want) - 1}"):
        render_chat_template(CHATML, chat_messages("x" * len(want)))
    for bad, match in [(dict(seconds=0), "seconds must be in"),
                       (dict(memory_bytes=2**20), "memory_bytes must be an integer >= "),
                       (dict(chars=0), "chars must be an integer >= 1")]:
        with pytest.raises(ValueError, match=match):
            RenderLimits(**bad)


def test_what_the_template_is_given_must_be_json_data():
    for messages, match in [([], "non-empty list"), ("hi", "non-empty list"),
                            (["hi"], "message 0 must be a dict"),
                            ([{"role": "user", "content": object()}], "must be JSON data")]:
        with pytest.raises(ValueError, match=match) as info:
            render_chat_template(CHATML, messages)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="'messages' is set by the render itself"):
        render_chat_template(CHATML, chat_messages("hi"), variables={"messages": []})
    with pytest.raises(ValueError, match="tools must be a list"):
        render_chat_template(CHATML, chat_messages("hi"), tools={"name": "x"})


# ----------------------------------------------------------------------------
# Tokenizer failures: one line naming the text's length and the failing part


def backtracking_tokenizer_json() -> str:
    """Llama 3's tokenizer with its Split pattern changed for one that backtracks
    without end on a run of ``a`` (Oniguruma gives up, and the library panics)."""
    spec = json.loads(llama3_tokenizer().to_str())
    assert spec["pre_tokenizer"]["pretokenizers"][0]["type"] == "Split"
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": BACKTRACKING}
    return json.dumps(spec)


@pytest.fixture(scope="module")
def backtracking() -> HFTokenizer:
    return HFTokenizer(backtracking_tokenizer_json())


def test_a_panic_in_the_tokenizer_is_one_line_and_rust_prints_nothing(backtracking, capfd,
                                                                       monkeypatch):
    monkeypatch.setenv("RUST_BACKTRACE", "1")  # a backtrace of thirty lines, were it shown
    raw = tokenizers.Tokenizer.from_str(backtracking.tokenizer_json)
    with pytest.raises(BaseException) as info:  # the library itself: pyo3's panic
        raw.encode(RUN_OF_A)
    assert not isinstance(info.value, Exception)
    assert "panicked" in capfd.readouterr().err  # Rust's report, on descriptor 2
    with pytest.raises(ValueError) as info:
        backtracking.encode(RUN_OF_A)
    assert str(info.value) == (
        "the tokenizer's pre-tokenizer (Split, step 1 of a Sequence of 2) panicked on a "
        "text of 40 characters: Onig: Regex search error: retry-limit-in-match over")
    assert capfd.readouterr() == ("", "")
    assert backtracking.encode("ab ab") == raw.encode("ab ab").ids  # others still encode


def test_the_library_s_own_error_names_the_part_that_raised_it():
    model = tokenizers.models.BPE(vocab={"a": 0, "b": 1}, merges=[], unk_token="<unk>")
    tok = HFTokenizer(tokenizers.Tokenizer(model).to_str())
    assert tok.encode("ab") == [0, 1]
    with pytest.raises(ValueError, match=r"^the tokenizer's model \(BPE\) failed on a text "
                                         r"of 3 characters: .*<unk>") as info:
        tok.encode("abc")  # c is unknown, and so is the unknown token
    assert "\n" not in str(info.value)


def test_library_calls_keep_other_output_and_nest(capfd):
    with library_call():
        os.write(2, b"a library's own line\n")
        with library_call():
            os.write(2, b"and the inner block's\n")
    assert capfd.readouterr().err == "a library's own line\nand the inner block's\n"

    class Panic(BaseException):
        pass

    with pytest.raises(LibraryPanic, match="^boom here$"), library_call():
        os.write(2, b"thread panicked at ...\n")
        raise Panic("boom\nhere")
    for stop in (KeyboardInterrupt, SystemExit, GeneratorExit):
        with pytest.raises(stop), library_call():
            raise stop()
    assert capfd.readouterr().err == ""
    os.write(2, b"descriptor 2 is back\n")
    assert capfd.readouterr().err == "descriptor 2 is back\n"


# ----------------------------------------------------------------------------
# The issue's table, as real processes: one line, exit 2, seconds, bounded memory


def tiny_run(folder: Path, *, template: str = LLAMA3, tokenizer_json: str | None = None
             ) -> Path:
    """A run of a tiny Llama-3-style model (random weights) with the given chat template
    and tokenizer."""
    tok = HFTokenizer(tokenizer_json or llama3_tokenizer().to_str(), special_tokens={
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, chat_template=template)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig.preset("tiny", vocab_size=tok.n_vocab)).eval()
    settings = LMSettings(tokenizer="hf", epochs=0, lr=1e-3)
    save_checkpoint(folder, model, {"task": "lm", "settings": dataclasses.asdict(settings),
                                    "model": model.cfg.to_dict(), "tokenizer": tok.to_dict()})
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    return {"loop": tiny_run(root / "loop", template=LOOP),
            "huge": tiny_run(root / "huge", template=HUGE),
            "regex": tiny_run(root / "regex", tokenizer_json=backtracking_tokenizer_json())}


# Starts a command as its own child and writes that child's peak RSS (KiB) to argv[1].
# The test process cannot measure its child itself: Linux folds the memory a process held
# at exec into its peak, and a child spawned by pytest holds pytest's pages (hundreds of MB
# after the suite's heavier tests) until it execs. This launcher is small when it forks.
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
os._exit(os.waitstatus_to_exitcode(status) % 256)
"""


class Qkv:
    """``python -m qkv ARGS`` started as a real process (through :data:`LAUNCHER`, which
    measures its peak memory); :meth:`result` waits for it."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1",
               "RUST_BACKTRACE": "1"}  # a panic's report would be a backtrace
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
        self.rss = tempfile.NamedTemporaryFile(delete=False)  # noqa: SIM115
        self.rss.close()
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, self.rss.name, sys.executable, "-m", "qkv",
             *args], env=env, stdout=self.out, stderr=self.err, start_new_session=True)

    def result(self, timeout: float = 120) -> tuple[int, str, str, float, int]:
        """Exit status, stdout, stderr, seconds, and peak resident memory in bytes (the
        process's own or its children's, whichever was larger)."""
        timer = threading.Timer(timeout, lambda: os.killpg(self.proc.pid, 9))
        timer.start()
        try:
            self.proc.wait()
        finally:
            timer.cancel()
        seconds = time.monotonic() - self.start
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read().decode())
            f.close()
        with open(self.rss.name) as f:
            kib = int(f.read() or 0)
        os.unlink(self.rss.name)
        return self.proc.returncode, *texts, seconds, kib * 1024


# A tiny model's process: Python, torch and the model take about 350 MB.
MAX_RSS = 1024 * 2**20
# The issue's table: the run, the arguments of `lm generate`, and the line it must end in.
TABLE = {
    # (which limit a loop of single characters reaches first depends on the machine's
    # speed, and on how busy it is: the clock's, on one too busy to run the render)
    "loop": (["--chat", "--prompt", "hi"],
             r"the chat template(.s output passed the limit of 4,194,304 characters| ran past "
             r"its time limit \(2 s of CPU time\)| did not finish within 11 s on the clock "
             r"\(its time limit is 2 s of CPU time; the machine may be too busy\))"),
    "huge": (["--chat", "--prompt", "hi"], "the chat template would build a value of "
             "1,000,000,000 characters, past the limit of 4,194,304 characters"),
    "regex": (["--prompt", RUN_OF_A], re.escape(
        "the tokenizer's pre-tokenizer (Split, step 1 of a Sequence of 2) panicked on a text "
        "of 40 characters: Onig: Regex search error: retry-limit-in-match over")),
}


@pytest.mark.parametrize("case", list(TABLE))
def test_the_issue_s_hostile_models_end_in_one_line(runs, case):
    args, _ = TABLE[case]
    code, out, err, seconds, rss = Qkv("lm", "generate", "--ckpt", str(runs[case]), *args,
                                       "--max-new-tokens", "2").result()
    assert (code, out) == (2, "") and re.fullmatch(f"qkv lm: error: {TABLE[case][1]}\n",
                                                   err), err
    assert seconds < 60 and rss < MAX_RSS, (seconds, rss)


# ----------------------------------------------------------------------------
# Every other path that renders or tokenizes


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers, with Llama 3's tokenizer and chat template."""
    folder = tmp_path_factory.mktemp("llama") / "hf"
    tok = llama3_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3}))
    return folder


def with_template(folder: Path, root: Path, template: str) -> Path:
    """A copy of ``folder`` whose ``chat_template.jinja`` (which wins over the config's,
    as in transformers) is ``template``."""
    copy = root / f"copy{len(list(root.iterdir()))}"
    shutil.copytree(folder, copy)
    (copy / "chat_template.jinja").write_text(template, encoding="utf-8")
    return copy


def one_line(capfd, code: int, argv: list[str]) -> str:
    assert main(argv) == code
    out, err = capfd.readouterr()
    assert err.count("\n") == (code != 0) and "Traceback" not in err and "panicked at" not in err
    return err


def test_import_refuses_a_model_whose_template_fails_its_probe(llama_folder, tmp_path, capfd):
    for template, named in [
            (HUGE, "would build a value of 1,000,000,000 characters"),
            ("{% for m in messages %}", "syntax error at line 1"),
            ("{{ ''.__class__.__mro__ }}", "SecurityError")]:
        run = tmp_path / "run"
        err = one_line(capfd, 2, ["lm", "import", str(with_template(
            llama_folder, tmp_path, template)), "--run-dir", str(run)])
        assert "its chat template fails on a one-message conversation, so the model is not " \
               "imported: the chat template" in err and named in err, err
        assert not (run / "model.safetensors").exists()
    # a template that refuses the probe conversation ran within its limits: imported
    refusing = with_template(llama_folder, tmp_path, "{{ raise_exception('tools only') }}")
    one_line(capfd, 0, ["lm", "import", str(refusing), "--run-dir", str(tmp_path / "ok")])
    lm = LanguageModel.load(tmp_path / "ok")
    with pytest.raises(ChatTemplateRefusedError, match="tools only"):
        lm.generate("hi", 2, chat=True)


def test_view_refuses_a_text_its_tokenizer_fails_on_in_one_line(runs, tmp_path, capfd):
    err = one_line(capfd, 2, ["view", "--ckpt", str(runs["regex"]), "--text", "The cat",
                              "--text", RUN_OF_A, "--html", str(tmp_path / "a.html")])
    assert err == ("qkv view: error: the tokenizer's pre-tokenizer (Split, step 1 of a "
                   "Sequence of 2) panicked on a text of 40 characters: Onig: Regex search "
                   "error: retry-limit-in-match over\n")
    assert not (tmp_path / "a.html").exists()


def test_the_server_answers_a_hostile_text_in_one_line_and_serves_on(runs, capfd):
    logged: list[str] = []
    srv = make_server(LanguageModel.load(runs["regex"]), port=0, texts=["The cat"],
                      log=logged.append)
    with running(srv) as url:
        for _ in range(2):
            status, answer = post(url, {"text": RUN_OF_A})
            assert status == 400 and answer["error"].startswith(
                "the tokenizer's pre-tokenizer (Split, step 1 of a Sequence of 2) panicked "
                "on a text of 40 characters")
            status, body = get(url + "/api/attention?text=The+cat+sat")
            assert status == 200 and json.loads(body)["example"]["text"] == "The cat sat"
    assert logged == [] and capfd.readouterr().err == ""


def test_train_init_refuses_a_corpus_its_tokenizer_fails_on(runs, tmp_path, capfd):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat. " * 50 + RUN_OF_A, encoding="utf-8")
    err = one_line(capfd, 2, ["lm", "train", "--init", str(runs["regex"]), "--text",
                              str(corpus), "--run-dir", str(tmp_path / "tuned"), "--epochs",
                              "1", "--no-progress", "--sample", ""])
    assert err == (f"qkv lm: error: text file {corpus}, from character 0: the tokenizer's "
                   "pre-tokenizer (Split, step 1 of a Sequence of 2) panicked on a text of "
                   "1,240 characters: Onig: Regex search error: retry-limit-in-match over\n")


def test_a_gguf_tokenizer_the_library_cannot_build_is_one_line(tmp_path):
    pytest.importorskip("gguf")
    from qkv.data.gguf_tokenizer import tokenizer_from_gguf
    from test_open_tokenizers import vocabulary, write_gguf
    tokens, merges = vocabulary(byte_level_tokenizer(BYTE_LEVEL_SPECIALS))
    path = write_gguf(tmp_path / "m.gguf", "llama", "gpt2", tokens,
                      merges=[*merges, "a zzzz"])
    with pytest.raises(ValueError, match=r"m.gguf: the tokenizers library cannot build a gpt2 "
                                         r"tokenizer from its metadata \(.*zzzz"):
        tokenizer_from_gguf(path)


def test_a_panic_reading_safetensors_is_one_line(llama_folder, runs, monkeypatch):
    import safetensors
    import safetensors.torch

    from qkv.models.hf_open import config_fields, read_open_config, read_open_weights

    class Panic(BaseException):  # what pyo3's PanicException is: not an Exception
        pass

    real = safetensors.safe_open

    class Panicking:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def get_tensor(self, name):
            raise Panic("called `Result::unwrap()` on an `Err` value")

    monkeypatch.setattr(safetensors, "safe_open", Panicking)
    fields = config_fields(read_open_config(llama_folder), "config.json")
    with pytest.raises(ValueError, match=r"model.safetensors: cannot be read as safetensors "
                                         r"\(LibraryPanic: called `Result::unwrap\(\)`"):
        read_open_weights(llama_folder, fields)
    # (a run's own model.safetensors is read by qkv's checkpoint reader, which checks its
    # header itself and takes the tensors as views of the file's bytes: no library call)


def test_the_command_line_makes_any_other_base_exception_one_line(monkeypatch, capfd):
    from qkv.cli import walkthrough

    class PanicException(BaseException):
        pass

    def panics(args):
        raise PanicException("a Rust library\npanicked")

    monkeypatch.setattr(walkthrough, "run", panics)
    err = one_line(capfd, 1, ["walkthrough"])
    assert err == ("qkv walkthrough: error: PanicException: a Rust library panicked (rerun "
                   "with --debug for the traceback)\n")
    for stop in (SystemExit(3), GeneratorExit()):
        def stopping(args, stop=stop):
            raise stop
        monkeypatch.setattr(walkthrough, "run", stopping)
        with pytest.raises(type(stop)):
            main(["walkthrough"])

"""A model's own chat template, rendered the way transformers renders it, within limits.

An instruction-tuned model was trained on conversations laid out by a Jinja template that
ships with it (``tokenizer_config.json``'s ``chat_template``, a ``chat_template.jinja``
file, or a GGUF file's ``tokenizer.chat_template``). Prompting it with anything else
gets worse answers, so the template itself is rendered:

    render_chat_template(template, chat_messages("Hi!", system="Be brief."),
                         special_tokens={"bos_token": "<s>", "eos_token": "</s>"})

gives, for a ChatML template, ``"<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user
\\nHi!<|im_end|>\\n<|im_start|>assistant\\n"``: the text the model continues with its reply.

A template is code that came with a downloaded file. It runs in Jinja's immutable
sandbox, which keeps it from Python objects' internals and from changing what it was
given, and the sandbox runs in a process of its own (:mod:`qkv.data.chat_sandbox`, the
standard library and jinja2, started in about 0.1 s) that is bounded by
:data:`CHAT_RENDER_LIMITS`: CPU time, memory and the characters it may build and write.
A template that loops for ever, or builds a string of a billion characters, ends in one
line naming the limit it reached; the machine's memory is never at risk. The
environment is the one transformers' ``apply_chat_template`` builds, so the same
template gives the same string in both.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checks import show

__all__ = [
    "CHAT_RENDER_LIMITS",
    "MAX_CHAT_TEMPLATE_CHARS",
    "ChatTemplateError",
    "ChatTemplateRefusedError",
    "RenderLimits",
    "chat_messages",
    "check_chat_template",
    "render_chat_template",
]

# The largest template read: real ones are 0.5-10 kB (tool-calling ones up to ~20 kB).
MAX_CHAT_TEMPLATE_CHARS = 2**20


@dataclass(frozen=True)
class RenderLimits:
    """How far one render of a chat template may go.

    Real templates render in milliseconds, in a few MiB, to a prompt the size of the
    conversation; the defaults are far beyond that and far below what would trouble the
    machine.

    Attributes:
        seconds: CPU time for compiling and rendering the template.
        memory_bytes: the address space of the process that renders it (``RLIMIT_AS``;
            Python and jinja2 take about 30 MiB of it). Enforced where the system
            enforces ``RLIMIT_AS`` (Linux); elsewhere the checks below still hold.
        chars: the characters of the rendered text, of the conversation and variables
            the template is given (as JSON), and of any string, list or number the
            template builds (checked before ``*``, ``+``, ``**``, ``join``, ``replace``
            and padding build it).
    """

    seconds: float = 2.0
    memory_bytes: int = 512 * 2**20
    chars: int = 2**22

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, (int, float)) and 0 < self.seconds <= 3600):
            raise ValueError(f"seconds must be in (0, 3600], got {show(self.seconds)}")
        for name, lo in (("memory_bytes", 64 * 2**20), ("chars", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo:,}, got {show(value)}")

    @property
    def wall_seconds(self) -> float:
        """The deadline on the clock: the CPU time, and the process's start, on a
        machine busy enough to give it a third of a core."""
        return 3 * self.seconds + 5


# The limits every render runs under. Change them for a process by assigning another
# ``RenderLimits`` here, or for one render with ``render_chat_template(..., limits=...)``.
CHAT_RENDER_LIMITS = RenderLimits()


class ChatTemplateError(ValueError):
    """A chat template that could not be rendered: one line saying why.

    ``kind`` is ``"syntax"`` (it does not parse), ``"refused"`` (its own
    ``raise_exception``: :class:`ChatTemplateRefusedError`), ``"time"``, ``"memory"`` or
    ``"size"`` (a limit of :class:`RenderLimits`), or ``"failed"`` (anything else it
    did, the sandbox's refusals included)."""

    def __init__(self, message: str, kind: str = "failed") -> None:
        super().__init__(message)
        self.kind = kind


class ChatTemplateRefusedError(ChatTemplateError):
    """The template refuses the conversation (Gemma's, for a ``system`` message)."""


# How RLIMIT_CPU ends a process: SIGXCPU past the soft limit, SIGKILL past the hard one.
_KILLED_FOR_TIME = tuple(-getattr(signal, name) for name in ("SIGXCPU", "SIGKILL")
                         if hasattr(signal, name))
# The program that renders, run as a file so that it imports nothing of qkv's.
_SANDBOX = Path(__file__).with_name("chat_sandbox.py")
_JINJA2_HINT = "pip install 'jinja2>=3.1.6' (or pip install 'qkv[hf]')"
# What transformers passes beside the template's own variables; not the caller's to set.
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
# Names a message's reasoning comes under: transformers gives templates all of them.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """The conversation a chat prompt renders: an optional system message, then the user's.

    Returns ``[{"role": "system", "content": system}, {"role": "user", "content": user}]``
    (without the first item when ``system`` is None).
    """
    if not isinstance(user, str):
        raise ValueError(f"the user message must be a string, got {show(user)}")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"the system message must be a string or None, got {show(system)}")
    messages = [] if system is None else [{"role": "system", "content": system}]
    return [*messages, {"role": "user", "content": user}]


def _conversation(messages: Any) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template: keys set to None left out,
    and a message's reasoning under each name templates read it by."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} "
                         f"dicts, got {show(messages)}")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a dict like {{'role': 'user', 'content': "
                             f"'Hi'}}, got {show(message)}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _as_json(value: Any, what: str, **kwargs: Any) -> str:
    try:
        return json.dumps(value, **kwargs)
    except (TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"{what} must be JSON data (strings, numbers, booleans, lists and "
                         f"dicts with string keys): {' '.join(str(error).split())[:160]}"
                         ) from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str | None] | None = None,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
    limits: RenderLimits | None = None,
) -> str:
    """The prompt text ``template`` makes of ``messages``, as transformers renders it.

    Args:
        template: the model's Jinja chat template (at most
            :data:`MAX_CHAT_TEMPLATE_CHARS` characters).
        messages: ``[{"role": ..., "content": ...}, ...]``, e.g. from :func:`chat_messages`;
            values are JSON data (an assistant's ``tool_calls``, its ``reasoning_content``).
        special_tokens: the template variables transformers passes from the tokenizer:
            ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ... (their text).
        add_generation_prompt: end with the header that opens the assistant's reply.
        tools: the tools' JSON schemas, as transformers' ``tools=`` (None: no tools).
        variables: more template variables, as transformers' keyword arguments
            (``{"enable_thinking": False}``); they take precedence over ``special_tokens``.
        limits: the bounds of this render (default: :data:`CHAT_RENDER_LIMITS`).

    Returns:
        The rendered text: encode it without adding special tokens (the template
        writes its own, a leading ``bos_token`` included).

    Raises:
        ChatTemplateError: (a ValueError) one line for a template that does not parse,
            that refuses the conversation (:class:`ChatTemplateRefusedError`: Gemma's for a
            ``system`` role it does not take, roles out of order), that reaches a limit
            of ``limits`` (naming it), or that fails or is stopped by the sandbox.
        ValueError: messages, tools or variables that are not JSON data, or larger
            than ``limits.chars`` as JSON.
        ImportError: jinja2 (3.1.6 or later) is not installed.
    """
    limits = CHAT_RENDER_LIMITS if limits is None else limits
    if not isinstance(limits, RenderLimits):
        raise ValueError(f"limits must be a RenderLimits, got {show(limits)}")
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat template must be a non-empty string, got {show(template)}")
    if len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise ValueError(f"chat template has {len(template):,} characters; at most "
                         f"{MAX_CHAT_TEMPLATE_CHARS:,} are accepted")
    extra = dict(variables or {})
    reserved = [name for name in _RESERVED if name in extra]
    if reserved:
        raise ValueError(f"template variable {reserved[0]!r} is set by the render itself, "
                         f"as are {', '.join(_RESERVED)}; name it otherwise")
    if tools is not None and (isinstance(tools, (str, bytes, Mapping))
                              or not isinstance(tools, Sequence)):
        raise ValueError(f"tools must be a list of JSON schemas (dicts), got {show(tools)}")
    data = {
        **{str(k): str(v) for k, v in (special_tokens or {}).items() if v is not None},
        **extra,
        "messages": _conversation(messages),
        "tools": None if tools is None else list(tools),
        "documents": None,
        "add_generation_prompt": bool(add_generation_prompt),
    }
    size = len(_as_json(data, "the conversation, tools and variables", ensure_ascii=False))
    if size > limits.chars:
        raise ValueError(f"the conversation, tools and variables take {size:,} characters as "
                         f"JSON; a chat template is given at most {limits.chars:,}")
    answer = _run_sandbox(template, _as_json(data, "the conversation"), limits)
    text = answer.get("text")
    if isinstance(text, str) and len(text) <= limits.chars:
        return text
    kind, message = answer.get("error"), answer.get("message") or ""
    if kind == "import":
        raise ImportError(f"{message}: {_JINJA2_HINT}")
    if kind == "refused":
        raise ChatTemplateRefusedError(message, kind)
    if kind == "time":
        raise ChatTemplateError(_time_message(limits), kind)
    if kind == "memory":
        raise ChatTemplateError(_memory_message(limits), kind)
    if kind in ("syntax", "size", "failed") and message:
        raise ChatTemplateError(message, kind)
    raise ChatTemplateError(f"the process rendering the chat template answered "
                            f"{show(answer)}, not a text")


def _time_message(limits: RenderLimits) -> str:
    return f"the chat template ran past its time limit ({limits.seconds:g} s of CPU time)"


def _memory_message(limits: RenderLimits) -> str:
    return (f"the chat template needed more than its memory limit "
            f"({limits.memory_bytes / 2**20:,.0f} MiB)")


def _run_sandbox(template: str, variables: str, limits: RenderLimits) -> dict[str, Any]:
    """Render in a process of its own (:mod:`qkv.data.chat_sandbox`), bounded by
    ``limits``: its answer, a dict."""
    if not sys.executable:
        raise OSError("no Python interpreter to render the chat template in "
                      "(sys.executable is empty)")
    # The child runs isolated (-I: no environment variables, no current folder on its
    # path); it is handed the folders this process imports from, to find jinja2 there.
    paths = [p for p in sys.path if p and os.path.isabs(p)]
    request = (f'{{"sys_path": {json.dumps(paths)}, "template": {json.dumps(template)}, '
               f'"variables": {variables}}}').encode("ascii")
    command = [sys.executable, "-I", str(_SANDBOX), repr(float(limits.seconds)),
               str(limits.memory_bytes), str(limits.chars)]
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except OSError as error:
        raise OSError(f"cannot start the process that renders the chat template "
                      f"({error.strerror or error})") from None
    try:
        out, _ = proc.communicate(request, timeout=limits.wall_seconds)
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(
            f"the chat template did not finish within {limits.wall_seconds:g} s on the "
            f"clock (its time limit is {limits.seconds:g} s of CPU time; the machine may "
            "be too busy)", "time") from None
    finally:  # a timeout, or Ctrl-C while it renders: the child goes too
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode in _KILLED_FOR_TIME:
        # RLIMIT_CPU ended a computation Python could not interrupt
        raise ChatTemplateError(_time_message(limits), "time")
    try:
        answer = json.loads(out)
    except ValueError:
        answer = None
    if proc.returncode != 0 or not isinstance(answer, dict):
        raise ChatTemplateError(
            f"the process rendering the chat template ended without an answer (exit status "
            f"{proc.returncode}); the template may have exhausted its memory limit "
            f"({limits.memory_bytes / 2**20:,.0f} MiB)", "memory")
    return answer


# The conversation a template is tried on when a model is imported.
PROBE_MESSAGES = chat_messages("Hello!")


def check_chat_template(
    template: str,
    *,
    special_tokens: Mapping[str, str | None] | None = None,
    limits: RenderLimits | None = None,
) -> None:
    """Render ``template`` once on a one-message conversation (:data:`PROBE_MESSAGES`),
    under ``limits``, to refuse a template that cannot be used before a model that
    carries it is imported.

    A template that refuses the probe itself (its own ``raise_exception``) passes: it
    ran within its limits, and other conversations may suit it.

    Raises:
        ChatTemplateError: the template does not parse, reaches a limit or fails.
        ImportError: jinja2 (3.1.6 or later) is not installed.
    """
    with contextlib.suppress(ChatTemplateRefusedError):
        render_chat_template(template, PROBE_MESSAGES, special_tokens=special_tokens,
                             add_generation_prompt=True, limits=limits)

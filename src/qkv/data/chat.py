"""A model's own chat template, rendered the way transformers renders it.

An instruction-tuned model was trained on conversations laid out by a Jinja template that
ships with it (``tokenizer_config.json``'s ``chat_template``, a ``chat_template.jinja``
file, or a GGUF file's ``tokenizer.chat_template``). Prompting it with anything else
gets worse answers, so the template itself is rendered:

    render_chat_template(template, chat_messages("Hi!", system="Be brief."),
                         special_tokens={"bos_token": "<s>", "eos_token": "</s>"})

gives, for a ChatML template, ``"<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user
\\nHi!<|im_end|>\\n<|im_start|>assistant\\n"``: the text the model continues with its reply.

A template is code that came with a downloaded file, so it runs in Jinja's immutable
sandbox: it can read the messages and the few helpers below, never touch Python objects'
internals, and never change what it was given. The environment is the one transformers'
``apply_chat_template`` builds (blocks trimmed, ``break``/``continue``, and the globals
``raise_exception``, ``strftime_now`` and a ``tojson`` that leaves non-ASCII and HTML
characters as they are), so the same template gives the same string in both.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from ..checks import show

__all__ = [
    "MAX_CHAT_TEMPLATE_CHARS",
    "chat_messages",
    "render_chat_template",
]

# The largest template read: real ones are 0.5-10 kB (tool-calling ones up to ~20 kB).
MAX_CHAT_TEMPLATE_CHARS = 2**20


# Earlier releases have known ways out of the sandbox, and a chat template is code that
# came with a downloaded model.
MIN_JINJA2 = (3, 1, 6)


def _import_jinja2() -> Any:
    hint = "pip install 'jinja2>=3.1.6' (or pip install 'qkv[hf]')"
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError(f"rendering a chat template needs jinja2: {hint}") from None
    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < MIN_JINJA2:
        raise ImportError(f"jinja2 {jinja2.__version__} is too old to run a chat template "
                          f"safely: {hint}")
    return jinja2


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


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The template compiled in the sandbox (cached: one model's template is rendered often)."""
    jinja2 = _import_jinja2()

    class RaisedByTemplate(jinja2.exceptions.TemplateError):
        """What the template's own ``raise_exception(message)`` raises."""

    def raise_exception(message: Any) -> None:
        raise RaisedByTemplate(str(message))

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names, so that no template can reach
        Python internals through an attribute it sets itself."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                Namespace.check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key: str, value: Any) -> None:
            Namespace.check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the underscore name {key!r} on a namespace")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's part of a
        template written for training masks; rendering a prompt just keeps its text."""

        tags = {"generation"}  # noqa: RUF012 (Jinja reads it from the class)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("keep"), [], [], body) \
                .set_lineno(lineno)

        def keep(self, caller: Any) -> str:
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(template), RaisedByTemplate
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"chat template has a syntax error at line {error.lineno}: "
                         f"{' '.join(str(error.message).split())}") from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    special_tokens: Mapping[str, str] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text ``template`` makes of ``messages``, as transformers renders it.

    Args:
        template: the model's Jinja chat template (at most
            :data:`MAX_CHAT_TEMPLATE_CHARS` characters).
        messages: ``[{"role": ..., "content": ...}, ...]``, e.g. from :func:`chat_messages`.
        special_tokens: the template variables transformers passes from the tokenizer:
            ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ... (their text).
        add_generation_prompt: end with the header that opens the assistant's reply.

    Returns:
        The rendered text: encode it without adding special tokens (the template
        writes its own, a leading ``bos_token`` included).

    Raises:
        ValueError: one line for a template that does not parse, that refuses the
            conversation (``raise_exception``, e.g. Gemma's for a ``system`` role it does
            not take or roles out of order), or that fails or is stopped by the sandbox
            while rendering.
        ImportError: jinja2 is not installed.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat template must be a non-empty string, got {show(template)}")
    if len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise ValueError(f"chat template has {len(template):,} characters; at most "
                         f"{MAX_CHAT_TEMPLATE_CHARS:,} are accepted")
    jinja2 = _import_jinja2()
    compiled, raised_by_template = _compile(template)
    # Fresh plain dicts and strings: the template sees nothing the caller holds.
    chat = [{str(k): str(v) for k, v in message.items()} for message in messages]
    variables = {str(k): str(v) for k, v in (special_tokens or {}).items() if v is not None}
    try:
        return compiled.render(messages=chat, tools=None, documents=None,
                               add_generation_prompt=bool(add_generation_prompt), **variables)
    except raised_by_template as error:
        raise ValueError(f"the chat template refuses this conversation: "
                         f"{' '.join(str(error).split())}") from None
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, AttributeError,
            KeyError, IndexError, ZeroDivisionError, RecursionError) as error:
        raise ValueError(f"the chat template failed while rendering "
                         f"({type(error).__name__}: {' '.join(str(error).split())[:200]})"
                         ) from None

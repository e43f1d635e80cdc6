"""The program that renders a chat template, in a process of its own, within limits.

:mod:`qkv.data.chat` runs this file for each render, as ``python -I chat_sandbox.py
SECONDS BYTES CHARS``; qkv never imports it. It uses the standard library and jinja2
only, so it starts in about a tenth of a second and never loads torch.

A chat template is code that came with a downloaded model. Jinja's sandbox keeps it from
Python's internals but bounds neither its time nor its memory, so before reading
anything this process limits itself:

- its address space to BYTES (``RLIMIT_AS``): a value too large to build fails here with
  ``MemoryError``, never in the machine's memory;
- its CPU time: the render (compiling the template included) is stopped after SECONDS
  by a profiling timer; a computation Python cannot interrupt (one huge multiplication)
  is ended by the system (``RLIMIT_CPU``: SIGXCPU a second later, SIGKILL a second after
  that);
- no core file and no file written (``RLIMIT_CORE``, ``RLIMIT_FSIZE``);

and the environment checks what the sandbox lets it check before it is built (the size
of ``*``, ``+`` and ``**`` results, ``join``, ``replace`` and the padding methods and
filters) and counts the output as the template writes it, stopping past CHARS
characters.

It reads one JSON request from stdin:

    {"sys_path": [...], "template": "...", "variables": {"messages": [...], ...}}

and writes one JSON answer to stdout: ``{"text": "..."}``, or ``{"error": KIND,
"message": "one line"}`` with KIND one of :data:`ERROR_KINDS`.

The environment is the one transformers' ``apply_chat_template`` builds (blocks
trimmed, ``break``/``continue``, the globals ``raise_exception``, ``strftime_now``,
``dict`` and ``namespace``, and a ``tojson`` that leaves non-ASCII and HTML characters as
they are), so the same template gives the same string in both.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import signal
import sys
from typing import Any

# What an answer's "error" can be: jinja2 missing or too old, a template that does not
# parse, one that refuses the conversation (its raise_exception), one stopped by a limit
# (time, memory, the size of a value or of the output), and any other failure.
ERROR_KINDS = ("import", "syntax", "refused", "time", "memory", "size", "failed")

# Earlier releases have known ways out of the sandbox.
MIN_JINJA2 = (3, 1, 6)

# How many characters a value may have: set from the command line.
_CHARS = 0


class Stop(BaseException):
    """A limit reached while rendering. A BaseException, so that nothing on the way
    (Jinja's own ``except Exception``) mistakes it for the template's error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def limit_process(seconds: float, memory_bytes: int) -> None:
    """Bound this process's memory and CPU time, before it reads the template."""
    try:
        import resource
    except ImportError:  # not a Unix system: the parent's clock still bounds the time
        return
    cpu = math.ceil(seconds) + 1  # the profiling timer stops the render before this
    for name, (soft, hard) in (("RLIMIT_AS", (memory_bytes, memory_bytes)),
                               ("RLIMIT_CPU", (cpu, cpu + 1)), ("RLIMIT_CORE", (0, 0)),
                               ("RLIMIT_FSIZE", (0, 0))):
        if not hasattr(resource, name):
            continue
        kind = getattr(resource, name)
        _, ceiling = resource.getrlimit(kind)
        if ceiling != resource.RLIM_INFINITY:  # the system's own limit is lower: kept
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(kind, (soft, hard))


def check_size(n: int, what: str = "a value of", unit: str = "characters") -> None:
    """Refuse, before it is built, a value of ``n`` characters (or items, or digits)."""
    if n > _CHARS:
        raise Stop("size", f"the chat template would build {what} {n:,} {unit}, past the "
                           f"limit of {_CHARS:,} characters")


def _digits(bits: int) -> int:
    return math.ceil(bits * math.log10(2))


def _unit(value: Any) -> str:
    return "characters" if isinstance(value, str) else "items"


def check_binop(operator: str, left: Any, right: Any) -> None:
    """The size of ``left OPERATOR right`` for ``*``, ``+`` and ``**``, checked first."""
    sized = (str, list, tuple)
    numbers = (isinstance(left, int) and not isinstance(left, bool)
               and isinstance(right, int) and not isinstance(right, bool))
    if operator == "*":
        if isinstance(left, sized) and isinstance(right, int):
            check_size(len(left) * right, unit=_unit(left))
        elif isinstance(right, sized) and isinstance(left, int):
            check_size(len(right) * left, unit=_unit(right))
        elif numbers:
            check_size(_digits(left.bit_length() + right.bit_length()), "a number of", "digits")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        check_size(len(left) + len(right), unit=_unit(left))
    elif operator == "**" and numbers and right > 0 and abs(left) > 1:
        # (an exponent of more than 62 bits is past any limit, and past a float's range)
        digits = _CHARS + 1 if right.bit_length() > 62 else math.ceil(
            right * math.log10(abs(left)))
        check_size(digits, "a number of", "digits")


_PADDING = ("center", "ljust", "rjust", "zfill", "expandtabs")


def checked_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A string method's result size, checked before the call; ``args`` returned, with
    an iterator given to ``join`` read into a list (the call reads it anyway)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return args
    if name == "join" and args:
        items = list(args[0])
        check_size(len(owner) * max(len(items) - 1, 0)
                   + sum(len(item) for item in items if isinstance(item, str)))
        return (items, *args[1:])
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        check_size(len(owner) + count * max(len(args[1]) - len(args[0]), 0))
    if name in _PADDING:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int):
                check_size(value * (8 if name == "expandtabs" else 1))
    return args


def build_environment() -> tuple[Any, type[Exception]]:
    """The sandboxed Jinja environment, and the error its ``raise_exception`` raises."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class RaisedByTemplate(jinja2.exceptions.TemplateError):
        """What the template's own ``raise_exception(message)`` raises."""

    def raise_exception(message: Any) -> None:
        raise RaisedByTemplate(str(message))

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
        if isinstance(indent, int):
            check_size(indent, "an indentation of", "spaces")
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)``, and nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

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

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """The immutable sandbox, with the size of what an operator or a string method
        would build checked before it is built."""

        intercepted_binops = frozenset({"*", "+", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any,  # noqa: N805
                 **kwargs: Any) -> Any:
            args = checked_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True,
                  extensions=[Generation, jinja2.ext.loopcontrols])
    join, center, indent, replace = (env.filters[name] for name in
                                     ("join", "center", "indent", "replace"))

    @jinja2.pass_eval_context
    def bounded_join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)
        if attribute is None:
            check_size(len(str(d)) * max(len(items) - 1, 0)
                       + sum(len(item) for item in items if isinstance(item, str)))
        return join(eval_ctx, items, d, attribute)

    def bounded_center(value: Any, width: int = 80) -> str:
        if isinstance(width, int):
            check_size(width)
        return center(value, width)

    def bounded_indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        text = str(s)
        step = width if isinstance(width, int) else len(str(width))
        check_size(len(text) + step * (text.count("\n") + 1))
        return indent(s, width, first, blank)

    @jinja2.pass_eval_context
    def bounded_replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> str:
        checked_call(str(s).replace, (str(old), str(new), -1 if count is None else count), {})
        return replace(eval_ctx, s, old, new, count)

    env.filters.update(join=bounded_join, center=bounded_center, indent=bounded_indent,
                       replace=bounded_replace, tojson=tojson)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=Namespace)
    return env, RaisedByTemplate


def one_line(text: Any, limit: int = 200) -> str:
    return " ".join(str(text).split())[:limit]


class _NeverRaisedError(Exception):
    """Stands for the template's own error until the environment that raises it exists."""


def render(template: str, variables: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The answer for one request: ``{"text": ...}`` or ``{"error": ..., "message": ...}``
    (no message for "time" and "memory": the parent, which knows its limits, words them)."""
    try:
        import jinja2
    except ImportError:
        return {"error": "import", "message": "rendering a chat template needs jinja2"}
    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < MIN_JINJA2:
        return {"error": "import", "message": f"jinja2 {jinja2.__version__} is too old to "
                                              "run a chat template safely"}

    def out_of_time(_signum: int, _frame: Any) -> None:
        raise Stop("time", "")

    raised_by_template: type[Exception] = _NeverRaisedError
    timed = hasattr(signal, "setitimer")  # not on Windows: the parent's clock bounds it
    if timed:
        signal.signal(signal.SIGPROF, out_of_time)
        signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        env, raised_by_template = build_environment()
        try:
            compiled = env.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as error:
            return {"error": "syntax", "message": f"the chat template has a syntax error at line "
                                                  f"{error.lineno}: {one_line(error.message)}"}
        pieces, count = [], 0
        for piece in compiled.generate(**variables):
            count += len(piece)
            if count > _CHARS:
                raise Stop("size", f"the chat template's output passed the limit of "
                                   f"{_CHARS:,} characters")
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except MemoryError:
        return {"error": "memory", "message": ""}
    except raised_by_template as error:
        return {"error": "refused", "message": f"the chat template refuses this "
                                               f"conversation: {one_line(error)}"}
    except Exception as error:  # noqa: BLE001 - whatever the template did, one line
        return {"error": "failed", "message": f"the chat template failed while rendering "
                                              f"({type(error).__name__}: {one_line(error)})"}
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_PROF, 0)


def main(argv: list[str]) -> int:
    global _CHARS
    seconds, memory_bytes, _CHARS = float(argv[0]), int(argv[1]), int(argv[2])
    limit_process(seconds, memory_bytes)
    request = json.loads(sys.stdin.buffer.read())
    # The folders the parent imports from (jinja2 where it found it), after this
    # interpreter's own: -I left out the environment's PYTHONPATH.
    sys.path += [p for p in request["sys_path"] if isinstance(p, str) and p not in sys.path]
    try:
        answer = render(request["template"], request["variables"], seconds)
    except Stop as stop:  # the timer, between the render's end and its being stopped
        answer = {"error": stop.kind, "message": str(stop)}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

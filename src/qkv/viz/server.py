"""``qkv view --serve``: the page on a local server, with a text box; each new text runs
through the model and the page redraws.

The server listens on 127.0.0.1 only and answers:

- ``GET /``: the page, in its "serve" mode;
- ``POST /api/attention`` with the JSON body ``{"text": "...", "generate": N}`` (what
  the page sends; ``generate``, the greedy tokens a language model adds to the text, is
  optional and 0 by default; at most :data:`MAX_BODY_BYTES`), or
  ``GET /api/attention?text=...&generate=N``: one example of
  :func:`qkv.viz.data.example` as ``{"example": ...}``, or ``{"error": "one line"}``
  with status 400 for bad input (a text over :data:`~qkv.viz.data.MAX_TEXT_CHARS`
  characters, say), 413 for a body over the limit and 500 for anything else.

Each connection has a thread of its own, so a client that connects and sends nothing,
or half a request, delays no one: it has ``timeout`` seconds to send its whole request
before the connection is closed, and each write of an answer must go through within
``timeout`` too. At most ``max_connections`` are open at once (one more is answered
503), and the model runs for one request at a time. A client that goes away, or goes
quiet, is its own business: nothing is logged. An error in one request never stops the
server; Ctrl-C and SIGTERM do (as ``KeyboardInterrupt``, for the caller to report).
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..checks import parse_json
from ..tasks.translate import Translator
from ..utils.native import STOPPING
from .data import MAX_TEXT_CHARS, Target, check_translator_generate, example, page_data
from .page import render_page

__all__ = ["HOST", "REQUEST_TIMEOUT", "MAX_CONNECTIONS", "MAX_BODY_BYTES", "make_server",
           "serve", "default_text"]

HOST = "127.0.0.1"
# Seconds a client has to send its whole request, and for each write of an answer.
REQUEST_TIMEOUT = 10.0
# Connections open at once: each holds a thread while it lasts.
MAX_CONNECTIONS = 64
# The longest text the model takes, as JSON with every character escaped (12 bytes for
# one outside the Basic Multilingual Plane: a surrogate pair of "\uXXXX"), plus room for
# the braces and the key.
MAX_BODY_BYTES = 12 * MAX_TEXT_CHARS + 1024
# The greedy tokens one request may ask for, as written in a request (more digits than
# any context length needs, few enough to refuse a huge number before converting it).
_GENERATE = re.compile(r"[0-9]{1,7}")
API = "/api/attention"


def default_text(target: Target) -> str:
    """A first text for the page when the user gives none."""
    if isinstance(target, Translator):  # English to French, unless the dates corpus
        return "10 June 1993" if target.settings.data == "dates" else "i am cold ."
    return "The cat sat on the mat."


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them, and a deadline for
    reading each request (checked between the polls of ``serve_forever``)."""

    daemon_threads = True
    # Closing the server (Ctrl-C, SIGTERM) does not wait for the clients still connected.
    block_on_close = False
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 request_timeout: float, max_connections: int,
                 say: Callable[[str], None]) -> None:
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self.say = say
        self._slots = threading.BoundedSemaphore(max_connections)
        self._reading: dict[socket.socket, float] = {}  # connection -> its deadline
        self._reading_lock = threading.Lock()
        super().__init__(address, handler)

    # -- the deadline: a connection still sending its request when it passes is closed.

    def start_reading(self, connection: socket.socket) -> None:
        with self._reading_lock:
            self._reading[connection] = time.monotonic() + self.request_timeout

    def done_reading(self, connection: socket.socket) -> bool:
        """The request on ``connection`` is read: False if its deadline came first (the
        connection is closed, and the request may be cut short: it is not answered)."""
        with self._reading_lock:
            return self._reading.pop(connection, None) is not None

    def service_actions(self) -> None:
        now = time.monotonic()
        with self._reading_lock:
            late = [c for c, deadline in self._reading.items() if deadline <= now]
            for connection in late:
                del self._reading[connection]
        for connection in late:  # its thread's read returns at once; the thread ends
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    # -- the bound on connections.

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            self.close_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:  # no thread started ("can't start new thread"): free its slot
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.done_reading(request)
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        # Answered here, without a thread: a few hundred bytes fit in any socket buffer,
        # so nothing here can block the loop that accepts connections.
        body = json.dumps({"error": f"the server has {self.max_connections} connections "
                                    "open, its most; try again in a moment"}).encode()
        head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        with suppress(OSError):
            request.setblocking(False)
            request.sendall(head + body)
            request.recv(65536)  # what the client already sent: closing over it would reset

    def shutdown_request(self, request: Any) -> None:
        # On the connection's own thread, once it is answered. The client may still be
        # sending (a body refused unread, say): closing over unread bytes resets the
        # connection, and a reset can destroy the answer before the client reads it.
        # So this side ends first, then what still comes is read and dropped, for a
        # bounded time and number of bytes, until the client closes too.
        end = time.monotonic() + min(self.request_timeout, 2.0)
        with suppress(OSError):
            request.shutdown(socket.SHUT_WR)
            budget = MAX_BODY_BYTES + 65536
            while budget > 0 and (left := end - time.monotonic()) > 0:
                request.settimeout(left)
                chunk = request.recv(65536)
                if not chunk:
                    break
                budget -= len(chunk)
        self.close_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # the client went away or went quiet: no one else's concern
        self.say("qkv view: a request failed:\n" + traceback.format_exc())


def make_server(target: Target, *, port: int = 0, texts: Sequence[str] = (),
                title: str = "qkv attention", beam: int = 1, generate: int = 0,
                log: Callable[[str], None] | None = None,
                timeout: float = REQUEST_TIMEOUT,
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    """A server bound to 127.0.0.1:``port`` (0: any free port; ``server.server_port``
    says which) showing ``texts`` first (a language model's continued by ``generate``
    greedy tokens, the page's first value for its own field); call ``serve_forever()``
    on it.

    ``timeout``: seconds a client has to send its request and for each write of the
    answer; ``max_connections``: connections served at once. ``log`` takes the server's
    own error reports (stderr by default)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    if not 0 < timeout <= 3600:
        raise ValueError(f"timeout must be in (0, 3600] seconds, got {timeout}")
    if not 1 <= max_connections <= 1024:
        raise ValueError(f"max_connections must be in 1..1024, got {max_connections}")
    data = page_data(target, list(texts) or [default_text(target)], beam=beam,
                     generate=generate)
    data["generate"] = generate  # the page's field starts with it
    page = render_page(data, title=title, mode="serve").encode("utf-8")
    say = log or (lambda line: print(line, file=sys.stderr))
    model_lock = threading.Lock()  # one model, one computation at a time

    class Handler(BaseHTTPRequestHandler):
        server_version = "qkv-view"
        server: _Server

        def setup(self) -> None:
            super().setup()
            self.server.start_reading(self.connection)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
            pass  # one line per request would bury the URL; errors are logged

        def send_error(self, code: int, message: str | None = None,
                       explain: str | None = None) -> None:
            # The standard library's own refusals (an unknown method, a request line
            # over 64 KiB, too many headers...) in the same one-line JSON as ours.
            status = HTTPStatus(code)
            if status == HTTPStatus.REQUEST_URI_TOO_LONG:
                message = (f"the URL is over 64 KiB; send a long text as POST {API} with "
                           'the JSON body {"text": ...}')
            self.close_connection = True
            self._json(status, {"error": message or status.phrase})

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: HTTPStatus, obj: dict[str, Any]) -> None:
            self._send(status, json.dumps(obj).encode("utf-8"), "application/json")

        def _addressed_here(self) -> bool:
            # Another site's page could reach this server through a DNS name that
            # points at 127.0.0.1; only requests addressed to this machine by its own
            # names are answered.
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
            if host not in (HOST, "localhost"):
                self._json(HTTPStatus.FORBIDDEN, {"error": f"unexpected Host {host!r}"})
                return False
            return True

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if not self.server.done_reading(self.connection) or not self._addressed_here():
                return
            url = urlsplit(self.path)
            if url.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
            elif url.path == API:
                query = parse_qs(url.query, keep_blank_values=True)
                texts = query.get("text")
                counts = query.get("generate", [])
                if not texts or len(texts) != 1 or len(counts) > 1 or set(query) - {
                        "text", "generate"}:
                    self._json(HTTPStatus.BAD_REQUEST,
                               {"error": f"give one text: {API}?text=...[&generate=N]"})
                    return
                count: Any = counts[0] if counts else 0
                if isinstance(count, str) and _GENERATE.fullmatch(count):
                    count = int(count)
                self._attention(texts[0], count)
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path!r} here; "
                                                  f"try / or {API}?text=..."})

        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            body = self._body()
            if (body is None or not self.server.done_reading(self.connection)
                    or not self._addressed_here()):
                return
            if urlsplit(self.path).path != API:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"POST goes to {API}, not "
                                                  f"{urlsplit(self.path).path!r}"})
                return
            usage = 'the body must be the JSON {"text": "..."} or {"text": "...", "generate": N}'
            try:
                request = parse_json(body)  # bounded nesting: "[[[[..." is refused
            except ValueError as e:
                self._json(HTTPStatus.BAD_REQUEST, {"error": f"{usage}; {str(e)[:200]}"})
                return
            if not isinstance(request, dict) or "text" not in request or set(request) - {
                    "text", "generate"}:
                self._json(HTTPStatus.BAD_REQUEST, {"error": usage})
                return
            self._attention(request["text"], request.get("generate", 0))

        def _body(self) -> bytes | None:
            """The request's body, or None when it was refused (answered here) or the
            client went away before sending it all."""
            if not self.headers.get("Content-Type", "").startswith("application/json"):
                # A page of another site can send a "simple" POST (text/plain) to any
                # address; asking for JSON makes the browser ask this server first, and
                # the server never says yes.
                self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                            "send the body as Content-Type: application/json")
                return None
            length = self.headers.get("Content-Length")
            if "Transfer-Encoding" in self.headers or length is None:
                self._error(HTTPStatus.LENGTH_REQUIRED,
                            "send the body with a Content-Length (no chunked encoding)")
                return None
            if not re.fullmatch(r"[0-9]{1,20}", length.strip()):
                self._error(HTTPStatus.BAD_REQUEST,
                            f"Content-Length must be a number of bytes, got {length!r}")
                return None
            size = int(length)
            if size > MAX_BODY_BYTES:
                self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"the body has {size:,} bytes; at most {MAX_BODY_BYTES:,} "
                            f"(a text of at most {MAX_TEXT_CHARS:,} characters)")
                return None
            body = self.rfile.read(size)
            if len(body) < size:  # the client closed, or the deadline closed it
                self.close_connection = True
                return None
            return body

        def _error(self, status: HTTPStatus, message: str) -> None:
            # Refused before its body was read: the connection cannot serve another
            # request, and the body is never read.
            self.server.done_reading(self.connection)
            self.close_connection = True
            self._json(status, {"error": message})

        def _attention(self, text: Any, count: Any) -> None:
            try:
                if isinstance(target, Translator):
                    check_translator_generate(count)
                with model_lock:
                    answer = example(target, text, beam=beam, generate=count)
            except ValueError as e:  # the input's fault: say what is wrong with it
                self._json(HTTPStatus.BAD_REQUEST, {"error": (str(e).splitlines() or [""])[0]})
            except STOPPING:
                raise
            except BaseException as e:  # noqa: BLE001 - the server outlives any one request
                # (a library's panic, a BaseException, included)
                say("qkv view: a request failed:\n" + traceback.format_exc())
                first = (str(e).splitlines() or [""])[0]
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR,
                           {"error": f"the model failed on this text: "
                                     f"{type(e).__name__}: {first}"})
            else:
                self._json(HTTPStatus.OK, {"example": answer})

    Handler.timeout = timeout  # the socket's: for each read and each write of an answer
    try:
        return _Server((HOST, port), Handler, request_timeout=timeout,
                       max_connections=max_connections, say=say)
    except OSError as e:
        raise OSError(f"cannot listen on {HOST}:{port} ({e.strerror or e}); choose another "
                      "--port, or 0 for any free one") from None


def serve(target: Target, *, port: int = 8000, texts: Sequence[str] = (),
          title: str = "qkv attention", beam: int = 1, generate: int = 0,
          log: Callable[[str], None] | None = None) -> None:
    """Serve the page, saying where with ``log`` (stdout, flushed, by default), until
    Ctrl-C or SIGTERM: their ``KeyboardInterrupt`` ends the server and goes on to the
    caller (the command line reports it and exits 130 or 143)."""
    say = log or partial(print, flush=True)  # flushed: a pipe or a log file sees it now
    server = make_server(target, port=port, texts=texts, title=title, beam=beam,
                         generate=generate)
    with server:
        say(f"qkv view: serving on http://{HOST}:{server.server_port}/ (Ctrl-C stops)")
        # The server loops on a thread of its own while this one, the main thread, only
        # waits: the KeyboardInterrupt of Ctrl-C or SIGTERM, raised in the main thread,
        # then never lands in the server's code halfway through handing a connection to
        # its thread (the server would close that connection under the thread's feet).
        # It waits on an Event (an interrupted Thread.join can leave the thread marked as
        # ended while it runs), half a second at a time: a signal that the system gives
        # to another thread sets a flag the main thread reads only when it wakes.
        failed: list[BaseException] = []
        ended = threading.Event()

        def loop() -> None:
            try:
                server.serve_forever()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                failed.append(e)
            finally:
                ended.set()

        threading.Thread(target=loop, name="qkv-view-server", daemon=True).start()
        try:
            while not ended.wait(0.5):
                pass
        finally:
            server.shutdown()  # at once if the loop has ended; else within its poll
        if failed:
            raise failed[0]

"""``qkv view --serve``: the page on a local server, with a text box; each new text runs
through the model and the page redraws.

The server listens on 127.0.0.1 only and answers two requests: ``GET /`` (the page, in
its "serve" mode) and ``GET /api/attention?text=...`` (one example of
:func:`qkv.viz.data.example` as JSON, or ``{"error": "one line"}`` with status 400 for
bad input and 500 for anything else). One request is served at a time, so the model
never runs twice at once; an error in one request never stops the server.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..tasks.translate import Translator
from .data import Target, example, page_data
from .page import render_page

__all__ = ["HOST", "make_server", "serve", "default_text"]

HOST = "127.0.0.1"


def default_text(target: Target) -> str:
    """A first text for the page when the user gives none."""
    if isinstance(target, Translator):  # English to French, unless the dates corpus
        return "10 June 1993" if target.settings.data == "dates" else "i am cold ."
    return "The cat sat on the mat."


def make_server(target: Target, *, port: int = 0, texts: Sequence[str] = (),
                title: str = "qkv attention", beam: int = 1,
                log: Callable[[str], None] | None = None) -> HTTPServer:
    """A server bound to 127.0.0.1:``port`` (0: any free port; ``server.server_port``
    says which) showing ``texts`` first; call ``serve_forever()`` on it."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    page = render_page(page_data(target, list(texts) or [default_text(target)], beam=beam),
                       title=title, mode="serve").encode("utf-8")
    say = log or (lambda line: print(line, file=sys.stderr))

    class Handler(BaseHTTPRequestHandler):
        server_version = "qkv-view"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
            pass  # one line per request would bury the URL; errors are logged below

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: HTTPStatus, obj: dict[str, Any]) -> None:
            self._send(status, json.dumps(obj).encode("utf-8"), "application/json")

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            # Another site's page could reach this server through a DNS name that
            # points at 127.0.0.1; only requests addressed to this machine by its own
            # names are answered.
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
            if host not in (HOST, "localhost"):
                self._json(HTTPStatus.FORBIDDEN, {"error": f"unexpected Host {host!r}"})
                return
            url = urlsplit(self.path)
            if url.path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
            elif url.path == "/api/attention":
                self._attention(url.query)
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path!r} here; "
                                                  "try / or /api/attention?text=..."})

        def _attention(self, query: str) -> None:
            texts = parse_qs(query, keep_blank_values=True).get("text")
            if not texts or len(texts) != 1:
                self._json(HTTPStatus.BAD_REQUEST, {"error": "give one text: "
                                                    "/api/attention?text=..."})
                return
            try:
                answer = example(target, texts[0], beam=beam)
            except ValueError as e:  # the input's fault: say what is wrong with it
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(e).splitlines()[0]})
            except Exception as e:  # noqa: BLE001 - the server outlives any one request
                say("qkv view: a request failed:\n" + traceback.format_exc())
                first = (str(e).splitlines() or [""])[0]
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR,
                           {"error": f"the model failed on this text: "
                                     f"{type(e).__name__}: {first}"})
            else:
                self._json(HTTPStatus.OK, {"example": answer})

    try:
        return HTTPServer((HOST, port), Handler)
    except OSError as e:
        raise OSError(f"cannot listen on {HOST}:{port} ({e.strerror or e}); choose another "
                      "--port, or 0 for any free one") from None


def serve(target: Target, *, port: int = 8000, texts: Sequence[str] = (),
          title: str = "qkv attention", beam: int = 1,
          log: Callable[[str], None] = print) -> None:
    """Serve the page until Ctrl-C, saying where with ``log``."""
    server = make_server(target, port=port, texts=texts, title=title, beam=beam)
    with server:
        log(f"qkv view: serving on http://{HOST}:{server.server_port}/ (Ctrl-C stops)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            log("qkv view: stopped")

"""The page: one HTML template (``page.html``, with its CSS and script inline) filled
with the attention data of :mod:`qkv.viz.data`.

The template has three slots: ``{{TITLE}}`` (HTML-escaped text), ``{{MODE}}``
(``"file"`` for a saved page, ``"serve"`` for :mod:`qkv.viz.server`'s, which adds a text
box) and ``{{DATA}}`` (the JSON of :func:`qkv.viz.data.page_data`, inside a
``<script type="application/json">``). Nothing on the page is fetched: the template
holds every byte of code, written in this project.
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from typing import Any

__all__ = ["MODES", "render_page"]

MODES = ("file", "serve")


def _template() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


def render_page(data: dict[str, Any], *, title: str = "qkv attention", mode: str = "file"
                ) -> str:
    """The whole page, as a string: ``data`` (see :func:`qkv.viz.data.page_data`)
    embedded as JSON, ``title`` in the tab and the heading."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    # Inside <script>, "</" could end the element early (a token "</script>" in the
    # text, say); JSON allows "\/" for "/", and "\u2028"/"\u2029" are escaped by
    # ensure_ascii, so the JSON is inert HTML.
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":")).replace("</", "<\\/")
    values = {"TITLE": html.escape(title), "MODE": mode, "DATA": payload}
    page = _template()
    missing = [slot for slot in values if "{{" + slot + "}}" not in page]
    if missing:
        raise RuntimeError(f"the page template has no {{{{{missing[0]}}}}} slot")
    # One pass, so that a slot's name inside a value (a title "{{DATA}}") stays text.
    return re.sub(r"\{\{(TITLE|MODE|DATA)\}\}", lambda m: values[m[1]], page)

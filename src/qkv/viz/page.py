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

# The data block is HTML before it is JSON: inside <script>, "</script" ends the
# element and "<!--" followed by "<script" makes the parser skip the real end tag (the
# rest of the page then becomes data, and the page stays blank). JSON text has these
# characters only inside strings, where "\u003c" reads back as "<"; with no "<" left the
# HTML parser sees no tag and no comment at all. ">" and "&" go too (so that no "-->"
# or entity appears), and U+2028/U+2029, which ensure_ascii already escapes, in case a
# script ever evaluates the block as code.
_INERT = str.maketrans({c: f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"})


def _template() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


def render_page(data: dict[str, Any], *, title: str = "qkv attention", mode: str = "file"
                ) -> str:
    """The whole page, as a string: ``data`` (see :func:`qkv.viz.data.page_data`)
    embedded as JSON, ``title`` in the tab and the heading."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":")).translate(_INERT)
    values = {"TITLE": html.escape(title), "MODE": mode, "DATA": payload}
    page = _template()
    missing = [slot for slot in values if "{{" + slot + "}}" not in page]
    if missing:
        raise RuntimeError(f"the page template has no {{{{{missing[0]}}}}} slot")
    # One pass, so that a slot's name inside a value (a title "{{DATA}}") stays text.
    return re.sub(r"\{\{(TITLE|MODE|DATA)\}\}", lambda m: values[m[1]], page)

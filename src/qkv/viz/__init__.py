"""See what a trained model attends to: ``explore(run_dir, text)`` makes a page of its
attention maps (every layer and head), one self-contained HTML file that works offline;
``qkv view`` is the command line front, with a local server for live input.

Layout: :mod:`.data` turns attention tensors into the page's data, :mod:`.page` fills the
one HTML template (``page.html``, CSS and script inline), :mod:`.explore` is the Python
entry point and :mod:`.server` the local server.
"""

from .data import decode_section, encode_section, page_data
from .explore import Exploration, explore, load_target
from .page import render_page

__all__ = ["explore", "Exploration", "load_target", "page_data", "encode_section",
           "decode_section", "render_page"]

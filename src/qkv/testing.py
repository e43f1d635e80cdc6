"""Pause points for tests that must interrupt a real process at an exact moment.

Whether a checkpoint survives a Ctrl-C, a SIGTERM or a SIGKILL depends on the instant it
arrives: before a save, between two of its files, after its commit. A test cannot hit
those instants by timing, so the code marks them with :func:`pause_point` and a test
process runs with ``QKV_TEST_PAUSE=NAME[@N]:DIR`` in its environment. At the N-th time
(default: the first) the process reaches the point called NAME, it creates
``DIR/paused-NAME`` and waits until the test creates ``DIR/resume`` (at most 60 s); the
test sends its signal in between. Without the variable a pause point does nothing but
read one environment variable.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["PAUSE_ENV", "pause_point"]

PAUSE_ENV = "QKV_TEST_PAUSE"
_reached: dict[str, int] = {}


def pause_point(name: str) -> None:
    """Wait here if the test that started this process asked to (see the module doc)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    point, _, folder = spec.partition(":")
    point, _, nth = point.partition("@")
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] != int(nth or 1):
        return
    folder_path = Path(folder)
    (folder_path / f"paused-{name}").touch()
    deadline = time.monotonic() + 60
    while not (folder_path / "resume").exists() and time.monotonic() < deadline:
        time.sleep(0.01)

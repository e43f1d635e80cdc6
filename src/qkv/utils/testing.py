"""Pause points for tests that must interrupt a real process at an exact moment.

Whether a checkpoint survives a Ctrl-C, a SIGTERM or a SIGKILL depends on the instant it
arrives: before a save, between two of its files, after its commit. A test cannot hit
those instants by timing, so the code marks them with :func:`pause_point` and a test
process runs with ``QKV_TEST_PAUSE=NAME[@N][,NAME[@N]...]:DIR`` in its environment. The
N-th time (default: the first) the process reaches the point called NAME, it creates
``DIR/paused-NAME`` and waits until the test creates ``DIR/resume-NAME`` (at most 60 s);
the test sends its signal in between. Without the variable a pause point does nothing
but read one environment variable.
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
    points, _, folder = spec.partition(":")
    wanted = dict((p.partition("@")[0], int(p.partition("@")[2] or 1))
                  for p in points.split(","))
    if name not in wanted:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] != wanted[name]:
        return
    (Path(folder) / f"paused-{name}").touch()
    resume = Path(folder) / f"resume-{name}"
    deadline = time.monotonic() + 60
    while not resume.exists() and time.monotonic() < deadline:
        time.sleep(0.01)

"""The command line answers at once and stops cleanly at any moment of its start.

``--help``, ``--version`` and a bad flag must not import torch (its import takes a second
or more; the times are in docs/benchmarks.md, not asserted here). A Ctrl-C or SIGTERM
while the command line imports itself, before it parses, or inside ``import torch`` is one
line on stderr and exit status 130 (SIGTERM: 143), never a traceback. Each test drives
``python -m qkv`` in a subprocess; where the moment matters it pauses at a named point
(:mod:`qkv.utils.testing`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkv.utils.testing import PAUSE_ENV

SRC = str(Path(__file__).resolve().parents[1] / "src")


def env(pause: str | None = None, folder: Path | None = None) -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    out.pop(PAUSE_ENV, None)
    if pause is not None:
        out[PAUSE_ENV] = f"{pause}:{folder}"
    return out


# Every way of asking the command line a question that needs no work: each must answer
# without importing torch.
QUESTIONS = [["--help"], ["--version"], ["lm", "generate", "--help"],
             ["translate", "train", "--help"], ["bench", "train", "--help"],
             ["view", "--help"], ["walkthrough", "--help"], ["lm", "train", "--bogus"],
             ["translate", "train", "--epochs", "many"], ["nonsense"]]


def test_help_version_and_bad_flags_answer_without_importing_torch():
    script = (
        "import sys\n"
        "from qkv.cli import main\n"
        f"for argv in {QUESTIONS!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.splitlines()[-1] == "[]", out.stderr[-2000:]


def test_python_m_qkv_help_imports_no_torch():
    # -X importtime lists every module the interpreter imports, in the real program.
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "qkv", "--help"],
                         env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: qkv" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "qkv.cli" in imported
    assert "torch" not in imported


def start(*args: str, pause: str | None = None, folder: Path | None = None) -> subprocess.Popen:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "qkv", *args], env=env(pause, folder),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} before {what}: {err}{out}")
        assert time.monotonic() < deadline, f"never reached {what}"
        time.sleep(0.005)


def stopped(proc: subprocess.Popen, sig: int) -> str:
    """Send ``sig``; the process must exit 128 + ``sig`` with one line on stderr."""
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize(("point", "sig"), [
    ("cli-import", signal.SIGINT),   # among the command line's own imports
    ("cli-start", signal.SIGINT),    # before the flags are parsed
    ("cli-start", signal.SIGTERM),
])
def test_a_signal_during_start_up_is_one_line(tmp_path, point, sig):
    folder = tmp_path / "pause"
    proc = start("walkthrough", "--steps", pause=point, folder=folder)
    wait_for(proc, (folder / f"paused-{point}").exists, f"pausing at {point}")
    assert stopped(proc, sig) == "qkv: interrupted"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_ctrl_c_inside_the_torch_import_is_one_line():
    # The walkthrough imports torch once its flags are parsed. torch's shared library is
    # mapped early in `import torch`, which then goes on importing for a second or so:
    # the signal arrives in the middle of it.
    proc = start("walkthrough", "--steps")
    maps = Path(f"/proc/{proc.pid}/maps")

    def torch_loading() -> bool:
        try:
            return "libtorch" in maps.read_text()
        except OSError:
            return False

    wait_for(proc, torch_loading, "importing torch")
    assert stopped(proc, signal.SIGINT) == "qkv walkthrough: interrupted"

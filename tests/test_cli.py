"""The qkv command line shell: help, version, errors, --debug."""

import subprocess
import sys

import pytest

import qkv
from qkv.cli import main


def test_help_and_no_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "walkthrough" in capsys.readouterr().out
    assert main([]) == 0
    assert "usage: qkv" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"qkv {qkv.__version__}"


def test_unknown_command_and_option_are_one_line_exit_2(capsys):
    for argv in (["nonsense"], ["walkthrough", "--bogus"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "--help" in err


def test_user_error_is_one_line_and_debug_shows_traceback(capsys):
    assert main(["walkthrough", "--text", "   "]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv walkthrough: error:") and err.count("\n") == 1
    assert "Traceback" not in err
    with pytest.raises(ValueError):
        main(["--debug", "walkthrough", "--text", "   "])


def test_python_dash_m_qkv_help():
    out = subprocess.run(
        [sys.executable, "-m", "qkv", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: qkv" in out.stdout

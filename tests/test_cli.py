"""The ``forwardkit`` command itself: help, version, one-line errors, --debug."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forwardkit import __version__
from forwardkit.cli import main


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forwardkit.cli", *argv], capture_output=True,
                          text=True, timeout=120)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"forwardkit {__version__}"


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("bench", "config", "generate"):
        assert name in out


@pytest.mark.parametrize("sub", ["bench", "config", "generate"])
def test_every_flag_has_help(sub):
    from forwardkit.cli import build_parser

    parser = build_parser()
    subparser = parser._subparsers._group_actions[0].choices[sub]
    for action in subparser._actions:
        if action.dest != "help":
            assert action.help, f"forwardkit {sub}: {action.option_strings or action.dest} has no help"


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_errors_are_one_line_and_debug_shows_traceback():
    plain = _run("generate", "--prompt-token-ids", "1,2", "--model", "/nonexistent/ckpt")
    assert plain.returncode == 2
    assert plain.stderr.strip().count("\n") == 0 and "/nonexistent/ckpt" in plain.stderr
    debug = _run("generate", "--debug", "--prompt-token-ids", "1,2", "--model", "/nonexistent/ckpt")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_unknown_subcommand_is_one_line():
    proc = _run("serve")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "invalid choice: 'serve'" in proc.stderr

"""The command line answers --help and --version, and offers only commands that work."""
from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from ridgefill_gguf import __version__
from ridgefill_gguf.cli import main

COMMANDS = ("equivalence", "models", "demo", "info", "convert", "inspect", "verify", "fit", "corpus", "solve",
            "merge", "serve", "bench", "eval")


def test_version_prints_the_package_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_help_lists_the_working_commands_and_none_that_are_not_built_yet():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in COMMANDS:
        assert cmd in result.output
    # eval offers the three instruments of the paper
    result = CliRunner().invoke(main, ["eval", "--help"])
    for instrument in ("nll", "needles", "agreement"):
        assert f"  {instrument} " in result.output


def test_every_command_has_help():
    for cmd in COMMANDS:
        result = CliRunner().invoke(main, [cmd, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output


def test_the_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.cli", "--version"], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_equivalence_refuses_a_missing_model_by_name(tmp_path):
    result = CliRunner().invoke(main, ["equivalence", str(tmp_path / "absent.gguf")])
    assert result.exit_code != 0 and "absent.gguf" in result.output


def test_token_counts_take_k_for_1024_and_refuse_nonsense():
    from ridgefill_gguf.cli import _ints

    assert _ints("4k, 8192,32K", "--lengths") == (4096, 8192, 32768)
    for bad in ("", "4x", "-1", "0"):
        with pytest.raises(click.BadParameter):
            _ints(bad, "--lengths")

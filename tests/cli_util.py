"""Running the installed commands in subprocesses, and making broken copies of the tiny checkpoint."""

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent


@dataclass
class Result:
    code: int
    stdout: bytes
    stderr: str


def run(command, *args, stdin=None, env=None, timeout=300):
    exe = BIN / command
    argv = [str(exe)] if exe.exists() else [sys.executable, "-c",
                                             f"from moss_cli.cli import {command.split('-', 1)[1].replace('-', '_')}_command as c; c()"]
    p = subprocess.run(argv + [str(a) for a in args], input=stdin, capture_output=True, env=env, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr.decode("utf-8", "replace"))


FAST = ["--width", "64", "--height", "48", "--steps", "3"]     # a picture the tiny checkpoint makes quickly


def error_lines(result):
    """The stderr lines that report the failure (progress notes are not errors)."""
    return [line for line in result.stderr.splitlines() if ": error:" in line]


def single_error(result):
    """The one error line of a failed command (no traceback)."""
    assert result.code != 0
    errors = error_lines(result)
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


def encode_fixture(tmp_path_factory):
    """An ENC of the prompt "a red fox in snow" (the body of the test modules' `enc` fixtures)."""
    out = tmp_path_factory.mktemp("enc") / "p.enc"
    r = run("moss-encode", "--prompt", "a red fox in snow", "--out", out, "--quiet")
    assert r.code == 0, r.stderr
    return out


def copy_model(tmp_path, name="model"):
    from moss_cli.checkpoint import EMBEDDED
    dst = tmp_path / name
    shutil.copytree(EMBEDDED, dst)
    return dst

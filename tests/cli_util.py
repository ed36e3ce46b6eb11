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
                                             f"from moss_cli.cli import {command.split('-')[1]}_command as c; c()"]
    p = subprocess.run(argv + [str(a) for a in args], input=stdin, capture_output=True, env=env, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr.decode("utf-8", "replace"))


def error_lines(result):
    """The stderr lines that report the failure (progress notes are not errors)."""
    return [line for line in result.stderr.splitlines() if ": error:" in line]


def copy_model(tmp_path, name="model"):
    from moss_cli.checkpoint import EMBEDDED
    dst = tmp_path / name
    shutil.copytree(EMBEDDED, dst)
    return dst

"""The README's examples run as written on a fresh clone: every command line of its code blocks that uses
the embedded tiny checkpoint, run by bash in an empty folder."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

README = Path(__file__).resolve().parent.parent / "README.md"
REAL_MODEL = re.compile(r"MOSS_IMAGE_MODEL|/path/to|--model\b")


def code_blocks(text):
    """Markdown's indented code blocks, each a list of its lines (indent removed)."""
    blocks, block = [], []
    for line in text.splitlines():
        if line.startswith("    ") and line.strip():
            block.append(line[4:])
        elif line.strip() or not block:
            if block:
                blocks.append(block)
            block = []
    if block:
        blocks.append(block)
    return blocks


def command(line):
    """The moss-* part of a README line: from its first moss-* command on (an install prefix joined by '&&'
    dropped), or None for a line that runs none (or is a diagram such as 'moss-encode  prompt -> ENC')."""
    parts = [p.strip() for p in line.split("&&")]
    for i, part in enumerate(parts):
        if re.search(r"(^|\|\s*)moss-\w+ ", part):      # a moss-* command, first or after a pipe
            rest = " && ".join(parts[i:])
            return rest if re.search(r"(^|\s)--?\w", rest) else None
    return None


def tiny_commands(text):
    """The commands of every block that does not point at a real model (those blocks set MOSS_IMAGE_MODEL)."""
    out = []
    for block in code_blocks(text):
        if any(REAL_MODEL.search(line) for line in block):
            continue
        out.extend(c for c in map(command, block) if c)
    return out


def test_the_extraction_finds_the_demo_and_skips_the_rest():
    text = README.read_text()
    cmds = tiny_commands(text)
    assert len(cmds) >= 2, cmds
    assert all("moss-" in c and "pip install" not in c and "->" not in c for c in cmds), cmds
    assert any(c.startswith("moss-image") for c in cmds), cmds


@pytest.mark.parametrize("line", tiny_commands(README.read_text()))
def test_readme_command_runs_as_written(tmp_path, line):
    env = {k: v for k, v in os.environ.items() if k != "MOSS_IMAGE_MODEL"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, f"{line}\n{p.stderr}"
    assert "error" not in p.stderr, p.stderr
    for word in shlex.split(line):          # every picture it names was made
        if word.endswith(".png") and "{" not in word:
            assert Image.open(tmp_path / word).format == "PNG"
    if "--keep" in line:
        keep = tmp_path / shlex.split(line)[shlex.split(line).index("--keep") + 1]
        assert list(keep.glob("prompt*.enc")) and list(keep.glob("latents*.lat")), sorted(os.listdir(keep))



def missing_options(tables):
    """(command, option) for each long option of the commands that the README's tables do not name."""
    import click

    from moss_cli import cli
    from moss_cli.server import main as server_main

    commands = [getattr(cli, n) for n in ("_encode", "_denoise", "_decode", "_image", "_encode_image")]
    commands.append(server_main._server)
    return [(c.name, opt) for c in commands for p in c.params if isinstance(p, click.Option)
            for opt in p.opts if opt.startswith("--") and f"`{opt}" not in tables]


def test_every_option_of_every_command_is_in_the_readmes_tables():
    """A reader finds each option in the README's command tables (or the sampling options' table)."""
    text = README.read_text()
    tables = text[text.index("## Commands and options"):text.index("## The server")]
    assert not missing_options(tables)
    # planted: the trace option's mention taken out of the tables is found missing
    assert ("-denoise", "--trace") in missing_options(tables.replace("`--trace", "`trace"))

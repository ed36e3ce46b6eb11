"""moss-image with several seeds and prompts: each picture equals its single run byte for byte; the seed
syntax, the picture name patterns and the prompt file fail before any work with one line; progress on stderr."""

import io
import os
import re

import pytest

from cli_util import BIN, error_lines, run
from moss_cli import batch
from moss_cli.errors import UsageError
from moss_cli.progress import Progress

FAST = ["--width", "64", "--height", "48", "--steps", "3"]


def _single_error(r, code=1):
    assert r.code == code, r.stderr
    errors = error_lines(r)
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    return errors[0]


def test_four_seeds_in_one_call_equal_four_single_calls(tmp_path):
    multi, keep = tmp_path / "multi", tmp_path / "keep"
    multi.mkdir()
    r = run("moss-image", "--prompt", "a red fox", "--seed", "7,11-12", "--seed", "-3", *FAST,
            "--picture", multi / "fox-{seed}.png", "--keep", keep)
    assert r.code == 0, r.stderr
    assert r.stdout == b""
    assert r.stderr.count("encoding prompt") == 1 and r.stderr.count("encoding negative") == 1
    assert r.stderr.count("loading transformer") == 1 and "picture 4/4" in r.stderr
    assert sorted(p.name for p in multi.iterdir()) == ["fox--3.png", "fox-11.png", "fox-12.png", "fox-7.png"]
    assert sorted(p.name for p in keep.iterdir()) == ["latents-1--3.lat", "latents-1-11.lat", "latents-1-12.lat",
                                                      "latents-1-7.lat", "prompt-1.enc"]
    for seed in (7, 11, 12, -3):
        single = tmp_path / f"single{seed}"
        single.mkdir()
        assert run("moss-image", "--prompt", "a red fox", "--seed", seed, *FAST, "--picture", single / "p.png",
                   "--keep", single, "--quiet").code == 0
        assert (multi / f"fox-{seed}.png").read_bytes() == (single / "p.png").read_bytes()
        assert (keep / f"latents-1-{seed}.lat").read_bytes() == (single / "latents.lat").read_bytes()
        assert (keep / "prompt-1.enc").read_bytes() == (single / "prompt.enc").read_bytes()


def test_prompts_from_a_file_equal_single_calls(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a red fox\r\n\n   \nune forêt [bold]la nuit[/bold]\n".encode())
    r = run("moss-image", "--prompt-file", prompts, "--seed", "5", *FAST,
            "--picture", tmp_path / "p{index}-line{line}-{seed:03d}.png", "--quiet")
    assert r.code == 0 and r.stderr == "", r.stderr
    made = sorted(p.name for p in tmp_path.glob("*.png"))
    assert made == ["p1-line1-005.png", "p2-line4-005.png"]
    for name, prompt in (("p1-line1-005.png", "a red fox"), ("p2-line4-005.png", "une forêt [bold]la nuit[/bold]")):
        single = tmp_path / "single.png"
        assert run("moss-image", "--prompt", prompt, "--seed", "5", *FAST, "--picture", single, "--quiet").code == 0
        assert (tmp_path / name).read_bytes() == single.read_bytes()


@pytest.mark.parametrize("values,seeds", [
    (["42"], [42]),
    (["1,2,3"], [1, 2, 3]),
    (["10-13"], [10, 11, 12, 13]),
    (["3", "1, 2"], [3, 1, 2]),
    (["-5"], [-5]),
    (["-2-1", "7-7"], [-2, -1, 0, 1, 7]),
    ([str(2**64 - 1)], [2**64 - 1]),
    ([str(-2**63)], [-2**63]),
])
def test_seed_syntax(values, seeds):
    assert batch.parse_seeds(values) == seeds


@pytest.mark.parametrize("value,needle", [
    ("1-x", "give a seed"),
    ("1,,2", "give a seed"),
    ("", "give a seed"),
    ("1.5", "give a seed"),
    ("5-3", "range is empty"),
    ("2,1-3", "2 is given twice"),
    (str(2**64), "out of the range"),
    (f"0-{2**64}", "out of the range"),
    (f"1-{batch.MAX_PICTURES + 1}", f"more than {batch.MAX_PICTURES}"),
])
def test_bad_seeds_are_one_line(value, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        batch.parse_seeds([value])


@pytest.mark.parametrize("args,needle", [
    (["--seed", "1-x"], "give a seed (42), a list (1,2,3) or a range (10-13)"),
    (["--seed", "4-2"], "range is empty"),
    (["--seed", "1,2", "--picture", "{out}/same.png"], "need a placeholder"),
    (["--seed", "1,2", "--picture", "{out}/p{index}.png"], "seed 1 and seed 2 would both be"),
    (["--seed", "1,2", "--picture", "{out}/p{prompt}.png"], "unknown placeholder {prompt}"),
    (["--seed", "1,2", "--picture", "{out}/p{seed.png"], "literal braces"),
    (["--seed", "1,2", "--picture", "-"], "stdout takes one picture"),
    (["--prompt-file", "{out}/none.txt"], "no such file"),
    (["--prompt-file", "{out}/blank.txt"], "no prompts"),
    (["--prompt-file", "{out}/twice.txt", "--picture", "{out}/p{seed}.png"],
     "prompt 1, seed 1 and prompt 2, line 3, seed 1 would both be"),
    (["--prompt-file", "{out}/twice.txt", "--prompt", "p"], "give one of them"),
])
def test_bad_batches_fail_before_any_work(tmp_path, args, needle):
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "twice.txt").write_text("one\n\ntwo\n")
    args = [a.replace("{out}", str(tmp_path)) for a in args]
    if "--picture" not in args:
        args += ["--picture", f"{tmp_path}/p-{{index}}-{{seed}}.png"]
    if "--seed" not in args:
        args += ["--seed", "1"]
    if "--prompt-file" not in args and "--prompt" not in args:
        args += ["--prompt", "p"]
    r = run("moss-image", *FAST, *args)
    assert needle in _single_error(r, 2 if needle == "give one of them" else 1)      # conflicting options: usage
    assert "loading" not in r.stderr and "moss-image: model" not in r.stderr      # no work began
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*"))


def test_plain_progress_lines_carry_step_sigma_elapsed_and_eta(tmp_path):
    r = run("moss-image", "--prompt", "p", "--seed", "1,2", *FAST, "--picture", tmp_path / "p{seed}.png")
    assert r.code == 0, r.stderr
    assert "\x1b" not in r.stderr                                # not a terminal: no cursor moves, no colour
    steps = [line for line in r.stderr.splitlines() if " step " in line]
    pattern = (r"moss-image: picture [12]/2 \(seed [12]\): "
               r"step \d/3  sigma \d\.\d{4} -> \d\.\d{4}  elapsed \S+s  ETA \S+s")
    assert steps and all(re.fullmatch(pattern, line) for line in steps), steps
    assert sum("step 3/3" in line for line in steps) == 2      # the last step of each picture always prints


def test_quiet_prints_nothing(tmp_path):
    r = run("moss-image", "--prompt", "p", "--seed", "1-2", *FAST, "--picture", tmp_path / "p{seed}.png", "--quiet")
    assert r.code == 0 and r.stderr == "" and r.stdout == b""
    assert len(list(tmp_path.glob("p*.png"))) == 2


def test_progress_on_a_terminal_is_one_bar_line_redrawn(tmp_path):
    import pty
    import subprocess
    primary, secondary = pty.openpty()
    p = subprocess.Popen([str(BIN / "moss-image"), "--prompt", "p", "--seed", "3", *FAST, "--picture",
                          str(tmp_path / "p.png")], stderr=secondary, stdout=subprocess.DEVNULL,
                         env=dict(os.environ, COLUMNS="100", TERM="xterm"))
    os.close(secondary)
    out = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:      # the pty closes when the process ends
            break
        if not chunk:
            break
        out += chunk
    os.close(primary)
    assert p.wait(timeout=120) == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode())           # colours off, cursor moves kept
    bars = [line for line in text.split("\r\n") if " step " in line]
    assert len(bars) == 3
    assert all(line.startswith("\x1b[1A\x1b[2K") for line in bars[1:])   # each step redraws the line above
    assert re.search(r"━+ step 3/3 sigma 0\.0000 elapsed \S+s ETA \S+s$", bars[-1]), bars[-1]


def test_progress_eta_counts_the_steps_after_the_first(monkeypatch):
    from moss_cli import progress as progress_module
    clock = [1000.0]                         # a fake clock: the times shown do not depend on the machine's load
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock[0])
    progress = Progress(False, "moss")
    progress.console.file = io.StringIO()
    progress.console.width = 200
    clock[0] += 100.0                        # the first step also carried 100 s of setup
    progress.step(0, 4, 1.0, 0.75)
    clock[0] += 10.0                         # then one step took 10 s
    progress.step(1, 4, 0.75, 0.5)
    lines = progress.console.file.getvalue().splitlines()
    assert re.search(r"step 1/4  sigma 1\.0000 -> 0\.7500  elapsed 1m40s  ETA 5m00s$", lines[0]), lines
    assert re.search(r"step 2/4  sigma 0\.7500 -> 0\.5000  elapsed 1m50s  ETA 20\.0s$", lines[1]), lines


def test_pngs_are_written_behind_the_next_picture_in_order_and_a_failed_write_raises(monkeypatch):
    """batch.run writes each PNG in a second thread while the next picture is made: the pictures are announced
    in order, each once its file is written, and a write that fails raises before the run goes on."""
    import threading
    made, written = [], []

    def fake_made(pictures, *args):
        for p in pictures:
            made.append(p)
            yield p, "", None, {}

    def fake_write(path, pixels, text):
        assert threading.current_thread() is not threading.main_thread()
        if path == "bad":
            raise UsageError("bad: cannot write")
        written.append(path)

    monkeypatch.setattr(batch, "_made", fake_made)
    monkeypatch.setattr(batch, "_write_png", fake_write)

    class Pic:
        def __init__(self, path):
            self.path = path

    out = []

    def announce(picture, note):
        assert picture.path in written            # announced once its file is written
        out.append(picture.path)

    batch.run([Pic(n) for n in ("a", "b", "c")], None, None, None, None, None, None, announce)
    assert out == ["a", "b", "c"] == written
    made.clear()
    out.clear()
    with pytest.raises(UsageError, match="bad: cannot write"):
        batch.run([Pic("a"), Pic("bad"), Pic("c"), Pic("d")], None, None, None, None, None, None, announce)
    assert out == ["a"]
    assert [p.path for p in made] == ["a", "bad", "c"]   # the picture after the failed one was made, no more


def test_each_png_is_announced_when_written_not_a_picture_later(monkeypatch):
    """Picture 1's line comes while picture 2 is made (as soon as its file is written), and after a Ctrl-C
    during picture 2 picture 1, written, has been announced."""
    import threading
    announced, seen_during_2 = [], []
    first_written = threading.Event()

    def fake_made(pictures, *args):
        yield pictures[0], "", None, {}
        assert first_written.wait(60)          # picture 2 is being made: picture 1's write ends meanwhile
        seen_during_2.extend(announced)
        yield pictures[1], "", None, {}
        raise KeyboardInterrupt                # Ctrl-C while picture 3 is made

    def fake_write(path, pixels, text):
        pass

    def announce(picture, note):
        announced.append(picture)
        if picture == "pic-1.png":
            first_written.set()

    class Pic(str):
        @property
        def path(self):
            return str(self)

    monkeypatch.setattr(batch, "_made", fake_made)
    monkeypatch.setattr(batch, "_write_png", fake_write)
    with pytest.raises(KeyboardInterrupt):
        batch.run([Pic("pic-1.png"), Pic("pic-2.png"), Pic("pic-3.png")], None, None, None, None, None, None,
                  announce)
    assert seen_during_2 == ["pic-1.png"]
    assert announced == ["pic-1.png", "pic-2.png"]     # picture 2's write, started before the Ctrl-C, ends too


def test_a_noise_drawn_ahead_is_taken_only_by_its_own_picture_and_is_the_same_draw(monkeypatch):
    """Model.draw_noise_ahead draws on a host thread; Model.noise takes that draw only for the same shape,
    seed and kernel, and otherwise draws now. The bits are noise.randn's either way."""
    import threading

    from moss_cli import noise, stages
    from moss_cli.checkpoint import open_checkpoint
    real, where = noise.randn, []

    def spy(shape, seed, kernel="avx2"):
        where.append((seed, threading.current_thread() is threading.main_thread()))
        return real(shape, seed, kernel=kernel)

    monkeypatch.setattr(noise, "randn", spy)
    model, shape = stages.Model(open_checkpoint()), (1, 128, 3, 4)
    model.draw_noise_ahead(shape, 11, "avx2")
    assert model.noise(shape, 11, "avx2").tobytes() == real(shape, 11).tobytes()
    assert where == [(11, False)]
    for asked in ((shape, 13, "avx2"), ((1, 128, 4, 3), 12, "avx2"), (shape, 12, "generic")):
        where.clear()
        model.draw_noise_ahead(shape, 12, "avx2")
        ahead = model._ahead[1]
        assert model.noise(*asked).tobytes() == real(*asked[:2], kernel=asked[2]).tobytes()
        ahead.result()
        assert sorted(where) == sorted([(12, False), (asked[1], True)])
    where.clear()
    model.draw_noise_ahead(shape, 12, "avx2")
    ahead = model._ahead[1]
    model.noise(shape, 13, "avx2")
    model.noise(shape, 12, "avx2")               # the draw ahead went to the picture before: drawn now
    ahead.result()
    assert sorted(where) == [(12, False), (12, True), (13, True)]


def test_each_picture_takes_the_noise_drawn_ahead_of_it(tmp_path, monkeypatch):
    from moss_cli import stages
    from moss_cli.checkpoint import open_checkpoint
    from moss_cli.progress import Silent
    model, taken, real = stages.Model(open_checkpoint()), [], stages.Model.noise

    def spy(self, shape, seed, kernel):
        taken.append((seed, self._ahead[0][1] if self._ahead else None))
        return real(self, shape, seed, kernel)

    monkeypatch.setattr(stages.Model, "noise", spy)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\na blue fox\n")
    pictures = batch.plan(None, str(prompts), ["7,11"], str(tmp_path / "f-{index}-{seed}.png"))
    options = stages.SamplingOptions(seed=0, width=32, height=32, steps=1)
    done = []
    batch.run(pictures, options, stages.DEFAULT_NEGATIVE, lambda stage: model, model.fingerprint, None, Silent(),
              lambda picture, note: done.append(picture))
    assert len(done) == 4
    assert taken == [(7, 7), (11, 11), (7, 7), (11, 11)]      # the first drawn before the first encode


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_on_the_gpu_every_component_is_made_before_the_first_encode(tmp_path, monkeypatch, device):
    """With `--device cuda`, moss-image makes the encoder, the transformer and the decoder in that order before
    it encodes the first prompt (their loads hand their weights to the uploader's thread, so the transformer's
    copies overlap the first encode); on the CPU each is made when its stage first needs it (the control: the
    same run with the device named cpu has made none but the encoder when it encodes)."""
    from moss_cli import stages
    from moss_cli.checkpoint import open_checkpoint
    from moss_cli.progress import Silent
    cpu, made = stages.Model(open_checkpoint()), []

    class Named:
        """The CPU model under another device name, noting each component's first use."""
        def __init__(self):
            self.device = device

        def __getattr__(self, name):
            if name in ("encoder", "transformer", "decoder") and name not in made:
                made.append(name)
            return getattr(cpu, name)

    class Encoding(Exception):
        pass

    def encode(model, *args, **kwargs):
        model.encoder
        raise Encoding(list(made))

    monkeypatch.setattr(stages, "encode", encode)
    pictures = batch.plan("a red fox", None, ["7"], str(tmp_path / "f.png"))
    options = stages.SamplingOptions(seed=0, width=32, height=32, steps=1)
    model = Named()
    with pytest.raises(Encoding) as at_encode:
        batch.run(pictures, options, stages.DEFAULT_NEGATIVE, lambda stage: model, cpu.fingerprint, None,
                  Silent(), lambda picture, note: None)
    assert at_encode.value.args[0] == (["encoder", "transformer", "decoder"] if device == "cuda" else ["encoder"])

"""Progress and notes on stderr (rich); nothing but artifacts ever goes to stdout."""

import time

from rich.console import Console
from rich.console import RenderHook
from rich.control import Control, ControlType
from rich.text import Text


class Progress:
    _picture = None       # 'picture 2/4 (...)' while a batch makes several
    _first_step = None    # when the first step of the current denoising ended, and its index
    _first_index = 0
    _last_line = 0.0      # when the last plain step line was printed
    _bar_hook = None

    def __init__(self, quiet=False, prog="moss"):
        self.quiet = quiet
        self.prog = prog
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self._t0 = time.perf_counter()

    def note(self, message):
        """MESSAGE is printed literally: paths and prompts may hold rich markup or :emoji: codes."""
        if not self.quiet:
            self.console.print(Text.assemble((f"{self.prog}:", "dim"), " ", str(message)))

    def warn(self, message):
        """Warnings show even with --quiet."""
        self.console.print(Text(f"{self.prog}: warning: {message}", style="yellow"))

    def start_clock(self):
        """Step times count from here (e.g. once the input is read, not while waiting on stdin)."""
        self._t0 = time.perf_counter()

    def picture(self, number, total, label=""):
        """The steps that follow make picture NUMBER of TOTAL (LABEL says which); its clock starts now."""
        self._picture = f"picture {number}/{total}" + (f" ({label})" if label else "")
        self.start_clock()

    def step(self, index, total, sigma, sigma_next):
        """Denoising step INDEX (from 0) of TOTAL has run, from SIGMA to SIGMA_NEXT.

        On a terminal: one bar line, redrawn in place, with the step, sigma, elapsed time and ETA.
        Elsewhere (pipes, logs): plain lines with the same fields, at the first and last step and at most
        one every PLAIN_EVERY_S seconds between. The ETA is the mean time of the steps after the first
        (the first one also carries setup, e.g. loading the transformer) times the steps left.
        """
        if self.quiet:
            return
        now = time.perf_counter()
        done = index + 1
        if index == 0 or self._first_step is None:
            self._first_step, self._first_index = now, index
        elapsed = now - self._t0
        if index > self._first_index:
            per_step = (now - self._first_step) / (index - self._first_index)
        else:
            per_step = elapsed / done
        eta = per_step * (total - done)
        if _is_terminal(self.console):
            self._bar(done, total, sigma_next, elapsed, eta)
        elif index == 0 or done == total or now - self._last_line >= PLAIN_EVERY_S:
            self._last_line = now
            self.console.print(Text.assemble(
                (f"{self.prog}:", "dim"), " ", f"{self._picture}: " if self._picture else "",
                f"step {done}/{total}  sigma {sigma:.4f} -> {sigma_next:.4f}  elapsed {_duration(elapsed)}  "
                f"ETA {_duration(eta)}"))
        if done == total:
            self._first_step = None

    def _bar(self, done, total, sigma, elapsed, eta):
        """Redraw the bar line (the previous one is erased unless something was printed since), one line
        at any width: the bar shrinks first, then the picture's label, then the line is cut."""
        if self._bar_hook is None:
            self._bar_hook = _Printed()
            self.console.push_render_hook(self._bar_hook)
        if self._bar_hook.bar_last and done > 1:
            self.console.control(Control((ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2)))
        width = max(self.console.width - 1, 1)
        tail = f" step {done}/{total} sigma {sigma:.4f} elapsed {_duration(elapsed)} ETA {_duration(eta)}"
        head = f"{self.prog}: " + (f"{self._picture}: " if self._picture else "")
        if self._picture and len(head) + BAR_MIN + len(tail) > width:
            head = f"{self.prog}: {self._picture.split(' (')[0]}: "
        bar = min(BAR_WIDTH, max(BAR_MIN, width - len(head) - len(tail)))
        filled = round(bar * done / total)
        line = Text.assemble((head, "dim"), ("━" * filled, "green" if done == total else "bar.complete"),
                             ("━" * (bar - filled), "bar.back"), tail)
        line.truncate(width, overflow="ellipsis")
        self.console.print(line, soft_wrap=False, no_wrap=True, overflow="ellipsis")
        self._bar_hook.bar_last = done < total


PLAIN_EVERY_S = 1.0   # the least time between two plain step lines (the first and last steps always print)
BAR_WIDTH = 30        # the bar's most and fewest cells
BAR_MIN = 8


class _Printed(RenderHook):
    """Watches the console: `bar_last` is cleared when anything is printed after the bar line."""

    def __init__(self):
        self.bar_last = False

    def process_renderables(self, renderables):
        self.bar_last = False
        return renderables


def _is_terminal(console):
    """A terminal that takes cursor moves (stderr a tty, TERM not dumb)."""
    try:
        return console.file.isatty() and not console.is_dumb_terminal
    except (AttributeError, ValueError):
        return False


def _duration(seconds):
    """12.3s, 4m05s, 2h07m."""
    if seconds < 59.95:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


class Silent(Progress):
    def __init__(self):
        super().__init__(quiet=True)

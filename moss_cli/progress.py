"""Progress and notes on stderr (rich); nothing but artifacts ever goes to stdout."""

import time

from rich.console import Console
from rich.text import Text


class Progress:
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

    def step(self, index, total, sigma, sigma_next):
        if not self.quiet:
            elapsed = time.perf_counter() - self._t0
            self.console.print(
                f"[dim]{self.prog}:[/dim] step {index + 1}/{total}  sigma {sigma:.4f} -> {sigma_next:.4f}"
                f"  [dim]{elapsed:.1f}s[/dim]", markup=True)


class Silent(Progress):
    def __init__(self):
        super().__init__(quiet=True)

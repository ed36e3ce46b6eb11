"""Progress and notes on stderr (rich); nothing but artifacts ever goes to stdout."""

import time

from rich.console import Console


class Progress:
    def __init__(self, quiet=False, prog="moss"):
        self.quiet = quiet
        self.prog = prog
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self._t0 = time.perf_counter()

    def note(self, message):
        if not self.quiet:
            self.console.print(f"[dim]{self.prog}:[/dim] {message}", markup=True)

    def warn(self, message):
        """Warnings show even with --quiet."""
        self.console.print(f"{self.prog}: warning: {message}", markup=False, style="yellow")

    def step(self, index, total, sigma, sigma_next):
        if not self.quiet:
            elapsed = time.perf_counter() - self._t0
            self.console.print(
                f"[dim]{self.prog}:[/dim] step {index + 1}/{total}  sigma {sigma:.4f} -> {sigma_next:.4f}"
                f"  [dim]{elapsed:.1f}s[/dim]", markup=True)


class Silent(Progress):
    def __init__(self):
        super().__init__(quiet=True)

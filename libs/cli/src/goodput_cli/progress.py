"""What `goodput up` shows while the services start: a live table on a terminal, one line per change elsewhere."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from goodput_cli.procs import Proc

__all__ = ["Progress"]


class Progress:
    """A live status table on a terminal; one line per state change elsewhere; nothing without a console."""

    def __init__(self, console: Console | None, procs: list[Proc]) -> None:
        self.console = console
        self.procs = procs
        self.live: Live | None = None
        self.seen: dict[str, str] = {}
        if console is not None and console.is_terminal:
            self.live = Live(self._table(), console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> Progress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.update(self._table())
            self.live.__exit__(*exc)

    def _table(self) -> Table:
        table = Table(box=None, show_header=False, pad_edge=False)
        now = time.monotonic()
        for p in self.procs:
            style = "green" if p.state == "serving" else "red" if p.state.startswith("exited") else "yellow"
            table.add_row(p.spec.name, str(p.spec.grpc_addr), f"[{style}]{p.state}[/]",
                          f"{now - p.started_at:5.0f} s", str(p.spec.log_path))
        return table

    def update(self) -> None:
        if self.live is not None:
            self.live.update(self._table())
        elif self.console is not None:
            for p in self.procs:
                if self.seen.get(p.spec.name) != p.state:
                    self.seen[p.spec.name] = p.state
                    self.console.print(f"{p.spec.name} ({p.spec.grpc_addr}): {p.state}", markup=False,
                                       highlight=False)

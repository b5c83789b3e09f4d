"""What the chaos tests measure, and how they show it: each figure as a ``FIGURE`` line in
the test's output and a property in its JUnit record; times read back from llmgw's logs."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path


def figure(record_property, name: str, value: float | int | str, unit: str = "") -> None:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    record_property(name, text)
    print(f"FIGURE {name} = {text}{' ' + unit if unit else ''}")


def timed_lines(log: Path, *words: str) -> list[tuple[float, str]]:
    """(Unix time, line) of every line of an llmgw log holding each of ``words``, read from
    the timestamp that opens it (``2026-12-04 14:17:53,693 INFO ...``)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if all(w in line for w in words):
            with_ms = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            found.append((with_ms.timestamp(), line))
    return found

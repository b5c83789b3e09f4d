"""engine-check: does the engine still have every flag llmgw launches it with?

Engines rename flags between versions, and the failure then shows up minutes into a model
load, on a node nobody is watching. This renders the widest commands llmgw could produce
for an engine and looks for each flag in the engine's own ``--help``, on a word boundary
(``--port`` is not satisfied by ``--port-range``). Pure: running the help is the caller's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType

from llmgw.engines.base import NodeFacts

_NUMBER = re.compile(r"^-\d")


@dataclass(frozen=True, slots=True)
class HelpCheck:
    """One program to ask for help, and the flags llmgw passes it."""

    help_argv: tuple[str, ...]
    flags: tuple[str, ...]
    min_lines: int = 0  # a full help text is at least this long


@dataclass(frozen=True, slots=True)
class Verdict:
    help_argv: tuple[str, ...]
    present: tuple[str, ...]
    missing: tuple[str, ...]
    warnings: tuple[str, ...] = field(default=())


def flags_of(argv: tuple[str, ...], skip: int) -> tuple[str, ...]:
    """The flags in ``argv`` after the ``skip`` tokens that name the program."""
    seen: dict[str, None] = {}
    for token in argv[skip:]:
        if token.startswith("-") and not _NUMBER.match(token) and token != "-":
            seen.setdefault(token.split("=", 1)[0], None)
    return tuple(seen)


def plan(adapter: ModuleType, node: NodeFacts) -> list[HelpCheck]:
    """Render every widest shape and group the flags by the program that takes them."""
    groups: dict[tuple[str, ...], dict[str, None]] = {}
    min_lines: dict[tuple[str, ...], int] = {}
    for request in adapter.widest():
        launch = adapter.render(request, node)
        help_argv, skip, min_lines[help_argv] = adapter.help_argv(launch.argv)
        flags = groups.setdefault(help_argv, {})
        for flag in flags_of(launch.argv, skip):
            flags.setdefault(flag, None)
    return [HelpCheck(argv, tuple(flags), min_lines[argv]) for argv, flags in groups.items()]


def has_flag(flag: str, help_text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def judge(check: HelpCheck, help_text: str) -> Verdict:
    present = tuple(f for f in check.flags if has_flag(f, help_text))
    missing = tuple(f for f in check.flags if f not in present)
    warnings = []
    lines = help_text.count("\n")
    if lines < check.min_lines:
        warnings.append(
            f"the help text has {lines} lines where a full one has at least "
            f"{check.min_lines}: it "
            "looks cut off, so flags reported missing may only be missing from the text"
        )
    elif help_text and not help_text.endswith("\n"):
        warnings.append("the help text ends mid-line: it may be cut off")
    return Verdict(check.help_argv, present, missing, tuple(warnings))

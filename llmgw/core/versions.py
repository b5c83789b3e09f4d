"""How far a node's llmgw is behind the control plane's, in releases.

A release is a minor version (0.4 → 0.5); patch releases of one minor are one release.
Versions are PEP 440-shaped as the package reports them (``0.5.1``, ``0.6.0rc1``,
``0.0.0+unknown`` from a source tree); anything without a numeric major.minor cannot be
compared and is None.
"""

from __future__ import annotations

import re

_RELEASE = re.compile(r"(\d+)\.(\d+)")


def release_of(version: str) -> tuple[int, int] | None:
    match = _RELEASE.match(version)
    return (int(match[1]), int(match[2])) if match else None


def releases_behind(control_plane: str, node: str) -> int | None:
    """How many releases ``node`` is behind ``control_plane`` (0 when level or ahead); a
    major version behind counts as more than any minor gap. None when either version
    cannot be read, or comes from a source tree (``+unknown``)."""
    if control_plane.endswith("+unknown") or node.endswith("+unknown"):
        return None
    ours, theirs = release_of(control_plane), release_of(node)
    if ours is None or theirs is None:
        return None
    if theirs[0] < ours[0]:
        return 1000 * (ours[0] - theirs[0])
    if theirs[0] > ours[0]:
        return 0
    return max(0, ours[1] - theirs[1])


def behind_words(control_plane: str, node: str) -> str | None:
    """Words for a node whose llmgw is more than one release behind the control plane's;
    None otherwise."""
    behind = releases_behind(control_plane, node) if node else None
    if behind is None or behind <= 1:
        return None
    return (f"llmgw {node} is more than one release behind the control plane's "
            f"{control_plane}: upgrade the node (docs/operations.md, Upgrading)")


_NUMBERS = re.compile(r"\d+(?:\.\d+)*")


def newer(version: str, than: str) -> bool | None:
    """Whether ``version`` is a later release than ``than`` by its numbers (``0.10.1`` >
    ``0.9.3``); None when either has none to compare, or their numbers are equal but the
    versions differ (``0.5.0rc1`` and ``0.5.0``: no order is guessed)."""
    a, b = _NUMBERS.match(version), _NUMBERS.match(than)
    if a is None or b is None:
        return None
    ours = [int(n) for n in a[0].split(".")]
    theirs = [int(n) for n in b[0].split(".")]
    width = max(len(ours), len(theirs))
    ours += [0] * (width - len(ours))
    theirs += [0] * (width - len(theirs))
    if ours == theirs:
        return False if version == than else None
    return ours > theirs

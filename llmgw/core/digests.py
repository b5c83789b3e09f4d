"""Publishers' lists of sha256 digests, as the agent and `llmgw bundle create` read them."""

from __future__ import annotations

import json


def parse_digests(text: str, asset: str) -> str | None:
    """The sha256 of ``asset`` from a SHA256SUMS file ("<hex>  <name>", the name maybe
    marked binary with ``*``) or from GitHub's release JSON (``assets[].digest``)."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            release = json.loads(stripped)
        except ValueError:
            return None
        for entry in release.get("assets", []) if isinstance(release, dict) else []:
            if not isinstance(entry, dict):
                continue
            digest = str(entry.get("digest") or "")
            if entry.get("name") == asset and digest.startswith("sha256:"):
                return digest.removeprefix("sha256:").lower()
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*").removeprefix("./") == asset:
            return parts[0].lower()
    return None

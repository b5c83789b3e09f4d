"""The usage page(s)."""

from __future__ import annotations

ROUTES: list = []

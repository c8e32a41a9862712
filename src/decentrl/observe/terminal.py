"""Text that other peers chose (names, error details), made safe to print on a terminal: without
control characters a terminal would obey (escape sequences, carriage returns) and without rich
markup the console would render, and cut to a length that cannot flood a line."""

from __future__ import annotations

import unicodedata

from rich.markup import escape

TERMINAL_CHARS = 64


def terminal_text(text: str, limit: int = TERMINAL_CHARS) -> str:
    """`text` with control and format characters replaced by "?", cut to `limit` characters,
    with rich markup escaped."""
    visible = "".join("?" if unicodedata.category(c).startswith("C") else c for c in text)
    if len(visible) > limit:
        visible = visible[:limit - 1] + "…"
    return escape(visible)

"""Text that other peers chose (names, error details), made safe to print on a rich console:
inert and bounded (net/text.py: no control character a terminal would obey, cut to a length
with a marker) and with rich markup escaped, so that a name like "[bold red]" prints as itself."""

from __future__ import annotations

from rich.markup import escape

from decentrl.net.text import peer_text

# A peer's name in a table cell or a status line.
TERMINAL_CHARS = 64


def terminal_text(text: object, limit: int = TERMINAL_CHARS, *, multiline: bool = False) -> str:
    """`text` as peer_text shows it (control characters escaped, at most `limit` characters and
    a marker), with rich markup escaped. `multiline` keeps newlines."""
    return escape(peer_text(text, limit, multiline=multiline))

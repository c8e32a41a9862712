"""Figures and untrusted text as Markdown for the run report (observe/report.py) and the model
card (release/card.py): inert text, tables, byte units, durations."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from decentrl.net.text import peer_text

DETAIL_CHARS = 160
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
# CommonMark lets a backslash escape any of these; together they rule out tables broken by `|`,
# links, emphasis, code spans, raw HTML and (on GitHub) math.
MARKDOWN_SPECIALS = set("\\`*_[]<>|~&#!$")


def markdown_text(text: str, limit: int = DETAIL_CHARS) -> str:
    """Untrusted text as one line of inert Markdown: whitespace runs as one space, other control
    characters escaped and the text cut as net/text.py does (at most `limit` characters and a
    marker, before the Markdown escapes, so that none is cut in half)."""
    inert = peer_text(" ".join(text.split()), limit)
    return "".join(f"\\{c}" if c in MARKDOWN_SPECIALS else c for c in inert)


def byte_unit(count: float) -> tuple[int, str]:
    """(bytes per unit, its name): the largest binary unit not above `count`."""
    power = 0
    while power < len(BYTE_UNITS) - 1 and abs(count) >= 1024 ** (power + 1):
        power += 1
    return 1024 ** power, BYTE_UNITS[power]


def human_bytes(count: float) -> str:
    scale, unit = byte_unit(count)
    return f"{count:.0f} B" if scale == 1 else f"{count / scale:.1f} {unit}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def peer_name(name: str, peer_id: str) -> str:
    return name or peer_id[-8:]


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def duration(seconds: float) -> str:
    # A short run's seconds would all round to "0.0 min".
    return f"{seconds:.1f} s" if seconds < 120 else minutes(seconds)


def number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def image(path: Path, alt: str) -> str:
    return f"![{alt}]({path.name})"

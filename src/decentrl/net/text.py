"""Text that other peers chose (a name in an announcement, the error string of a refusal, a
verification detail) made inert and bounded before this process keeps, logs or shows it.

Inert: every control and format character (escape sequences, carriage returns, newlines, bidi
overrides, line separators) is written as its Python escape, so a log line stays one line and a
terminal obeys nothing in it. Bounded: the text is cut to a length, with a marker saying how much
was cut, so a peer can neither flood a log nor fill memory with one string. Each surface adds its
own escaping on top (rich markup: observe/terminal.py, Markdown: observe/markdown.py)."""

from __future__ import annotations

import unicodedata

# A name, a reason or an error a person reads in one line of a log.
PEER_TEXT_CHARS = 200
# An id a peer chose (a group id, a session id), named in a message or a log line.
SHOWN_ID_CHARS = 64
# The error string of a peer's refusal (net/streams.py): our own handlers' reasons take a line or
# two, a peer's own may be anything.
REMOTE_ERROR_CHARS = 500
# Unicode categories a display acts on rather than shows: controls, formats (bidi overrides),
# surrogates, private-use and unassigned code points, and the line and paragraph separators.
_ACTIVE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _shown(char: str, multiline: bool) -> str:
    if (multiline and char == "\n") or unicodedata.category(char) not in _ACTIVE_CATEGORIES:
        return char
    return char.encode("unicode_escape").decode("ascii")


def peer_text(text: object, limit: int = PEER_TEXT_CHARS, *, multiline: bool = False) -> str:
    """`str(text)` with every control and format character escaped ("\\x1b", "\\n",
    "\\u202e"), at most `limit` characters of it, then "…(+N chars)" where N characters of
    `text` were cut. `multiline` keeps newlines as they are (a message of several lines)."""
    if limit < 1:
        raise ValueError(f"a peer text limit must be at least 1 character, got {limit}")
    raw = str(text)
    parts: list[str] = []
    length = 0
    for consumed, char in enumerate(raw):
        shown = _shown(char, multiline)
        if length + len(shown) > limit:
            return "".join(parts) + f"…(+{len(raw) - consumed} chars)"
        parts.append(shown)
        length += len(shown)
    return "".join(parts)

"""Text that people and other systems typed, on its way in and on its way out to a terminal.

In: an operator's reason is a line or a short paragraph. A browser's textarea sends its line
breaks as CRLF, so CRLF (and a lone CR) becomes LF; TAB and LF are the only control characters a
reason keeps. Every other one — the C0 controls (ESC starts the sequences that repaint a
terminal, BEL rings it, BS overwrites), DEL and the C1 controls (U+0080–U+009F, of which U+009B
is an 8-bit CSI) — is refused (``control_character``).

Out: what the management commands print of stored text (reasons, actors, errors, workflow ids,
a receiver's words) goes through ``printable``, which shows those characters as visible escapes
(``\\x1b``) instead of letting a terminal act on them; rows stored before the check, and text
the check does not cover (an error a receiver sent back), are printed harmlessly too. So are the
bidirectional overrides and isolates (U+202A–U+202E, U+2066–U+2069), which reorder what a line
appears to say. JSON output needs nothing: ``json.dumps`` escapes every one of them.
"""

from __future__ import annotations

import re

# Refused in a reason: C0 but TAB and LF, DEL, C1 (CR is turned into LF first).
_REFUSED = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Escaped on output: the same, plus CR, the bidirectional controls, and LF unless kept.
_ESCAPED = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_ESCAPED_KEEPING_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def normalize_newlines(text: str) -> str:
    """CRLF and lone CR as LF: what a textarea sent, as one line break each."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def control_character(text: str) -> str | None:
    """The first control character ``text`` may not hold (TAB and LF are allowed), or None."""
    found = _REFUSED.search(text)
    return found.group() if found else None


def codepoint(char: str) -> str:
    """``U+001B``: how a message names a character that cannot be shown."""
    return f"U+{ord(char):04X}"


def printable(value: object, *, multiline: bool = False) -> str:
    """``value`` as text a terminal shows and does not act on: control characters (and LF,
    unless ``multiline``) as ``\\xNN``/``\\n``/``\\r``, bidirectional controls as ``\\uNNNN``.
    TAB is kept. Backslashes are left as they are: the escapes are for a reader, not a parser."""
    text = value if isinstance(value, str) else str(value)
    pattern = _ESCAPED_KEEPING_LINES if multiline else _ESCAPED
    return pattern.sub(_escape, text)


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"

"""Text a client chose, made safe for a log line."""

from __future__ import annotations

#: the most characters of one client-chosen value a log line shows
LOGGED_CHARS = 256


def loggable(text: object) -> str:
    """``text`` with its control and non-ASCII characters escaped (``\\n``, ``\\x1b``, ``\\u2028``)
    and cut at :data:`LOGGED_CHARS`: a request id with a newline cannot forge a second log line,
    nor an escape sequence rewrite a terminal."""
    value = str(text)
    escaped = value[:LOGGED_CHARS].encode("ascii", "backslashreplace").decode("ascii")
    escaped = "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" for c in escaped)
    return escaped + ("..." if len(value) > LOGGED_CHARS else "")

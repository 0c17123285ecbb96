"""Text from peers made safe to print on an operator's terminal.

SGLang answers, journal lines, remote hosts' output and unit names or properties read from
systemd reach `watchdog check` and `watchdog incidents` output. A terminal obeys the control
characters in them: an OSC sequence retitles the window or writes to the clipboard, CSI clears
the screen or hides what follows, a bare carriage return overwrites a line, a bidi override
reorders it. `printable` shows each such character as an escape (`\\x1b`, `\\u202e`) instead, so
the text stays readable evidence and the terminal only ever sees printable characters, newlines
and tabs.
"""

from __future__ import annotations

# C0 except newline and tab, DEL, C1 (0x9b is CSI on its own), and the bidi embeddings,
# overrides and isolates.
_UNSAFE = (
    [c for c in range(0x20) if chr(c) not in "\n\t"]
    + [0x7F, *range(0x80, 0xA0)]
    + [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}


def printable(text: str) -> str:
    """`text` with every terminal control character shown as an escape (newlines and tabs kept)."""
    return text.translate(_ESCAPES)


__all__ = ["printable"]

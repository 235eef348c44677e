"""Tables that fit the terminal: ``hetpilot jobs`` and ``hetpilot nodes``.

Why not rich's own fitting: given too little width, rich wraps or squeezes
every column, so a number can be split over two lines ("0.41" above "23") or
cut ("0.4…"), and an operator reads a wrong value. Here each column says how
much it matters (``priority``) and whether it is free text that may be cut
with an ellipsis (``shrink``: names, never numbers); columns that do not fit
are left out, lowest priority first, and the caption says which. Each kept
column gets a fixed width, so rich has nothing left to squeeze.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Column", "fit", "print_table", "safe", "terminal_width"]

_MIN_SHRUNK = 6
"""A free-text column is cut to no fewer characters than this (or its header)."""
_WANTED = 24
"""Characters of free text a column is given before lower-priority columns come in."""


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]")
"""Characters a terminal acts on, or that reorder or hide text: C0, DEL, C1, bidi."""


def safe(value: str) -> str:
    """``text`` to print on a terminal: each control character written as Python does
    (``\\x1b``, ``\\n``, ``\\u202e``). For every value another user, a job's code or an agent
    chose (names, reasons, warnings, hosts): ``\\x1b[2J`` would clear the screen."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], value)


def text(value: str) -> Any:
    """A table cell: ``safe``, and plain text (rich would read ``[link=...]`` as markup)."""
    from rich.text import Text

    return Text(safe(value))


@dataclass(frozen=True)
class Column:
    header: str
    priority: int = 50
    """Higher stays longer when the terminal is narrow."""
    shrink: bool = False
    """Free text that may be cut with an ellipsis; numbers never are."""
    justify: Literal["left", "right"] = "left"


def terminal_width() -> int:
    """$COLUMNS, else the terminal's width, else 80 (piped output)."""
    return shutil.get_terminal_size().columns


def _overhead(n: int) -> int:
    """Characters rich's default box takes around ``n`` columns: an edge or separator
    before each and one after the last, one space of padding on each side."""
    return 3 * n + 1


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int
        ) -> tuple[list[int], list[int]]:
    """(indices of the columns kept, in order, and their widths) for a table at most
    ``width`` characters wide where it can be. Columns are taken highest priority first
    while they fit, free text counted at up to ``_WANTED`` characters (so a long name
    does not crowd out the numbers) and numbers at their full width; a column that does
    not fit is left out and smaller, lower ones may still come in. What is left over goes
    to the cut free text, highest priority first."""
    natural = [max([len(c.header), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    least = [min(natural[i], max(_MIN_SHRUNK, len(c.header))) if c.shrink else natural[i]
             for i, c in enumerate(columns)]
    wanted = [max(least[i], min(natural[i], _WANTED)) if c.shrink else natural[i]
              for i, c in enumerate(columns)]

    def need(idx: list[int], widths: list[int]) -> int:
        return sum(widths[i] for i in idx) + _overhead(len(idx))

    kept: list[int] = []
    for i in sorted(range(len(columns)), key=lambda i: -columns[i].priority):  # stable
        if not kept or need([*kept, i], wanted) <= width:
            kept.append(i)
    kept.sort()
    widths = {i: wanted[i] for i in kept}
    over = need(kept, wanted) - width
    for i in sorted(kept, key=lambda i: columns[i].priority):  # only when the first is wide
        if over <= 0:
            break
        cut = min(over, widths[i] - least[i])
        widths[i] -= cut
        over -= cut
    spare = width - sum(widths.values()) - _overhead(len(kept))
    for i in sorted(kept, key=lambda i: -columns[i].priority):
        if spare <= 0:
            break
        more = min(spare, natural[i] - widths[i])
        widths[i] += more
        spare -= more
    return kept, [widths[i] for i in kept]


def print_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]],
                width: int | None = None, caption: str = "") -> list[str]:
    """Print the table fitted to ``width`` (default: the terminal's); the headers of the
    columns left out, which the caption names too."""
    from rich.console import Console
    from rich.table import Table

    width = width or terminal_width()
    rows = [[safe(cell) for cell in row] for row in rows]  # measured as they will print
    columns = [Column(safe(c.header), c.priority, c.shrink, c.justify) for c in columns]
    kept, widths = fit(columns, rows, width)
    dropped = [c.header for i, c in enumerate(columns) if i not in kept]
    notes = [caption] if caption else []
    if dropped:
        notes.append(f"left out to fit {width} columns: {', '.join(dropped)} (--json has all)")
    table = Table(title=text(title), caption=text("; ".join(notes)) if notes else None,
                  caption_justify="left")
    for i, w in zip(kept, widths, strict=True):
        col = columns[i]
        table.add_column(text(col.header), width=w, no_wrap=True, justify=col.justify,
                         overflow="ellipsis" if col.shrink else "fold")
    for row in rows:
        table.add_row(*(text(row[i]) for i in kept))
    Console(width=width).print(table)
    return dropped

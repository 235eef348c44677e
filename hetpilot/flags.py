"""argparse ``type=`` functions for the numeric flags of every subcommand.

A bad value (``nan``, ``inf``, a deadline of 0, a negative count, a number past
what the wire carries) is refused while the arguments are parsed: argparse then
exits 2 with one line naming the flag (``argument --timeout: must be a finite
number of seconds > 0, got 'nan'``), before anything runs or calls.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["integer", "number", "seconds"]

INT64_MAX = 2**63 - 1


def integer(low: int = 0, high: int = INT64_MAX) -> Callable[[str], int]:
    """An integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            top = f" and <= {high}" if high < INT64_MAX else ""
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{top}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float = 0.0, *, above: bool = False, high: float = 1e9,
           what: str = "number") -> Callable[[str], float]:
    """A finite number >= ``low`` (> ``low`` with ``above``) and <= ``high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above else value >= low)
                and value <= high):
            raise argparse.ArgumentTypeError(
                f"must be a finite {what} {'>' if above else '>='} {low:g} and <= {high:g}, "
                f"got {text!r}")
        return value

    parse.__name__ = what
    return parse


def seconds(*, zero: bool = False, high: float = 1e9) -> Callable[[str], float]:
    """A finite number of seconds > 0 (>= 0 with ``zero``): a deadline of 0 or nan
    would fail every call with DEADLINE_EXCEEDED, one of inf is not a deadline."""
    return number(0.0, above=not zero, high=high, what="number of seconds")

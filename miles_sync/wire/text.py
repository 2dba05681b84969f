"""Small text helpers shared by error messages across layers: shortened lists, problem lists, enum value lists."""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

__all__ = ["raise_if", "shorten"]


def shorten(items: Iterable[object], *, limit: int, sep: str = ", ") -> str:
    """The first `limit` items joined by `sep`, then "{sep}and N more" when N items were left out.

    shorten(["a", "b", "c"], limit=2) == "a, b, and 1 more"; shorten(problems, limit=8, sep="; ") joins problems
    that contain commas themselves. Items are rendered with str(): pass repr()s to quote names.
    """
    items = list(items)
    shown = sep.join(str(item) for item in items[:limit])
    more = len(items) - limit
    return shown + (f"{sep}and {more} more" if more > 0 else "")


def raise_if(problems: list[str], *, what: str = "") -> None:
    """Raise ValueError listing every problem ("; "-separated, after "{what}: " when given); no-op when empty."""
    if problems:
        raise ValueError((f"{what}: " if what else "") + "; ".join(problems))


def allowed_values(enum_cls: type[Enum]) -> str:
    """The values of an enum for an error message: "'a', 'b', 'c'"."""
    return ", ".join(repr(m.value) for m in enum_cls)

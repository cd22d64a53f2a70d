"""Printing shared by the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(
    header: tuple[str, ...], rows: Sequence[tuple[str, ...]], num_text_columns: int = 1
) -> None:
    """A markdown table: the first num_text_columns left-aligned, figures right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        padded = [
            c.ljust(w) if i < num_text_columns else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        "-" * (w + 2) if i < num_text_columns else "-" * (w + 1) + ":" for i, w in enumerate(widths)
    ]
    print(line(header))
    print("|" + "|".join(rule) + "|")
    for row in rows:
        print(line(row))

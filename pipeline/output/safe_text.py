"""Text files tokenmill writes for other programs, made safe for the ways they are commonly read.

- CSV: a cell beginning with `=`, `+`, `-`, `@`, a tab or a carriage return is a formula to a spreadsheet
  (OWASP's CSV injection rule); such a text cell gets a leading `'`, which spreadsheets show as text. Ids,
  tenants and `custom_id`s come from clients, so every CSV tokenmill writes goes through `safe_csv`.
  Number columns are left as they are: a negative number is data, not a formula.
- JSONL: `json.dumps(..., ensure_ascii=False)` writes U+2028, U+2029 and U+0085 raw, and `str.splitlines()`
  splits a line at each of them; `json_line` writes them as `\\u` escapes (JSON allows any character escaped),
  so "one line per record" holds for every line splitter.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"}


def safe_cells(table: pa.Table) -> pa.Table:
    """`table` with every text cell a spreadsheet would execute prefixed with `'`."""
    pattern = "^[" + "".join("\\" + c if c in "-+" else c for c in FORMULA_START) + "]"
    for i, field in enumerate(table.schema):
        if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
            column = table.column(i)
            risky = pc.match_substring_regex(column, pattern)
            fixed = pc.if_else(risky, pc.binary_join_element_wise("'", column, ""), column)
            table = table.set_column(i, field, fixed)
    return table


def write_safe_csv(table: pa.Table, sink) -> None:
    """`table` as CSV to `sink` (a path or a file object), its cells safe to open in a spreadsheet."""
    import pyarrow.csv as pacsv

    pacsv.write_csv(safe_cells(table), sink)


def json_line(value) -> str:
    """`value` as one JSONL line (its newline included), with no character any line splitter splits at."""
    text = json.dumps(value, ensure_ascii=False)
    for raw, escaped in LINE_BREAKS.items():
        if raw in text:
            text = text.replace(raw, escaped)
    return text + "\n"

"""Shared output of the benchmarks: an aligned text table, then one JSON line (machine-readable, last).

    from bench._report import print_table, emit_json
    print_table([{"op": "write", "MB/s": 512.3}], title="buffer")
    emit_json({"write_ratio_vs_pyarrow": 0.93})
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def print_table(rows: Iterable[dict[str, Any]], columns: list[str] | None = None, title: str | None = None, file=None) -> None:
    """Print dict rows as a table; columns default to the keys of the first row, in order."""
    rows = list(rows)
    out = file or sys.stdout
    if title:
        print(title, file=out)
    if not rows:
        print("  (no rows)", file=out)
        return
    cols = columns or list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)
    out.flush()


def emit_json(result: dict[str, Any]) -> None:
    """The final line of a benchmark's output: one JSON object."""
    print(json.dumps(result, sort_keys=True), flush=True)

"""Number and table formatting for the report's markdown: fixed formats, so the same numbers give the same bytes.

A missing value is always '-', never 'nan' or 'None', and never '-0.000'.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from benchctl.core import stats


def missing(x: Any) -> bool:
    return x is None or x is pd.NA or (isinstance(x, (float, np.floating)) and math.isnan(x))


def fseeds(seeds: Iterable[Any]) -> str:
    """How many seeds and which, '1 seed (0)' or '3 seeds (0, 1, 2)': a bare '0' under a 'seeds' header reads as
    no seeds at all."""
    ids = sorted({int(s) for s in seeds})
    return f"{len(ids)} seed{'' if len(ids) == 1 else 's'} ({', '.join(map(str, ids))})"


def fnum(x: Any, digits: int = 3) -> str:
    """Fixed-point with thousands separators; '-' for a missing value; never '-0.000'."""
    if missing(x):
        return "-"
    s = f"{float(x):,.{digits}f}"
    return s[1:] if s.startswith("-") and float(s.replace(",", "")) == 0 else s


def fint(x: Any) -> str:
    return "-" if missing(x) else f"{int(round(float(x))):,}"


def fci(lo: Any, hi: Any, n: Any, digits: int = 3, unit: str = "seed") -> str:
    if missing(lo) or missing(hi):
        if missing(n) or int(n) == 0:
            return "-"
        return f"no CI ({int(n)} {unit})" if int(n) == 1 else "-"
    return f"{fnum(lo, digits)} to {fnum(hi, digits)}"


def fpm(mean: Any, lo: Any, hi: Any, digits: int = 2) -> str:
    """'3.41 ± 0.12' (symmetric t-interval half width), or '3.41 (no CI)' from a single value."""
    if missing(mean):
        return "-"
    if missing(lo) or missing(hi):
        return f"{fnum(mean, digits)} (no CI)"
    return f"{fnum(mean, digits)} ± {fnum((float(hi) - float(lo)) / 2, digits)}"


def fp(p: Any) -> str:
    if missing(p):
        return "-"
    return stats.fmt_p(float(p)).replace("p = ", "").replace("p ", "")


def cell(x: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    return " ".join(str(x).split()).replace("|", "\\|")


_TAG = re.compile(r"<(?=[A-Za-z/!?])")  # what a markdown renderer would read as the start of raw HTML
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")


def escape_html(markdown: str) -> str:
    """The report's markdown with every `<` that would open an HTML tag, comment or declaration written as `&lt;`,
    outside code spans and fenced blocks (where a renderer shows text as written).

    The report writes no HTML of its own; names and text from the database (a plan's variant names and description,
    an error stored with a run) reach its tables, headings and prose, and must show as text, never act as markup.
    A `<` before a space or digit ("p < 0.001") opens nothing and stays as it is."""
    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(line)
            continue
        if fenced:
            out.append(line)
            continue
        parts, last = [], 0
        for m in _CODE_SPAN.finditer(line):
            parts.append(_TAG.sub("&lt;", line[last : m.start()]))
            parts.append(m.group(0))
            last = m.end()
        parts.append(_TAG.sub("&lt;", line[last:]))
        out.append("".join(parts))
    return "\n".join(out)


def md_table(headers: list[str], rows: Iterable[Iterable[Any]], right: Iterable[int] = ()) -> list[str]:
    r = set(right)
    out = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "|" + "|".join("---:" if i in r else "---" for i in range(len(headers))) + "|",
    ]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out


def bytes_unit(max_bytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")


def time_unit(max_s: float) -> tuple[float, str]:
    if max_s >= 2 * 3600:
        return 3600.0, "h"
    if max_s >= 120:
        return 60.0, "min"
    return 1.0, "s"


def ftokens(x: Any) -> str:
    """A token count in k/M/B."""
    if missing(x):
        return "-"
    x = float(x)
    if x >= 1e9:
        return f"{x / 1e9:.2f} B"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


def py(v: Any) -> Any:
    """numpy/pandas scalars and NaN as plain Python values (for JSON and formatting)."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return None
    if isinstance(v, np.generic):
        return v.item()
    return v


def value_range(lo: Any, hi: Any, n: Any, scale: float) -> str:
    if missing(n) or int(n) == 0:
        return "-"
    if int(n) == 1:
        return "one seed"
    return f"{fnum(float(lo) / scale, 2)} to {fnum(float(hi) / scale, 2)}"


def scaled(x: Any, scale: float) -> float | None:
    return None if missing(x) else float(x) / scale


def date(x: Any) -> str:
    return "-" if missing(x) else str(x)


def counts(values: Iterable[Any], absent: str = "not recorded") -> str:
    """Distinct values with how many runs have each; `absent` names a missing value."""
    c: dict[str, int] = {}
    for v in values:
        k = absent if missing(v) or v == "" else str(v)
        c[k] = c.get(k, 0) + 1
    return ", ".join(f"{k} ({n} run{'s' if n != 1 else ''})" for k, n in sorted(c.items())) or "-"


def min_str(s: pd.Series) -> Any:
    v = sorted(str(x) for x in s.dropna())
    return v[0] if v else None


def max_str(s: pd.Series) -> Any:
    v = sorted(str(x) for x in s.dropna())
    return v[-1] if v else None


def nan(x: Any) -> float:
    return math.nan if missing(x) else float(x)


def need(what: str) -> list[str]:
    return [what, ""]

"""The bench table as the report reads it: the latest `benchctl bench` invocation for the report's preset."""

from __future__ import annotations

import pandas as pd

from benchctl.report.context import Context, arch_rank


def bench_frame(ctx: Context, bench: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The latest `benchctl bench` invocation for the preset (and how many earlier invocations exist)."""
    if bench.empty or ctx.preset is None:
        return bench.iloc[0:0], 0
    b = bench[bench["preset"] == ctx.preset].copy()
    if b.empty:
        return b, 0
    ids = b.groupby("bench_id")["created_at"].max().reset_index()
    ids = ids.sort_values(["created_at", "bench_id"], na_position="first")
    latest = ids["bench_id"].iloc[-1]
    b = b[b["bench_id"] == latest].copy()
    b["_o"] = b["arch"].map(lambda a: arch_rank(str(a)))
    b = b.sort_values(["_o", "impl", "compiled", "id"]).drop(columns="_o").reset_index(drop=True)
    return b, len(ids) - 1

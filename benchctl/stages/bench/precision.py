"""The precision inference runs in, chosen from the decode benchmark's stored measurements.

`benchctl bench --decode` times the decode path with the weights cast to each of `--precisions` (float32 and
bfloat16 by default). `sample` and `eval` then cast the weights once to the precision that generated fastest on
this hardware, unless the user sets one (`--precision`); with no such measurement they stay in float32 and say so.
Which precision is fastest is a property of the machine (a CPU's bf16 matrix-vector products, per-step overhead),
not of the training recipe, so it is read from measurements rather than inferred from a capability flag.

The measurement used is the newest `bench --decode` invocation on the same hardware (device type and model name)
that timed the decode path in float32 and in at least one other precision. Within it, each other precision is
compared with float32 row by row (same architecture and batch size: the rows took turns in one process); the
precision with the highest geometric mean of decode tokens/s over float32's wins, float32 when none is above 1.

Speed alone is not enough: a cast that changes what the model generates changes every sample and score computed
after it. Each decode row stores its greedy tokens' agreement with the float32 reference loop, and a precision is
chosen only when every one of its rows in that comparison agreed at least MIN_AGREEMENT; a faster precision that
agreed less is named in the reason and float32 is kept (`--precision` still casts to it on request).
"""

from __future__ import annotations

import math
from typing import Any

import sqlite_utils
import torch

from benchctl.core import telemetry
from benchctl.core.runtime import INFERENCE_DTYPES, inference_precision

MIN_AGREEMENT = 0.99  # share of greedy tokens equal to float32's, in every row, for a precision to be chosen


def _decode_rows(db: sqlite_utils.Database, device: torch.device) -> list[dict[str, Any]]:
    if "bench" not in db.table_names():
        return []
    hardware = telemetry.hardware_name(device)
    rows = db.query(
        "select bench_id, arch, batch, dtype, tokens_per_s, agreement, device_name, created_at from bench "
        "where mode = 'decode' and impl = 'decode' and device = ? and tokens_per_s > 0 "
        "order by created_at desc, id desc",
        [device.type],
    )
    return [r for r in rows if str(r["device_name"] or "").split(" (", 1)[0] == hardware]


def measured_precision(db: sqlite_utils.Database, device: torch.device) -> tuple[torch.dtype, str] | None:
    """(dtype, reason) from the newest decode benchmark on this hardware that compared precisions; None without."""
    rows = _decode_rows(db, device)
    for bench_id in dict.fromkeys(r["bench_id"] for r in rows):
        mine = [r for r in rows if r["bench_id"] == bench_id]
        fp32 = {(r["arch"], r["batch"]): r["tokens_per_s"] for r in mine if r["dtype"] == "float32"}
        ratios: dict[str, list[float]] = {}
        agreed: dict[str, float] = {}  # the lowest agreement of each precision's rows (0 where one was not measured)
        for r in mine:
            base = fp32.get((r["arch"], r["batch"]))
            if r["dtype"] != "float32" and r["dtype"] in INFERENCE_DTYPES and base:
                ratios.setdefault(r["dtype"], []).append(r["tokens_per_s"] / base)
                agree = r.get("agreement")
                agreed[r["dtype"]] = min(agreed.get(r["dtype"], 1.0), 0.0 if agree is None else float(agree))
        if not ratios:
            continue
        means = {d: math.exp(sum(map(math.log, v)) / len(v)) for d, v in ratios.items()}
        where = f"bench --decode {bench_id} on {telemetry.hardware_name(device)}"
        others = ", ".join(f"{d} {m:.2f}x" for d, m in sorted(means.items()))
        n = max(len(v) for v in ratios.values())
        how = f"decode tokens/s over float32's, geometric mean of {n} architecture-batch rows: {others}"
        faithful = {d: m for d, m in means.items() if agreed[d] >= MIN_AGREEMENT}
        best = max(faithful, key=lambda d: faithful[d]) if faithful else None
        if best is not None and faithful[best] > 1.0:
            return INFERENCE_DTYPES[best], f"measured: {best} decoded fastest ({where}; {how})"
        unfaithful = [d for d, m in sorted(means.items()) if m > 1.0 and d not in faithful]
        if unfaithful:
            why = "; ".join(
                f"{d} was faster but its greedy tokens agreed only {agreed[d]:.2f} with float32's "
                f"(at least {MIN_AGREEMENT} in every row to be chosen)"
                for d in unfaithful
            )
            return torch.float32, f"measured: float32 ({where}; {how}; {why})"
        return torch.float32, f"measured: float32 decoded fastest ({where}; {how})"
    return None


def choose_precision(db: sqlite_utils.Database | None, setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype inference casts the weights to once, and why: `setting` when the user set one, else the decode
    benchmark's measurement on this hardware, else float32."""
    if setting != "auto":
        return inference_precision(setting, device)
    measured = measured_precision(db, device) if db is not None else None
    if measured is not None:
        return measured
    return torch.float32, (
        f"auto: float32, no bench --decode comparison of precisions on {telemetry.hardware_name(device)} "
        "(benchctl bench --decode measures one)"
    )

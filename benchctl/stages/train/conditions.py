"""What the validation losses are conditional on, which no number in the Loss table shows by itself: the one fixed
validation sample every interval is computed on, how many passes over the training split each run made, the share
of its steps each run spent warming its learning rate up, and whether the code that trained it was a commit at all.

Everything is read from results.db: the sample from each run's stored config (`eval.val_windows`,
`model.max_seq_len`, `eval.val_seed`), epochs from `runs.tokens_seen` over `runs.data_train_tokens` (the prepared
training split's size, recorded with every run since benchctl stored it), warm-up from `train.warmup_steps` over
`train.max_steps`, and the tree a run was trained from from `runs.git_commit`, which carries "-dirty" when tracked
files differed from the commit.

A run stored before the split's size was recorded has no `data_train_tokens`; the size is a function of the prepared
data alone, which `runs.data_fingerprint` identifies (the source's content, the tokenizer recipe and the caps), so it
is taken from another run on the same fingerprint when the database has one, and is unknown ("-") otherwise.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from benchctl.core.config import STORIES
from benchctl.report.fmt import fnum, missing
from benchctl.report.frames import Frames

DIRTY = "-dirty"  # the suffix benchctl.core.telemetry gives a commit whose checkout had uncommitted changes


def _config(config_json: Any) -> dict[str, Any]:
    try:
        raw = json.loads(str(config_json))
    except (TypeError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _int(section: dict[str, Any], key: str) -> int | None:
    v = section.get(key) if isinstance(section, dict) else None
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _split_sizes(runs: pd.DataFrame) -> dict[str, int]:
    """data fingerprint -> the training split's size, from every run (of any preset) that recorded it."""
    out: dict[str, int] = {}
    for fp, n in zip(runs["data_fingerprint"], runs["data_train_tokens"]):
        if not missing(fp) and not missing(n) and int(n) > 0:
            out.setdefault(str(fp), int(n))
    return out


def run_frame(frames: Frames) -> pd.DataFrame:
    """One row per done run: its model and seed, its validation sample, its epochs (and whether the split's size
    was recorded with it or taken from a run on the same data), its warm-up and the commit it was trained from."""
    cols = [
        "model",
        "seed",
        "task",
        "val_windows",
        "seq_len",
        "val_seed",
        "epochs",
        "split_from",
        "warmup_steps",
        "max_steps",
        "warmup",
        "commit",
        "dirty",
    ]
    done = frames.ctx.done
    if done.empty:
        return pd.DataFrame(columns=cols)
    sizes = _split_sizes(frames.data.runs)
    rows = []
    for r in done.to_dict("records"):
        cfg = _config(r["config_json"])
        train, ev, model = cfg.get("train") or {}, cfg.get("eval") or {}, cfg.get("model") or {}
        task = (cfg.get("task") or {}).get("name", STORIES) if isinstance(cfg.get("task"), dict) else STORIES
        split, split_from = None, None
        if not missing(r.get("data_train_tokens")) and int(r["data_train_tokens"]) > 0:
            split, split_from = int(r["data_train_tokens"]), "recorded"
        elif task == STORIES and not missing(r.get("data_fingerprint")) and str(r["data_fingerprint"]) in sizes:
            split, split_from = sizes[str(r["data_fingerprint"])], "same data"
        tokens = None if missing(r.get("tokens_seen")) else float(r["tokens_seen"])
        warm, steps = _int(train, "warmup_steps"), _int(train, "max_steps")
        commit = None if missing(r.get("git_commit")) else str(r["git_commit"])
        rows.append(
            {
                "model": r["model"],
                "seed": int(r["seed"]),
                "task": str(task),
                "val_windows": _int(ev, "val_windows"),
                "seq_len": _int(model, "max_seq_len"),
                "val_seed": _int(ev, "val_seed"),
                "epochs": tokens / split if tokens is not None and split else None,
                "split_from": split_from,
                "warmup_steps": warm,
                "max_steps": steps,
                "warmup": warm / steps if warm is not None and steps else None,
                "commit": None if commit is None else commit.removesuffix(DIRTY),
                "dirty": commit is not None and commit.endswith(DIRTY),
            }
        )
    return pd.DataFrame(rows, columns=cols)


def epochs_cell(g: pd.DataFrame) -> str:
    """A model's epochs per run: the mean over its seeds, '-' when a seed's split size is unknown (or the run learns
    a procedural task, whose problems are fresh at every step), a range when the seeds differ."""
    if g.empty or g["epochs"].isna().any():
        return "-"
    lo, hi = float(g["epochs"].min()), float(g["epochs"].max())
    return fnum(lo, 2) if fnum(lo, 2) == fnum(hi, 2) else f"{fnum(lo, 2)} to {fnum(hi, 2)}"


def warmup_cell(g: pd.DataFrame) -> str:
    """'80 of 400 (20%)': warm-up steps over all steps (a model key, so one value per model)."""
    r = g.dropna(subset=["warmup"])
    if r.empty:
        return "-"
    first = r.iloc[0]
    return f"{int(first['warmup_steps']):,} of {int(first['max_steps']):,} ({_pct(float(first['warmup']))})"


def _pct(x: float) -> str:
    s = f"{100 * x:.1f}".removesuffix(".0")
    return f"{s}%"


def warmups_differ(rf: pd.DataFrame) -> bool:
    """Whether the models spend different shares of their steps warming up (then the table shows the share).
    Different as shown, to 0.1%: a plan that scales the warm-up with the steps rounds it to whole steps, and
    318 of 1,589 is the same 20% as 636 of 3,179."""
    return len({_pct(float(v)) for v in rf["warmup"].dropna()}) > 1


def dirty_cell(g: pd.DataFrame) -> str:
    """The seeds of a model trained from a checkout with uncommitted changes, '-' when none was."""
    seeds = sorted(int(s) for s in g.loc[g["dirty"], "seed"])
    return "-" if not seeds else f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


def _sample(r: pd.Series) -> str:
    if missing(r["val_windows"]) or (r["task"] == STORIES and missing(r["seq_len"])):
        return "a sample its stored config does not describe"
    seed = "" if missing(r["val_seed"]) else f", eval.val_seed {int(r['val_seed'])}"
    if r["task"] != STORIES:
        return f"the first {int(r['val_windows']):,} problems of the task's validation split{seed}"
    n, t = int(r["val_windows"]), int(r["seq_len"])
    return f"{n:,} windows × {t:,} tokens ({n * t:,} predicted tokens) of the validation split{seed}"


def lines(frames: Frames, models: list[str]) -> list[str]:
    """The paragraph under the Loss table: what the intervals cover, on which sample, and the flags."""
    rf = run_frame(frames)
    if rf.empty:
        return []
    by_sample: dict[str, list[str]] = {}
    for m in models:
        g = rf[rf["model"] == m]
        for text in dict.fromkeys(_sample(r) for _, r in g.iterrows()):
            by_sample.setdefault(text, []).append(m)
    if len(by_sample) == 1:
        (text,) = by_sample
        where = f"every model is scored on one fixed validation sample: {text}"
    else:
        where = "the models are scored on fixed validation samples that differ: " + "; ".join(
            f"{', '.join(ms)}: {text}" for text, ms in by_sample.items()
        )
    out = [
        "The 95% CIs in this report cover the variation between training seeds only. "
        + where[0].upper()
        + where[1:]
        + ", drawn once and the same at every evaluation of every run, so how the loss would vary over other "
        "validation text is in no interval (eval.val_windows, model.max_seq_len and eval.val_seed of the runs' "
        "configs)."
    ]
    derived = rf["split_from"].eq("same data").any()
    unknown = rf[rf["epochs"].isna()]
    stories_unknown = unknown[unknown["task"] == STORIES]
    note = (
        "Epochs = tokens trained on over the tokens of the prepared training split: how many times a training "
        "token was seen, on average (a run draws its windows at random)"
    )
    if derived:
        note += (
            "; for runs stored before the split's size was recorded it is taken from a run on the same prepared "
            "data (same data fingerprint)"
        )
    if not stories_unknown.empty:
        note += "; '-': the split's size is not recorded for these runs, nor for any run on the same data"
    if (unknown["task"] != STORIES).any():
        note += "; a reasoning task draws fresh problems at every step and has no epochs"
    out.append(note + ".")
    if warmups_differ(rf):
        out.append(
            "Warm-up = train.warmup_steps of train.max_steps: it differs between the models here, so their "
            "learning-rate schedules differ beyond the architecture and the tokens."
        )
    dirty = [m for m in models if rf.loc[rf["model"] == m, "dirty"].any()]
    if dirty:
        out.append(
            "Trained from a checkout with uncommitted changes (the commit is recorded with -dirty, so the code that "
            "trained these runs is not exactly that commit, and what differed is not recorded): "
            + "; ".join(f"{m} {dirty_cell(rf[rf['model'] == m])}" for m in dirty)
            + "."
        )
    mixed = [(m, n) for m in models if (n := rf.loc[rf["model"] == m, "commit"].dropna().nunique()) > 1]
    if mixed:
        out.append(
            "Seeds of one model trained from different commits: "
            + "; ".join(f"{m} ({n} commits)" for m, n in mixed)
            + "; see Provenance."
        )
    return out

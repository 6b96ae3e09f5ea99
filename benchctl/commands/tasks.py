"""`benchctl tasks` (what a run can learn), `benchctl tasks show NAME` (example problems of a level) and `benchctl tasks
export NAME` (a level's problems as JSONL or parquet, so another model can be scored on exactly benchctl's problems).

Every problem is a pure function of (task, knobs, split, level, seed, index): an exported file names those columns, so
anyone can regenerate or extend it. Cheap: the task registry is plain Python (no torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from benchctl.core.config import STORIES, make_config, parse_set
from benchctl.core.errors import ConfigError
from benchctl.stages.cli import SetOpt, console

app = typer.Typer()

tasks_app = typer.Typer(help="Reasoning tasks: what `--task NAME` trains on.", rich_markup_mode=None)
app.add_typer(tasks_app, name="tasks")

MAX_EXPORT = 10_000_000  # problems in one export: a bound on a typo, far past any evaluation set


def _task(name: str, set_: list[str] | None) -> Any:
    """The task object `name` with the --set task.* knobs (checked by the config layer: one line per mistake)."""
    if name == STORIES:
        raise ConfigError("stories is TinyStories language modelling, read from --data; it has no generated problems")
    overrides = parse_set(set_)
    bad = [k for k in overrides if not k.startswith("task.")]
    if bad:
        raise ConfigError(f"only task.* keys apply here, got {', '.join(bad)}")
    cfg = make_config("small", "control", overrides={**overrides, "task.name": name})
    from benchctl.core import taskdata

    return taskdata.build_task(cfg.task)


def _knobs(task: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in vars(task.args).items())


def _ranges(level: Any) -> str:
    return ", ".join(f"{k} {lo}" if lo == hi else f"{k} {lo}-{hi}" for k, (lo, hi) in level.knobs.items())


@tasks_app.callback(invoke_without_command=True)
def tasks_(ctx: typer.Context) -> None:
    """List the tasks: knobs at their defaults, levels, longest sequence and source."""
    if ctx.invoked_subcommand is not None:
        return
    import tasks as registry

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for head in ("task", "levels (first: in-distribution)", "tokens", "description"):
        t.add_column(head, justify="right" if head == "tokens" else "left", no_wrap=head == "task")
    t.add_row(STORIES, "-", "-", "TinyStories language modelling (the default; --data DIR or the hub)")
    for name in registry.names():
        task = registry.build(name)
        levels = "; ".join(f"{lv.name}: {_ranges(lv)}" for lv in task.levels())
        t.add_row(name, levels, str(task.max_len()), task.description)
    console.print(t)
    console.print(
        "Train on one with 'benchctl study --task NAME' (or 'benchctl train --task NAME'); change a knob with "
        "--set task.KNOB=VALUE. 'benchctl tasks show NAME' prints examples and the knobs, 'benchctl tasks export "
        "NAME' writes problems to a file.",
        highlight=False,
    )


@tasks_app.command("show", short_help="Example problems of one level of a task, and its knobs.")
def show(
    name: Annotated[str, typer.Argument(help="A task's name ('benchctl tasks' lists them).")],
    level: Annotated[
        str, typer.Option("--level", "-l", help="Difficulty level (default: id, in-distribution).")
    ] = "id",
    n: Annotated[int, typer.Option("-n", help="Problems to show (1-100).")] = 5,
    split: Annotated[str, typer.Option("--split", help="train, valid or test.")] = "test",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the problems.")] = 0,
    set_: SetOpt = None,
) -> None:
    """Example problems of one level of a task, with its knobs, levels and source."""
    if not 1 <= n <= 100:
        raise ConfigError(f"-n must be in [1, 100], got {n}")
    task = _task(name, set_)
    import tasks as registry

    try:
        problems = task.problems(split, level, seed, n)
    except registry.TaskError as e:
        raise ConfigError(str(e)) from None
    console.print(f"{task.name}: {task.description}", highlight=False)
    console.print(f"source: {task.source}", highlight=False)
    console.print(f"knobs: {_knobs(task)}", highlight=False)
    console.print("levels: " + "; ".join(f"{lv.name} ({_ranges(lv)})" for lv in task.levels()), highlight=False)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"{split} problems of level {level}, seed {seed}")
    for head in ("index", "prompt", "answer", "difficulty"):
        t.add_column(head, justify="right" if head == "index" else "left", overflow="fold")
    for i, p in enumerate(problems):
        t.add_row(str(i), p.prompt, p.answer, ", ".join(f"{k}={v}" for k, v in p.difficulty.items()))
    console.print(t)


@tasks_app.command("export", short_help="Write a range of a task's problems to .jsonl or .parquet.")
def export(
    name: Annotated[str, typer.Argument(help="A task's name ('benchctl tasks' lists them).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The file to write: .jsonl or .parquet.")],
    level: Annotated[
        str, typer.Option("--level", "-l", help="Difficulty level (default: id, in-distribution).")
    ] = "id",
    n: Annotated[int, typer.Option("-n", help="Problems to write.")] = 500,
    split: Annotated[
        str, typer.Option("--split", help="train, valid or test (what the accuracy stage scores).")
    ] = "test",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the problems (the accuracy stage's default is 0).")] = 0,
    start: Annotated[int, typer.Option("--start", help="Index of the first problem.")] = 0,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
) -> None:
    """Write problems [start, start+n) of (split, level, seed) with their difficulty columns, as the accuracy stage
    sees them: the first 500 test problems of a level at seed 0 are exactly what `benchctl accuracy` scores."""
    if not 1 <= n <= MAX_EXPORT:
        raise ConfigError(f"-n must be in [1, {MAX_EXPORT:,}], got {n}")
    if start < 0:
        raise ConfigError(f"--start must be >= 0, got {start}")
    suffix = out.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"--out: the file must end in .jsonl or .parquet, got {out.name!r}")
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise ConfigError(f"--out: folder {out.parent} does not exist")
    task = _task(name, set_)
    import tasks as registry

    try:
        problems = task.problems(split, level, seed, n, start=start)
    except registry.TaskError as e:
        raise ConfigError(str(e)) from None
    knobs = vars(task.args)
    rows = [
        {
            "task": task.name,
            "split": split,
            "level": level,
            "seed": seed,
            "index": start + i,
            "prompt": p.prompt,
            "answer": p.answer,
            **{f"difficulty_{k}": v for k, v in p.difficulty.items()},
            "knobs": json.dumps(knobs, sort_keys=True),
        }
        for i, p in enumerate(problems)
    ]
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        if suffix == ".jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        else:
            import pandas as pd

            pd.DataFrame(rows).to_parquet(tmp, index=False)
        os.replace(tmp, out)
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    console.print(f"wrote {n} {split} problems of {task.name} level {level} (seed {seed}) to {out}", highlight=False)

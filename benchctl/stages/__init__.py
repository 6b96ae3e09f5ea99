"""The study's stages as a registry: each stage is one folder here whose `stage.py` defines `STAGE = Stage(...)`.

A stage has a name, a position in the study (`order`), a `run(study)` that does its work through the engine and
the database (resumable: it skips what is already stored), the tables of results.db it owns (declared with the
functions that write them in its `tables.py`), and the report sections that show its results. `benchctl
study` runs the registered stages in order and the report renders their sections in the same order, so adding a
stage is adding one folder to this package; neither the study loop nor the report's top level names any stage.

Orders in use: prepare 10, train 20, bench 22, retrofit 25, sample 30, judge 40, eval 50, depth 55, infer 58, report
100 (the report stage closes the report with the comparisons across stages, benchmark rows and provenance), export 110
(off unless asked). Leave gaps so new stages can slot in between.

This package also holds what the stages share: the study's options and state (`StudyOptions`, `StudyRun`,
`TrainAllResult`), the run selection the stages after training take (`RunSelection`), and the command lines' common
pieces (`benchctl.stages.cli`). Each stage's own options are one frozen dataclass in `<name>/options.py`, which its
command builds from the command line, its `stage.py` from the study's options, and its engine takes whole.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchctl.core.progress import format_duration
from benchctl.stages.train.executors import Execution

if TYPE_CHECKING:
    from benchctl.core.db import Database
    from benchctl.core.tables import Table
    from benchctl.report.frames import Frames

Section = Callable[["Frames"], list[str]]  # report frames -> markdown lines (a "## Title" section)


@dataclass(frozen=True)
class Stage:
    """One step of the study and its part of the report.

    `run` may be None for a stage that only contributes report sections. `figures` names every PNG its sections
    can write, so the report can remove a stale one when the data behind it is gone. `skippable` stages can be
    left out with `benchctl study --skip NAME`; their `run` checks `study.skips(name)` itself, because what it
    says when skipped (and whether there is anything to do) is the stage's own business. Under torchrun the
    `every_rank` stages (preparing the data, training) run on every process; the study's other ranks stop after
    the last of them and rank 0 alone runs the rest, which needs no process group. `reads_weights` says whether the
    stage loads trained runs' checkpoints in a given study. `tables` are the tables of
    results.db the stage owns, from its `tables.py` (`TABLES`), which alone writes them: every connection creates
    and migrates them (`connect` below). `queries` gives the Datasette canned queries `benchctl browse` offers over
    them: from the columns of the file being served (table -> columns), the queries its tables can answer, by URL
    name (a file written by an older benchctl may lack a table or a column the query needs). Beside Datasette's keys a
    query may carry two of browse's own: `link_column`, a column (and parameter) name whose values, in the results of
    any query, link to this query with the parameter filled in; and `summarises`, a table whose page points to it."""

    name: str
    order: int
    run: Callable[[StudyRun], None] | None = None
    sections: tuple[Section, ...] = ()
    figures: tuple[str, ...] = ()
    skippable: bool = False
    every_rank: bool = False  # under torchrun: run on every rank (training's DDP); otherwise rank 0 alone
    tables: tuple[Table, ...] = ()
    queries: Callable[[dict[str, list[str]]], dict[str, dict[str, Any]]] | None = None
    # whether the stage loads the trained runs' weights in this study (None: never). Training counts a run that
    # results.db has as done, but whose checkpoint is not here, as finished only when no later stage does.
    reads_weights: Callable[[StudyRun], bool] | None = None
    # how long the stage's work in this study takes on this machine, asked before the study's first stage runs:
    # (seconds, how that was worked out), or None when there is nothing to do or it cannot tell before the runs exist
    estimate: Callable[[StudyRun], tuple[float, str] | None] | None = None
    # the lines the stage adds to the summary that closes the study (what it found, in a few lines)
    summary: Callable[[StudyRun], list[str]] | None = None


def unless_skipped(name: str) -> Callable[[StudyRun], bool]:
    """`reads_weights` of a skippable stage that loads the trained runs' weights whenever it runs."""
    return lambda study: not study.skips(name)


def weights_read_after(study: StudyRun, order: int) -> bool:
    """Whether any stage after `order` loads the trained runs' weights in this study."""
    return any(s.reads_weights(study) for s in registered() if s.order > order and s.reads_weights is not None)


@dataclass(frozen=True, kw_only=True)
class RunSelection:
    """Which finished runs a stage works on (`--runs`, `--archs`, `--preset`); None is no filter. The stages that
    work on trained runs (sample, judge, eval, depth) take it in their options; the study selects by run id."""

    run_ids: tuple[str, ...] | None = None
    archs: tuple[str, ...] | None = None
    preset: str | None = None

    def __post_init__(self) -> None:
        for name in ("run_ids", "archs"):  # lists from the command line, kept as tuples: the options are frozen
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))


def _default_db_path() -> Path:
    # sqlite_utils loads pandas: kept out of 'benchctl --help', which imports this package
    from benchctl.core import db as dbm

    return dbm.default_path()


@dataclass
class StudyOptions:
    """Everything `benchctl study` decides, in one place (the CLI fills it; tests build it directly)."""

    preset: str | None = None  # None: the plan's preset, else paper
    plan: str = "study"  # a built-in plan's name or a plan file's path
    archs: list[str] | None = None  # keep only the plan's variants of these architectures
    seeds: list[int] | None = None  # None: the plan's seeds, else 0, 1, 2
    overrides: dict[str, Any] = field(default_factory=dict)
    db_path: Path = field(default_factory=_default_db_path)
    out_dir: Path = Path("reports")
    judge_model: str = "gemini-2.5-flash"
    judge_concurrency: int = 8
    n_prompts: int | None = None  # None: the sample stage's default at the preset (study_n_prompts)
    eval_tasks: list[str] | None = None  # None: the bundled tasks
    skip: tuple[str, ...] = ()  # names of skippable stages to leave out (sample, judge, eval)
    yes: bool = False
    progress: bool = True
    jobs: int | str = 1  # runs trained, sampled and evaluated at once on this machine (a number or "auto")
    executor: str = "local"  # local, or ray: every run a task on a Ray cluster
    ray_address: str | None = None  # the cluster to join (None: $RAY_ADDRESS, else a new local instance)
    runs_dir: Path | None = None  # where run directories live (None: beside results.db); shared by every machine
    bench: bool | None = None  # time every model's step (stage bench); None: on for a CPU at small
    export: tuple[str, ...] = ()  # formats to export every finished run to (stage export); () is off
    export_dir: Path | None = None  # where the exports go (None: export/ in out_dir, beside the report)

    def execution(self) -> Execution:
        """The executors.Execution these options describe (validated: a bad --jobs is one clear error)."""
        return Execution(executor=self.executor, jobs=self.jobs, ray_address=self.ray_address, runs_dir=self.runs_dir)


@dataclass
class TrainAllResult:
    """The runs a training sweep reached: trained now (`done`), found done (`skipped`), or failed, with the error."""

    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    resumed: dict[str, int] = field(default_factory=dict)  # run id -> the checkpoint step it resumed from


@dataclass
class StudyRun:
    """The state one `benchctl study` invocation passes from stage to stage.

    Earlier stages fill what later ones read: prepare sets `prepared`, train sets `trained`, report sets
    `report_path`. `confirm` is how the engine asks the user before long work (None: it cannot ask, so long work
    needs --yes); the engine never talks to a terminal itself."""

    opts: StudyOptions
    cfgs: list[Any]  # RunConfig of every run in the sweep
    archs: list[str]  # architectures of the sweep, in registry order
    variants: list[str] | None = None  # the plan's variant name of each config in `cfgs` (None: arch names)
    plan: Any = None  # the benchctl.plans.Plan the sweep comes from
    log: Callable[[str], None] = print
    confirm: Callable[[str], bool] | None = None
    prepared: Any = None
    trained: TrainAllResult | None = None
    report_path: Path | None = None
    heading: str = ""  # "3/6 sample", set by the study loop before each stage runs
    eta: float | None = None  # the running stage's estimated seconds (Stage.estimate), set by the study loop
    # (stage, wall seconds, CPU seconds of this process and the processes it waited for), filled by the study loop
    times: list[tuple[str, float, float]] = field(default_factory=list)

    def say(self, detail: str) -> None:
        """The stage's one heading line, e.g. '== 3/6 sample: skipped', with the time it should take when the stage
        has an estimate."""
        eta = "" if self.eta is None else f" (about {format_duration(self.eta)})"
        self.log(f"== {self.heading}: {detail}{eta}")

    def skips(self, name: str) -> bool:
        return name in self.opts.skip

    @property
    def run_ids(self) -> list[str]:
        """The runs later stages work on: every run that finished training (now or before)."""
        return [] if self.trained is None else self.trained.done + self.trained.skipped

    @functools.cached_property
    def db(self) -> Any:
        return connect(self.opts.db_path)


def story_only(study: Any) -> bool:
    """True, after the stage's one line saying why, when `study` trains a reasoning task and the calling stage only
    means something for TinyStories runs (story samples, their grades, the TinyStories lm-eval ladder, validation
    loss against depth, decode cost on story prompts). Every run of a study learns the same task."""
    cfgs = getattr(study, "cfgs", None) or []
    task = getattr(cfgs[0], "task", None) if cfgs else None
    if task is None or task.is_stories:
        return False
    study.say(f"skipped: it works on TinyStories runs, and this study trains on the {task.name} task")
    return True


@functools.lru_cache(maxsize=1)
def registered() -> tuple[Stage, ...]:
    """Every stage defined in this package, in study order. A name or order used twice is a programming error."""
    found: list[Stage] = []
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not mod.ispkg:
            continue
        stage = getattr(importlib.import_module(f"{__name__}.{mod.name}.stage"), "STAGE", None)
        if isinstance(stage, Stage):
            found.append(stage)
    for attr in ("name", "order"):
        seen: dict[Any, Stage] = {}
        for s in found:
            other = seen.setdefault(getattr(s, attr), s)
            if other is not s:
                raise RuntimeError(
                    f"two stages ({other.name} at {other.order}, {s.name} at {s.order}) have the "
                    f"same {attr} {getattr(s, attr)!r}"
                )
    return tuple(sorted(found, key=lambda s: s.order))


@dataclass(frozen=True)
class Declared:
    """What the command line's help says of a stage (`benchctl --help`, `study --help`): its name, its place in the
    study, whether `--skip` takes it, and the folder it lives in."""

    name: str
    order: int
    skippable: bool
    folder: str
    # where its `tables` come from: (module, attribute) pairs whose tuples, concatenated, are the stage's tables,
    # so that opening the database needs the light `tables.py` modules and not the stages (None: not written out,
    # the stage itself is imported for them)
    tables: tuple[tuple[str, str], ...] | None = ()


@functools.lru_cache(maxsize=1)
def declared() -> tuple[Declared, ...]:
    """Every stage's name, order and `skippable`, as `registered()` has them, in study order, read from the source
    of each folder's `stage.py` without running it: importing a stage imports its engine and report (torch,
    pandas), and the help that lists the stages must stay light. A `STAGE = Stage(...)` that gives these as
    literals, or as constants assigned at the top of its module, is read as written; any other stage is imported
    (correct, only slower)."""
    found = []
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not mod.ispkg:
            continue
        source = Path(__path__[0]) / mod.name / "stage.py"
        info = _read_declaration(source, mod.name) if source.is_file() else None
        if info is None:
            stage = getattr(importlib.import_module(f"{__name__}.{mod.name}.stage"), "STAGE", None)
            if not isinstance(stage, Stage):
                continue
            info = Declared(stage.name, stage.order, stage.skippable, mod.name, tables=None)
        found.append(info)
    return tuple(sorted(found, key=lambda d: d.order))


class _Unreadable(Exception):
    """A declaration's value that only running the module can tell."""


def _read_declaration(path: Path, folder: str) -> Declared | None:
    """The name, order and `skippable` of the `STAGE = Stage(...)` in `path`, or None when they are not written
    out (then the caller imports the module)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    constants: dict[str, Any] = {}
    imported: dict[str, tuple[str, str]] = {}  # a name bound by `from M import A [as name]` -> (M, A)
    call: ast.Call | None = None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            try:
                module = importlib.util.resolve_name("." * node.level + (node.module or ""), f"{__name__}.{folder}")
            except (ImportError, ValueError):
                continue
            imported.update({a.asname or a.name: (module, a.name) for a in node.names})
            continue
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        target, value = node.targets[0].id, node.value
        if target == "STAGE":
            named = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Stage"
            call = value if named and isinstance(value, ast.Call) else None
        elif isinstance(value, ast.Constant):
            constants[target] = value.value
    if call is None or call.args:
        return None
    given = {k.arg: k.value for k in call.keywords if k.arg is not None}
    defaults = {f.name: f.default for f in dataclasses.fields(Stage)}

    def read(key: str) -> Any:
        if key not in given:
            return defaults[key]
        node = given[key]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        raise _Unreadable(key)

    try:
        name, order, skippable = read("name"), read("order"), read("skippable")
    except _Unreadable:
        return None
    if not (isinstance(name, str) and type(order) is int and isinstance(skippable, bool)):
        return None
    tables: tuple[tuple[str, str], ...] | None = ()
    if "tables" in given:
        node = given["tables"]
        tables = (imported[node.id],) if isinstance(node, ast.Name) and node.id in imported else None
    return Declared(name, order, skippable, folder, tables)


def names() -> list[str]:
    return [s.name for s in registered()]


def skippable() -> list[str]:
    """Stage names `benchctl study --skip` accepts, in study order."""
    return [s.name for s in registered() if s.skippable]


def figure_names() -> tuple[str, ...]:
    """Every figure file a report can contain, in stage order."""
    return tuple(f for s in registered() for f in s.figures)


def tables() -> tuple[Table, ...]:
    """Every registered stage's tables, in stage order (so a table comes after the tables its foreign keys point
    at: training's runs first). A table two stages claim is a programming error.

    Read through `declared()`: a stage that passes `tables=TABLES` imported from its `tables.py` gives them without
    being imported itself. Every command that opens the database calls this, and importing every stage (engines,
    reports: torch, scipy, seaborn) took several seconds that `benchctl runs` and each training process
    paid for nothing."""
    found: list[Table] = []
    for d in declared():
        if d.tables is None:
            stage = getattr(importlib.import_module(f"{__name__}.{d.folder}.stage"), "STAGE", None)
            found.extend(stage.tables if isinstance(stage, Stage) else ())
            continue
        for module, attr in d.tables:
            found.extend(getattr(importlib.import_module(module), attr))
    names = [t.name for t in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RuntimeError(f"tables owned by two stages: {', '.join(twice)}")
    return tuple(found)


def canned_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Every registered stage's Datasette canned queries for a file with these tables and columns, in stage order.
    A query name two stages use is a programming error."""
    found: dict[str, dict[str, Any]] = {}
    for s in registered():
        for name, query in (s.queries(columns) if s.queries is not None else {}).items():
            if name in found:
                raise RuntimeError(f"canned query {name!r} is defined twice (the second by stage {s.name})")
            found[name] = query
    return found


def connect(path: str | os.PathLike | None = None, **kw: Any) -> Database:
    """Open results.db (`path`, else $BENCHCTL_DB, else results/results.db) with every registered stage's tables
    created or migrated: how every command, stage and test opens it (`benchctl.core.db.connect` takes the same
    keyword arguments: `create`, `wal`)."""
    # sqlite_utils loads pandas: kept out of 'benchctl --help', which imports this package
    from benchctl.core import db as dbm

    # a read-only connection creates and migrates nothing, so it needs no table, nor the stages that declare them
    # (importing every stage imports torch)
    return dbm.connect(path, tables=() if kw.get("readonly") else tables(), **kw)

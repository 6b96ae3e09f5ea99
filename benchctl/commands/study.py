"""`benchctl study`: the whole comparison in one command."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand

from benchctl import stages
from benchctl.core.errors import ConfigError
from benchctl.core.files import check_writable_dir
from benchctl.stages import StudyOptions
from benchctl.stages.cli import (
    DataOpt,
    DbOpt,
    ProgressOpt,
    SetOpt,
    TaskOpt,
    YesOpt,
    console,
    db_path_of,
    overrides_with_data,
    parse_seeds,
    split_list,
    terminal_confirm,
)
from benchctl.stages.export.options import parse_formats
from benchctl.stages.train.cli import ExecutorOpt, RayAddressOpt, RunsDirOpt

app = typer.Typer()


def stages_paragraph() -> str:
    """The study's stages as its help lists them, from the stage registry (read without importing the stages)."""
    found = stages.declared()
    skippable = [d.name for d in found if d.skippable]
    return f"Stages, in order: {', '.join(d.name for d in found)}." + (
        f" --skip takes {', '.join(skippable)}." if skippable else ""
    )


class StudyCommand(TyperCommand):
    """`benchctl study`: its help ends with the registered stages, listed when the help is read (for --help and the
    reference page), never written out by hand, and never when the command line is merely built."""

    @property
    def help(self) -> str | None:
        return f"{inspect.cleandoc(self._own_help or '')}\n\n{stages_paragraph()}"

    @help.setter
    def help(self, value: str | None) -> None:
        self._own_help = value


PlanOpt = Annotated[str, typer.Option("--plan", help="A built-in plan (see 'benchctl plans') or a plan file's path.")]
PlanPresetOpt = Annotated[
    str | None,
    typer.Option("--preset", "-p", help="Named preset: paper, small or tiny (default: the plan's, else paper)."),
]


@app.command(cls=StudyCommand, short_help="A whole comparison: train, evaluate and report a plan's models.")
def study(
    plan: PlanOpt = "study",
    preset: PlanPresetOpt = None,
    seeds: Annotated[
        str | None,
        typer.Option(
            "--seeds",
            help="Comma list or range, e.g. 0,1,2 or 0-4 (default: the plan's, else 0,1,2); at most 1000 seeds.",
        ),
    ] = None,
    archs: Annotated[
        str | None, typer.Option("--archs", help="Keep only the plan's variants of these architectures (comma list).")
    ] = None,
    judge_model: Annotated[
        str,
        typer.Option(
            "--judge-model",
            help="Judge model that grades the stories: a Gemini model, or openai:<name> for an OpenAI-compatible "
            "server (its base URL from $OPENAI_BASE_URL).",
        ),
    ] = "gemini-2.5-flash",
    n_prompts: Annotated[int | None, typer.Option("--n-prompts", help="Story beginnings to complete.")] = None,
    tasks: Annotated[str | None, typer.Option("--tasks", help="lm-eval tasks (default: the bundled ones).")] = None,
    skip: Annotated[
        str | None,
        typer.Option(
            "--skip",
            help="Stages to leave out (comma list): any the list above names as skippable (a wrong name lists them).",
        ),
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Report folder.")] = Path("reports"),
    set_: SetOpt = None,
    data: DataOpt = None,
    task: TaskOpt = None,
    db: DbOpt = None,
    yes: YesOpt = False,
    progress: ProgressOpt = True,
    jobs: Annotated[
        str,
        typer.Option(
            "--jobs",
            "-j",
            help="Runs trained, sampled and evaluated at once, each in its own process with its share of "
            "the cores: a number, or auto (one per core on a CPU, one per GPU on a GPU machine).",
        ),
    ] = "1",
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    runs_dir: RunsDirOpt = None,
    bench: Annotated[
        bool | None,
        typer.Option(
            "--bench/--no-bench",
            help="Time every model's training step with 'benchctl bench' for a clean cost ratio "
            "[default: on for a CPU at small].",
        ),
    ] = None,
    export: Annotated[
        str | None,
        typer.Option(
            "--export",
            help="After the report, export every finished run whose architecture supports it: hf, llama2c or "
            "both (comma list); see 'benchctl export'. Off by default.",
        ),
    ] = None,
    export_dir: Annotated[
        Path | None,
        typer.Option("--export-dir", help="Where --export writes (default: export/ in the report folder)."),
    ] = None,
) -> None:
    """Run every stage of the study, in order, for every variant × seed of a plan (default: the study's four
    models): prepare the data, train, then measure, grade and report. Rerun the same command to resume where it
    stopped: each stage skips what results.db already holds."""
    # torch: kept out of 'benchctl --help'
    from benchctl.core.runtime import Dist
    from benchctl.study import run_study

    skipped = tuple(split_list(skip) or ())
    bad = [s for s in skipped if s not in stages.skippable()]
    if bad:
        raise ConfigError(f"--skip accepts {', '.join(stages.skippable())}; got {', '.join(bad)}")
    formats = parse_formats(export)
    for folder in (out, export_dir):
        if folder is not None:
            check_writable_dir(folder)  # the report is the study's last step: a folder it cannot write is said now
    opts = StudyOptions(
        preset=preset,
        plan=plan,
        archs=split_list(archs),
        seeds=parse_seeds(seeds),
        overrides=overrides_with_data(set_, data, task),
        db_path=db_path_of(db),
        out_dir=out,
        judge_model=judge_model,
        n_prompts=n_prompts,
        eval_tasks=split_list(tasks),
        skip=skipped,
        yes=yes,
        progress=progress,
        jobs=jobs,
        executor=executor,
        ray_address=ray_address,
        runs_dir=runs_dir,
        bench=bench,
        export=formats,
        export_dir=export_dir,
    )
    is_main = Dist.from_env().is_main  # under torchrun every rank trains; rank 0 alone speaks and runs the rest
    # the study closes with its summary, which says where the report is
    run_study(opts, log=_say if is_main else _quiet, confirm=terminal_confirm())


def _say(line: str) -> None:
    """One line of the study's log: wrapped to a terminal's width, but whole in a file or pipe (one line a line)."""
    console.print(line, soft_wrap=not console.is_terminal)


def _quiet(*_: object) -> None:
    """The log of ranks other than 0."""

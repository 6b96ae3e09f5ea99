"""`benchctl lm-eval ARGS...`: lm-eval's own command line, with the benchctl model and bundled tasks available.

Typer parses only benchctl's two options (--record, --db); every other argument goes to lm-eval untouched, including
--help (lm-eval's help). See benchctl/lm_eval_cli.py.
"""

from __future__ import annotations

from typing import Annotated

import typer

from benchctl.stages.cli import DbOpt, console

app = typer.Typer()


@app.command(
    "lm-eval",
    short_help="lm-eval's own command line, with benchctl's models and tasks.",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def lm_eval_(
    ctx: typer.Context,
    record: Annotated[
        bool, typer.Option("--record", help="Also store the metrics in results.db (eval_results), like benchctl eval.")
    ] = False,
    db: DbOpt = None,
) -> None:
    """Run lm-eval's CLI (every option, every task) with --model benchctl and the bundled TinyStories tasks."""
    from benchctl.stages.eval import lm_eval_cli  # lm_eval, torch: kept out of 'benchctl --help'

    args = list(ctx.args)
    if any(a in ("-h", "--help") for a in args):
        console.print(
            "benchctl lm-eval: lm-eval's command line with --model benchctl registered and the bundled "
            "tasks (tinystories_ppl, tinystories_ending, tinystories_names, tinystories_order) generated "
            "for the checkpoint given in --model_args checkpoint=...; benchctl's own options: --record "
            "(store the metrics in results.db) and --db PATH. lm-eval's help follows.\n",
            highlight=False,
            soft_wrap=True,
        )
    lm_eval_cli.run(
        args, record=record, db_path=db, log=lambda msg: console.print(msg, highlight=False, soft_wrap=True)
    )

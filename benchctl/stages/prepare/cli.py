"""`benchctl prepare`: read the data, fit the tokenizer and pretokenize both splits into the cache.

Instant when the cache already holds data for the same content and settings; see `benchctl.core.data`.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from benchctl.core.config import make_config
from benchctl.stages.cli import DataOpt, PresetOpt, SetOpt, console, make_progress, overrides_with_data
from benchctl.stages.prepare.options import PrepareOptions

app = typer.Typer()


@app.command(short_help="Read and tokenize the data for a preset (cached).")
def prepare(
    data: DataOpt = None,
    preset: PresetOpt = "paper",
    set_: SetOpt = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Hash every cached file whole against its manifest (opening the cache hashes small files whole and "
            "large ones by sampled blocks).",
        ),
    ] = False,
) -> None:
    """Prepare the data for a preset: stories -> SentencePiece BPE tokenizer -> train.bin / valid.bin (cached)."""
    from benchctl.stages.prepare import engine  # torch: kept out of 'benchctl --help'

    cfg = make_config(preset, "control", overrides=overrides_with_data(set_, data))
    opts = PrepareOptions(data=cfg.data, vocab_size=cfg.model.vocab_size)
    t0 = time.perf_counter()
    p = engine.prepare(opts, progress=make_progress(True, stderr=True))
    if verify:
        from benchctl.core import data

        data.verify_prepared(p)
    seconds = time.perf_counter() - t0

    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("source", p.source)
    summary.add_row("cache", str(p.dir) + ("  (already prepared)" if p.cache_hit else ""))
    summary.add_row("stories", f"train {p.n_train_stories:,}   valid {p.n_valid_stories:,}")
    summary.add_row("tokens", f"train {p.n_train_tokens:,}   valid {p.n_valid_tokens:,}")
    summary.add_row("vocab", f"{p.vocab_size:,} (SentencePiece BPE, {p.tokenizer_path.name})")
    summary.add_row("fingerprint", p.fingerprint)
    if verify:
        summary.add_row("verified", "every file hashed whole: matches its manifest")
    summary.add_row("seconds", f"{seconds:.2f}")
    console.print(summary)

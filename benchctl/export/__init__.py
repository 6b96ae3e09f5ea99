"""`benchctl export`: a finished run's model in a format other tools read, with a model card.

- `hf`: a Hugging Face folder (`LlamaForCausalLM`: config.json, model.safetensors, the tokenizer, README.md), which
  `from_pretrained`, lm-eval's `hf` model and the Hub take as is.
- `llama2c`: `model.bin` and `tokenizer.bin` for karpathy/llama2.c's `run.c`.

Both write the model as a plain Llama (`benchctl.export.llama`), so only an architecture that is one, or unrolls
into one, can be exported; it declares the formats in `export_formats`, and any other gets a one-line refusal.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchctl.core.files import partial_path, stale_partials

FORMATS = ("hf", "llama2c")
# The packages a format writes with beyond benchctl's own dependencies: its `export` extra.
NEEDS = {"hf": ("transformers", "safetensors")}
EXPORT_EXTRA = "pip install 'benchctl[export]'"


def check_installed(fmt: str, option: str = "--format") -> None:
    """A ConfigError naming the extra to install when `fmt` writes with packages this installation lacks, before
    anything is trained or written."""
    from benchctl.core.errors import ConfigError

    missing = [m for m in NEEDS.get(fmt, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{option} {fmt} writes with {' and '.join(missing)}, not installed here: {EXPORT_EXTRA}")


@dataclass(frozen=True)
class ExportResult:
    run_id: str
    arch: str
    fmt: str
    out: Path
    files: list[str]
    n_layers: int  # block calls in the exported stack
    unique_params: int  # the run's trained parameters
    exported_params: int  # parameters of the exported model (the unrolled stack's copies counted)


def check_format(arch: str, fmt: str) -> None:
    """A ConfigError naming what the architecture can be exported to, when `fmt` is not among them."""
    import architectures
    from benchctl.core.errors import ConfigError
    from benchctl.export.llama import export_formats

    if fmt not in FORMATS:
        raise ConfigError(f"--format: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    check_installed(fmt)
    formats = export_formats(architectures.get(arch))
    if fmt not in formats:
        if formats:
            can = f"it exports to {', '.join(formats)} only"
        else:
            able = [n for n in architectures.names() if fmt in export_formats(architectures.get(n))]
            can = f"it declares no export format ({fmt} is for {', '.join(able) or 'no architecture'})"
        raise ConfigError(f"{arch} cannot be exported as {fmt}: {can}")


def export_run(
    db: Any,
    db_path: Path,
    run_id: str,
    fmt: str,
    out: Path,
    *,
    n_recur: int | None = None,
    extrapolate: str | None = None,
    force: bool = False,
) -> ExportResult:
    """Write run `run_id` (finished, in the results database `db` at `db_path`) to `out` in format `fmt`."""
    import architectures
    from benchctl.core import checkpoint
    from benchctl.core.errors import ConfigError
    from benchctl.export import card
    from benchctl.export.hf import write_hf
    from benchctl.export.llama import llama_weights
    from benchctl.export.llama2c import check_run_c, write_llama2c
    from benchctl.stages.train import tables as train_tables

    (row,) = train_tables.finished_runs(db, run_ids=[run_id], purpose="to export", kind="stories")
    check_format(row["arch"], fmt)
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        raise ConfigError(f"--out {out} exists and is not an empty directory; choose another or pass --force")
    model, cfg, tok_path = checkpoint.load_model(checkpoint.run_dir(db_path, run_id) / checkpoint.CKPT_NAME, row=row)
    try:
        weights = llama_weights(model, n_recur, extrapolate)
    except architectures.RecurrenceError as e:
        raise ConfigError(str(e)) from None
    if fmt == "llama2c":
        check_run_c(weights)  # before anything is written
    unique = sum(p.numel() for p in model.parameters())
    info = card.CardInfo(
        row=row,
        cfg_json=cfg.to_json(indent=2),
        fmt=fmt,
        n_recur=model.resolve_n_recur(n_recur),
        extrapolate=extrapolate,
        shape=weights.shape,
        unique_params=unique,
        exported_params=weights.n_params(),
        train_command=card.train_command(cfg),
    )

    def write(folder: Path) -> list[str]:
        files = write_hf(weights, tok_path, folder) if fmt == "hf" else write_llama2c(weights, tok_path, folder)
        (folder / "README.md").write_text(card.render(info))
        return files

    files = write_folder(out, write)
    return ExportResult(
        run_id=run_id,
        arch=row["arch"],
        fmt=fmt,
        out=out,
        files=sorted({*files, "README.md"}),
        n_layers=weights.shape.n_layers,
        unique_params=unique,
        exported_params=weights.n_params(),
    )


def write_folder(out: Path, write: Callable[[Path], list[str]]) -> list[str]:
    """Write a folder whole or not at all: `write` fills a staging folder beside `out` (same file system), which is
    then renamed to `out` in one step (into an existing `out`, under --force, file by file, each one atomic). A
    failure or a kill leaves `out` as it was; a staging folder left by a killed export is removed by the next one.
    Disk-full and read-only destinations are one line (`OutputError`)."""
    from benchctl.core.errors import output_error

    for stale in stale_partials(out):
        shutil.rmtree(stale, ignore_errors=True)
    stage = partial_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir()
        files = write(stage)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():  # --force into a folder that has other files: replace ours one by one
            for f in sorted(stage.iterdir()):
                os.replace(f, out / f.name)
            stage.rmdir()
        else:
            os.replace(stage, out)
    except OSError as e:
        raise output_error(out, e) from None
    except Exception as e:  # safetensors reports a full disk as its own error, with the OS's words in it
        if "No space left on device" not in str(e):
            raise
        raise output_error(out, OSError(errno.ENOSPC, "No space left on device")) from None
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
    return files


def as_json(result: ExportResult) -> str:
    return json.dumps({**result.__dict__, "out": str(result.out)}, indent=2)

"""What a local data directory must hold to be a data source (`--data DIR`): a train and a valid split, each as text,
JSONL or parquet, under one of the accepted names. Checked from the file names alone, before anything is read.

Kept apart from `benchctl.core.sources`, which reads the stories and so imports pyarrow and the hub's client: a
command checks `--data` with this module alone, as it parses its options, so a wrong path is reported at once
instead of after torch and the readers are loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from benchctl.core.errors import DataError

SPLITS = ("train", "valid")
# File names accepted for each split in a data directory, in order of preference.
SPLIT_NAMES = {"train": ("train", "TinyStories-train"), "valid": ("valid", "validation", "TinyStories-valid")}
FORMATS = ("txt", "jsonl", "parquet")
HUB = "hub"  # the source that is not a directory: the Hugging Face hub's copy of TinyStories

_HINT_LOCAL = (
    "pass --data DIR or set BENCHCTL_DATA=DIR to a directory holding train.txt + valid.txt "
    "(<|endoftext|>-separated), train.jsonl + valid.jsonl or train.parquet + valid.parquet"
)


@dataclass(frozen=True)
class _SplitFiles:
    fmt: str  # txt | jsonl | parquet
    files: tuple[Path, ...]  # several only for parquet shards


def _find_split(root: Path, split: str) -> _SplitFiles:
    for base in (root, root / "data"):  # data/: the hub repository's layout (data/train-00000-of-00004-*.parquet)
        found: list[_SplitFiles] = []
        for name in SPLIT_NAMES[split]:
            for fmt in FORMATS:
                if (base / f"{name}.{fmt}").is_file():
                    found.append(_SplitFiles(fmt, (base / f"{name}.{fmt}",)))
            shards = sorted(p for p in base.glob(f"{name}-*.parquet") if p.is_file())
            if shards:
                found.append(_SplitFiles("parquet", tuple(shards)))
        if len(found) > 1:
            names = ", ".join(str(s.files[0].name) + (" (+ shards)" if len(s.files) > 1 else "") for s in found)
            raise DataError(f"{base} holds several {split} files ({names}); keep one so the choice is explicit")
        if found:
            return found[0]
    expected = ", ".join(f"{n}.{{txt,jsonl,parquet}}" for n in SPLIT_NAMES[split])
    raise DataError(f"no {split} split in {root}: expected one of {expected}")


def _local_splits(path: Path) -> dict[str, _SplitFiles]:
    if not path.exists():
        raise DataError(f"data source {path} does not exist; {_HINT_LOCAL}, or use --data hub")
    if not path.is_dir():
        raise DataError(f"data source {path} is a file; {_HINT_LOCAL}")
    try:
        return {s: _find_split(path, s) for s in SPLITS}
    except PermissionError as e:
        raise DataError(f"data source {path} cannot be read ({e.strerror}); {_HINT_LOCAL}") from None


def check_source(spec: str | os.PathLike) -> None:
    """Raise the DataError a data source would raise when prepared, as far as its file names tell: a missing path,
    a file, a directory without a train or a valid split, or with two candidates for one. `hub` passes (whether the
    hub answers is known only by asking it)."""
    text = str(spec).strip()
    if text == HUB:
        return
    _local_splits(Path(text).expanduser().resolve())

"""Where stories come from: a local directory (text, JSONL or parquet) or the Hugging Face hub, read as stripped
stories, with a fingerprint of the content (sha256 of the files, or the hub's commit) that keys the data cache.

Local files are hashed once and remembered by (path, size, mtime) in the cache, so a 2 GB train.txt is not read
again on every run; the hub's last revision seen online is remembered too, so a machine without network can reuse
data prepared from it.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import HfApi
from huggingface_hub import errors as hf_errors

from benchctl.core.datadir import _HINT_LOCAL, SPLITS, _local_splits, _SplitFiles
from benchctl.core.errors import ConfigError, DataError
from benchctl.core.files import atomic_write, cache_root
from benchctl.core.progress import Progress, as_progress

HUB_REPO = "roneneldan/TinyStories"
HUB_SPLITS = {"train": "train", "valid": "validation"}
EOT = "<|endoftext|>"
TXT_CHUNK = 1 << 22  # characters per read of a .txt source: a 2 GB file is streamed, never loaded whole

# --------------------------------------------------------------------------------------------------------------------
# Sources -> stories


@dataclass(frozen=True)
class _Source:
    description: str  # absolute directory or "hub:roneneldan/TinyStories"
    fingerprint: str  # of the content, not of the path
    splits: dict[str, Any]  # split -> _SplitFiles (local) or the hub revision (hub)


def _local_source(path: Path) -> _Source:
    splits = _local_splits(path)
    content = {s: {"format": f.fmt, "sha256": [_file_sha256(p) for p in f.files]} for s, f in splits.items()}
    return _Source(str(path), _sha256_json({"kind": "files", **content}), splits)


def _first_bad_utf8(path: Path) -> tuple[int, int]:
    """(byte offset, line number) of the first byte sequence that is not UTF-8."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                dec.decode(chunk)
            except UnicodeDecodeError as e:
                return offset + e.start, lines + chunk[: e.start].count(b"\n")
            offset += len(chunk)
            lines += chunk.count(b"\n")
    return offset, lines  # pragma: no cover - only called after a decode error


def _not_utf8(path: Path) -> DataError:
    offset, line = _first_bad_utf8(path)
    return DataError(f"{path} line {line}: not UTF-8 text (bad byte at offset {offset}); save the file as UTF-8")


def _read_txt(path: Path) -> Iterator[str]:
    buf, separators = "", 0
    try:
        with open(path, encoding="utf-8") as f:
            while chunk := f.read(TXT_CHUNK):
                parts = (buf + chunk).split(EOT)
                buf = parts.pop()  # may be the start of a story (or of a separator) continued in the next chunk
                separators += len(parts)
                for part in parts:
                    if story := part.strip():
                        yield story
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    if separators == 0 and buf.strip():
        raise DataError(f"{path} has no {EOT} separator: stories in a .txt file must be separated by a line {EOT}")
    if story := buf.strip():
        yield story


def _read_jsonl(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict) or "text" not in obj:
                    raise DataError(f"{path} line {lineno}: expected a JSON object with a 'text' field")
                text = obj["text"]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(f"{path} line {lineno}: 'text' must be a string, got {type(text).__name__}")
                if story := text.strip():
                    yield story
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _read_parquet(path: Path) -> Iterator[str]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if "text" not in schema.names:
        raise DataError(f"{path} has no 'text' column (columns: {', '.join(schema.names) or 'none'})")
    tp = schema.field("text").type
    if not (pa.types.is_string(tp) or pa.types.is_large_string(tp) or pa.types.is_string_view(tp)):
        raise DataError(f"{path}: column 'text' must hold strings, not {tp}")
    try:
        for batch in pf.iter_batches(columns=["text"], batch_size=8192):
            for text in batch.column(0).to_pylist():
                if text and (story := text.strip()):
                    yield story
    except pa.ArrowException as e:
        raise DataError(f"{path} is a corrupt parquet file ({e})") from None


_READERS = {"txt": _read_txt, "jsonl": _read_jsonl, "parquet": _read_parquet}


def _take(stories: Iterable[str], limit: int | None) -> list[str]:
    out: list[str] = []
    if limit is not None and limit <= 0:
        return out
    for story in stories:
        out.append(story)
        if limit is not None and len(out) >= limit:
            break  # stop reading: a cap of 2,000 stories never scans a 2 GB file
    return out


def _read_local_split(files: _SplitFiles, limit: int | None) -> list[str]:
    out: list[str] = []
    for path in files.files:
        got = _take(_READERS[files.fmt](path), None if limit is None else limit - len(out))
        if not got:
            raise DataError(f"{path} holds no stories (it is empty or every entry is blank)")
        out += got
        if limit is not None and len(out) >= limit:
            break
    return out


# ---- the Hugging Face hub


class _HubUnreachable(Exception):
    """Internal: the hub could not be asked for the dataset's revision (message is the reason)."""


def _unreachable(e: _HubUnreachable) -> DataError:
    return DataError(f"could not reach the Hugging Face hub for {HUB_REPO} ({e}); to use local files, {_HINT_LOCAL}")


def _hub_offline() -> str | None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var}={os.environ[var]}"
    return None


def _hub_revision() -> str:
    """The commit sha of roneneldan/TinyStories: one quick API call, no retries, so offline fails in a second."""
    if offline := _hub_offline():
        raise _HubUnreachable(f"offline mode is on ({offline})")
    # huggingface_hub >= 1.0 raises its HTTP client's errors (HTTPError covers transport and status errors).
    network_errors: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError)
    if (http_error := getattr(hf_errors, "HTTPError", None)) is not None:
        network_errors = (*network_errors, http_error)
    try:
        info = HfApi().dataset_info(HUB_REPO, timeout=10.0)
    except network_errors as e:
        raise _HubUnreachable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no answer'}") from None
    if not info.sha:
        raise _HubUnreachable("the hub returned no revision")
    return info.sha


def _hub_source() -> _Source:
    sha = _hub_revision()
    _remember_hub_revision(sha)
    return _hub_source_at(sha)


def _hub_source_at(sha: str) -> _Source:
    return _Source(
        f"hub:{HUB_REPO}", _sha256_json({"kind": "hub", "repo": HUB_REPO, "revision": sha}), {s: sha for s in SPLITS}
    )


def _hub_revision_file() -> Path:
    return cache_root() / "hub-revision.json"


def _remember_hub_revision(sha: str) -> None:
    atomic_write(_hub_revision_file(), json.dumps({"repo": HUB_REPO, "revision": sha}))


def _last_hub_revision() -> str | None:
    try:
        saved = json.loads(_hub_revision_file().read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return saved.get("revision") if isinstance(saved, dict) and saved.get("repo") == HUB_REPO else None


def _read_hub_split(split: str, revision: str, limit: int | None, progress: Progress) -> list[str]:
    # datasets (with its pandas and pyarrow) serves the hub source alone: every training, sampling and evaluation
    # process reads the prepared cache through this package and would pay for it at start-up
    import datasets

    try:
        with progress.library_bars():  # the download's bars that last become the reporter's own tasks
            ds = datasets.load_dataset(HUB_REPO, split=HUB_SPLITS[split], revision=revision)
    except ConnectionError as e:
        raise DataError(f"could not download {HUB_REPO} from the Hugging Face hub ({e}); {_HINT_LOCAL}") from None
    if "text" not in ds.column_names:
        raise DataError(f"hub dataset {HUB_REPO}@{revision} has no 'text' field (fields: {ds.column_names})")

    def texts() -> Iterator[str]:
        for batch in ds.iter(batch_size=8192):
            for text in batch["text"]:
                if text and (story := text.strip()):
                    yield story

    _log(progress, f"reading {split} stories from {HUB_REPO}")
    out = _take(texts(), limit)
    if not out:
        raise DataError(f"hub dataset {HUB_REPO}@{revision} split {HUB_SPLITS[split]} holds no stories")
    return out


def read_stories(source: str, split: str, limit: int | None = None, *, progress: Progress | bool = False) -> list[str]:
    """The stories of one split ("train" or "valid") of a source ("hub" or a directory), stripped, first `limit`."""
    progress = _reporter(progress)
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if source.strip() == "hub":
        try:
            src = _hub_source_at(_hub_revision())
        except _HubUnreachable as e:
            raise _unreachable(e) from None
        return _read_split(src, split, limit, progress)
    path = Path(source).expanduser().resolve()
    return _read_split(_Source(str(path), "", _local_splits(path)), split, limit, progress)


def _read_split(source: _Source, split: str, limit: int | None, progress: Progress) -> list[str]:
    where = source.splits[split]
    if isinstance(where, _SplitFiles):
        _log(
            progress,
            f"reading {split} stories from {', '.join(p.name for p in where.files[:3])}"
            + (" ..." if len(where.files) > 3 else ""),
        )
        return _read_local_split(where, limit)
    return _read_hub_split(split, where, limit, progress)


# --------------------------------------------------------------------------------------------------------------------
# Hashing


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    """sha256 of a data file, remembered by (path, size, mtime) in cache_root()/file-hashes.json: a 2 GB
    train.txt is hashed once, and any edit (which changes size or mtime) is hashed again."""
    st = path.stat()
    index_path = cache_root() / "file-hashes.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    key = str(path.resolve())
    hit = index.get(key)
    if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return str(hit["sha256"])
    digest = _sha256_file(path)
    index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    atomic_write(index_path, json.dumps(index, indent=1, sort_keys=True))
    return digest


# --------------------------------------------------------------------------------------------------------------------
# Progress messages


def _reporter(progress: Progress | bool) -> Progress:
    """The caller's reporter, or for a plain flag one that writes to stderr (stdout may carry a command's output)."""
    return as_progress(progress, stderr=True)


def _log(progress: Progress | bool, msg: str) -> None:
    """Preparation messages are part of the progress display: shown only when it is enabled."""
    progress = _reporter(progress)
    if progress.enabled:
        progress.log(msg)

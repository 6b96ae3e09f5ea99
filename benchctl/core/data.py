"""The data layer: TinyStories -> stories -> SentencePiece BPE tokenizer -> pretokenized uint16 splits, cached.

Follows karpathy/llama2.c `tinystories.py` (`train_vocab`, `pretokenize`):

- Sources (read by `benchctl.core.sources`). `"hub"` is the Hugging Face dataset `roneneldan/TinyStories` (splits
  train / validation, field `text`); otherwise a directory holding a train and a valid split as
  `<|endoftext|>`-separated text (`train.txt`, `valid.txt` / `validation.txt`, or the hub's
  `TinyStories-train.txt` / `TinyStories-valid.txt`), JSONL with a `text` field, or parquet with a `text` column
  (also the hub's `data/train-*.parquet` shard layout).
  Stories are stripped, empty ones dropped, and `max_train_stories` / `max_valid_stories` keep the first N.
- Tokenizer. SentencePiece BPE with exactly llama2.c's trainer arguments (`tokenizer_spec`), trained on a seeded
  random sample of the train split. As in llama2.c, which writes one story per line of a text file, SentencePiece
  sees every line of a story as one sentence.
- Pretokenizing. Each story becomes `[BOS] + tokens` (no EOS), all concatenated into one flat uint16 file per
  split (`train.bin`, `valid.bin`), read back with `np.memmap`. The validation stories are kept as
  `valid_stories.jsonl` (one `{"text": ...}` per line) for prompts and lm-eval tasks.
- Cache. `cache_root()/v{vocab}-{fingerprint[:16]}/`, the fingerprint hashing the source's content (sha256 of the
  files, or the hub's commit), the tokenizer recipe, the sample size, the caps and `FORMAT_VERSION`. A directory is
  built under a temporary name with `manifest.json` written last and renamed into place in one step, so a killed
  prepare never leaves a directory that looks complete. A final directory whose files disagree with its manifest
  is reported as corrupt (a `DataError` naming the file and asking to delete the directory); it is never rebuilt
  silently, because runs already trained on it are keyed by its fingerprint.
- Training windows. `WindowSampler` draws random windows of `seq_len + 1` tokens from its own seeded generator, the
  same global micro-batch on every DDP rank (each rank keeps its rows), with a state that resumes the exact stream;
  `val_windows` is the fixed, seeded validation set every model is measured on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import torch

from benchctl import __version__
from benchctl.core.config import DataConfig
from benchctl.core.errors import CheckpointError, ConfigError, DataError
from benchctl.core.files import atomic_write
from benchctl.core.progress import Progress
from benchctl.core.sources import (  # noqa: F401  (read_stories, cache_root and the hub names are this module's interface)
    EOT,
    HUB_REPO,
    SPLITS,
    _hub_source,
    _hub_source_at,
    _HubUnreachable,
    _last_hub_revision,
    _local_source,
    _log,
    _read_split,
    _reporter,
    _sha256_file,
    _sha256_json,
    _Source,
    _unreachable,
    cache_root,
    read_stories,
)

try:  # POSIX advisory locks keep two processes (e.g. DDP ranks) from building the same cache entry twice.
    import fcntl
except ImportError:  # pragma: no cover - Windows: concurrent builders race, and the first rename wins
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = 1  # bump when the layout or the meaning of the cached files changes
TOKENIZER_SEED = 0  # seed of the random sample of train stories the tokenizer is fitted on
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.model"
VALID_STORIES_FILE = "valid_stories.jsonl"
ENCODE_BATCH = 2048  # stories per encode call while pretokenizing


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_spec(vocab_size: int) -> dict[str, Any]:
    """llama2.c's `SentencePieceTrainer.train` arguments (plus its implicit special ids), minus input and threads.

    `num_threads` (os.cpu_count() at training time) is left out on purpose: the learned pieces do not depend on it
    (checked: 1 vs 2 threads give identical vocabularies), so it must not change the cache key across machines.
    """
    return {
        "model_type": "bpe",
        "vocab_size": vocab_size,
        "self_test_sample_size": 0,
        "input_format": "text",
        "character_coverage": 1.0,
        "split_digits": True,
        "allow_whitespace_only_pieces": True,
        "byte_fallback": True,
        "unk_surface": r" \342\201\207 ",
        "normalization_rule_name": "identity",
        "unk_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": -1,
    }


class Tokenizer:
    """A SentencePiece model file with the few calls benchctl needs."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"tokenizer file {self.path} does not exist; rerun `benchctl prepare`")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as e:
            raise DataError(
                f"{self.path} is not a SentencePiece model ({e}); delete its directory and rerun `benchctl prepare`"
            ) from None

    def __reduce__(self):  # picklable (dataloader workers, lm-eval): reload from the file
        return (Tokenizer, (str(self.path),))

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return self._sp.encode(text, add_bos=bos, add_eos=eos)

    def encode_batch(self, texts: Sequence[str], bos: bool = True, eos: bool = False) -> list[list[int]]:
        return self._sp.encode(list(texts), add_bos=bos, add_eos=eos, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Iterable[int] | torch.Tensor | np.ndarray) -> str:
        # BOS/EOS are control pieces: SentencePiece drops them when decoding.
        if hasattr(ids, "tolist"):  # torch.Tensor or np.ndarray
            ids = ids.tolist()
        return self._sp.decode([int(i) for i in ids])


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send the process's fd 2 to `path`: SentencePiece's C++ trainer logs every merge there."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _story_lines(stories: Iterable[str]) -> Iterator[str]:
    # llama2.c writes one story per line of tiny.txt; its inner newlines make SentencePiece see one sentence per line.
    for story in stories:
        for line in story.split("\n"):
            if line.strip():
                yield line


def train_tokenizer(
    stories: Sequence[str],
    vocab_size: int,
    out_dir: Path,
    *,
    n_sample: int,
    seed: int = TOKENIZER_SEED,
    progress: Progress | bool = False,
) -> Tokenizer:
    """Fit the llama2.c BPE recipe on a seeded random sample of `n_sample` stories; writes out_dir/tokenizer.model."""
    if n_sample < len(stories):
        # Sorted indices: the sample's order follows the split, so it depends only on (stories, n_sample, seed).
        idx = sorted(random.Random(seed).sample(range(len(stories)), n_sample))
        sample = [stories[i] for i in idx]
    else:
        sample = list(stories)
    _log(progress, f"training the tokenizer: SentencePiece BPE, vocab {vocab_size}, on {len(sample):,} stories")
    prefix = out_dir / Path(TOKENIZER_FILE).stem
    try:
        with _stderr_to(out_dir / "tokenizer_train.log"):
            spm.SentencePieceTrainer.train(
                sentence_iterator=_story_lines(sample),
                model_prefix=str(prefix),
                num_threads=os.cpu_count() or 1,
                **tokenizer_spec(vocab_size),
            )
    except RuntimeError as e:
        # e.g. "Vocabulary size too high (4096). Please set it to a value <= 1800." on a tiny corpus.
        raise DataError(
            f"tokenizer training failed: {e} (fit on {len(sample):,} stories; raise "
            "data.tokenizer_stories or use more data, or lower model.vocab_size)"
        ) from None
    return Tokenizer(prefix.with_suffix(".model"))


# --------------------------------------------------------------------------------------------------------------------
# Prepared data


@dataclass(frozen=True)
class Prepared:
    """A prepared cache directory: tokenizer + pretokenized splits + validation stories, as its manifest says."""

    dir: Path
    fingerprint: str
    source: str  # absolute directory, or 'hub:roneneldan/TinyStories'
    vocab_size: int
    tokenizer_path: Path
    train_path: Path
    valid_path: Path
    n_train_stories: int
    n_valid_stories: int
    n_train_tokens: int
    n_valid_tokens: int
    cache_hit: bool = field(default=False, compare=False)  # True when prepare() found it already built

    def train_tokens(self) -> np.ndarray:
        return _memmap(self.train_path, self.n_train_tokens)

    def valid_tokens(self) -> np.ndarray:
        return _memmap(self.valid_path, self.n_valid_tokens)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.tokenizer_path)

    def valid_stories(self) -> list[str]:
        path = self.dir / VALID_STORIES_FILE
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f if line.strip()]


def _memmap(path: Path, n_tokens: int) -> np.ndarray:
    if n_tokens == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r", shape=(n_tokens,))


def _corrupt(dir: Path, what: str) -> DataError:
    return DataError(f"corrupt data cache: {what}; delete {dir} and rerun `benchctl prepare`")


def load_prepared(dir: Path | str) -> Prepared:
    """Open a prepared directory from its manifest, checking every file (size, tokenizer hash, token ids < vocab)."""
    dir = Path(dir).expanduser().resolve()
    if not dir.is_dir():
        raise DataError(
            f"prepared data directory {dir} does not exist; rerun `benchctl prepare` with the same data settings"
        )
    mpath = dir / MANIFEST
    if not mpath.is_file():
        raise _corrupt(dir, f"{mpath} is missing")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _corrupt(dir, f"{mpath} is not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format_version") != FORMAT_VERSION:
        version = m.get("format_version") if isinstance(m, dict) else None
        raise DataError(
            f"{mpath} has cache format {version!r}, this benchctl reads {FORMAT_VERSION}; delete {dir} "
            "and rerun `benchctl prepare`"
        )
    try:
        files: dict[str, dict[str, Any]] = m["files"]
        vocab = int(m["vocab_size"])
        counts = {k: int(m[k]) for k in ("n_train_stories", "n_valid_stories", "n_train_tokens", "n_valid_tokens")}
        fingerprint, source = str(m["fingerprint"]), str(m["source"])
    except (KeyError, TypeError, ValueError) as e:
        raise _corrupt(dir, f"{mpath} lacks a field ({e})") from None
    for name in (TOKENIZER_FILE, "train.bin", "valid.bin", VALID_STORIES_FILE):
        path = dir / name
        if name not in files:
            raise _corrupt(dir, f"{mpath} does not list {name}")
        if not path.is_file():
            raise _corrupt(dir, f"{path} is missing")
        if (size := path.stat().st_size) != (expected := files[name].get("bytes")):
            raise _corrupt(dir, f"{path} has {size:,} bytes, the manifest says {expected}")
    if _sha256_file(dir / TOKENIZER_FILE) != files[TOKENIZER_FILE].get("sha256"):
        raise _corrupt(dir, f"{dir / TOKENIZER_FILE} does not match the manifest's sha256")
    for split in SPLITS:
        path, n = dir / f"{split}.bin", counts[f"n_{split}_tokens"]
        if path.stat().st_size != 2 * n:
            raise _corrupt(dir, f"{path} holds {path.stat().st_size // 2:,} tokens, the manifest says {n:,}")
        if (top := _max_token(_memmap(path, n))) >= vocab:
            raise _corrupt(dir, f"{path} contains token id {top} >= vocab size {vocab}")
    for name in ("train.bin", "valid.bin", VALID_STORIES_FILE):  # a change that keeps sizes and ids in range
        _check_content(dir, name, files[name])
    return Prepared(
        dir=dir,
        fingerprint=fingerprint,
        source=source,
        vocab_size=vocab,
        tokenizer_path=dir / TOKENIZER_FILE,
        train_path=dir / "train.bin",
        valid_path=dir / "valid.bin",
        n_train_stories=counts["n_train_stories"],
        n_valid_stories=counts["n_valid_stories"],
        n_train_tokens=counts["n_train_tokens"],
        n_valid_tokens=counts["n_valid_tokens"],
    )


# Files up to this size are hashed whole every time they are opened (a 0.8 M-token train.bin: milliseconds); a larger
# one (the full TinyStories train split, about 1 GB) is checked on SAMPLED_BLOCKS fixed blocks spread over the file,
# which any rewrite of more than a sliver of it changes, and whole by `benchctl prepare --verify`.
FULL_HASH_MAX_BYTES = 256 * 2**20
SAMPLED_BLOCKS = 64
SAMPLED_BLOCK_BYTES = 64 * 2**10


def _sampled_sha256(path: Path) -> str:
    """SHA-256 of SAMPLED_BLOCKS blocks at evenly spaced offsets of the file (the whole file when it is smaller)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLED_BLOCKS * SAMPLED_BLOCK_BYTES:
            h.update(f.read())
        else:
            span = size - SAMPLED_BLOCK_BYTES
            for i in range(SAMPLED_BLOCKS):
                f.seek(i * span // (SAMPLED_BLOCKS - 1))
                h.update(f.read(SAMPLED_BLOCK_BYTES))
    return h.hexdigest()


def _check_content(dir: Path, name: str, entry: dict[str, Any], *, full: bool = False) -> None:
    """The file's content against the manifest's hashes (caches written before they were recorded have none: only
    their sizes and token ids are checked)."""
    path = dir / name
    whole = entry.get("sha256")
    if whole and (full or path.stat().st_size <= FULL_HASH_MAX_BYTES):
        if _sha256_file(path) != whole:
            raise _corrupt(dir, f"{path} does not match the manifest's sha256 (its content changed)")
    elif entry.get("sampled_sha256") and _sampled_sha256(path) != entry["sampled_sha256"]:
        raise _corrupt(dir, f"{path} does not match the manifest's sampled sha256 (its content changed)")


def verify_prepared(prepared: Prepared) -> None:
    """Every file of a prepared directory hashed whole against its manifest (`benchctl prepare --verify`)."""
    m = json.loads((prepared.dir / MANIFEST).read_text(encoding="utf-8"))
    for name in ("train.bin", "valid.bin", VALID_STORIES_FILE, TOKENIZER_FILE):
        _check_content(prepared.dir, name, m["files"][name], full=True)


def _max_token(tokens: np.ndarray) -> int:
    top, step = -1, 1 << 24  # chunks of 32 MB: a 1 GB train.bin is checked without reading it into memory at once
    for i in range(0, len(tokens), step):
        top = max(top, int(tokens[i : i + step].max()))
    return top


# --------------------------------------------------------------------------------------------------------------------
# prepare()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes
        yield


def _key(source_fp: str, data: DataConfig, vocab_size: int) -> tuple[str, dict[str, Any]]:
    settings = {
        "format_version": FORMAT_VERSION,
        "source": source_fp,
        "tokenizer": tokenizer_spec(vocab_size),
        "tokenizer_stories": data.tokenizer_stories,
        "tokenizer_seed": TOKENIZER_SEED,
        "max_train_stories": data.max_train_stories,
        "max_valid_stories": data.max_valid_stories,
    }
    return _sha256_json(settings), settings


def _dir_for(fingerprint: str, vocab_size: int) -> Path:
    return cache_root() / f"v{vocab_size}-{fingerprint[:16]}"


def prepare(data: DataConfig, vocab_size: int, *, progress: Progress | bool = True) -> Prepared:
    """Read `data.source`, fit the tokenizer, pretokenize both splits and cache them; instant when already cached.

    `data` is a `benchctl.core.config.DataConfig`. Safe to call from several processes at once (e.g. every DDP rank):
    one builds, the others wait and then read the manifest. `progress` reports reading, tokenizer fitting and
    tokenizing (a plain flag reports to stderr).
    """
    progress = _reporter(progress)
    if not 259 <= vocab_size <= 65535:
        raise ConfigError(f"model.vocab_size: must be in [259, 65535], got {vocab_size}")
    t0 = time.perf_counter()
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cannot create the data cache {root} ({e}); set BENCHCTL_CACHE to a writable directory"
        ) from None
    spec = str(data.source).strip()
    if spec == "hub":
        try:
            source = _hub_source()
        except _HubUnreachable as e:
            # Offline (e.g. a compute node): reuse data prepared earlier from the last revision seen online.
            sha = _last_hub_revision()
            if sha is not None:
                source = _hub_source_at(sha)
                fingerprint, _ = _key(source.fingerprint, data, vocab_size)
                if (_dir_for(fingerprint, vocab_size) / MANIFEST).is_file():
                    _log(progress, f"the hub is unreachable ({e}); using data prepared from revision {sha[:12]}")
                    return _cached(_dir_for(fingerprint, vocab_size))
            raise _unreachable(e) from None
    else:
        source = _local_source(Path(spec).expanduser().resolve())

    fingerprint, settings = _key(source.fingerprint, data, vocab_size)
    final = _dir_for(fingerprint, vocab_size)
    if final.exists():
        return _cached(final)
    with _locked(final.parent / ".locks" / f"{final.name}.lock"):
        if final.exists():  # another process built it while we waited for the lock
            return _cached(final)
        for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a killed prepare; we hold the lock
            shutil.rmtree(stale)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _build(tmp, source, data, vocab_size, fingerprint, settings, progress, t0)
            try:
                os.rename(tmp, final)  # one atomic step: the directory appears complete or not at all
            except OSError:
                if not (final / MANIFEST).is_file():  # pragma: no cover - unrelated failure
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    prepared = load_prepared(final)
    _log(progress, f"prepared {prepared.dir} in {time.perf_counter() - t0:.1f} s")
    return prepared


def prepare_run_data(cfg: Any, *, progress: Progress | bool = True) -> Any:
    """What a run trains on: TinyStories prepared for its vocabulary (`Prepared`), or for a run on a procedural task
    its `TaskData` (the task's tokenizer and fingerprint; there is no corpus to prepare)."""
    if not cfg.task.is_stories:
        from benchctl.core import taskdata  # the task registry: only a task run needs it

        return taskdata.prepare_task(cfg.task)
    return prepare(cfg.data, cfg.model.vocab_size, progress=progress)


def prepared_for_run(
    cache: dict[str, Prepared],
    run_id: str,
    trained_on: str | None,
    data: DataConfig,
    vocab_size: int,
    *,
    progress: Progress | bool = True,
    to: str = "",
) -> Prepared:
    """The prepared data a finished run reads, for a stage that loads runs one after another: each source is
    prepared once per command (`cache`, keyed by the data config and vocabulary). Refused when the run's source now
    gives other data than the fingerprint it trained on (`trained_on`), since its scores would then be on other
    text; `to` ends the advice (e.g. " to sample it")."""
    key = json.dumps([dataclasses.asdict(data), vocab_size], sort_keys=True)
    if key not in cache:
        cache[key] = prepare(data, vocab_size, progress=progress)
    prepared = cache[key]
    if trained_on and trained_on != prepared.fingerprint:
        raise DataError(
            f"run {run_id} was trained on data {trained_on[:12]}, but its source {data.source} now gives "
            f"{prepared.fingerprint[:12]}; restore the original data{to}"
        )
    return prepared


def _cached(dir: Path) -> Prepared:
    return dataclasses.replace(load_prepared(dir), cache_hit=True)


def find_prepared(data: DataConfig, vocab_size: int) -> Prepared | None:
    """The data `prepare` would return if it is already in the cache, else None; never downloads or builds (the hub
    source is looked up at the last revision seen online). For questions about the data before anything is
    prepared, such as how many passes over the training split a plan's runs make."""
    spec = str(data.source).strip()
    if spec == "hub":
        sha = _last_hub_revision()
        if sha is None:
            return None
        source = _hub_source_at(sha)
    else:
        path = Path(spec).expanduser().resolve()
        if not path.is_dir():
            return None
        source = _local_source(path)
    fingerprint, _ = _key(source.fingerprint, data, vocab_size)
    final = _dir_for(fingerprint, vocab_size)
    return _cached(final) if (final / MANIFEST).is_file() else None


def _pretokenize(stories: Sequence[str], tok: Tokenizer, out: Path, desc: str, progress: Progress) -> int:
    """Write [BOS] + tokens of every story (no EOS) as one flat uint16 array; returns the token count."""
    n = 0
    with open(out, "wb") as f, progress.task(desc, total=len(stories)) as bar:
        for i in range(0, len(stories), ENCODE_BATCH):
            ids = tok.encode_batch(stories[i : i + ENCODE_BATCH], bos=True, eos=False)
            flat = np.fromiter((t for seq in ids for t in seq), dtype=np.uint16, count=sum(map(len, ids)))
            f.write(flat.tobytes())
            n += len(flat)
            bar.update(advance=len(ids))
    return n


def _build(
    tmp: Path,
    source: _Source,
    data: DataConfig,
    vocab_size: int,
    fingerprint: str,
    settings: dict[str, Any],
    progress: Progress,
    t0: float,
) -> None:
    _log(progress, f"preparing {source.description} (vocab {vocab_size}) into {_dir_for(fingerprint, vocab_size)}")
    stories = {
        "train": _read_split(source, "train", data.max_train_stories, progress),
        "valid": _read_split(source, "valid", data.max_valid_stories, progress),
    }
    tok = train_tokenizer(stories["train"], vocab_size, tmp, n_sample=data.tokenizer_stories, progress=progress)
    if tok.vocab_size != vocab_size:  # pragma: no cover - SentencePiece either fits the size or raises
        raise DataError(f"the tokenizer has {tok.vocab_size} pieces, expected {vocab_size}")
    n_tokens = {s: _pretokenize(stories[s], tok, tmp / f"{s}.bin", f"tokenizing {s}", progress) for s in SPLITS}
    with open(tmp / VALID_STORIES_FILE, "w", encoding="utf-8") as f:
        for story in stories["valid"]:
            f.write(json.dumps({"text": story}, ensure_ascii=False) + "\n")
    files: dict[str, dict[str, Any]] = {
        name: {"bytes": (tmp / name).stat().st_size}
        for name in (TOKENIZER_FILE, "train.bin", "valid.bin", VALID_STORIES_FILE)
    }
    for name, entry in files.items():  # content hashes: load_prepared checks them (a same-size change is caught)
        entry["sha256"] = _sha256_file(tmp / name)
        entry["sampled_sha256"] = _sampled_sha256(tmp / name)
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "source": source.description,
        "source_fingerprint": source.fingerprint,
        "source_revision": source.splits["train"] if isinstance(source.splits["train"], str) else None,
        "settings": settings,
        "vocab_size": vocab_size,
        "tokenizer_sample": min(data.tokenizer_stories, len(stories["train"])),
        "n_train_stories": len(stories["train"]),
        "n_valid_stories": len(stories["valid"]),
        "n_train_tokens": n_tokens["train"],
        "n_valid_tokens": n_tokens["valid"],
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(time.perf_counter() - t0, 3),
        "versions": {"benchctl": __version__, "sentencepiece": spm.__version__, "numpy": np.__version__},
    }
    # Written last: a directory without a manifest is never mistaken for a complete one.
    atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2))


# --------------------------------------------------------------------------------------------------------------------
# Training and validation windows


def _check_length(tokens: np.ndarray, seq_len: int) -> None:
    if seq_len < 1:
        raise ConfigError(f"model.max_seq_len: must be >= 1, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"the split has {len(tokens):,} tokens, too small for sequence length {seq_len} (windows "
            f"need {seq_len + 1}); use more stories or a shorter model.max_seq_len"
        )


def _gather(tokens: np.ndarray, starts: torch.Tensor, width: int) -> torch.Tensor:
    idx = starts.numpy()[:, None] + np.arange(width)  # (n, width)
    return torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))  # (n, width) int64


class WindowSampler:
    """Random windows of seq_len+1 tokens (x = w[:-1], y = w[1:]); windows may cross story boundaries.

    Every call draws the start offsets of the full global micro-batch (`batch_size` windows) from the sampler's own
    seeded generator, so all DDP ranks draw identical offsets, and returns rows [rank::world_size]: the union over
    ranks is exactly the single-process batch, and a resume may even change world_size.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ):
        _check_length(tokens, seq_len)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or batch_size % world_size:
            raise ConfigError(
                f"train.batch_size={batch_size} must be a positive multiple of the number of "
                f"processes ({world_size}) so every rank gets the same share of each micro-batch"
            )
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.batches = 0  # global micro-batches drawn so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n_starts = len(self.tokens) - self.seq_len  # last valid start leaves seq_len+1 tokens
        starts = torch.randint(0, n_starts, (self.batch_size,), generator=self.generator)  # (B,) global
        self.batches += 1
        w = _gather(self.tokens, starts[self.rank :: self.world_size], self.seq_len + 1)  # (B_local, T+1)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # x, y: (B_local, T) each

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "batches": self.batches,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "n_tokens": len(self.tokens),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        mine = {"seq_len": self.seq_len, "batch_size": self.batch_size, "n_tokens": len(self.tokens)}
        theirs = {k: d.get(k) for k in mine}
        if theirs != mine:
            raise CheckpointError(
                f"the checkpoint's data stream was drawn with {theirs}, this run has {mine}; "
                "resume with the same data and batch settings"
            )
        self.generator.set_state(d["generator"])
        self.batches = int(d["batches"])


def val_windows(tokens: np.ndarray, seq_len: int, n_windows: int, seed: int) -> torch.Tensor:
    """The fixed validation set: (n_windows, seq_len+1) int64, the same for the same (tokens, seq_len, n, seed)."""
    _check_length(tokens, seq_len)
    if n_windows < 1:
        raise ConfigError(f"eval.val_windows: must be >= 1, got {n_windows}")
    g = torch.Generator().manual_seed(seed)  # private generator: independent of torch's global RNG
    starts = torch.randint(0, len(tokens) - seq_len, (n_windows,), generator=g)  # (n,)
    return _gather(tokens, starts, seq_len + 1)  # (n, seq_len+1)

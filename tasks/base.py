"""What every task shares: its arguments, its levels, how a problem is drawn and split, scoring, the tokenizer.

A task is a generator of (prompt, answer) problems with a difficulty knob, an exact solver that reads the prompt
alone, and an analytic bound on the lengths. Everything else lives here, once:

Problems are a pure function of (task name, args, split, level, seed, index). `problem()` hashes the JSON text of
those values and an attempt counter (BLAKE2b) into the seed of a fresh `random.Random`, draws one problem with the
task's `generate`, and keeps it only if the hash of its prompt puts it in the requested split; otherwise it draws
again with the next attempt. `split_of` sends 1/16 of all prompts to "valid", 1/16 to "test" and the rest to
"train", whatever the seed, level or index that drew them, so a held-out prompt can never be a training prompt: the
split is a property of the text, not of the draw. Within a split, problems follow the task's distribution
conditioned on the split (for the large spaces used here, the same distribution).

The level structure says what "harder" means: the first level ("id") is the in-distribution one a model trains on,
the next ones push a difficulty knob past the trained range (more digits, more hops, a bigger maze), so accuracy
against the level separates models that learned the algorithm from models that learned the training lengths.

Tokens are characters: `CharTokenizer` gives `<pad>`, `<bos>`, `<eos>` the ids 0, 1, 2 and each of a task's
`symbols` one id after them. A training sequence is `<bos> prompt answer <eos>`; `masked_targets` makes the shifted
input/target pair with the loss on the answer (and `<eos>`) only, or on every real token.

Plain Python: no torch, no numpy, no I/O, no knowledge of benchctl.
"""

from __future__ import annotations

import _random
import dataclasses
import hashlib
import json
import random
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

SPLITS = ("train", "valid", "test")
IGNORE_INDEX = -1  # a target left out of the loss (the models' cross-entropy ignores it)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
# Draws of one problem before `problem()` gives up: a split holds 1/16 of a space, so 1000 misses in a row means
# the level's space has (almost) no prompt in that split, not bad luck (probability (15/16)^1000 < 1e-28).
MAX_ATTEMPTS = 1000
# split_of: the first byte of the prompt's hash, mod 16 -> split. 0 and 1 are the held-out buckets.
_BUCKETS = ("valid", "test") + ("train",) * 14


class TaskError(ValueError):
    """A task used wrongly: a bad knob value, an unknown level or split, a prompt the solver cannot read."""


@dataclass(frozen=True, kw_only=True)
class TaskArgs:
    """Base of a task's knobs: subclass it as a frozen dataclass, one field per knob, each with a default.

    Fields are `int`, `float`, `str`, `bool` or a `Literal[...]` of choices (the base `Task.validate` checks the types
    and choices; ranges are the task's own `validate`). A list of harder levels is a comma-separated string
    (`hard_digits: str = "15,20"`), so the args stay flat, hashable and writable as `task.<field>=...`.
    """


@dataclass(frozen=True)
class Level:
    """A difficulty level: the inclusive range each difficulty knob is drawn from.

    `name` is "id" for the in-distribution level (always the first of a task's levels), else the knob's initial
    and its value (e.g. "d15": 15 digits). `in_distribution` is True for the "id" level only.
    """

    name: str
    knobs: dict[str, tuple[int, int]]
    in_distribution: bool


@dataclass(frozen=True)
class Problem:
    """One problem. `prompt` ends with the task's separator (e.g. "0123+4567="); `difficulty` holds the knob values
    of this problem (e.g. {"digits": 4}), plus, for some tasks, a measured quantity (the maze's path length)."""

    prompt: str
    answer: str
    difficulty: dict[str, int]


def key(field: str) -> str:
    """The user-facing name of a task knob, as errors quote it."""
    return f"task.{field}"


def require(ok: bool, field: str, message: str) -> None:
    """Raise TaskError("task.<field> <message>") unless `ok`."""
    if not ok:
        raise TaskError(f"{key(field)} {message}")


def int_list(field: str, text: str, above: int | None = None, minimum: int = 1) -> tuple[int, ...]:
    """Parse a comma-separated list knob ("15,20") into strictly increasing integers >= `minimum` and > `above`.

    An empty string is an empty list (no harder levels). `above` is the in-distribution maximum: a harder level
    must lie past the trained range, or it would not measure extrapolation.
    """
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise TaskError(f"{key(field)} must be comma-separated integers (e.g. '15,20'), got {text!r}") from None
    for v in values:
        require(v >= minimum, field, f"values must be >= {minimum}, got {v} in {text!r}")
        if above is not None:
            require(v > above, field, f"values must exceed the in-distribution maximum {above}, got {v} in {text!r}")
    require(list(values) == sorted(set(values)), field, f"values must be strictly increasing, got {text!r}")
    return values


def seeded(seed: int) -> random.Random:
    """random.Random(seed), in the same state, built without the Python-level `__init__` and `seed` wrappers, which
    add about a third to the cost of seeding; seeding is the largest single cost of drawing a simple problem."""
    rng = random.Random.__new__(random.Random)
    _random.Random.seed(rng, seed)
    rng.gauss_next = None  # type: ignore[attr-defined]  # what Random.seed sets besides the state (not in stubs)
    return rng


class Task:
    """A procedural task: subclass it, set the class attributes, implement the four per-task methods (`levels`,
    `generate`, `solve`, `max_prompt_answer`) and, if it has knobs with ranges, `validate` (call super first).

    Registered with `@tasks.register(name, args=ArgsCls)`, which sets `name`, `label` (if unset) and `args_cls`.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    args_cls: ClassVar[type[TaskArgs]] = TaskArgs
    description: ClassVar[str] = ""  # one line
    source: ClassVar[str] = ""  # the paper(s) the task follows
    symbols: ClassVar[str] = ""  # every character a prompt or answer may contain, each once
    sequence_answer: ClassVar[bool] = False  # per-position accuracy is meaningful (the answer is a sequence)
    # The generator's version: raise it whenever the same (knobs, split, level, seed, index) would give another
    # problem, so runs trained on the old problems keep their own data fingerprint and never mix with new ones.
    version: ClassVar[int] = 1

    def __init__(self, args: TaskArgs | None = None):
        args = self.args_cls() if args is None else args
        if type(args) is not self.args_cls:
            raise TaskError(
                f"task '{self.name}' takes {self.args_cls.__name__} arguments, got {type(args).__name__}: {args!r}"
            )
        self.args = args
        self.validate()
        levels = self.levels()
        self._check_levels(levels)
        self._levels = levels
        self._by_name = {lv.name: lv for lv in levels}
        self._tokenizer = CharTokenizer(self.symbols)
        self._args_dict = dataclasses.asdict(args)
        self._prefixes: dict[tuple[str, str, int], Any] = {}

    def __repr__(self) -> str:
        return f"<task {self.name} {self.args!r}>"

    def __getstate__(self) -> dict[str, Any]:
        # picklable (e.g. for data-loader worker processes): the cached hash states are not, and are rebuilt
        state = self.__dict__.copy()
        state["_prefixes"] = {}
        return state

    # --- per task -------------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the knobs (raise TaskError naming the key). The base checks each field's type and choices."""
        for f, hint in _field_hints(self.args_cls).items():
            v = getattr(self.args, f)
            origin = typing.get_origin(hint)
            if origin is Literal:
                choices = typing.get_args(hint)
                require(v in choices, f, f"must be one of {', '.join(map(repr, choices))}, got {v!r}")
            elif hint is bool:
                require(type(v) is bool, f, f"must be true or false, got {v!r}")
            elif hint is int:
                require(type(v) is int, f, f"must be an integer, got {v!r}")
            elif hint is float:
                require(type(v) in (int, float), f, f"must be a number, got {v!r}")
            elif hint is str:
                require(type(v) is str, f, f"must be a string, got {v!r}")
            else:
                raise TypeError(f"{self.args_cls.__name__}.{f}: a task knob is int, float, str, bool or a Literal")

    def levels(self) -> list[Level]:
        """The levels, in-distribution ("id") first, then harder ones in increasing difficulty."""
        raise NotImplementedError

    def generate(self, rng: random.Random, level: Level) -> Problem:
        """Draw one problem of `level` with `rng` (and nothing else: `problem()` relies on it being pure)."""
        raise NotImplementedError

    def solve(self, prompt: str) -> str:
        """The exact answer to a prompt, read from the prompt text alone (the knobs give only fixed formats)."""
        raise NotImplementedError

    def max_prompt_answer(self, level: Level) -> tuple[int, int]:
        """The most characters a prompt and an answer of `level` can have (analytic, not sampled)."""
        raise NotImplementedError

    def train_overrides(self, preset: str) -> dict[str, object]:
        """Training-length settings for this task at a preset (`train.max_steps`, ...), the same for every
        architecture; {} keeps the preset's own."""
        return {}

    # --- levels ---------------------------------------------------------------------------------------------

    def level(self, name: str) -> Level:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise TaskError(f"task '{self.name}' has no level {name!r}; levels: {', '.join(self._by_name)}") from None

    def _resolve(self, level: str | Level) -> Level:
        if isinstance(level, Level):
            if self._by_name.get(level.name) != level:
                raise TaskError(f"level {level.name!r} is not one of the levels of task '{self.name}' (levels())")
            return level
        return self.level(level)

    def _check_levels(self, levels: list[Level]) -> None:
        where = f"{type(self).__name__}.levels()"
        if not levels or levels[0].name != "id" or not levels[0].in_distribution:
            raise TypeError(f"{where} must start with the in-distribution level named 'id'")
        if any(lv.in_distribution for lv in levels[1:]):
            raise TypeError(f"{where}: only the first level is in-distribution")
        if len({lv.name for lv in levels}) != len(levels):
            raise TypeError(f"{where}: level names must be unique, got {[lv.name for lv in levels]}")
        for lv in levels:
            for k, (lo, hi) in lv.knobs.items():
                if not lo <= hi:
                    raise TypeError(f"{where}: level {lv.name!r} knob {k!r} has an empty range ({lo}, {hi})")

    # --- problems -------------------------------------------------------------------------------------------

    def split_of(self, problem: Problem) -> str:
        """The split a problem belongs to, from the hash of its prompt alone: the first byte of its BLAKE2b hash,
        mod 16, is 0 for "valid", 1 for "test", anything else for "train"."""
        return _BUCKETS[hashlib.blake2b(problem.prompt.encode(), digest_size=1).digest()[0] & 15]

    def problem(self, split: str, level: str | Level, seed: int, index: int) -> Problem:
        """Problem `index` of (split, level, seed): a pure function of those and of the task's name and args.

        The draw's seed is the 128-bit BLAKE2b hash of `json.dumps([name, args, split, level, seed, index,
        attempt], sort_keys=True)` (args as a dict, level by name), read as a little-endian integer; a draw whose
        prompt belongs to another split is rejected and the next attempt drawn.
        """
        lv = self._resolve(level)
        if type(index) is not int or index < 0:
            raise TaskError(f"problem index must be an integer >= 0, got {index!r}")
        prefix = self._prefix(split, lv.name, seed)
        for attempt in range(MAX_ATTEMPTS):
            h = prefix.copy()
            h.update(f", {index}, {attempt}]".encode())
            p = self.generate(seeded(int.from_bytes(h.digest(), "little")), lv)
            if _BUCKETS[hashlib.blake2b(p.prompt.encode(), digest_size=1).digest()[0] & 15] == split:
                return p
        raise TaskError(
            f"task '{self.name}' level {lv.name!r}: no {split} problem in {MAX_ATTEMPTS} draws; the level's problem "
            "space is too small to split (raise its knobs)"
        )

    def problems(self, split: str, level: str | Level, seed: int, n: int, start: int = 0) -> list[Problem]:
        """Problems start .. start+n-1 of (split, level, seed)."""
        return [self.problem(split, level, seed, i) for i in range(start, start + n)]

    def _prefix(self, split: str, level_name: str, seed: int) -> Any:
        """The hash state after the JSON text up to the index, cached per (split, level, seed)."""
        k = (split, level_name, seed)
        h = self._prefixes.get(k)
        if h is None:
            if split not in SPLITS:
                raise TaskError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
            if type(seed) is not int:
                raise TaskError(f"seed must be an integer, got {seed!r}")
            text = json.dumps([self.name, self._args_dict, split, level_name, seed], sort_keys=True)
            h = hashlib.blake2b(text[:-1].encode(), digest_size=16)  # the JSON text without its closing "]"
            if len(self._prefixes) >= 256:
                self._prefixes.clear()
            self._prefixes[k] = h
        return h

    # --- scoring --------------------------------------------------------------------------------------------

    def score(self, problem: Problem, prediction: str) -> dict[str, float]:
        """{"exact": 1.0 if the prediction is the answer else 0.0, "positions": the fraction of answer characters
        the prediction has at the same position (missing characters are wrong; extra ones cost only `exact`)}."""
        answer = problem.answer
        right = sum(a == b for a, b in zip(answer, prediction))
        return {"exact": float(prediction == answer), "positions": right / len(answer) if answer else 1.0}

    # --- tokens ---------------------------------------------------------------------------------------------

    def tokenizer(self) -> CharTokenizer:
        return self._tokenizer

    def max_len(self, levels: list[Level] | None = None) -> int:
        """The longest encoded sequence (<bos> prompt answer <eos>) over `levels` (every level by default)."""
        return 2 + max(sum(self.max_prompt_answer(lv)) for lv in (self._levels if levels is None else levels))


_HINTS: dict[type, dict[str, Any]] = {}


def _field_hints(cls: type[TaskArgs]) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = _HINTS[cls] = {f.name: resolved[f.name] for f in dataclasses.fields(cls)}
    return hints


class _Unknown(dict):
    """str.translate's table: a character without an id is an error, not passed through."""

    def __missing__(self, code: int) -> str:
        raise TaskError(f"character {chr(code)!r} is not one of the tokenizer's symbols")


class CharTokenizer:
    """One token per character: ids 0, 1, 2 are <pad>, <bos>, <eos>, then one id per symbol, in `symbols` order."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, symbols: str):
        if not symbols:
            raise TaskError("a character tokenizer needs at least one symbol")
        dup = sorted({c for c in symbols if symbols.count(c) > 1})
        if dup:
            raise TaskError(f"tokenizer symbols must be distinct, {dup} repeat in {symbols!r}")
        self.symbols = symbols
        self.vocab_size = len(SPECIALS) + len(symbols)
        # encode as str.translate to one character per id, then to bytes: a C loop, not a Python one
        self._table = _Unknown({ord(c): chr(i + len(SPECIALS)) for i, c in enumerate(symbols)})
        self._wide = self.vocab_size > 256

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.symbols == self.symbols

    def __hash__(self) -> int:
        return hash(self.symbols)

    def __repr__(self) -> str:
        return f"CharTokenizer({self.symbols!r})"

    def encode_text(self, text: str) -> list[int]:
        mapped = text.translate(self._table)
        return [ord(c) for c in mapped] if self._wide else list(mapped.encode("latin-1"))

    def encode(self, problem: Problem) -> tuple[list[int], int]:
        """(<bos> prompt answer <eos> as ids, the index of the first answer token)."""
        mapped = "\x01" + (problem.prompt + problem.answer).translate(self._table) + "\x02"  # BOS_ID, EOS_ID
        ids = [ord(c) for c in mapped] if self._wide else list(mapped.encode("latin-1"))
        return ids, 1 + len(problem.prompt)

    def decode(self, ids: typing.Iterable[int]) -> str:
        """The text of `ids` up to the first <eos>, without <pad> and <bos>."""
        out = []
        offset = len(SPECIALS)
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i < offset:
                continue
            if i >= self.vocab_size:
                raise TaskError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(self.symbols[i - offset])
        return "".join(out)

    def to_json(self) -> str:
        return json.dumps({"type": "char", "specials": list(SPECIALS), "symbols": self.symbols})

    @classmethod
    def from_json(cls, text: str) -> CharTokenizer:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskError(f"tokenizer JSON is not valid JSON: {e}") from None
        if not isinstance(raw, dict) or raw.get("type") != "char" or not isinstance(raw.get("symbols"), str):
            raise TaskError("tokenizer JSON is not a character tokenizer's ({'type': 'char', 'symbols': ...})")
        if raw.get("specials", list(SPECIALS)) != list(SPECIALS):
            raise TaskError(f"tokenizer JSON has specials {raw.get('specials')}, expected {list(SPECIALS)}")
        return cls(raw["symbols"])


def masked_targets(
    ids: list[int], answer_start: int, seq_len: int, loss: str = "answer"
) -> tuple[list[int], list[int]]:
    """The (input, target) pair of one sequence at a fixed length: `ids` padded to seq_len+1 with <pad>, x = all
    but the last, y = all but the first, and y = IGNORE_INDEX (-1) where the target is padding and, for
    loss="answer", where it is not an answer token or the closing <eos>. loss="all" keeps every real target
    (prompt, answer and <eos>; never <bos>, which is no position's target)."""
    n = len(ids)
    if n > seq_len + 1:
        raise TaskError(f"a sequence of {n} tokens does not fit seq_len={seq_len} (at most seq_len+1 tokens)")
    if not 1 <= answer_start < n:
        raise TaskError(f"answer_start must be in [1, {n - 1}] for a sequence of {n} tokens, got {answer_start}")
    if loss == "answer":
        first = answer_start
    elif loss == "all":
        first = 1
    else:
        raise TaskError(f"loss must be 'answer' or 'all', got {loss!r}")
    tail = seq_len + 1 - n
    x = list(ids) + [PAD_ID] * (tail - 1) if tail else list(ids[:-1])
    y = [IGNORE_INDEX] * (first - 1) + list(ids[first:]) + [IGNORE_INDEX] * tail
    return x, y

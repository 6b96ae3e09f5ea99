"""The data of a procedural task (`tasks/`): the training stream, the validation problems and the stored tokenizer.

A procedural task has no corpus to prepare: every problem is a pure function of (task, knobs, split, level, seed,
index), so training streams fresh problems (index = position in the run's stream, seed = the run's seed) and never
repeats one, and held-out problems are disjoint from training ones by construction (the task hashes each problem
into its split). What a study's `prepare` stage makes for a task run is `TaskData`: the task's tokenizer written once
as JSON (each run directory gets a copy, so it is self-contained like a TinyStories run with its SentencePiece model)
and a fingerprint of what makes the problems what they are (the task's name, its generator version and its
vocabulary), which enters every run id in place of a corpus fingerprint.

Each problem is encoded as `[BOS] prompt answer [EOS]`, padded to the model's context, and its targets masked
(`IGNORE_INDEX`) outside the answer tokens and the EOS when the loss is "answer", outside the padding when "all".
Validation loss is always over the answer (and EOS) tokens: the teacher-forced answer loss, comparable across runs
whatever loss they optimised.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import tasks
from benchctl.core.checkpoint import TASK_TOKENIZER_NAME
from benchctl.core.config import TaskConfig
from benchctl.core.errors import CheckpointError, ConfigError
from benchctl.core.files import atomic_write
from benchctl.core.sources import cache_root

TOKENIZER_FILE = TASK_TOKENIZER_NAME
TRAIN_LEVEL = "id"  # a task's training problems are drawn from its in-distribution level (its first)


def build_task(task: TaskConfig) -> tasks.Task:
    """The task object a run's config describes (its knobs already validated by the config)."""
    if task.is_stories:
        raise ConfigError("stories is the corpus task, not a procedural one")
    return tasks.build(task.name, task.args)


@dataclass(frozen=True)
class TaskData:
    """What a procedural task's runs read, in place of prepared TinyStories (`benchctl.core.data.Prepared`)."""

    name: str
    fingerprint: str
    tokenizer_path: Path
    n_train_tokens: int | None = None  # a stream of fresh problems has no epochs
    cache_hit: bool = field(default=False, compare=False)

    @property
    def source(self) -> str:
        return f"task:{self.name}"

    def tokenizer(self) -> tasks.CharTokenizer:
        return tasks.CharTokenizer.from_json(self.tokenizer_path.read_text())


def fingerprint(task: tasks.Task) -> str:
    """What makes a task's problems what they are, beside the knobs that the run id hashes already: its name, its
    generator's version (bumped whenever the same coordinates would give another problem) and its vocabulary."""
    blob = json.dumps(
        {"task": task.name, "version": task.version, "tokenizer": task.tokenizer().to_json()},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def prepare_task(task_cfg: TaskConfig) -> TaskData:
    """The task's tokenizer written (once) under the data cache, and the fingerprint its runs are keyed by."""
    task = build_task(task_cfg)
    fp = fingerprint(task)
    path = cache_root() / "tasks" / f"{task.name}-{fp[:16]}" / TOKENIZER_FILE
    hit = path.is_file()
    text = task.tokenizer().to_json()
    if not hit or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)
        hit = False
    return TaskData(name=task.name, fingerprint=fp, tokenizer_path=path, cache_hit=hit)


def encode(
    task: tasks.Task, tok: tasks.CharTokenizer, problem: tasks.Problem, seq_len: int, loss: str
) -> tuple[list[int], list[int]]:
    """One problem as model input and targets of length `seq_len`: (x, y), y masked by the loss."""
    ids, answer_start = tok.encode(problem)
    return tasks.masked_targets(ids, answer_start, seq_len, loss=loss)


def problem_batch(
    task: tasks.Task,
    tok: tasks.CharTokenizer,
    split: str,
    level: str,
    seed: int,
    indices: range | list[int],
    seq_len: int,
    loss: str,
) -> torch.Tensor:
    """Problems `indices` of (split, level, seed), encoded: (n, 2, seq_len) int64, x in [:, 0] and y in [:, 1]."""
    return encode_batch(task, tok, [task.problem(split, level, seed, i) for i in indices], seq_len, loss)


def encode_batch(
    task: tasks.Task, tok: tasks.CharTokenizer, problems: list[tasks.Problem], seq_len: int, loss: str
) -> torch.Tensor:
    """Problems already drawn, encoded: (n, 2, seq_len) int64, x in [:, 0] and y in [:, 1]."""
    rows = [encode(task, tok, p, seq_len, loss) for p in problems]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 2, seq_len)


class TaskSampler:
    """The training stream of a procedural task: micro-batch b holds problems [b*B, (b+1)*B) of the train split at
    the in-distribution level, under the run's seed. Like `WindowSampler`, every DDP rank steps through the same
    global micro-batch and keeps rows [rank::world_size], and the state (a count of micro-batches) resumes the
    exact stream."""

    def __init__(
        self,
        task: tasks.Task,
        seq_len: int,
        batch_size: int,
        seed: int,
        loss: str,
        rank: int = 0,
        world_size: int = 1,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or batch_size % world_size:
            raise ConfigError(
                f"train.batch_size={batch_size} must be a positive multiple of the number of "
                f"processes ({world_size}) so every rank gets the same share of each micro-batch"
            )
        self.task, self.tok = task, task.tokenizer()
        self.seq_len, self.batch_size, self.seed, self.loss = seq_len, batch_size, seed, loss
        self.rank, self.world_size = rank, world_size
        self.batches = 0  # global micro-batches drawn so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.batches * self.batch_size
        mine = range(start + self.rank, start + self.batch_size, self.world_size)
        self.batches += 1
        w = problem_batch(self.task, self.tok, "train", TRAIN_LEVEL, self.seed, mine, self.seq_len, self.loss)
        return w[:, 0].contiguous(), w[:, 1].contiguous()  # x, y: (B_local, T) each

    def state_dict(self) -> dict[str, Any]:
        return {
            "task": self.task.name,
            "batches": self.batches,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        mine = {"task": self.task.name, "seq_len": self.seq_len, "batch_size": self.batch_size}
        theirs = {k: d.get(k) for k in mine}
        if theirs != mine:
            raise CheckpointError(
                f"the checkpoint's problem stream was drawn with {theirs}, this run has {mine}; "
                "resume with the same task and batch settings"
            )
        self.batches = int(d["batches"])


def val_problems(task: tasks.Task, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """The fixed validation set of a task run: the first `n` problems of the valid split at the in-distribution
    level under `seed`, with answer-only targets: (n, 2, seq_len)."""
    if n < 1:
        raise ConfigError(f"eval.val_windows: must be >= 1, got {n}")
    return problem_batch(task, task.tokenizer(), "valid", TRAIN_LEVEL, seed, range(n), seq_len, "answer")

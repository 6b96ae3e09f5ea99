"""Run configuration: one frozen config tree per run, named presets, and dotted overrides.

torchtitan / nanoGPT style: `ModelArgs` is the network, `TrainConfig`, `DataConfig` and `EvalConfig` are the job.
`ModelArgs` holds the trunk every architecture shares (widths, depth, vocabulary, context, recurrence) and carries
the architecture's own arguments in `arch_args`, an instance of the frozen dataclass the architecture registered
(`@register("relaxed", args=RelaxedArgs)`): this module never lists an architecture's fields. Users still address
them as model keys (`--set model.lora_rank=8`); a key of another architecture is an error saying whose it is.

A `RunConfig` is built once from a preset name plus `--set section.key=value` overrides, validated (unknown keys,
wrong types, choices and impossible shapes are `ConfigError`s naming the key), resolved (every "auto"/None default
made explicit, e.g. the FFN hidden size from the llama2.c formula and the architecture's default recurrence), and
then never mutated: derive new configs with `dataclasses.replace`. The resolved config serialises to JSON (the
architecture's arguments flat in the "model" section, beside the trunk) and back losslessly, and is stored in the
runs table and in every checkpoint.

The `paper` preset is the published study's recipe: karpathy/llama2.c's defaults with multiple_of = 16.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from benchctl.core.errors import ConfigError, did_you_mean

if typing.TYPE_CHECKING:  # architectures imports torch; the CLI imports this module before it needs torch
    from architectures import BaseLM


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """The network's trunk. Symbols: dim d, n_layers L (unique blocks), hidden_dim h, n_recur R."""

    dim: int = 256
    n_layers: int = 4  # unique transformer blocks
    n_heads: int = 8
    n_kv_heads: int = 8
    hidden_dim: int | None = None  # None -> llama2.c: multiple_of * ceil(int(8*dim/3) / multiple_of)
    multiple_of: int = 16
    vocab_size: int = 4096
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0
    init_std: float = 0.02
    # Recurrence: passes over the blocks (frailt, relaxed) or core iterations (three-part).
    # None -> the architecture's default (4 passes; 7 core iterations), so effective depth is 16 at L=4.
    n_recur: int | None = None
    # The architecture's own arguments (its registered dataclass); None until resolved -> that dataclass's defaults.
    arch_args: Any = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    batch_size: int = 32  # micro batch
    grad_accum: int = 2
    max_steps: int = 25_000
    lr: float = 5e-4
    min_lr: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    warmup_steps: int = 1_000
    grad_clip: float = 1.0
    eval_interval: int = 500
    log_interval: int = 10
    ckpt_interval: int = 1_000
    # torch.compile the training step: true, false, or auto (None: compile where it was measured to pay, a bf16 step
    # on a CPU with a C++ compiler; see runtime.resolve_compile). Float rounding only: the maths is the same.
    compile: bool | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 where native (runtime.resolve_precision)
    # adamw: AdamW on every parameter; muon: torch.optim.Muon on the hidden 2-D matrices, AdamW on the rest
    optimizer: Literal["adamw", "muon"] = "adamw"
    # Ramp the recurrence up from 1 to model.n_recur over the first recur_curriculum_frac of the steps (passes for
    # looped models, the mean sampled depth for three-part); none trains at the full depth from the first step.
    recur_curriculum: Literal["none", "linear", "1-sqrt"] = "none"
    recur_curriculum_frac: float = 0.25
    # Set by `benchctl retrofit`: "<parent run id>:<init method>", the run whose weights this one starts from.
    init_from: str | None = None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "hub"  # "hub" (roneneldan/TinyStories) or a path: directory of txt, .jsonl, .parquet
    tokenizer_stories: int = 100_000  # stories sampled from train to fit the tokenizer
    max_train_stories: int | None = None  # cap the train split (None = all)
    max_valid_stories: int | None = None


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Where a run's numbers are mirrored besides results.db (which stays the source of truth)."""

    # also write every metric row to <db dir>/tensorboard/<run id> (or $BENCHCTL_TENSORBOARD=1)
    tensorboard: bool = False


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    val_windows: int = 3_200  # fixed validation windows of seq_len+1 tokens (llama2.c: 100 iters x 32)
    val_batch_size: int = 32
    val_seed: int = 1337  # the same windows for every model and every evaluation


STORIES = "stories"  # the default task: next-token prediction on TinyStories, read by the data layer


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """What the run learns. `name` is "stories" (TinyStories language modelling, the default: every run stored before
    tasks existed is one) or a registered procedural task (`tasks/`), whose own knobs sit in `args` (an instance of
    the dataclass the task registered) and flat in the "task" section of the JSON form, like an architecture's."""

    name: str = STORIES
    # The optimised loss: "answer" counts the answer tokens only (a task's prompt is given, not predicted), "all"
    # every token; auto resolves to answer for a procedural task and all for stories (its only meaningful choice).
    loss: Literal["auto", "answer", "all"] = "auto"
    args: Any = None

    @property
    def is_stories(self) -> bool:
        return self.name == STORIES


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    arch: str = "control"
    preset: str = "paper"
    seed: int = 0
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    task: TaskConfig = field(default_factory=TaskConfig)

    @property
    def train_seq_len(self) -> int:
        """The length of a training sequence: the model's context on stories; on a procedural task the longest
        problem of the level it trains on (the context is longer, for the harder levels it is scored on, and
        training sequences are padded only to what training needs: the FLOPs counted are the FLOPs run)."""
        if self.task.is_stories:
            return self.model.max_seq_len
        return task_shape(self.task).train_len

    @property
    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.train.grad_accum * self.train_seq_len

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; the architecture's own arguments sit flat in "model", beside the trunk, and the
        task's own knobs flat in "task", beside its name and loss."""
        out = dataclasses.asdict(
            replace(self, model=replace(self.model, arch_args=None), task=replace(self.task, args=None))
        )
        del out["model"]["arch_args"]
        del out["task"]["args"]
        if self.model.arch_args is not None:
            out["model"].update(dataclasses.asdict(self.model.arch_args))
        if self.task.args is not None:
            out["task"].update(dataclasses.asdict(self.task.args))
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from None
        return from_dict(raw)


SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "train": TrainConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "task": TaskConfig,
}
TOP_LEVEL = ("arch", "preset", "seed")
MAX_SEED = 2**32 - 1
# the containers of the architecture's and the task's own keys, not keys themselves
_NOT_A_KEY = ("model.arch_args", "task.args")

# Presets are plain data: overrides on top of the defaults above (which are the paper recipe). A preset may set
# an architecture's own key (e.g. model.lora_rank); it applies to that architecture and is ignored for the others.
PRESETS: dict[str, dict[str, Any]] = {
    # The published study's recipe, exactly.
    "paper": {},
    # A CPU-scale version of the study: same four architectures, same effective depth 16 for the recurrent ones,
    # same recipe shape (AdamW, warmup + cosine, accumulation, clipping, tied embeddings, llama2.c init).
    # Sized so the four-model comparison trains on a 2-core CPU in minutes, not hours.
    "small": {
        "model.dim": 64,
        "model.n_heads": 4,
        "model.n_kv_heads": 4,
        "model.vocab_size": 4096,
        "model.max_seq_len": 128,
        "train.batch_size": 16,
        "train.grad_accum": 1,
        "train.max_steps": 400,
        "train.lr": 1.5e-3,
        "train.warmup_steps": 80,
        "train.eval_interval": 50,
        "train.log_interval": 5,
        "train.ckpt_interval": 100,
        "train.compile": False,  # minutes-long runs: compiling would cost more than it saves
        "data.tokenizer_stories": 20_000,
        "eval.val_windows": 128,
        "eval.val_batch_size": 32,
    },
    # Seconds, for tests and smoke runs.
    "tiny": {
        "model.dim": 32,
        "model.n_heads": 2,
        "model.n_kv_heads": 2,
        "model.vocab_size": 512,
        "model.max_seq_len": 32,
        "model.lora_rank": 4,
        "train.batch_size": 8,
        "train.grad_accum": 2,
        "train.max_steps": 30,
        "train.lr": 3e-3,
        "train.warmup_steps": 5,
        "train.eval_interval": 10,
        "train.log_interval": 5,
        "train.ckpt_interval": 10,
        "train.compile": False,
        "data.tokenizer_stories": 2_000,
        "data.max_train_stories": 2_000,
        "data.max_valid_stories": 400,
        "eval.val_windows": 32,
        "eval.val_batch_size": 16,
    },
}


# The preset that is a smoke run (its comment above): the stages after training do the least work that still runs
# every one of their paths, each declaring that work in its options next to its full defaults.
SMOKE_PRESET = "tiny"


def is_smoke(preset: str | None) -> bool:
    return preset == SMOKE_PRESET


def llama2c_hidden_dim(dim: int, multiple_of: int) -> int:
    """llama2.c's SwiGLU width: 2/3 of 4*dim, rounded up to a multiple (688 at dim 256, multiple_of 16)."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# --------------------------------------------------------------------------------------------------------------------
# Parsing and validation


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _parse_scalar(key: str, tp: Any, value: Any) -> Any:
    """Coerce `value` (a CLI string or a JSON value) to the annotated type `tp`, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        parsed = _parse_scalar(key, type(choices[0]), value)
        _require(parsed in choices, key, f"must be one of {', '.join(map(str, choices))}; got {parsed!r}")
        return parsed
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        # "auto" reads as None too: every optional key's None means "derive it" (hidden_dim, n_recur, lora_rank)
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "auto")):
            return None
        return _parse_scalar(key, args[0], value)
    if value is None:
        raise ConfigError(f"{key}: None is not allowed (expected {tp.__name__})")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    f = math.nan
                if math.isfinite(f) and f.is_integer():
                    return int(f)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - a bug in this file


def _arch_class(arch: str) -> type[BaseLM]:
    import architectures  # torch: kept out of 'benchctl --help' and 'benchctl plans', which import this module

    try:
        return architectures.get(arch)
    except architectures.UnknownArchitectureError as e:
        raise ConfigError(str(e)) from None


def _arch_fields(arch_cls: type[BaseLM]) -> dict[str, Any]:
    """The architecture's own keys (model.<field>) and their annotated types; a trunk name there is a bug."""
    types_ = _field_types(arch_cls.args_cls)
    clash = sorted(set(types_) & {f.name for f in fields(ModelArgs)})
    if clash:
        raise ConfigError(f"architecture '{arch_cls.name}' declares {', '.join(clash)}, already a trunk model key")
    return types_


def _task_class(name: str) -> Any:
    """The registered procedural task `name` (None for stories), or a ConfigError listing every task."""
    if name == STORIES:
        return None
    import tasks  # plain Python, but only config of a task run needs it

    try:
        return tasks.get(name)
    except tasks.UnknownTaskError:
        known = task_names()
        raise ConfigError(f"unknown task '{name}'{did_you_mean(name, known)} available: {', '.join(known)}") from None


def task_names() -> list[str]:
    """Every task a run can learn: stories (the default) first, then the registered procedural tasks."""
    import tasks

    return [STORIES, *tasks.names()]


def _task_fields(name: str) -> dict[str, Any]:
    """The task's own keys (task.<field>) and their annotated types; none for stories."""
    task_cls = _task_class(name)
    if task_cls is None:
        return {}
    types_ = _field_types(task_cls.args_cls)
    clash = sorted(set(types_) & {f.name for f in fields(TaskConfig)})
    if clash:
        raise ConfigError(f"task '{name}' declares {', '.join(clash)}, already a key of the task section")
    return types_


def all_keys(arch: str = "control", task: str = STORIES) -> list[str]:
    """Every key a config of `arch` on `task` accepts: the top level, each section's fields, the architecture's own
    and the task's own."""
    keys = list(TOP_LEVEL)
    for section, cls in SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in fields(cls) if f"{section}.{f.name}" not in _NOT_A_KEY]
    keys += [f"model.{name}" for name in _arch_fields(_arch_class(arch))]
    return keys + [f"task.{name}" for name in _task_fields(task)]


def task_key_owners(key: str) -> list[str]:
    """The registered tasks whose own knobs include `key` ("task.max_digits" -> ["addition"])."""
    if not key.startswith("task."):
        return []
    name = key.split(".", 1)[1]
    return [t for t in task_names() if name in _task_fields(t)]


def key_owners(key: str) -> list[str]:
    """The registered architectures whose own arguments include `key` ("model.lora_rank" -> ["relaxed"])."""
    import architectures  # torch: kept out of 'benchctl --help' and 'benchctl plans', which import this module

    if not key.startswith("model."):
        return []
    name = key.split(".", 1)[1]
    return [a for a in architectures.names() if name in _arch_fields(architectures.get(a))]


def overrides_for(arch: str, overrides: dict[str, Any] | None, archs: list[str]) -> dict[str, Any]:
    """The overrides that apply to `arch` in a run over several architectures (`archs`, which holds it).

    Each architecture takes its own keys: a key of another architecture in `archs` is left out for this one (a
    sweep with `--set model.lora_rank=8` changes relaxed and leaves the control as it is). A key that no
    architecture of `archs` has is kept, so `make_config` refuses it, saying whose it is.
    """
    out = {}
    for key, value in (overrides or {}).items():
        owners = key_owners(key)
        if not owners or arch in owners or not set(owners) & set(archs):
            out[key] = value
    return out


def choices(arch: str = "control", task: str = STORIES) -> dict[str, tuple[Any, ...]]:
    """Keys with a closed set of values (a `Literal` annotation) for `arch` on `task`, and their choices."""
    out: dict[str, tuple[Any, ...]] = {}
    typed = [(f"{section}.{name}", tp) for section, cls in SECTIONS.items() for name, tp in _field_types(cls).items()]
    typed += [(f"model.{name}", tp) for name, tp in _arch_fields(_arch_class(arch)).items()]
    typed += [(f"task.{name}", tp) for name, tp in _task_fields(task).items()]
    for key, tp in typed:
        if typing.get_origin(tp) is Literal:
            out[key] = typing.get_args(tp)
    return out


def _apply(
    flat: dict[str, Any],
    overrides: dict[str, Any],
    arch: str,
    task: str = STORIES,
    *,
    skip_other_archs: bool = False,
) -> None:
    """Set `overrides` on `flat`. A key of another architecture is skipped (presets, configs stored before the
    architectures owned their keys) or refused with whose it is; so is a knob of another task; any other unknown
    key suggests the closest one."""
    known = all_keys(arch, task)
    for key, value in overrides.items():
        if key in known:
            flat[key] = value
            continue
        owners = key_owners(key)
        if owners and skip_other_archs:
            continue
        if owners:
            whose = " and ".join(f"'{o}'" for o in owners)
            raise ConfigError(f"config key '{key}' belongs to architecture {whose}, not to '{arch}'")
        task_owners = task_key_owners(key)
        if task_owners:
            whose = " and ".join(f"'{o}'" for o in task_owners)
            raise ConfigError(f"config key '{key}' is a knob of task {whose}, not of '{task}' (set task.name)")
        raise ConfigError(f"unknown config key '{key}'{did_you_mean(key, known)} valid keys: {', '.join(known)}")


def _flat_defaults(arch: str, task: str = STORIES) -> dict[str, Any]:
    task_cls = _task_class(task)
    defaults = RunConfig(
        arch=arch,
        model=ModelArgs(arch_args=_arch_class(arch).args_cls()),
        task=TaskConfig(name=task, args=None if task_cls is None else task_cls.args_cls()),
    )
    return _flatten(defaults.to_dict())


def _flatten(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                out[f"{k}.{k2}"] = v2
        else:
            out[k] = v
    return out


def _build(flat: dict[str, Any]) -> RunConfig:
    top_types = _field_types(RunConfig)
    kwargs: dict[str, Any] = {k: _parse_scalar(k, top_types[k], flat[k]) for k in TOP_LEVEL}
    for section, cls in SECTIONS.items():
        ftypes = _field_types(cls)
        sec = {
            name: _parse_scalar(f"{section}.{name}", tp, flat[f"{section}.{name}"])
            for name, tp in ftypes.items()
            if f"{section}.{name}" not in _NOT_A_KEY
        }
        kwargs[section] = cls(**sec)
    arch_cls = _arch_class(kwargs["arch"])
    own = {
        name: _parse_scalar(f"model.{name}", tp, flat[f"model.{name}"]) for name, tp in _arch_fields(arch_cls).items()
    }
    kwargs["model"] = replace(kwargs["model"], arch_args=arch_cls.args_cls(**own))
    task_cls = _task_class(kwargs["task"].name)
    if task_cls is not None:
        knobs = {
            name: _parse_scalar(f"task.{name}", tp, flat[f"task.{name}"])
            for name, tp in _task_fields(kwargs["task"].name).items()
        }
        kwargs["task"] = replace(kwargs["task"], args=task_cls.args_cls(**knobs))
    return RunConfig(**kwargs)


def parse_set(items: list[str] | tuple[str, ...] | None) -> dict[str, str]:
    """`["train.lr=1e-3", "model.dim=128"]` -> {"train.lr": "1e-3", ...}; a malformed item is a ConfigError."""
    out: dict[str, str] = {}
    for item in items or ():
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. --set train.lr=3e-4), got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def preset_names() -> list[str]:
    return list(PRESETS)


def make_config(
    preset: str = "paper",
    arch: str = "control",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> RunConfig:
    """Build, validate and resolve the config for one run: preset -> task -> overrides -> resolve -> validate.

    On a procedural task (`task.name` in the overrides) the task's own training length at the preset comes after
    the preset (the same for every architecture, so comparisons stay fair), the vocabulary is the task's tokenizer
    and, unless `model.max_seq_len` is given, the context is the task's longest problem over all its levels."""
    if preset not in PRESETS:
        hint = did_you_mean(preset, PRESETS)
        raise ConfigError(f"unknown preset '{preset}'{hint} available: {', '.join(PRESETS)}")
    overrides = dict(overrides or {})
    task = _parse_scalar("task.name", str, overrides.get("task.name", STORIES))
    flat = _flat_defaults(arch, task)
    _apply(flat, PRESETS[preset], arch, task, skip_other_archs=True)
    task_cls = _task_class(task)
    if task_cls is not None:
        _apply(flat, task_cls(task_cls.args_cls()).train_overrides(preset), arch, task)
    flat.update({"arch": arch, "preset": preset, "seed": seed})
    _apply(flat, overrides, arch, task)
    if task_cls is not None:
        built = _build(flat)
        shape = task_shape(built.task)
        flat["model.vocab_size"] = shape.vocab_size
        if "model.max_seq_len" not in overrides:
            flat["model.max_seq_len"] = shape.seq_len
    return resolve(_build(flat))


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Rebuild a config from its JSON form, rejecting unknown keys (a config from another benchctl version).

    Configs stored before the architectures owned their arguments have every architecture's keys in "model";
    the keys of other architectures are dropped, so those configs load as the config they always described.
    Configs stored before tasks existed have no "task" section: they are stories runs.
    """
    if not isinstance(raw, dict):
        raise ConfigError("config JSON must be an object")
    arch = raw.get("arch", RunConfig.arch)
    if not isinstance(arch, str):
        raise ConfigError(f"arch: expected a string, got {arch!r}")
    section = raw.get("task") or {}
    task = section.get("name", STORIES) if isinstance(section, dict) else None
    if not isinstance(task, str):
        raise ConfigError(f"task.name: expected a string, got {task!r}")
    flat = _flat_defaults(arch, task)
    _apply(flat, _flatten(raw), arch, task, skip_other_archs=True)
    return resolve(_build(flat))


@dataclass(frozen=True)
class TaskShape:
    """What a procedural task asks of the model: its tokenizer's vocabulary, the context its longest problem over
    every level needs and the level that sets it, and the length of its training sequences (its longest problem of
    the in-distribution level). Lengths are of inputs: the encoded problem less its last token."""

    vocab_size: int
    seq_len: int
    longest_level: str
    train_len: int


@functools.lru_cache(maxsize=64)
def task_shape(task: TaskConfig) -> TaskShape:
    """The vocabulary and lengths of a procedural task with these knobs (a ConfigError for a bad knob)."""
    import tasks

    task_cls = _task_class(task.name)
    try:
        t = task_cls(task.args if task.args is not None else task_cls.args_cls())
        levels = t.levels()
        lengths = [(t.max_len([lv]), lv.name) for lv in levels]
        vocab = t.tokenizer().vocab_size
    except tasks.TaskError as e:
        raise ConfigError(str(e)) from None
    longest, level = max(lengths)
    return TaskShape(vocab_size=vocab, seq_len=longest - 1, longest_level=level, train_len=lengths[0][0] - 1)


def resolve(cfg: RunConfig) -> RunConfig:
    """Make every default explicit and validate. Idempotent: resolve(resolve(c)) == resolve(c)."""
    arch_cls = _arch_class(cfg.arch)
    m = cfg.model
    own = arch_cls.args_cls() if m.arch_args is None else m.arch_args
    if type(own) is not arch_cls.args_cls:
        raise ConfigError(
            f"model.arch_args: architecture '{cfg.arch}' takes {arch_cls.args_cls.__name__}, got {type(own).__name__}"
        )
    if m.hidden_dim is None:
        if m.dim <= 0 or m.multiple_of <= 0:
            _validate_model(m)
        m = replace(m, hidden_dim=llama2c_hidden_dim(m.dim, m.multiple_of))
    _validate_model(m)  # an architecture's "auto" argument may be a function of the trunk's shapes
    m = replace(m, arch_args=arch_cls.resolve_arch_args(own, m))
    if m.n_recur is None:
        m = replace(m, n_recur=arch_cls.default_n_recur(m))
    cfg = replace(cfg, model=m, task=_resolve_task(cfg.task))
    validate(cfg)
    try:
        arch_cls.validate_args(cfg.model)
    except ValueError as e:  # the architecture's own check (its message names the key): a user error
        raise ConfigError(str(e)) from None
    return cfg


def _resolve_task(task: TaskConfig) -> TaskConfig:
    task_cls = _task_class(task.name)
    if task_cls is None:
        _require(task.args is None, "task.args", "stories has no knobs")
        _require(task.loss in ("auto", "all"), "task.loss", "stories learns every token: must be all (or auto)")
        return replace(task, loss="all")
    args = task_cls.args_cls() if task.args is None else task.args
    if type(args) is not task_cls.args_cls:
        raise ConfigError(
            f"task.args: task '{task.name}' takes {task_cls.args_cls.__name__}, got {type(args).__name__}"
        )
    return replace(task, args=args, loss="answer" if task.loss == "auto" else task.loss)


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _validate_model(m: ModelArgs) -> None:
    _require(m.dim > 0, "model.dim", f"must be positive, got {m.dim}")
    _require(m.n_layers > 0, "model.n_layers", f"must be positive, got {m.n_layers}")
    _require(m.n_heads > 0, "model.n_heads", f"must be positive, got {m.n_heads}")
    _require(m.multiple_of > 0, "model.multiple_of", f"must be positive, got {m.multiple_of}")
    _require(m.dim % m.n_heads == 0, "model.dim", f"{m.dim} is not divisible by model.n_heads={m.n_heads}")
    _require(m.n_kv_heads > 0, "model.n_kv_heads", f"must be positive, got {m.n_kv_heads}")
    _require(
        m.n_heads % m.n_kv_heads == 0,
        "model.n_heads",
        f"{m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}",
    )
    _require(
        (m.dim // m.n_heads) % 2 == 0,
        "model.dim",
        f"head_dim = dim/n_heads = {m.dim // m.n_heads} must be even for RoPE",
    )


def validate(cfg: RunConfig) -> None:
    m, t, d, e = cfg.model, cfg.train, cfg.data, cfg.eval
    _validate_model(m)
    for key, value in (
        ("train.lr", t.lr),
        ("train.min_lr", t.min_lr),
        ("train.weight_decay", t.weight_decay),
        ("train.grad_clip", t.grad_clip),
        ("train.recur_curriculum_frac", t.recur_curriculum_frac),
        ("model.norm_eps", m.norm_eps),
        ("model.init_std", m.init_std),
        ("model.rope_theta", m.rope_theta),
    ):  # an inf or nan passes every comparison below unnoticed and fails steps later, mid-run
        _require(math.isfinite(value), key, f"must be a finite number, got {value}")
    _require(m.hidden_dim is not None and m.hidden_dim > 0, "model.hidden_dim", f"must be positive, got {m.hidden_dim}")
    _require(m.max_seq_len > 1, "model.max_seq_len", f"must be > 1, got {m.max_seq_len}")
    if cfg.task.is_stories:
        _require(
            259 <= m.vocab_size <= 65535,
            "model.vocab_size",
            "must be in [259, 65535] (byte fallback needs 256 + 3 special tokens; tokens are stored as uint16), "
            f"got {m.vocab_size}",
        )
    else:
        shape = task_shape(cfg.task)
        _require(
            m.vocab_size == shape.vocab_size,
            "model.vocab_size",
            f"task '{cfg.task.name}' has {shape.vocab_size} tokens (its tokenizer's vocabulary), got {m.vocab_size}",
        )
        _require(
            m.max_seq_len >= shape.seq_len,
            "model.max_seq_len",
            f"task '{cfg.task.name}' needs a context of at least {shape.seq_len} tokens (its longest problem, level "
            f"{shape.longest_level}), got {m.max_seq_len}",
        )
    _require(m.norm_eps > 0, "model.norm_eps", f"must be positive, got {m.norm_eps}")
    _require(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    _require(m.init_std > 0, "model.init_std", f"must be positive, got {m.init_std}")
    _require(m.n_recur is not None and m.n_recur >= 1, "model.n_recur", f"must be >= 1, got {m.n_recur}")
    for key, allowed in choices(cfg.arch, cfg.task.name).items():  # configs built in code skip the parser's check
        section, name = key.split(".")
        holder = getattr(cfg, section)
        if hasattr(holder, name):
            value = getattr(holder, name)
        else:
            value = getattr(m.arch_args if section == "model" else cfg.task.args, name)
        _require(value in allowed, key, f"must be one of {', '.join(map(str, allowed))}; got {value!r}")
    # numpy's generator, seeded with it, takes no more than 32 bits
    _require(0 <= cfg.seed <= MAX_SEED, "seed", f"must be in [0, {MAX_SEED}], got {cfg.seed}")
    _require(t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
    _require(t.grad_accum >= 1, "train.grad_accum", f"must be >= 1, got {t.grad_accum}")
    _require(t.max_steps >= 1, "train.max_steps", f"must be >= 1, got {t.max_steps}")
    _require(t.lr > 0, "train.lr", f"must be positive, got {t.lr}")
    _require(0 <= t.min_lr <= t.lr, "train.min_lr", f"must be in [0, train.lr], got {t.min_lr}")
    _require(0 <= t.beta1 < 1, "train.beta1", f"must be in [0, 1), got {t.beta1}")
    _require(0 <= t.beta2 < 1, "train.beta2", f"must be in [0, 1), got {t.beta2}")
    _require(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    _require(
        0 <= t.warmup_steps <= t.max_steps,
        "train.warmup_steps",
        f"must be in [0, train.max_steps={t.max_steps}], got {t.warmup_steps}",
    )
    _require(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0 (0 = off), got {t.grad_clip}")
    _require(t.eval_interval >= 1, "train.eval_interval", f"must be >= 1, got {t.eval_interval}")
    _require(t.log_interval >= 1, "train.log_interval", f"must be >= 1, got {t.log_interval}")
    _require(t.ckpt_interval >= 1, "train.ckpt_interval", f"must be >= 1, got {t.ckpt_interval}")
    _require(
        0 < t.recur_curriculum_frac <= 1,
        "train.recur_curriculum_frac",
        f"must be in (0, 1], got {t.recur_curriculum_frac}",
    )
    dev = t.device
    _require(
        dev in ("auto", "cpu", "cuda", "mps") or (dev.startswith("cuda:") and dev[5:].isdigit()),
        "train.device",
        f"must be auto, cpu, cuda, cuda:N or mps; got {dev!r}",
    )
    _require(d.source.strip() != "", "data.source", "must be 'hub' or a path")
    _require(d.tokenizer_stories >= 1, "data.tokenizer_stories", f"must be >= 1, got {d.tokenizer_stories}")
    for key, val in (("data.max_train_stories", d.max_train_stories), ("data.max_valid_stories", d.max_valid_stories)):
        _require(val is None or val >= 1, key, f"must be >= 1 or none, got {val}")
    _require(e.val_windows >= 1, "eval.val_windows", f"must be >= 1, got {e.val_windows}")
    _require(e.val_batch_size >= 1, "eval.val_batch_size", f"must be >= 1, got {e.val_batch_size}")


# Fields that change how a run is logged, not what it computes; they do not enter the run id.
_NOT_IDENTITY = ("train.log_interval", "train.ckpt_interval", "train.eval_interval", "data.source", "log.tensorboard")


# Keys added after runs were already stored: at their default they stay out of the run id, so every run trained
# before they existed keeps its id (and is found, skipped or resumed as before).
_ID_OMITTED_AT_DEFAULT: dict[str, Any] = {
    "train.optimizer": "adamw",
    "train.recur_curriculum": "none",
    "train.recur_curriculum_frac": 0.25,
    "train.init_from": None,
}


def _identity_flat(cfg: RunConfig) -> dict[str, Any]:
    """The settings that make a run what it is, flattened. train.compile's auto (None) counts as false, the default
    it replaced: like train.dtype=auto, the setting is the identity and what it resolved to on a machine is recorded
    with the run (compiled, compile_reason), so runs stored before auto existed keep their ids."""
    flat = {k: v for k, v in _flatten(cfg.to_dict()).items() if k not in _NOT_IDENTITY}
    if "train.compile" in flat and flat["train.compile"] is None:
        flat["train.compile"] = False
    return flat


def identity_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """`key: a != b` for every setting that makes two configs different runs (logging settings are not among them:
    a run may be resumed with another log interval or with TensorBoard switched on)."""
    fa, fb = _identity_flat(a), _identity_flat(b)
    keys = list(dict.fromkeys([*fa, *fb]))
    return [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in keys if fa.get(k) != fb.get(k)]


def run_id(cfg: RunConfig, data_fingerprint: str) -> str:
    """A stable id for (resolved config, data): reruns of the same experiment find the same row.

    The data source path is replaced by the fingerprint of its content, so the same data reached by another path
    is the same run, and changed data is a different one. The hash covers the trunk and this architecture's own
    arguments only, so registering another architecture never changes an id. (Ids computed before the
    architectures owned their arguments also hashed every other architecture's keys; those ids changed once with
    that move. A run already stored keeps its recorded id.)
    """
    flat = _identity_flat(cfg)
    for k, default in _ID_OMITTED_AT_DEFAULT.items():
        if flat.get(k) == default:
            flat.pop(k, None)
    if cfg.task.is_stories:  # the default task: every run stored before tasks existed keeps its id
        flat = {k: v for k, v in flat.items() if not k.startswith("task.")}
    flat["data.fingerprint"] = data_fingerprint
    blob = json.dumps(flat, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:10]
    task = "" if cfg.task.is_stories else f"{cfg.task.name}-"
    return f"{cfg.arch}-{task}{cfg.preset}-s{cfg.seed}-{digest}"


# the hash that ends a run id (`run_id`): what tells apart runs of one name (architecture, task, preset, seed) whose
# configs or data differ
_ID_DIGEST = 10
_SHORT_DIGEST = 4  # the fewest hash characters a short id keeps, when it needs any


def short_run_ids(ids: typing.Iterable[str]) -> dict[str, str]:
    """id -> the shortest form of it that still tells it apart from every other id given: its name without the hash
    (`control-tiny-s0`) where no other id has that name, else the name and the shortest prefix of the hash (at least
    4 characters) no other id of that name shares. An id not of `run_id`'s form is kept whole. What a table that has
    no room for whole ids shows."""
    ids = list(dict.fromkeys(ids))
    by_name: dict[str, list[str]] = {}
    for i in ids:
        name, sep, digest = i.rpartition("-")
        if sep and len(digest) == _ID_DIGEST and all(c in "0123456789abcdef" for c in digest):
            by_name.setdefault(name, []).append(i)
    out = {i: i for i in ids}
    for name, same in by_name.items():
        if len(same) == 1 and name not in out:  # an id could be exactly another id's name: then keep the hash
            out[same[0]] = name
            continue
        for n in range(_SHORT_DIGEST, _ID_DIGEST + 1):
            if len({i[-_ID_DIGEST:][:n] for i in same}) == len(same):
                break
        for i in same:
            out[i] = f"{name}-{i[-_ID_DIGEST:][:n]}"
    return out

"""Tests of the run configuration (benchctl/config.py): presets, the study's paper recipe, JSON round trip, the
architectures' own arguments (keys, choices, configs stored in the older flat format), every override error, and
the stable run id."""

from __future__ import annotations

import dataclasses
import json

import pytest

import architectures
from architectures.relaxed import RelaxedArgs
from benchctl.core.config import (
    PRESETS,
    ModelArgs,
    RunConfig,
    choices,
    from_dict,
    identity_diff,
    llama2c_hidden_dim,
    make_config,
    overrides_for,
    parse_set,
    preset_names,
    resolve,
    run_id,
)
from benchctl.core.errors import BenchctlError, ConfigError

ALL = [(p, a) for p in PRESETS for a in architectures.names()]


def _err(overrides=None, *, preset="tiny", arch="control", seed=0) -> str:
    """The ConfigError message for a config that must be rejected."""
    with pytest.raises(ConfigError) as info:
        make_config(preset, arch, seed=seed, overrides=overrides)
    msg = str(info.value)
    assert "\n" not in msg, "errors are one line"
    return msg


# ---- presets --------------------------------------------------------------------------------------------------------


def test_preset_names():
    assert preset_names() == ["paper", "small", "tiny"]


@pytest.mark.parametrize("preset,arch", ALL)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_preset_builds_resolved(preset, arch):
    cfg = make_config(preset, arch)
    m = cfg.model
    assert (cfg.preset, cfg.arch) == (preset, arch)
    assert m.hidden_dim == llama2c_hidden_dim(m.dim, m.multiple_of)
    assert type(m.arch_args) is architectures.get(arch).args_cls
    if arch == "relaxed":
        assert m.arch_args.lora_alpha == float(m.arch_args.lora_rank)
    assert m.n_recur == architectures.get(arch).default_n_recur(m)
    # The study's recurrent models keep its effective depth 16 at every preset (four unique blocks).
    depth = architectures.build_shapes(arch, m).effective_depth()
    if arch in ("control", "frailt", "three-part", "relaxed"):
        assert depth == (4 if arch == "control" else 16)


def test_paper_preset_is_spec_section_1():
    cfg = make_config("paper", "control")
    m, t = cfg.model, cfg.train
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim) == (256, 4, 8, 8, 32)
    assert m.hidden_dim == 688 and m.multiple_of == 16
    assert llama2c_hidden_dim(256, 32) == 704  # the llama2.c default multiple_of does NOT match the study
    assert (m.vocab_size, m.max_seq_len) == (4096, 128)
    assert (m.norm_eps, m.rope_theta, m.dropout, m.init_std) == (1e-5, 1e4, 0.0, 0.02)
    assert (t.batch_size, t.grad_accum, cfg.tokens_per_step) == (32, 2, 8192)
    assert t.max_steps == 25_000 and t.max_steps * cfg.tokens_per_step == 204_800_000
    assert (t.lr, t.beta1, t.beta2, t.weight_decay) == (5e-4, 0.9, 0.95, 0.1)
    assert (t.warmup_steps, t.min_lr, t.grad_clip) == (1_000, 0.0, 1.0)
    # The study's open points at their recorded defaults (sampled depth and truncation off in "paper").
    assert make_config("paper", "frailt").model.arch_args.frailt_init == "zeros"
    tp = make_config("paper", "three-part").model.arch_args
    assert (tp.state_init_std, tp.recur_sampling, tp.backprop_depth, tp.recur_out) == (0.02, "fixed", 0, "norm")
    rx = make_config("paper", "relaxed").model.arch_args
    assert (rx.lora_rank, rx.lora_alpha, rx.lora_init) == (16, 16.0, "normal")
    assert make_config("paper", "frailt").model.n_recur == 4
    assert make_config("paper", "relaxed").model.n_recur == 4
    assert make_config("paper", "three-part").model.n_recur == 7


# ---- JSON round trip and resolve -------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,arch", ALL)
def test_json_round_trip_is_lossless(preset, arch):
    cfg = make_config(preset, arch, seed=3)
    text = cfg.to_json()
    back = RunConfig.from_json(text)
    assert back == cfg
    assert back.to_json() == text
    assert json.loads(cfg.to_json(indent=2)) == json.loads(text)


def test_json_round_trip_keeps_overridden_values():
    cfg = make_config(
        "tiny",
        "three-part",
        overrides={
            "model.hidden_dim": "100",
            "model.recur_sigma": "1",
            "data.max_train_stories": "none",
            "train.compile": "true",
            "model.recur_sampling": "poisson-lognormal",
            "train.lr": "1e-3",
        },
    )
    back = RunConfig.from_json(cfg.to_json())
    assert back == cfg
    assert (back.model.hidden_dim, back.model.arch_args.recur_sigma, back.data.max_train_stories) == (100, 1.0, None)
    assert back.train.compile is True and isinstance(back.model.arch_args.recur_sigma, float)
    assert back.model.arch_args.recur_sampling == "poisson-lognormal"
    relaxed = make_config("tiny", "relaxed", overrides={"model.lora_alpha": "8"})
    assert RunConfig.from_json(relaxed.to_json()).model.arch_args.lora_alpha == 8.0


@pytest.mark.parametrize("preset,arch", ALL)
def test_resolve_is_idempotent(preset, arch):
    cfg = make_config(preset, arch)
    assert resolve(cfg) == cfg
    assert resolve(resolve(cfg)) == cfg


def test_resolve_fills_auto_fields_and_keeps_explicit_ones():
    raw = RunConfig(arch="relaxed", model=ModelArgs(arch_args=RelaxedArgs(lora_rank=8)))
    assert raw.model.hidden_dim is None and raw.model.n_recur is None and raw.model.arch_args.lora_alpha is None
    cfg = resolve(raw)
    assert (cfg.model.hidden_dim, cfg.model.n_recur, cfg.model.arch_args.lora_alpha) == (688, 4, 8.0)
    explicit = make_config(
        "tiny", "relaxed", overrides={"model.hidden_dim": 96, "model.n_recur": 2, "model.lora_alpha": 2.5}
    )
    assert (explicit.model.hidden_dim, explicit.model.n_recur, explicit.model.arch_args.lora_alpha) == (96, 2, 2.5)
    # no arguments at all: the architecture's defaults; another architecture's arguments: an error
    assert resolve(RunConfig(arch="relaxed")).model.arch_args == RelaxedArgs(lora_rank=16, lora_alpha=16.0)
    with pytest.raises(ConfigError, match="architecture 'control' takes ArchArgs, got RelaxedArgs"):
        resolve(RunConfig(arch="control", model=ModelArgs(arch_args=RelaxedArgs())))


def test_from_json_rejects_bad_input():
    assert "not valid JSON" in str(pytest.raises(ConfigError, RunConfig.from_json, "{nope").value)
    assert "must be an object" in str(pytest.raises(ConfigError, RunConfig.from_json, "[1, 2]").value)
    raw = make_config("tiny", "control").to_dict()
    raw["model"]["dimm"] = 3  # a config from another benchctl version
    assert "unknown config key 'model.dimm'" in str(pytest.raises(ConfigError, from_dict, raw).value)
    raw = make_config("tiny", "control").to_dict()
    raw["model"]["dim"] = True  # JSON booleans are not integers
    assert "model.dim: expected an integer" in str(pytest.raises(ConfigError, from_dict, raw).value)


# ---- overrides ------------------------------------------------------------------------------------------------------


def test_parse_set():
    assert parse_set(["train.lr=1e-3", " model.dim = 128 ", "data.source=a=b"]) == {
        "train.lr": "1e-3",
        "model.dim": "128",
        "data.source": "a=b",
    }
    assert parse_set(None) == {}
    msg = str(pytest.raises(ConfigError, parse_set, ["train.lr"]).value)
    assert "key=value" in msg and "'train.lr'" in msg


def test_compile_auto_keeps_the_run_ids_of_the_default_it_replaced():
    """train.compile is auto (None) in the paper recipe and false in the CPU-scale presets; auto hashes as the false
    it replaced, so runs stored before it keep their ids and resume; true is still another run."""
    paper = make_config("paper", "control")
    assert paper.train.compile is None
    assert make_config("small", "control").train.compile is False
    assert make_config("tiny", "frailt").train.compile is False
    assert make_config("paper", "control", overrides={"train.compile": "auto"}).train.compile is None
    eager = make_config("paper", "control", overrides={"train.compile": "false"})
    compiled = make_config("paper", "control", overrides={"train.compile": "true"})
    assert run_id(paper, "fp") == run_id(eager, "fp") != run_id(compiled, "fp")
    assert identity_diff(paper, eager) == [] and identity_diff(paper, compiled) == ["train.compile: False != True"]


def test_overrides_apply_with_types():
    cfg = make_config(
        "tiny",
        "control",
        overrides=parse_set(
            [
                "model.dim=64",
                "train.lr=1e-3",
                "train.compile=yes",
                "train.max_steps=1_000",
                "model.n_heads=4",
                "model.n_kv_heads=2",
                "data.max_train_stories=None",
                "train.warmup_steps=2e2",
            ]
        ),
    )
    assert (cfg.model.dim, cfg.train.lr, cfg.train.compile, cfg.train.max_steps) == (64, 1e-3, True, 1000)
    assert (cfg.model.n_heads, cfg.model.n_kv_heads, cfg.data.max_train_stories) == (4, 2, None)
    assert cfg.train.warmup_steps == 200 and isinstance(cfg.train.warmup_steps, int)
    assert cfg.model.hidden_dim == llama2c_hidden_dim(64, 16)  # derived from the overridden dim
    assert isinstance(cfg.train.lr, float)


def test_unknown_key_names_it_and_suggests():
    msg = _err({"model.dimm": "3"})
    assert "unknown config key 'model.dimm'" in msg and "did you mean 'model.dim'?" in msg
    msg = _err({"train.learning_rate": "3"})
    assert "'train.learning_rate'" in msg and "train.lr" in msg  # listed among the valid keys
    assert "did you mean 'train.warmup_steps'" in _err({"train.warmup_step": "3"})


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("model.dim", "abc", "model.dim: expected an integer, got 'abc'"),
        ("model.dim", "3.5", "model.dim: expected an integer, got '3.5'"),
        ("model.dim", True, "model.dim: expected an integer, got True"),
        ("train.lr", "fast", "train.lr: expected a number, got 'fast'"),
        ("train.lr", False, "train.lr: expected a number, got False"),
        ("train.compile", "maybe", "train.compile: expected true/false, got 'maybe'"),
        ("train.compile", 2, "train.compile: expected true/false, got 2"),
        ("train.device", 3, "train.device: expected a string, got 3"),
        ("model.dim", "none", "model.dim: expected an integer, got 'none'"),
        ("model.dim", None, "model.dim: None is not allowed"),
    ],
)
def test_wrong_type_names_the_key(key, value, expect):
    assert expect in _err({key: value})


@pytest.mark.parametrize(
    "arch,overrides,expect",
    [
        ("control", {"model.dim": 33}, "model.dim: 33 is not divisible by model.n_heads=2"),
        ("control", {"model.n_kv_heads": 3}, "model.n_heads: 2 is not divisible by model.n_kv_heads=3"),
        ("control", {"model.dim": 36, "model.n_heads": 4, "model.n_kv_heads": 4}, "must be even for RoPE"),
        ("three-part", {"model.n_prelude": 2, "model.n_coda": 2}, "model.n_prelude (2) + model.n_coda (2)"),
        ("three-part", {"model.n_prelude": 3, "model.n_coda": 1}, "model.n_prelude (3) + model.n_coda (1)"),
        ("three-part", {"model.n_coda": -1}, "model.n_coda (-1)"),
        ("control", {"train.warmup_steps": 31}, "train.warmup_steps: must be in [0, train.max_steps=30], got 31"),
        ("control", {"model.vocab_size": 258}, "model.vocab_size: must be in [259, 65535]"),
        ("control", {"model.vocab_size": 65536}, "model.vocab_size: must be in [259, 65535]"),
        ("control", {"model.dim": 0}, "model.dim: must be positive"),
        ("control", {"model.n_heads": 0}, "model.n_heads: must be positive"),
        ("frailt", {"model.n_recur": 0}, "model.n_recur: must be >= 1, got 0"),
        ("control", {"model.n_recur": 2}, "model.n_recur: the control runs each block once, so it must be 1"),
        ("relaxed", {"model.lora_rank": 0}, "model.lora_rank: must be >= 1"),
        ("control", {"train.min_lr": 1.0}, "train.min_lr: must be in [0, train.lr]"),
        ("control", {"train.device": "gpu"}, "train.device: must be auto, cpu, cuda, cuda:N or mps"),
        ("control", {"seed": -1}, "seed: must be in [0, 4294967295]"),
        ("control", {"seed": 2**32}, "seed: must be in [0, 4294967295]"),
        ("control", {"data.max_train_stories": 0}, "data.max_train_stories: must be >= 1 or none"),
        ("control", {"model.max_seq_len": 1}, "model.max_seq_len: must be > 1"),
    ],
)
def test_impossible_values_are_config_errors(arch, overrides, expect):
    assert expect in _err(overrides, arch=arch)


def test_three_part_shape_error_is_a_benchctl_error_for_the_cli():
    # The architecture's own check raises ValueError; the config layer must turn it into a ConfigError so the CLI
    # prints one line instead of a traceback.
    with pytest.raises(BenchctlError):
        make_config("tiny", "three-part", overrides={"model.n_prelude": 2, "model.n_coda": 2})
    make_config("tiny", "three-part", overrides={"model.n_prelude": 2, "model.n_coda": 1})  # core of one block: fine
    make_config("tiny", "three-part", overrides={"model.n_prelude": 0, "model.n_coda": 0})


# task.loss resolves its auto (to all on stories, where answer is refused): tests/test_task_runs.py covers it
CHOICES = [
    (arch, key, allowed)
    for arch in architectures.names()
    for key, allowed in choices(arch).items()
    if key != "task.loss"
]


def test_choices_come_from_the_annotations():
    assert choices("control") == {
        "task.loss": ("auto", "answer", "all"),
        "train.dtype": ("auto", "float32", "bfloat16"),
        "train.optimizer": ("adamw", "muon"),
        "train.recur_curriculum": ("none", "linear", "1-sqrt"),
    }
    assert choices("frailt")["model.frailt_init"] == ("zeros", "normal")
    assert choices("three-part")["model.recur_sampling"] == ("fixed", "poisson-lognormal")
    assert choices("three-part")["model.recur_out"] == ("norm", "bias")
    assert choices("relaxed")["model.lora_init"] == ("normal", "kaiming")


@pytest.mark.parametrize("arch,key,allowed", CHOICES)
def test_enum_choices(arch, key, allowed):
    msg = _err({key: "bogus"}, arch=arch)
    assert msg.startswith(f"{key}: must be one of {', '.join(allowed)}") and "'bogus'" in msg
    for choice in allowed:
        cfg = make_config("tiny", arch, overrides={key: choice})
        assert cfg.to_dict()[key.split(".")[0]][key.split(".")[1]] == choice
    # a config built in code skips the parser: validation catches the value too
    if key.startswith("model."):
        bad = dataclasses.replace(cfg.model.arch_args, **{key.split(".")[1]: "bogus"})
        with pytest.raises(ConfigError, match=f"{key}: must be one of"):
            resolve(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, arch_args=bad)))


# ---- the architectures' own keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,key,owner",
    [
        ("control", "model.lora_rank", "relaxed"),
        ("frailt", "model.n_prelude", "three-part"),
        ("relaxed", "model.frailt_init", "frailt"),
        ("three-part", "model.lora_init", "relaxed"),
    ],
)
def test_a_key_of_another_architecture_says_whose_it_is(arch, key, owner):
    msg = _err({key: "1"}, arch=arch)
    assert msg == f"config key '{key}' belongs to architecture '{owner}', not to '{arch}'"


def test_unknown_key_suggests_among_the_architectures_own_keys():
    assert "did you mean 'model.lora_rank'?" in _err({"model.lora_rnk": 8}, arch="relaxed")
    msg = _err({"model.n_prelud": 2}, arch="three-part")
    assert "did you mean 'model.n_prelude'?" in msg and "model.recur_out" in msg and "model.lora_rank" not in msg
    assert "model.n_prelude" not in _err({"model.zzz": 1}, arch="control")  # only the keys control accepts


def test_a_preset_key_applies_to_its_architecture_only():
    assert PRESETS["tiny"]["model.lora_rank"] == 4
    assert make_config("tiny", "relaxed").model.arch_args.lora_rank == 4
    assert "lora_rank" not in make_config("tiny", "control").to_dict()["model"]


@pytest.mark.parametrize("arch", architectures.names())
def test_model_section_holds_the_trunk_and_the_architectures_own_keys(arch):
    model = make_config("tiny", arch).to_dict()["model"]
    trunk = {f.name for f in dataclasses.fields(ModelArgs)} - {"arch_args"}
    own = {f.name for f in dataclasses.fields(architectures.get(arch).args_cls)}
    assert set(model) == trunk | own


# The model section every config had before the architectures owned their arguments: every architecture's keys.
_OLD_ARCH_KEYS = {
    "frailt_init": "zeros",
    "n_prelude": 1,
    "n_coda": 1,
    "state_init_std": 0.02,
    "recur_sampling": "fixed",
    "recur_sigma": 0.5,
    "backprop_depth": 0,
    "recur_out": "norm",
    "lora_rank": 4,
    "lora_alpha": 4.0,
    "lora_init": "normal",
}


@pytest.mark.parametrize("arch", ["control", "frailt", "three-part", "relaxed"])
def test_a_config_stored_in_the_old_flat_format_loads(arch):
    cfg = make_config("tiny", arch, seed=2)
    raw = cfg.to_dict()
    raw["model"] = {**_OLD_ARCH_KEYS, **raw["model"]}  # this architecture's own values win
    assert from_dict(raw) == cfg
    assert RunConfig.from_json(json.dumps(raw)) == cfg
    raw["model"]["dimm"] = 3  # a key nobody owns is still refused
    assert "unknown config key 'model.dimm'" in str(pytest.raises(ConfigError, from_dict, raw).value)


def test_unknown_preset_suggests():
    msg = _err(preset="smal")
    assert msg == "unknown preset 'smal'; did you mean 'small'? available: paper, small, tiny"
    assert "did you mean" not in _err(preset="zzzz")


def test_unknown_arch_suggests():
    msg = _err(arch="thre-part")
    assert msg.startswith("unknown architecture 'thre-part'; did you mean 'three-part'?")
    assert "available: " + ", ".join(architectures.names()) in msg


# ---- run id ---------------------------------------------------------------------------------------------------------


def test_run_id_is_stable_and_tracks_identity():
    base = make_config("tiny", "frailt", seed=1)
    rid = run_id(base, "fp-a")
    assert rid == run_id(make_config("tiny", "frailt", seed=1), "fp-a")
    assert rid == run_id(RunConfig.from_json(base.to_json()), "fp-a")
    assert rid.startswith("frailt-tiny-s1-")
    changed = {
        "seed": make_config("tiny", "frailt", seed=2),
        "arch": make_config("tiny", "relaxed", seed=1),
        "lr": make_config("tiny", "frailt", seed=1, overrides={"train.lr": 1e-3}),
        "model": make_config("tiny", "frailt", seed=1, overrides={"model.frailt_init": "normal"}),
    }
    ids = {name: run_id(cfg, "fp-a") for name, cfg in changed.items()}
    ids["data"] = run_id(base, "fp-b")
    assert rid not in ids.values() and len(set(ids.values())) == len(ids)


@pytest.mark.parametrize(
    "key,value",
    [
        ("train.log_interval", 1),
        ("train.ckpt_interval", 7),
        ("train.eval_interval", 3),
        ("data.source", "/somewhere/else/tinystories"),
    ],
)
def test_run_id_ignores_logging_and_source_path(key, value):
    base = make_config("tiny", "three-part", seed=4)
    other = make_config("tiny", "three-part", seed=4, overrides={key: value})
    assert other != base
    assert run_id(other, "fp") == run_id(base, "fp")


def test_run_id_unchanged_when_an_architecture_is_registered():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WideArgs(architectures.ArchArgs):
        width: int = 3

    class Wide(architectures.BaseLM):
        def schedule(self, h, cos, sin, n_recur, cache):
            return h

    names = architectures.names()
    before = {a: run_id(make_config("tiny", a, seed=1), "fp") for a in names}
    architectures.register("zz-test-wide", args=WideArgs)(Wide)
    try:
        assert {a: run_id(make_config("tiny", a, seed=1), "fp") for a in names} == before
        assert make_config("tiny", "zz-test-wide", overrides={"model.width": 5}).model.arch_args == WideArgs(width=5)
        msg = "config key 'model.width' belongs to architecture 'zz-test-wide', not to 'control'"
        assert _err({"model.width": 5}) == msg
    finally:
        architectures._REGISTRY.pop("zz-test-wide")


def test_an_architecture_may_not_reuse_a_trunk_key():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class DimArgs(architectures.ArchArgs):
        dim: int = 3

    class Clash(architectures.BaseLM):
        def schedule(self, h, cos, sin, n_recur, cache):
            return h

    architectures.register("zz-test-clash", args=DimArgs)(Clash)
    try:
        assert "declares dim, already a trunk model key" in _err(arch="zz-test-clash")
    finally:
        architectures._REGISTRY.pop("zz-test-clash")


def test_register_wants_a_frozen_args_dataclass():
    @dataclasses.dataclass(frozen=True)
    class Loose:  # not an ArchArgs (a mutable subclass of it is refused by dataclasses itself)
        x: int = 1

    with pytest.raises(TypeError, match="frozen ArchArgs dataclass"):
        architectures.register("zz-test-loose", args=Loose)
    with pytest.raises(TypeError, match="frozen ArchArgs dataclass"):
        architectures.register("zz-test-loose", args=dict)


def test_overrides_for_a_run_over_several_architectures():
    both = ["control", "relaxed"]
    sets = {"model.lora_rank": 8, "model.dim": 64}
    assert overrides_for("control", sets, both) == {"model.dim": 64}  # relaxed's key is relaxed's alone
    assert overrides_for("relaxed", sets, both) == sets
    assert overrides_for("control", sets, ["control"]) == sets  # nobody in the run has it: make_config refuses it
    assert "belongs to architecture 'relaxed'" in _err(overrides_for("control", sets, ["control"]))


@pytest.mark.parametrize("key", ["train.lr", "train.min_lr", "train.weight_decay", "train.grad_clip", "model.init_std"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_refused_up_front(key, value):
    """train.lr=inf used to pass validation and fail at step 2 with exit 1."""
    with pytest.raises(ConfigError, match=f"{key}: must be a finite number"):
        make_config("tiny", "control", overrides={key: value})

"""Tests of the run configuration (benchctl/config.py): presets, the paper recipe of SPEC.md §1, JSON round trip,
every override error, and the stable run id (PRACTICES.md items 1 and 7)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import architectures
from benchctl.config import (
    CHOICES,
    PRESETS,
    RunConfig,
    from_dict,
    llama2c_hidden_dim,
    make_config,
    parse_set,
    preset_names,
    resolve,
    run_id,
)
from benchctl.errors import BenchctlError, ConfigError

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
def test_every_preset_builds_resolved(preset, arch):
    cfg = make_config(preset, arch)
    m = cfg.model
    assert (cfg.preset, cfg.arch) == (preset, arch)
    assert m.hidden_dim == llama2c_hidden_dim(m.dim, m.multiple_of)
    assert m.lora_alpha == float(m.lora_rank)
    assert m.n_recur == architectures.get(arch).default_n_recur(m)
    # The recurrent models keep the study's effective depth 16 at every preset (four unique blocks).
    depth = {"control": 4, "frailt": 4 * m.n_recur, "relaxed": 4 * m.n_recur, "three-part": 2 + 2 * m.n_recur}
    assert depth[arch] == (4 if arch == "control" else 16)


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
    # The open points of SPEC §2 at their recorded defaults (sampled depth and truncation off in "paper").
    assert (m.frailt_init, m.state_init_std, m.recur_sampling, m.backprop_depth, m.recur_out) == (
        "zeros", 0.02, "fixed", 0, "norm"
    )
    assert (m.lora_rank, m.lora_alpha, m.lora_init) == (16, 16.0, "normal")
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
        overrides={"model.hidden_dim": "100", "model.lora_alpha": "8", "data.max_train_stories": "none",
                   "train.compile": "true", "model.recur_sampling": "poisson-lognormal", "train.lr": "1e-3"},
    )
    back = RunConfig.from_json(cfg.to_json())
    assert back == cfg
    assert (back.model.hidden_dim, back.model.lora_alpha, back.data.max_train_stories) == (100, 8.0, None)
    assert back.train.compile is True and isinstance(back.model.lora_alpha, float)


@pytest.mark.parametrize("preset,arch", ALL)
def test_resolve_is_idempotent(preset, arch):
    cfg = make_config(preset, arch)
    assert resolve(cfg) == cfg
    assert resolve(resolve(cfg)) == cfg


def test_resolve_fills_auto_fields_and_keeps_explicit_ones():
    raw = dataclasses.replace(RunConfig(arch="relaxed"), model=dataclasses.replace(RunConfig().model, lora_rank=8))
    assert raw.model.hidden_dim is None and raw.model.n_recur is None and raw.model.lora_alpha is None
    cfg = resolve(raw)
    assert (cfg.model.hidden_dim, cfg.model.n_recur, cfg.model.lora_alpha) == (688, 4, 8.0)
    explicit = make_config("tiny", "relaxed", overrides={"model.hidden_dim": 96, "model.n_recur": 2,
                                                          "model.lora_alpha": 2.5})
    assert (explicit.model.hidden_dim, explicit.model.n_recur, explicit.model.lora_alpha) == (96, 2, 2.5)


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
        "train.lr": "1e-3", "model.dim": "128", "data.source": "a=b"
    }
    assert parse_set(None) == {}
    msg = str(pytest.raises(ConfigError, parse_set, ["train.lr"]).value)
    assert "key=value" in msg and "'train.lr'" in msg


def test_overrides_apply_with_types():
    cfg = make_config("tiny", "control", overrides=parse_set(
        ["model.dim=64", "train.lr=1e-3", "train.compile=yes", "train.max_steps=1_000", "model.n_heads=4",
         "model.n_kv_heads=2", "data.max_train_stories=None", "train.warmup_steps=2e2"]
    ))
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
        ("control", {"seed": -1}, "seed: must be >= 0"),
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


@pytest.mark.parametrize("key,choices", sorted(CHOICES.items()))
def test_enum_choices(key, choices):
    msg = _err({key: "bogus"})
    assert msg.startswith(f"{key}: must be one of {', '.join(choices)}") and "'bogus'" in msg
    for choice in choices:
        cfg = make_config("tiny", "control", overrides={key: choice})
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == choice


def test_unknown_preset_suggests():
    msg = _err(preset="smal")
    assert msg == "unknown preset 'smal'; did you mean 'small'? available: paper, small, tiny"
    assert "did you mean" not in _err(preset="zzzz")


def test_unknown_arch_suggests():
    msg = _err(arch="thre-part")
    assert msg.startswith("unknown architecture 'thre-part'; did you mean 'three-part'?")
    assert "available: control, frailt, three-part, relaxed" in msg


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
    [("train.log_interval", 1), ("train.ckpt_interval", 7), ("train.eval_interval", 3),
     ("data.source", "/somewhere/else/tinystories")],
)
def test_run_id_ignores_logging_and_source_path(key, value):
    base = make_config("tiny", "three-part", seed=4)
    other = make_config("tiny", "three-part", seed=4, overrides={key: value})
    assert other != base
    assert run_id(other, "fp") == run_id(base, "fp")

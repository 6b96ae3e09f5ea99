"""CUDA-only code paths exercised on the CPU: NVML that fails, checkpoints moved between machines, peak tables,
process-group setup, TF32, and the test suite's own CUDA hiding. Nothing here needs a GPU."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from benchctl.core import checkpoint as ckpt
from benchctl.core import runtime, telemetry
from benchctl.core.errors import ConfigError
from benchctl.stages.bench import engine as bench
from tests.test_train import REPO, run_cli

CUDA0 = torch.device("cuda", 0)


# ---- NVML ------------------------------------------------------------------------------------------------------------


class _NVMLError(Exception):
    pass


def fake_pynvml(fail: set[str] | None = None) -> types.ModuleType:
    """A pynvml whose calls in `fail` (all of them when None) raise, as on a MIG slice or without the library."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.calls = []
    ok = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByUUID": lambda uuid: ("handle", uuid),
        "nvmlSystemGetDriverVersion": lambda: b"550.1",
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=123),
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=7),
    }
    for name, fn in ok.items():

        def call(*a, _name=name, _fn=fn):
            m.calls.append((_name, a))
            if fail is None or _name in fail:
                raise _NVMLError(f"{_name}: Not Supported")
            return _fn(*a)

        setattr(m, name, call)
    return m


def test_nvml_raising_everywhere_is_never_fatal(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setattr(telemetry, "nvml_target", lambda d: ("uuid", "GPU-x"))
    s = telemetry.NvmlSampler(CUDA0)
    s.start()
    s.stop()
    assert not s.available and s.peak_used is None and s.max_util is None
    assert "nvmlInit failed" in s.note


def test_mig_slice_without_utilisation_keeps_memory(monkeypatch):
    nvml = fake_pynvml(fail={"nvmlDeviceGetUtilizationRates"})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(telemetry, "nvml_target", lambda d: ("uuid", "MIG-abc"))
    s = telemetry.NvmlSampler(CUDA0, interval=0.01)
    s.start()
    s.stop()
    assert s.available is False  # released by stop
    assert s.peak_used == 123 and s.max_util is None and s.driver_version == "550.1"
    assert s.note.startswith("gpu_util: nvmlDeviceGetUtilizationRates failed")
    assert ("nvmlDeviceGetHandleByUUID", ("MIG-abc",)) in nvml.calls  # the GPU torch uses, not NVML's index 0
    assert nvml.calls[-1][0] == "nvmlShutdown"


def test_nvml_target_matches_by_uuid_then_pci(monkeypatch):
    props = types.SimpleNamespace(uuid="1234-abcd", pci_bus_id=0x3B, pci_domain_id=0, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    assert telemetry.nvml_target(CUDA0) == ("uuid", "GPU-1234-abcd")
    props.uuid = None
    assert telemetry.nvml_target(CUDA0) == ("pci", "00000000:3b:00.0")
    assert telemetry.nvml_target(torch.device("cpu")) is None


def test_run_finishes_when_every_nvml_call_raises(tmp_path, tinystories_dir, monkeypatch):
    """A training run whose NVML fails at every call (here on the CPU, with the sampler pointed at a fake GPU) ends
    done, with the GPU reading marked absent and why."""
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(
        sys.modules, "pynvml", fake_pynvml(fail={"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates"})
    )
    monkeypatch.setattr(telemetry, "nvml_target", lambda d: ("uuid", "GPU-x"))
    db = tmp_path / "results.db"
    assert (
        run_cli(
            [
                "train",
                "--arch",
                "control",
                "--preset",
                "tiny",
                "--data",
                str(tinystories_dir),
                "--db",
                str(db),
                "--no-progress",
                "--set",
                "train.max_steps=3",
                "--set",
                "train.warmup_steps=1",
            ]
        )
        == 0
    )
    status, note, nvml_peak = (
        sqlite3.connect(db).execute("select status, gpu_telemetry_note, peak_nvml_mem_bytes from runs").fetchone()
    )
    assert status == "done" and nvml_peak is None
    assert "nvml_mem: nvmlDeviceGetMemoryInfo failed" in note and "gpu_util" in note


def test_peak_memory_reset_empties_the_cache_first(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append("reset"))
    telemetry.reset_peak_memory(CUDA0)
    assert calls == ["empty", "reset"]


def test_peak_rss_without_the_resource_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "resource", None)  # native Windows has no `resource`
    assert telemetry.peak_rss_bytes() is None


# ---- checkpoints across machines -------------------------------------------------------------------------------------


def test_checkpoint_with_many_gpu_rng_states_resumes_on_fewer(monkeypatch):
    """Older checkpoints saved one CUDA RNG state per visible GPU; resuming with fewer GPUs visible takes the training
    device's state instead of failing with IndexError."""
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d=None: restored.append((int(s[0]), d)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: (_ for _ in ()).throw(IndexError()))
    state = {**ckpt.rng_state(torch.device("cpu")), "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(4)]}
    ckpt.set_rng_state(state, torch.device("cuda", 0))
    ckpt.set_rng_state(state, torch.device("cuda", 6))  # beyond the saved list: the first state
    ckpt.set_rng_state(state, torch.device("cuda", 2))
    assert [r[0] for r in restored] == [0, 0, 2]


def test_new_checkpoints_hold_only_the_training_gpu_generator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d=None: torch.tensor([5], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("all GPUs' states saved"))
    state = ckpt.rng_state(torch.device("cuda", 1))
    assert int(state["cuda"][0]) == 5
    assert "cuda" not in ckpt.rng_state(torch.device("cpu"))


def test_hardware_change_is_described():
    a = {"device": "cuda", "device_name": "NVIDIA A100", "dtype": "bfloat16", "compiled": "no"}
    assert ckpt.hardware_change(a, dict(a)) is None
    assert ckpt.hardware_change(None, a) is None  # a checkpoint from before the record
    b = {**a, "device_name": "Tesla T4", "dtype": "float32"}
    assert ckpt.hardware_change(a, b) == "device_name NVIDIA A100 -> Tesla T4; dtype bfloat16 -> float32"
    assert ckpt.hardware_change(a, {**a, "compiled": "yes"}) == "compiled no -> yes"


def test_a_checkpoint_from_before_the_compile_record_compiled_as_its_config_said():
    """An eager paper run stored before train.compile=auto, resumed where auto compiles: another speed, so a change."""
    from benchctl.core.config import make_config

    old = {"device": "cpu", "device_name": "AMD EPYC", "dtype": "bfloat16"}
    for setting, was in (("false", "no"), ("true", "yes")):
        state = {
            "hardware": old,
            "config": make_config("paper", "control", overrides={"train.compile": setting}).to_json(),
        }
        assert ckpt.saved_hardware(state) == {**old, "compiled": was}
    state = {"hardware": old, "config": make_config("paper", "control", overrides={"train.compile": "false"}).to_json()}
    assert ckpt.hardware_change(ckpt.saved_hardware(state), {**old, "compiled": "yes"}) == "compiled no -> yes"
    assert ckpt.saved_hardware({"config": "{}"}) is None  # no record at all: nothing to compare


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_auto_resumed_on_a_cpu_without_bf16_warns_and_restarts_the_speed_record(tmp_path, tinystories_dir, monkeypatch):
    """`train.dtype=auto` is the run's identity; what it resolves to is the machine's. A run started with native bf16
    and resumed without it says so, records the new precision and times its steps afresh."""
    from benchctl import stages
    from benchctl.core import data
    from benchctl.core.config import make_config
    from benchctl.stages.train import tables as train_tables
    from benchctl.stages.train.engine import train_run

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    cfg = make_config(
        "tiny",
        "control",
        overrides={
            "data.source": str(tinystories_dir),
            "train.max_steps": 8,
            "train.ckpt_interval": 2,
            "train.warmup_steps": 1,
        },
    )
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    path = tmp_path / "results.db"
    db = stages.connect(path)
    monkeypatch.setattr(runtime, "cpu_bf16_capability", lambda: "avx512_bf16")
    train_run(cfg, prepared, db, path, progress=False, log=lambda *_: None, stop_after=5)
    assert train_tables.get_run(db, train_tables.runs(db)[0]["id"])["dtype"] == "bfloat16"
    monkeypatch.setattr(runtime, "cpu_bf16_capability", lambda: None)
    logs: list[str] = []
    r = train_run(cfg, prepared, db, path, progress=False, log=logs.append)
    assert r.status == "done" and r.resumed_from == 5
    assert any("resumes on different hardware (dtype bfloat16 -> float32)" in m for m in logs)
    row = train_tables.get_run(db, r.run_id)
    assert row["dtype"] == "float32" and row["precision_reason"] == "auto: no native bf16 (cpu:no native bf16)"
    state = ckpt.load(ckpt.run_dir(path, r.run_id) / ckpt.CKPT_NAME)
    assert state["hardware"]["dtype"] == "float32"
    assert len(state["telemetry"]["step_times"]) == 1  # steps 6-8, less two warm-up steps: this process only


# ---- peaks, process group, TF32, compile -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, found",
    [
        ("NVIDIA A100-SXM4-80GB", True),
        ("NVIDIA RTX A1000", False),
        ("NVIDIA GeForce RTX 4090", True),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", False),
        ("Tesla T4", False),
        ("NVIDIA A10", True),
    ],
)
def test_gpu_peak_patterns_are_word_bounded(name, found):
    """At bf16: a T4 has no bf16 peak (its number is fp16), a laptop 4090 none of the desktop card's."""
    peak, note = bench.gpu_peak(name)
    assert (peak is not None) == found, note


def test_bf16_peak_is_not_taken_from_an_fp16_only_gpu():
    assert bench.gpu_peak("Tesla V100-SXM2-16GB", "bfloat16")[0] is None
    assert bench.gpu_peak("Tesla V100-SXM2-16GB", "float16")[0] == 125e12


def test_init_distributed_binds_the_gpu(monkeypatch):
    import torch.distributed as dist

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.setdefault("init", kw))
    monkeypatch.setattr(runtime.atexit, "register", lambda fn: None)
    runtime.init_distributed(runtime.Dist(rank=1, world_size=2, local_rank=1), torch.device("cuda", 1))
    assert seen["set_device"] == torch.device("cuda", 1)
    assert seen["init"] == {"backend": "nccl", "device_id": torch.device("cuda", 1)}


def test_tf32_is_restored_after_a_computation():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with runtime.matmul_precision(CUDA0):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize(
    "device, amp, sampled, ramp, compiler, on, reason",
    [
        ("cpu", torch.bfloat16, False, False, "/usr/bin/g++", True, "auto: compiled (cpu, bf16 autocast)"),
        ("cpu", torch.bfloat16, False, False, None, False, "no C++ compiler"),
        ("cpu", None, False, False, "/usr/bin/g++", False, "eager in fp32"),
        ("cpu", torch.bfloat16, True, False, "/usr/bin/g++", False, "depth is sampled"),
        ("cpu", torch.bfloat16, False, True, "/usr/bin/g++", False, "depth ramps"),
        ("cuda", torch.bfloat16, False, False, "/usr/bin/g++", False, "eager on cuda"),
    ],
)
def test_compile_auto_compiles_only_where_it_was_measured_to_pay(
    monkeypatch, device, amp, sampled, ramp, compiler, on, reason
):
    """train.compile=auto (None): a bf16 CPU step at a fixed depth with a C++ compiler; eager everywhere else, with
    the reason recorded."""
    monkeypatch.setattr(runtime, "_cpp_compiler", lambda: compiler)
    choice = runtime.resolve_compile(None, torch.device(device), amp, sampled, ramp)
    assert choice.on is on and reason in choice.reason


def test_compile_set_is_obeyed_and_checked(monkeypatch):
    monkeypatch.setattr(runtime, "_cpp_compiler", lambda: None)
    assert runtime.resolve_compile(False, torch.device("cpu"), torch.bfloat16, False, False) == runtime.CompileChoice(
        False, "set: train.compile=false"
    )
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        runtime.resolve_compile(True, torch.device("cpu"), torch.bfloat16, False, False)


def test_compile_with_sampled_depth_is_refused(tmp_path, tinystories_dir, monkeypatch, capsys):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runtime, "check_compile_available", lambda d, w: None)
    code = run_cli(
        [
            "train",
            "--arch",
            "three-part",
            "--preset",
            "tiny",
            "--data",
            str(tinystories_dir),
            "--db",
            str(tmp_path / "results.db"),
            "--no-progress",
            "--set",
            "train.compile=true",
            "--set",
            "model.recur_sampling=poisson-lognormal",
        ]
    )
    assert code == 2 and "recompiles at every new depth" in capsys.readouterr().err


# ---- the suite on a GPU machine --------------------------------------------------------------------------------------


def test_unmarked_tests_see_no_gpu():
    assert not torch.cuda.is_available()
    assert runtime.resolve_device("auto") == torch.device("cpu")
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.slow  # a second pytest process
def test_suite_stays_on_cpu_when_cuda_is_faked_available(tmp_path):
    """A plugin makes torch report a GPU before the suite's fixtures run: an unmarked test still resolves to the CPU."""
    (tmp_path / "fake_gpu_plugin.py").write_text(
        "import torch\ntorch.cuda.is_available = lambda: True\ntorch.cuda.device_count = lambda: 2\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "fake_gpu_plugin",
            "-p",
            "no:cacheprovider",
            f"{Path(__file__)}::test_unmarked_tests_see_no_gpu",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr

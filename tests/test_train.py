"""Training engine: recipe pieces, resumption (in-process and after a real kill -9), DDP, errors, telemetry."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import architectures
from benchctl import stages
from benchctl.cli import main
from benchctl.core.config import make_config
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.engine import get_lr, make_optimizer

REPO = Path(__file__).resolve().parents[1]
FAST = [
    "--set",
    "train.max_steps=12",
    "--set",
    "train.eval_interval=4",
    "--set",
    "train.ckpt_interval=3",
    "--set",
    "train.log_interval=2",
]


def run_cli(args: list[str], capsys=None) -> int:
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def env_for(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["BENCHCTL_CACHE"] = str(cache)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("BENCHCTL_DB", None)
    return env


def cli_proc(args: list[str], cache: Path, extra_env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "benchctl", *args],
        env={**env_for(cache), **(extra_env or {})},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_lr_schedule_is_llama2c():
    cfg = make_config("paper", "control")
    assert get_lr(0, cfg) == 0.0
    assert get_lr(500, cfg) == pytest.approx(2.5e-4)
    assert get_lr(1000, cfg) == pytest.approx(5e-4)
    mid = 1000 + (25000 - 1000) // 2
    assert get_lr(mid, cfg) == pytest.approx(2.5e-4)
    assert get_lr(25000, cfg) == 0.0
    assert all(get_lr(s, cfg) >= get_lr(s + 1, cfg) for s in range(1000, 25000, 997))


def test_weight_decay_groups():
    import architectures

    cfg = make_config("tiny", "relaxed")
    model = architectures.build("relaxed", cfg.model)
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())  # tied embedding counted once


def _final_state(db_path: Path, arch: str = "control"):
    con = sqlite3.connect(db_path)
    row = con.execute(
        "select id, status, step, final_val_loss, initial_val_loss from runs where arch = ?", [arch]
    ).fetchone()
    # the model's numbers; the machine's own (memory, speed) differ between any two processes
    metrics = con.execute(
        "select step, name, value from metrics where run_id = ? and name not in "
        "('peak_rss_bytes', 'tokens_per_s') order by step, name",
        [row[0]],
    ).fetchall()
    con.close()
    ckpt = torch.load(db_path.parent / "runs" / row[0] / "ckpt.pt", weights_only=False)
    return row, metrics, ckpt["model"]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_resume_in_process_is_bit_identical(tmp_path, tinystories_dir, monkeypatch):
    """stop after step 5 (mid checkpoint interval) and resume: same weights, same metrics as one go."""
    from benchctl.core import data
    from benchctl.stages.train.engine import train_run

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    overrides = {
        "data.source": str(tinystories_dir),
        "train.max_steps": 10,
        "train.eval_interval": 4,
        "train.ckpt_interval": 3,
        "train.log_interval": 1,
    }
    cfg = make_config("tiny", "three-part", overrides=overrides)  # three-part: uses the global RNG in forward
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)

    a_path, b_path = tmp_path / "a" / "results.db", tmp_path / "b" / "results.db"
    train_run(cfg, prepared, stages.connect(a_path), a_path, progress=False, log=lambda *_: None)
    b = stages.connect(b_path)
    r = train_run(cfg, prepared, b, b_path, progress=False, log=lambda *_: None, stop_after=5)
    assert r.status == "running"
    assert train_tables.get_run(b, r.run_id)["step"] == 5
    logs: list[str] = []
    r2 = train_run(cfg, prepared, b, b_path, progress=False, log=logs.append)
    assert r2.resumed_from == 5 and any("resuming" in m for m in logs)

    (ra, ma, wa), (rb, mb, wb) = _final_state(a_path, "three-part"), _final_state(b_path, "three-part")
    assert ra[1] == rb[1] == "done"
    assert ra[3] == rb[3]  # final validation loss, bit for bit
    assert ma == mb  # no duplicated or missing metric rows, same values
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # two training processes, one killed
def test_kill_9_then_rerun_resumes_to_the_same_loss(tmp_path, tinystories_dir, monkeypatch):
    cache = tmp_path / "cache"
    args = ["train", "--arch", "control", "--preset", "tiny", "--data", str(tinystories_dir), "--no-progress", *FAST]
    ref_db = tmp_path / "ref" / "results.db"
    # the uninterrupted reference trains in this process (one torch thread, as the processes below): only the killed
    # run and its resumption need processes of their own, and a process start is most of what this test costs
    monkeypatch.setenv("BENCHCTL_CACHE", str(cache))
    monkeypatch.delenv("BENCHCTL_DB", raising=False)
    assert run_cli([*args, "--db", str(ref_db)]) == 0

    db_path = tmp_path / "killed" / "results.db"
    tb = {"BENCHCTL_TENSORBOARD": "1"}  # the killed run also mirrors its metrics to TensorBoard
    p = cli_proc([*args, "--db", str(db_path)], cache, tb)
    deadline = time.time() + 240
    step = 0
    while time.time() < deadline and p.poll() is None:
        if db_path.exists():
            try:
                con = sqlite3.connect(db_path, timeout=1)
                # the run row's step, written after the checkpoint's row: sqlite-utils commits each write on its
                # own, so on a loaded machine a kill can fall between the two
                got = con.execute("select step from runs").fetchone()
                con.close()
                step = (got[0] if got else 0) or 0
            except sqlite3.OperationalError:
                step = 0
            if step >= 3:
                break
        time.sleep(0.05)
    assert p.poll() is None, "the run finished before it could be killed; make it longer"
    p.send_signal(signal.SIGKILL)
    p.wait()
    con = sqlite3.connect(db_path)
    status, at = con.execute("select status, step from runs").fetchone()
    con.close()
    assert status == "running" and 3 <= at < 12  # left as it was: a checkpoint and its rows, nothing half-written

    again = cli_proc([*args, "--db", str(db_path)], cache, tb)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "resuming" in out
    _assert_tensorboard_equals_metrics(db_path)

    (r_ref, m_ref, w_ref), (r_new, m_new, w_new) = _final_state(ref_db), _final_state(db_path)
    assert r_new[1] == "done" and r_new[2] == 12
    assert r_new[3] == r_ref[3]  # bit-for-bit on CPU
    assert m_new == m_ref
    assert all(torch.equal(w_ref[k], w_new[k]) for k in w_ref)


def _assert_tensorboard_equals_metrics(db_path: Path) -> None:
    """TensorBoard's view of the run (after a kill and a resume) is exactly the metric rows: no step twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    con = sqlite3.connect(db_path)
    run_id = con.execute("select id from runs").fetchone()[0]
    rows = con.execute("select name, step, value from metrics order by name, step").fetchall()
    con.close()
    acc = EventAccumulator(str(db_path.parent / "tensorboard" / run_id), size_guidance={"scalars": 0})
    acc.Reload()
    seen = sorted((tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))
    assert [(n, s) for n, s, _ in seen] == [(n, s) for n, s, _ in rows]
    assert all(v == pytest.approx(w, rel=1e-6, abs=1e-6) for (_, _, v), (_, _, w) in zip(seen, rows))


def test_rerun_of_a_done_run_is_skipped(tmp_path, tinystories_dir, monkeypatch, capsys):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    db_path = tmp_path / "results.db"
    args = [
        "train",
        "--arch",
        "control",
        "--preset",
        "tiny",
        "--data",
        str(tinystories_dir),
        "--db",
        str(db_path),
        "--no-progress",
        "--set",
        "train.max_steps=3",
        "--set",
        "train.warmup_steps=1",
    ]
    assert run_cli(args) == 0
    capsys.readouterr()
    assert run_cli(args) == 0
    assert "already done" in capsys.readouterr().out
    con = sqlite3.connect(db_path)
    row = con.execute(
        "select status, initial_val_loss, final_val_loss, peak_rss_bytes, peak_gpu_mem_bytes, "
        "peak_nvml_mem_bytes, device, torch_version, tokens_per_s, train_seconds from runs"
    ).fetchone()
    assert con.execute("select count(*) from runs").fetchone()[0] == 1
    status, init, final, rss, gpu, nvml, device, tv, tps, secs = row
    assert status == "done" and final < init
    assert rss > 0 and device == "cpu" and tv == torch.__version__
    assert gpu is None and nvml is None  # no GPU here: NULL, not zero
    assert tps > 0 and secs > 0


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_train_all_runs_four_architectures(tmp_path, tinystories_dir, monkeypatch, capsys):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    db_path = tmp_path / "results.db"
    code = run_cli(
        [
            "train-all",
            "--preset",
            "tiny",
            "--data",
            str(tinystories_dir),
            "--db",
            str(db_path),
            "--no-progress",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.eval_interval=2",
            "--set",
            "train.warmup_steps=1",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "final" in out and "initial" in out
    con = sqlite3.connect(db_path)
    rows = con.execute("select arch, status, initial_val_loss, final_val_loss from runs order by arch").fetchall()
    assert [r[0] for r in rows] == sorted(architectures.names())  # every registered architecture, once
    assert all(r[1] == "done" and r[3] < r[2] for r in rows)
    # the same validation windows for every model: initial losses are close to ln(vocab)
    assert all(abs(r[2] - torch.log(torch.tensor(512.0)).item()) < 0.5 for r in rows)


@pytest.mark.slow  # a benchctl process per case
@pytest.mark.parametrize(
    "extra, code, needle",
    [
        (["--arch", "thre-part"], 2, "did you mean 'three-part'"),
        (["--arch", "control", "--data", "/nonexistent/dir"], 3, "/nonexistent/dir"),
        (["--arch", "control", "--set", "train.lr=fast"], 2, "train.lr"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, tinystories_dir, extra, code, needle):
    db_path = tmp_path / "results.db"
    args = ["train", "--preset", "tiny", "--db", str(db_path), "--no-progress"]
    if "--data" not in extra:
        args += ["--data", str(tinystories_dir)]
    p = cli_proc([*args, *extra], tmp_path / "cache")
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    if db_path.exists():  # nothing half-written
        assert sqlite3.connect(db_path).execute("select count(*) from runs").fetchone()[0] == 0


@pytest.mark.slow  # a training process importing torch and inductor
def test_compile_without_a_compiler_is_one_clear_line(tmp_path, tinystories_dir):
    (tmp_path / "empty").mkdir()
    env = env_for(tmp_path / "cache") | {"PATH": str(tmp_path / "empty")}  # no g++, c++ or clang++
    db_path = tmp_path / "results.db"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchctl",
            "train",
            "--preset",
            "tiny",
            "--arch",
            "control",
            "--data",
            str(tinystories_dir),
            "--db",
            str(db_path),
            "--no-progress",
            "--set",
            "train.compile=true",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert "needs a C++ compiler" in p.stderr and "Traceback" not in p.stderr
    if db_path.exists():  # the check runs before any row is written
        assert sqlite3.connect(db_path).execute("select count(*) from runs").fetchone()[0] == 0


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason="torch.compile on a CPU needs a C++ compiler",
)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_compile_auto_trains_a_bf16_cpu_run_compiled(tmp_path, tinystories_dir, monkeypatch):
    """train.compile=auto on a CPU in bf16: the run compiles, records that and why, ends where the same run trained
    eagerly ends (compilation changes float rounding only), and ends there again when trained again (the embedding's
    backward stays out of the compiled graph, whose atomic adds would make the order of its sums vary)."""
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    finals = {}
    for name, setting in (("auto", "auto"), ("again", "auto"), ("false", "false")):  # each in its own database:
        db_path = tmp_path / name / "results.db"  # auto hashes as false, so all three are the same run id
        assert (
            run_cli(
                [
                    "train",
                    "--preset",
                    "tiny",
                    "--arch",
                    "control",
                    "--data",
                    str(tinystories_dir),
                    "--db",
                    str(db_path),
                    "--no-progress",
                    "--set",
                    f"train.compile={setting}",
                    "--set",
                    "train.dtype=bfloat16",
                    "--set",
                    "train.max_steps=12",
                ]
            )
            == 0
        )
        (row,) = (
            sqlite3.connect(db_path)
            .execute("select compiled, compile_reason, final_val_loss, status from runs")
            .fetchall()
        )
        finals[name] = row
    assert finals["auto"][:2] == (1, "auto: compiled (cpu, bf16 autocast)")
    assert finals["again"] == finals["auto"]
    assert finals["false"][:2] == (0, "set: train.compile=false")
    assert finals["auto"][3] == finals["false"][3] == "done"
    assert finals["auto"][2] == pytest.approx(finals["false"][2], abs=0.02)


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_checkpoint_from_another_config_is_refused(tmp_path, tinystories_dir, monkeypatch, capsys):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    db_path = tmp_path / "results.db"
    base = [
        "train",
        "--preset",
        "tiny",
        "--data",
        str(tinystories_dir),
        "--db",
        str(db_path),
        "--no-progress",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.warmup_steps=1",
    ]
    assert run_cli([*base, "--arch", "control"]) == 0
    con = sqlite3.connect(db_path)
    (a_id,) = con.execute("select id from runs").fetchone()
    con.close()
    # plant control's checkpoint where the seed-1 run will look for its own
    from benchctl.core import data
    from benchctl.core.config import run_id

    cfg1 = make_config(
        "tiny", "control", 1, {"data.source": str(tinystories_dir), "train.max_steps": 2, "train.warmup_steps": 1}
    )
    prepared = data.prepare(cfg1.data, cfg1.model.vocab_size, progress=False)
    target = db_path.parent / "runs" / run_id(cfg1, prepared.fingerprint)
    target.mkdir(parents=True)
    (target / "ckpt.pt").write_bytes((db_path.parent / "runs" / a_id / "ckpt.pt").read_bytes())
    capsys.readouterr()
    assert run_cli([*base, "--arch", "control", "--seed", "1"]) == 4
    err = capsys.readouterr().err
    assert "different config" in err and "seed" in err
    con = sqlite3.connect(db_path)
    assert con.execute("select count(*) from runs").fetchone()[0] == 1  # nothing written for the refused run


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tinystories_dir, monkeypatch, capsys):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    db_path = tmp_path / "results.db"
    args = [
        "train",
        "--preset",
        "tiny",
        "--arch",
        "control",
        "--data",
        str(tinystories_dir),
        "--db",
        str(db_path),
        "--no-progress",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.warmup_steps=1",
    ]
    assert run_cli(args) == 0
    (ckpt,) = (db_path.parent / "runs").glob("*/ckpt.pt")
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated
    train_tables.update_run(stages.connect(db_path), ckpt.parent.name, status="running")
    capsys.readouterr()
    assert run_cli(args) == 4
    assert "unreadable" in capsys.readouterr().err


@pytest.mark.slow  # a benchctl process importing torch
def test_paper_on_cpu_asks_first_and_refuses_without_yes(tmp_path, tinystories_dir):
    # vocab 512: paper-scale compute either way, and fits the synthetic stories used where the real sample is absent
    p = cli_proc(
        [
            "train",
            "--arch",
            "relaxed",
            "--preset",
            "paper",
            "--data",
            str(tinystories_dir),
            "--db",
            str(tmp_path / "results.db"),
            "--no-progress",
            "--set",
            "model.vocab_size=512",
        ],
        tmp_path / "cache",
        stdin=subprocess.DEVNULL,
    )
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert "would take about" in err and "--yes" in err and "--preset small" in err


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["control", "ut-act"])  # ut-act: auxiliary terms, metrics and spent FLOPs reduced
def test_ddp_two_processes_match_single_process(tmp_path, tinystories_dir, arch):
    """torchrun with 2 CPU processes (gloo): the global batch is split, so the losses match one process."""
    cache = tmp_path / "cache"
    common = [
        "train",
        "--arch",
        arch,
        "--preset",
        "tiny",
        "--data",
        str(tinystories_dir),
        "--no-progress",
        "--set",
        "train.max_steps=6",
        "--set",
        "train.eval_interval=3",
        "--set",
        "train.warmup_steps=1",
    ]
    single = cli_proc([*common, "--db", str(tmp_path / "one" / "results.db")], cache)
    out, err = single.communicate(timeout=300)
    assert single.returncode == 0, err
    ddp = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "benchctl",
            *common,
            "--db",
            str(tmp_path / "two" / "results.db"),
        ],
        env=env_for(cache),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = ddp.communicate(timeout=300)
    assert ddp.returncode == 0, err
    (r1, m1, _), (r2, m2, _) = (
        _final_state(tmp_path / "one" / "results.db", arch),
        _final_state(tmp_path / "two" / "results.db", arch),
    )
    assert r2[1] == "done"
    assert r2[3] == pytest.approx(r1[3], abs=1e-4)
    v1 = [v for s, n, v in m1 if n == "val_loss"]
    v2 = [v for s, n, v in m2 if n == "val_loss"]
    assert v2 == pytest.approx(v1, abs=1e-4)
    # every rank's share is in the stored metrics: the same names and (to rounding) the same means as one process
    names1, names2 = {n for _, n, _ in m1}, {n for _, n, _ in m2}
    assert names1 == names2
    for name in sorted(n for n in names1 if n.startswith(("aux/", "val_aux/", "val_arch/mean_depth"))):
        a, b = [v for _, n, v in m1 if n == name], [v for _, n, v in m2 if n == name]
        assert b == pytest.approx(a, rel=1e-3), name
    # the training FLOPs of both processes: a fixed-depth model's are one process's; ut-act's loop stops once the
    # tokens of a process's own half have halted, so two processes never spend more than one
    f1, f2 = [v for _, n, v in m1 if n == "train_flops"], [v for _, n, v in m2 if n == "train_flops"]
    assert len(f1) == len(f2) > 0 and all(b <= a * (1 + 1e-6) for a, b in zip(f1, f2))
    if arch == "control":
        assert f2 == pytest.approx(f1, rel=1e-9)
    con = sqlite3.connect(tmp_path / "two" / "results.db")
    assert con.execute("select world_size from runs").fetchone()[0] == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run_records_gpu_memory(tmp_path, tinystories_dir, monkeypatch):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    db_path = tmp_path / "results.db"
    assert (
        run_cli(
            [
                "train",
                "--arch",
                "three-part",
                "--preset",
                "tiny",
                "--data",
                str(tinystories_dir),
                "--db",
                str(db_path),
                "--no-progress",
                "--set",
                "train.max_steps=3",
                "--set",
                "train.warmup_steps=1",
            ]
        )
        == 0
    )
    con = sqlite3.connect(db_path)
    gpu, reserved, device = con.execute(
        "select peak_gpu_mem_bytes, peak_gpu_reserved_bytes, device from runs"
    ).fetchone()
    assert device == "cuda" and gpu > 0 and reserved >= gpu

"""`benchctl bench --record DIR`: a dated file per measurement, with the machine, the code and the command."""

from __future__ import annotations

import datetime as dt

import pytest

from benchctl.core.errors import ConfigError
from benchctl.stages.bench import record as R
from benchctl.stages.bench.cli import HEADS, notes_of, table_rows


@pytest.mark.parametrize(
    ("device", "slug"),
    [
        ("Intel(R) Xeon(R) Processor (2 cores, 2 threads)", "intel-xeon-2core"),
        ("AMD EPYC 9R45 96-Core Processor (2 cores, 2 threads)", "amd-epyc-9r45-96-core-2core"),
        ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"),
    ],
)
def test_the_file_is_named_after_the_hardware(device, slug):
    assert R.hardware_slug(device) == slug


def _objs():
    return [
        {
            "bench_id": "20261126-000000-abcdef",
            "arch": "control",
            "dtype": "float32",
            "device_name": "AMD EPYC 9R45 (2 cores, 2 threads)",
            "threads": 2,
            "tokens_per_s": 1000.0,
            "tokens_per_s_min": 900.0,
            "tokens_per_s_max": 1100.0,
            "step_seconds": 0.5,
            "flops_per_token": 2e6,
            "peak_flops": None,
            "peak_flops_source": "no peak",
            "peak_mem_bytes": 2**20 * 10,
            "cost_ratio": 1.0,
            "load_avg": 1.5,
        }
    ]


def test_a_recorded_measurement_carries_commit_command_and_table(tmp_path):
    objs = _objs()
    path = R.write(
        tmp_path / "benchmarks",
        objs,
        "small",
        HEADS,
        table_rows(objs),
        notes_of(objs, tmp_path / "r.db"),
        argv=["bench", "--preset", "small"],
    )
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert path.name == f"small_amd-epyc-9r45-2core_{today}.md"
    text = path.read_text()
    assert "Command: `benchctl bench --preset small`" in text
    assert "Code: `" in text or "not a git checkout" in text
    assert "| control | fp32 | 1,000 | ±10% | 0.50s | 2.0 |" in text
    assert "20261126-000000-abcdef" in text
    # never overwritten: the same day's second measurement gets its own file
    again = R.write(tmp_path / "benchmarks", objs, "small", HEADS, table_rows(objs), [], argv=["bench"])
    assert again != path and again.name.endswith("_2.md") and path.read_text() == text


def test_record_into_a_file_is_one_clear_error(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        R.write(f, _objs(), "small", HEADS, table_rows(_objs()), [], argv=["bench"])


def test_a_decode_measurement_has_its_own_file_and_table(tmp_path):
    from benchctl.stages.bench.cli import DECODE_RECORD_HEADS, decode_rows

    row = {
        "bench_id": "20261126-000000-fedcba",
        "arch": "control",
        "mode": "decode",
        "impl": "decode",
        "dtype": "float32",
        "batch": 1,
        "compiled": 1,
        "device_name": "AMD EPYC 9R45 (2 cores, 2 threads)",
        "threads": 1,
        "tokens_per_s": 2500.0,
        "tokens_per_s_min": 2400.0,
        "tokens_per_s_max": 2600.0,
        "prefill_tokens_per_s": 9000.0,
        "agreement": 1.0,
    }
    objs = [
        row,
        {**row, "impl": "decode-reference", "compiled": 0},
        {**row, "impl": "transformers", "compiled": 0, "tokens_per_s": 1000.0},
        {**row, "impl": "llama2c-runfast", "compiled": 0, "tokens_per_s": 10000.0, "prefill_tokens_per_s": None},
    ]
    path = R.write(
        tmp_path,
        objs,
        "small",
        DECODE_RECORD_HEADS,
        decode_rows(objs, record=True),
        notes_of(objs, tmp_path / "r.db"),
        argv=["bench", "--decode"],
        decode=True,
    )
    text = path.read_text()
    assert path.name.startswith("small-decode_amd-epyc-9r45-2core_")
    assert text.startswith("# Generation (decode), preset `small`: control\n")
    assert "| control | decode | fp32 | 1 | yes | 9,000 | 2,500 | 2,400-2,600 | 100.0% | 1 | 2.50 | 0.25 |" in text
    assert "| control | llama2c-runfast | fp32 | 1 | no | - | 10,000 |" in text

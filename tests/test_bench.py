"""Tests of `benchctl bench` (benchctl/bench.py, benchctl/commands/bench.py). None of them is a timing test.

- The regression guard on step cost: benchctl's optimised step (`train_step` on the control, with its fused projections,
  complex RoPE and fused AdamW) and the eager llama2.c reference step give the same loss, the same clipped gradients
  and the same updated weights from the same weights and batch; and over several seeded steps the losses stay equal.
  The relaxed model's hand-written LoRA kernel (`LoRAProjection`) passes gradcheck and matches plain autograd.
- The reference is llama2.c's model: the same seed gives the same initial weights as benchctl's control.
- A smoke run of the real command at the `tiny` preset: the JSON fields and the rows written to the `bench` table.
- The GPU peak table answers known names and leaves unknown GPUs without a peak; bad options are one-line errors.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sqlite3
import struct
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import architectures
from benchctl import stages
from benchctl.cli import app, main
from benchctl.core import runtime
from benchctl.core.config import make_config
from benchctl.core.errors import ConfigError
from benchctl.export.llama import export_formats
from benchctl.stages.bench import engine as B
from benchctl.stages.bench import external as X
from benchctl.stages.train.engine import make_optimizer, train_step

runner = CliRunner()
CPU = torch.device("cpu")


def capture_grads(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str], out: dict[str, torch.Tensor]):
    """Record every gradient right before the optimizer steps (after clipping), keyed by parameter name."""

    def hook(opt, args, kwargs):
        for g in opt.param_groups:
            for p in g["params"]:
                out[names[p]] = p.grad.detach().clone()

    return optimizer.register_step_pre_hook(hook)


@pytest.mark.parametrize("overrides", [{}, {"model.n_kv_heads": 1}])
def test_optimised_step_matches_reference_step(overrides):
    cfg = make_config("tiny", "control", overrides=overrides)
    torch.manual_seed(0)
    model = architectures.build("control", cfg.model).train()
    ref = B.build_reference(cfg, CPU, weights_from=model).train()
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    opt, ref_opt = make_optimizer(model, cfg, CPU), B.reference_optimizer(ref, cfg, CPU)
    for g in opt.param_groups + ref_opt.param_groups:
        g["lr"] = cfg.train.lr
    before = {n: t.clone() for n, t in model.state_dict().items()}
    grads: dict[str, torch.Tensor] = {}
    ref_grads: dict[str, torch.Tensor] = {}
    capture_grads(opt, {p: n for n, p in model.named_parameters()}, grads)
    capture_grads(ref_opt, {p: n for n, p in ref.named_parameters()}, ref_grads)

    loss, grad_norm = train_step(model, model, opt, B.RandomBatches(cfg, CPU, seed=3), cfg, CPU, None)
    ref_loss = B.reference_step(ref, ref_opt, B.RandomBatches(cfg, CPU, seed=3), cfg, CPU, None)

    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grad_norm is not None and grad_norm > 0
    assert set(grads) == set(ref_grads) == {n for n, _ in model.named_parameters()}
    for n in grads:
        assert grads[n].abs().sum() > 0, n  # every parameter really receives a gradient
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-7, msg=n)
    after, ref_after = model.state_dict(), ref.state_dict()
    for n in after:
        # Adam's first update is lr * g / (|g| + eps), about lr * sign(g): float noise in a gradient entry near eps
        # (1e-8) moves a weight by a small fraction of lr (3e-3 here; 1e-5 seen), a wrong gradient by about lr
        torch.testing.assert_close(after[n], ref_after[n], rtol=0, atol=0.1 * cfg.train.lr, msg=n)
        assert not torch.equal(after[n], before[n]), n  # the step really updated it


def test_reference_with_the_same_seed_has_the_same_weights():
    cfg = make_config("tiny", "control")
    torch.manual_seed(5)
    ours = architectures.build("control", cfg.model)
    torch.manual_seed(5)
    ref = B.Reference(cfg.model)
    assert ref.tok_embeddings.weight is ref.output.weight  # tied, as in llama2.c
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_losses_match_over_seeded_steps():
    cfg = make_config("tiny", "control")
    check = B.check_equivalence(cfg, CPU, steps=6)
    assert len(check["losses"]) == len(check["reference_losses"]) == 6
    assert len(set(check["losses"])) == 6  # six different batches, really run
    assert check["max_abs_diff"] < 1e-4


def test_lora_projection_matches_plain_autograd():
    """The relaxed model's hand-written LoRA kernel: same outputs and gradients as the plain formula, and its
    backward passes torch's numerical gradient check (float64, scale != 1, unequal output widths as with GQA)."""
    from architectures.blocks import LoRAProjection

    g = torch.Generator().manual_seed(0)
    N, d_in, r, outs, scale = 6, 5, 2, (4, 3, 3), 0.5

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    x, w, a = rand(N, d_in), rand(sum(outs), d_in), rand(len(outs) * r, d_in)
    bs = [rand(o, r) for o in outs]
    assert torch.autograd.gradcheck(lambda *t: LoRAProjection.apply(t[0], t[1], t[2], scale, *t[3:]), (x, w, a, *bs))
    y = LoRAProjection.apply(x, w, a, scale, *bs)
    u = (x @ a.t()).split(r, dim=-1)
    plain = x @ w.t() + torch.cat([scale * uj @ b.t() for uj, b in zip(u, bs)], dim=-1)
    gy = torch.randn(N, sum(outs), generator=g, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, w, a, *bs), gy)
    want = torch.autograd.grad(plain, (x, w, a, *bs), gy)
    torch.testing.assert_close(y, plain)
    for gg, ww in zip(got, want):
        torch.testing.assert_close(gg, ww)


def test_lora_projection_under_bf16_autocast_matches_plain_autograd():
    """Under CPU bf16 autocast the fused LoRA function gets bf16 operands (as autocast gives a linear layer) and the
    float32 parameters get float32 gradients within bf16 rounding of the plain formula under the same autocast."""
    import architectures.blocks as blocks

    g = torch.Generator().manual_seed(1)
    lin = [torch.nn.Linear(16, o, bias=False) for o in (8, 4)]
    loras = {n: blocks.LoRA(16, o, rank=2, alpha=1.0) for n, o in (("wq", 8), ("wk", 4))}
    for m in loras.values():
        with torch.no_grad():
            m.A.normal_(generator=g), m.B.normal_(generator=g)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    params = [x, *(m.weight for m in lin), *(t for m in loras.values() for t in (m.A, m.B))]
    gy = torch.randn(3, 5, 12, generator=g)

    def run(fused: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = (
                blocks.project_group(lin, x, loras, ["wq", "wk"])
                if fused
                else torch.nn.functional.linear(x, torch.cat([m.weight for m in lin]))
                + blocks.lora_delta(x, [loras["wq"], loras["wk"]])
            )
        return y, torch.autograd.grad(y, params, gy)

    (y, grads), (y_plain, grads_plain) = run(True), run(False)
    assert y.dtype == torch.bfloat16 and all(gr.dtype == torch.float32 for gr in grads)
    torch.testing.assert_close(y.float(), y_plain.float(), rtol=2e-2, atol=2e-2)
    for gr, gp in zip(grads, grads_plain):
        torch.testing.assert_close(gr, gp, rtol=3e-2, atol=3e-2)


def test_relaxed_step_matches_plain_autograd():
    """The whole relaxed model (perturbed LoRA, scale 0.5): the optimised forward/backward equals the plain one."""
    import architectures.blocks as blocks

    cfg = make_config("tiny", "relaxed", overrides={"model.lora_alpha": 2.0})
    torch.manual_seed(0)
    model = architectures.build("relaxed", cfg.model).train()
    with torch.no_grad():
        for m in model.lora.modules():
            if isinstance(m, blocks.LoRA):
                m.B.normal_(0, 0.05)
    x, y = B.RandomBatches(cfg, CPU, n=1)()

    def loss_and_grads():
        model.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fast_loss, fast = loss_and_grads()
    plain_apply = blocks.LoRAProjection.apply
    try:  # route every LoRA'd projection through plain autograd instead
        blocks.LoRAProjection.apply = lambda x2, w, a, scale, *bs: (
            x2 @ w.t()
            + torch.cat([scale * uj @ b.t() for uj, b in zip((x2 @ a.t()).split(bs[0].shape[1], -1), bs)], dim=-1)
        )
        plain_loss, plain = loss_and_grads()
    finally:
        blocks.LoRAProjection.apply = plain_apply
    torch.testing.assert_close(fast_loss, plain_loss, rtol=1e-6, atol=1e-6)
    for n in fast:
        torch.testing.assert_close(fast[n], plain[n], rtol=1e-4, atol=1e-7, msg=n)


def test_gpu_peak_table():
    assert B.gpu_peak("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert B.gpu_peak("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert B.gpu_peak("NVIDIA H100 PCIe")[0] == 756e12
    assert B.gpu_peak("NVIDIA L4")[0] == 121e12
    assert B.gpu_peak("NVIDIA GeForce RTX 4090")[0] == 165.2e12
    peak, source = B.gpu_peak("Tesla T4", "float16")
    assert peak == 65e12 and "fp16" in source
    assert B.gpu_peak("Tesla T4")[0] is None  # its fp16 number is no bf16 peak
    assert B.gpu_peak("NVIDIA L40S")[0] == 362e12  # not mistaken for an L4
    assert (
        B.gpu_peak("Tesla V100-PCIE-32GB", "float16")[0] == 112e12
        and B.gpu_peak("Tesla V100-SXM2-16GB", "float16")[0] == 125e12
    )
    assert B.gpu_peak("NVIDIA H100 NVL")[0] is None and B.gpu_peak("NVIDIA A10G")[0] is None  # not guessed
    peak, note = B.gpu_peak("NVIDIA GeForce RTX 3070 Laptop GPU")
    assert peak is None and "MFU left empty" in note


def test_profiled_step_separates_kernel_time_from_the_rest():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x = torch.randn(4_000_000)

    def step():
        for _ in range(4):
            a @ b  # kernel time
        torch.exp(x).sum()  # not kernel time

    prof = B.profile_cpu_step(step)
    assert 0 < prof.kernel_seconds < prof.step_seconds
    with torch.profiler.profile() as p:
        torch.exp(x)
    assert not any(B.is_kernel_op(e.key) for e in p.key_averages())
    assert B.is_kernel_op("aten::mm") and B.is_kernel_op("aten::_scaled_dot_product_flash_attention_for_cpu")
    assert prof.peak_growth is None or prof.peak_growth >= x.numel() * 4  # exp(x) was live during the step


# The control and one recurrent design: every registered architecture is trained and counted by the registry-driven
# tests elsewhere; timing all of them here only made this the suite's slowest test.
BENCHED = ["control", "frailt"]


@pytest.mark.slow  # each architecture trained, timed and profiled, beside the eager reference
def test_bench_cli_smoke(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCHCTL_DB", raising=False)
    db_path = tmp_path / "results.db"
    result = runner.invoke(
        app,
        [
            "bench",
            "--preset",
            "tiny",
            "--archs",
            ",".join(BENCHED),
            "--steps",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--json",
            "--db",
            str(db_path),
        ],
    )
    assert result.exit_code == 0, result.output
    objs = json.loads(result.stdout)
    assert [o["arch"] for o in objs] == BENCHED
    for o in objs:
        cfg = make_config("tiny", o["arch"])
        expected_flops = architectures.build_shapes(o["arch"], cfg.model).flops_per_token()
        assert o["flops_per_token"] == expected_flops
        assert o["tokens_per_s_min"] <= o["tokens_per_s"] <= o["tokens_per_s_max"] and o["tokens_per_s"] > 0
        assert o["achieved_flops"] == pytest.approx(o["tokens_per_s"] * o["flops_per_token"])
        assert o["peak_flops"] > 0 and "measured matmul peak" in o["peak_flops_source"]  # CPU: measured, this run
        assert o["mfu"] == pytest.approx(o["achieved_flops"] / o["peak_flops"])
        assert o["peak_mem_bytes"] > 0 and o["cost_ratio"] > 0
    control = objs[0]
    assert control["cost_ratio"] == 1.0
    assert control["reference_tokens_per_s"] > 0
    assert control["speedup"] == pytest.approx(control["tokens_per_s"] / control["reference_tokens_per_s"])
    assert all("reference_tokens_per_s" not in o for o in objs[1:])
    # the ceiling: the reference's step over the control's matmul + attention kernel time (best profiled step)
    assert 0 < control["kernel_seconds"]
    assert control["speedup_ceiling"] == pytest.approx(control["reference_step_seconds"] / control["kernel_seconds"])
    assert control["speedup_ceiling_fp32"] == pytest.approx(
        control["reference_fp32_step_seconds"] / control["kernel_seconds"]
    )

    con = sqlite3.connect(db_path)
    con.row_factory = sqlite3.Row
    rows = [dict(r) for r in con.execute("select * from bench order by id")]
    # this machine's CPU may or may not compute bf16 natively: the reference runs at benchctl's precision and, when
    # that is bf16, in fp32 too (the ratio to llama2.c as its users run it on a CPU)
    bf16 = control["dtype"] == "bfloat16"
    auto = runtime.resolve_precision("auto", torch.device("cpu")).dtype
    assert control["reference_dtype"] == control["dtype"] == auto
    assert control["speedup_fp32"] == pytest.approx(control["tokens_per_s"] / control["reference_fp32_tokens_per_s"])
    refs = [("control", "reference")] + ([("control", "reference-fp32")] if bf16 else [])
    assert len(rows) == len(objs) + len(refs) and len({r["bench_id"] for r in rows}) == 1
    assert [(r["arch"], r["impl"]) for r in rows] == [("control", "benchctl"), *refs] + [
        (a, "benchctl") for a in BENCHED[1:]
    ]
    assert [r["dtype"] for r in rows] == [control["dtype"]] * 2 + (["float32"] if bf16 else []) + [control["dtype"]] * (
        len(objs) - 1
    )
    for r in rows:
        assert (r["preset"], r["steps"], r["repeats"], r["device"], r["compiled"]) == ("tiny", 2, 1, "cpu", 0)
        assert r["tokens_per_step"] == 8 * 2 * 32 and r["load_avg"] is not None and r["threads"] >= 1
        assert json.loads(r["config_json"])["arch"] == r["arch"]
    assert rows[0]["tokens_per_s"] == control["tokens_per_s"]
    assert rows[1]["tokens_per_s"] == control["reference_tokens_per_s"]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_bench_table_output_and_equivalence_check(tmp_path):
    db_path = tmp_path / "r.db"
    result = runner.invoke(
        app,
        [
            "bench",
            "--preset",
            "tiny",
            "--archs",
            "control",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--check-steps",
            "3",
            "--db",
            str(db_path),
        ],
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "speed-up over the eager llama2.c reference" in out and "loss after 3 seeded steps" in out
    assert "of measured matmul peak" in out and "load average" in out
    assert "in matmul and attention kernels" in out and "x the reference" in out
    assert max(len(line) for line in out.splitlines() if "│" in line or "─" in line) <= 80  # the table fits
    con = sqlite3.connect(db_path)
    (eq,) = con.execute("select equivalence_json from bench where impl = 'benchctl'").fetchone()
    check = json.loads(eq)
    assert check["steps"] == 3 and check["max_abs_diff"] < 1e-4 and len(check["reference_losses"]) == 3


@pytest.mark.slow  # every architecture's generation timed at two batches and two precisions
def test_bench_decode_times_both_paths_and_checks_the_tokens(tmp_path):
    db_path = tmp_path / "r.db"
    argv = ["bench", "--decode", "--preset", "tiny", "--batches", "1,3", "--new-tokens", "6", "--repeats", "2"]
    result = runner.invoke(app, [*argv, "--warmup", "1", "--db", str(db_path)])
    assert result.exit_code == 0, result.output
    assert "generation — preset 'tiny'" in result.stdout and "agreement" in result.stdout
    con = sqlite3.connect(db_path)
    con.row_factory = sqlite3.Row
    rows = [dict(r) for r in con.execute("select * from bench order by id")]
    expected = [
        (a, impl, b, dtype)
        for a in architectures.names()
        for b in (1, 3)
        for impl, dtype in [
            ("decode", "float32"),
            ("decode-reference", "float32"),
            ("decode", "bfloat16"),  # --precisions' default: float32 and bfloat16
            *([("transformers", "float32")] if "hf" in export_formats(architectures.get(a)) else []),
        ]
    ]
    assert [(r["arch"], r["impl"], r["batch"], r["dtype"]) for r in rows] == expected
    assert any(r["impl"] == "transformers" for r in rows)  # the same weights through the hf export
    for r in rows:
        assert (r["mode"], r["preset"], r["repeats"], r["warmup_steps"]) == ("decode", "tiny", 2, 1)
        assert (r["prompt_tokens"], r["new_tokens"], r["compiled"]) == (16, 6, 0)
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"] and r["prefill_tokens_per_s"] > 0
        assert r["impl_detail"]
        if r["dtype"] == "float32":  # the decode path's and transformers' greedy tokens are the reference loop's
            assert r["agreement"] == 1.0
        else:
            assert 0.0 <= r["agreement"] <= 1.0
    # sample and eval take the precision these rows measured fastest, unless told
    from benchctl.stages.bench.precision import choose_precision

    dtype, reason = choose_precision(stages.connect(db_path), "auto", torch.device("cpu"))
    assert reason.startswith("measured: ") and "bfloat16" in reason and dtype in (torch.float32, torch.bfloat16)
    assert choose_precision(stages.connect(db_path), "float32", torch.device("cpu"))[1].startswith("set: ")
    # the training bench and the report leave generation rows alone
    from benchctl.stages.bench import tables as bench_tables

    assert bench_tables.bench_configs(stages.connect(db_path), "tiny", "cpu") == []


def test_decode_agreement_counts_differing_and_missing_tokens():
    from benchctl.stages.bench.decode import agreement

    assert agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert agreement([[1, 2, 3], [4]], [[1, 9, 3], [4, 5]]) == pytest.approx(3 / 5)


# llama2.c's Makefile, as its repository has it (the targets bench --llama2c reads)
MAKEFILE = """# choose your compiler, e.g. gcc/clang
# example override to clang: make run CC=clang
CC = gcc

# the most basic way of building that is most likely to work on most systems
.PHONY: run
run: run.c
\t$(CC) -O3 -o run run.c -lm
\t$(CC) -O3 -o runq runq.c -lm

.PHONY: runfast
runfast: run.c
\t$(CC) -Ofast -o run run.c -lm
\t$(CC) -Ofast -o runq runq.c -lm

.PHONY: runomp
runomp: run.c
\t$(CC) -Ofast -fopenmp -march=native run.c  -lm  -o run
"""


def test_run_c_is_built_with_the_makefiles_runfast_command(tmp_path):
    cmd = X.runfast_command(MAKEFILE, tmp_path / "src", tmp_path / "out" / "run")
    assert cmd == ["gcc", "-Ofast", "-o", str(tmp_path / "out" / "run"), str(tmp_path / "src" / "run.c"), "-lm"]
    assert X.runfast_command(MAKEFILE.replace("CC = gcc", "CC = clang"), tmp_path, tmp_path / "r")[0] == "clang"
    with pytest.raises(ConfigError, match="no `runfast` target"):
        X.runfast_command(MAKEFILE.replace("runfast:", "fast:"), tmp_path, tmp_path / "r")


def test_run_c_rate_is_read_from_its_last_line():
    # run.c: fprintf(stderr, "achieved tok/s: %f\n", (pos-1) / (double)(end-start)*1000);
    assert X.parse_tok_per_s("achieved tok/s: 29350.000000\n") == 29350.0
    assert X.parse_tok_per_s("achieved tok/s: inf\n") is None  # the run fell within one millisecond tick
    assert X.parse_tok_per_s("") is None  # a single position: run.c prints no rate


def test_run_c_text_agreement_counts_new_tokens_up_to_the_first_difference(tmp_path):
    # a tokenizer.bin as the llama2c export writes it: max length, then per id its score, length and bytes
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n", b"\x07", b" Once", b" upon", b" a", b" time", b".", b"\xc3\xa9"]
    path = tmp_path / "tokenizer.bin"
    path.write_bytes(
        struct.pack("<I", max(map(len, pieces))) + b"".join(struct.pack("<fI", 0.0, len(p)) + p for p in pieces)
    )
    assert X.read_tokenizer_bin(path) == pieces
    prompt = [1, 4, 5]  # BOS " Once" " upon": run.c strips the space after BOS
    new = [6, 7, 3, 9, 8]  # " a" " time" (bell: not printed) "é" "."
    assert X.text_agreement(pieces, prompt, new, b"Once upon a time\xc3\xa9.\n") == 1.0
    assert X.text_agreement(pieces, prompt, new, b"Once upon a time.\n") == pytest.approx(3 / 5)
    assert X.text_agreement(pieces, prompt, new, b"Once upon a time\xc3\xa9. a\n") == pytest.approx(5 / 6)
    assert X.text_agreement(pieces, prompt, new, b"Twice\n") == 0.0


FAKE_RUN_C = r"""#include <stdio.h>
#include <string.h>
/* stands in for llama2.c's run.c: echoes its prompt, then reports a rate in run.c's format */
int main(int argc, char **argv) {
    for (int i = 1; i < argc - 1; i++) if (strcmp(argv[i], "-i") == 0) printf("%s", argv[i + 1]);
    printf("\n");
    fprintf(stderr, "achieved tok/s: %f\n", 1234.5);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the fake checkout's Makefile names it)")
def test_bench_decode_llama2c_compiles_runs_and_stores_run_c_rows(tmp_path, tinystories_dir):
    checkout = tmp_path / "llama2.c"
    checkout.mkdir()
    (checkout / "Makefile").write_text(MAKEFILE)
    (checkout / "run.c").write_text(FAKE_RUN_C)
    db_path = tmp_path / "r.db"
    argv = ["bench", "--decode", "--preset", "tiny", "--archs", "control", "--batches", "1", "--new-tokens", "4"]
    argv += ["--repeats", "1", "--warmup", "0", "--llama2c", str(checkout), "--set", f"data.source={tinystories_dir}"]
    result = runner.invoke(app, [*argv, "--db", str(db_path), "--record", str(tmp_path / "bench")])
    assert result.exit_code == 0, result.output
    con = sqlite3.connect(db_path)
    con.row_factory = sqlite3.Row
    (row,) = [dict(r) for r in con.execute("select * from bench where impl = 'llama2c-runfast'")]
    assert (row["batch"], row["threads"], row["tokens_per_s"], row["prefill_tokens_per_s"]) == (1, 1, 1234.5, None)
    assert row["agreement"] == 0.0  # the fake prints the prompt and no continuation
    assert "-Ofast" in row["impl_detail"] and "not a git checkout" in row["impl_detail"]
    (record,) = (tmp_path / "bench").iterdir()
    assert "| x transformers | x runfast |" in record.read_text()


def _decode_row(
    bench_id: str, arch: str, dtype: str, tps: float, device_name: str, when: str, agreement: float | None = 1.0
) -> dict:
    return {
        "agreement": agreement,
        "bench_id": bench_id,
        "arch": arch,
        "mode": "decode",
        "impl": "decode",
        "batch": 1,
        "dtype": dtype,
        "tokens_per_s": tps,
        "device": "cpu",
        "device_name": device_name,
        "created_at": when,
    }


def test_inference_precision_is_the_newest_measured_fastest_on_this_hardware(tmp_path):
    from benchctl.core import telemetry
    from benchctl.stages.bench.precision import choose_precision

    cpu = torch.device("cpu")
    here = telemetry.hardware_name(cpu) + " (2 cores, 2 threads)"
    db = stages.connect(tmp_path / "r.db")
    dtype, reason = choose_precision(db, "auto", cpu)
    assert dtype == torch.float32 and reason.startswith("auto: float32, no bench --decode comparison")
    rows = [  # bench b1: bfloat16 faster for both architectures
        _decode_row("b1", "control", "float32", 100.0, here, "2026-01-01"),
        _decode_row("b1", "control", "bfloat16", 150.0, here, "2026-01-01"),
        _decode_row("b1", "relaxed", "float32", 100.0, here, "2026-01-01"),
        _decode_row("b1", "relaxed", "bfloat16", 120.0, here, "2026-01-01"),
        # newer, but another machine, or one precision only: not a comparison on this hardware
        _decode_row("b2", "control", "float32", 100.0, "Another CPU (4 cores)", "2026-02-01"),
        _decode_row("b2", "control", "bfloat16", 10.0, "Another CPU (4 cores)", "2026-02-01"),
        _decode_row("b3", "control", "float32", 100.0, here, "2026-03-01"),
    ]
    db["bench"].insert_all(rows)
    dtype, reason = choose_precision(db, "auto", cpu)
    assert dtype == torch.bfloat16 and reason.startswith("measured: bfloat16 decoded fastest (bench --decode b1")
    assert "bfloat16 1.34x" in reason  # sqrt(1.5 * 1.2)
    assert choose_precision(db, "float16", cpu)[0] == torch.float16  # the user's choice wins
    db["bench"].insert_all(  # the newest comparison here: float32 ahead
        [
            _decode_row("b4", "control", "float32", 100.0, here, "2026-04-01"),
            _decode_row("b4", "control", "bfloat16", 80.0, here, "2026-04-01"),
        ]
    )
    dtype, reason = choose_precision(db, "auto", cpu)
    assert dtype == torch.float32 and reason.startswith("measured: float32 decoded fastest (bench --decode b4")


def test_a_faster_precision_that_changes_the_tokens_is_not_chosen(tmp_path):
    """bf16 decoding 1.5x faster but agreeing with float32's greedy tokens on 62% of them would change every sample
    and score after it: float32 stays, and the reason says why; a faithful faster precision is still chosen."""
    from benchctl.core import telemetry
    from benchctl.stages.bench.precision import MIN_AGREEMENT, choose_precision

    cpu = torch.device("cpu")
    here = telemetry.hardware_name(cpu) + " (2 cores, 2 threads)"
    db = stages.connect(tmp_path / "r.db")
    db["bench"].insert_all(
        [
            _decode_row("b1", "control", "float32", 100.0, here, "2026-01-01"),
            _decode_row("b1", "control", "bfloat16", 150.0, here, "2026-01-01", agreement=1.0),
            _decode_row("b1", "relaxed", "float32", 100.0, here, "2026-01-01"),
            _decode_row("b1", "relaxed", "bfloat16", 150.0, here, "2026-01-01", agreement=0.62),
        ]
    )
    dtype, reason = choose_precision(db, "auto", cpu)
    assert dtype == torch.float32 and reason.startswith("measured: float32 (bench --decode b1")
    assert (
        f"bfloat16 was faster but its greedy tokens agreed only 0.62 with float32's (at least {MIN_AGREEMENT}" in reason
    )
    db["bench"].insert_all(  # newer: one row without an agreement (an older database) is not taken on trust
        [
            _decode_row("b2", "control", "float32", 100.0, here, "2026-02-01"),
            _decode_row("b2", "control", "bfloat16", 150.0, here, "2026-02-01", agreement=None),
        ]
    )
    assert choose_precision(db, "auto", cpu)[0] == torch.float32
    db["bench"].insert_all(
        [
            _decode_row("b3", "control", "float32", 100.0, here, "2026-03-01"),
            _decode_row("b3", "control", "bfloat16", 150.0, here, "2026-03-01", agreement=MIN_AGREEMENT),
        ]
    )
    assert choose_precision(db, "auto", cpu)[0] == torch.bfloat16


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--decode", "--precisions", "bfloat16"], "--precisions"),
        (["--decode", "--precisions", "float32,fp8"], "--precisions"),
        (["--decode", "--llama2c", "/nonexistent/llama2.c"], "not a llama2.c checkout"),
        (["--llama2c", "."], "goes with --decode"),
        (["--decode", "--batches", "1,x"], "--batches"),
        (["--decode", "--batches", "0"], "--batches"),
        (["--steps", "0"], "--steps"),
        (["--archs", "contrl"], "did you mean 'control'"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--preset", "tiny", "--db", str(tmp_path / "r.db"), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


_ALLOC_PROBE = """
import resource, sys, torch
from benchctl.core import telemetry
if sys.argv[1] == "tune":
    print(telemetry.tune_cpu_allocator()); print(telemetry.tune_cpu_allocator())
def step():  # 50 x 4 MiB live at once, then freed: a training step's activations in miniature
    xs = [torch.ones(1 << 20) for _ in range(50)]
    del xs
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _probe(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _ALLOC_PROBE, mode], capture_output=True, text=True, env=clean | env, check=True
    ).stdout
    return out.splitlines()


@pytest.mark.slow  # three fresh interpreters importing torch
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is for glibc only")
def test_cpu_allocator_keeps_freed_memory_for_the_next_step():
    """Process-wide, so each case runs in a fresh interpreter; page faults are the measurable effect."""
    *said, tuned = _probe("tune")
    assert said[0] == said[-1] and "mmap threshold 32 MiB" in said[0]  # applied once, reported both times
    (untuned,) = _probe("leave")
    assert int(tuned) * 4 < int(untuned)  # freed pages are reused, not returned to the OS and faulted in again
    user = _probe("tune", MALLOC_TRIM_THRESHOLD_="0")  # the user's own malloc settings win
    assert user[0] == "None"


def test_the_ceiling_line_names_both_references():
    """With the reference timed at bf16 and in fp32, the ceiling is given against each (the same kernel time over
    each reference's step); with an fp32 reference alone, once."""
    from benchctl.stages.bench.cli import _reference_notes

    ctrl = {
        "speedup_fp32": 2.0,
        "speedup": 1.5,
        "speedup_cpu": 1.5,
        "reference_dtype": "bfloat16",
        "kernel_seconds": 0.64,
        "speedup_ceiling": 2.0,
        "speedup_ceiling_fp32": 2.49,
    }
    (line,) = [n for n in _reference_notes(ctrl, 2) if n.startswith("ceiling")]
    assert line.endswith("2.00x the reference at the same precision and 2.49x the reference in fp32")
    ctrl.update(reference_dtype="float32", speedup_ceiling_fp32=2.0)
    (line,) = [n for n in _reference_notes(ctrl, 2) if n.startswith("ceiling")]
    assert line.endswith("2.00x the reference at the same precision")

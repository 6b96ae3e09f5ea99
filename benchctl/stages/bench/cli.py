"""`benchctl bench`: time real training steps per architecture beside an eager llama2.c reference (bench.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl.core.config import parse_set
from benchctl.core.errors import ConfigError
from benchctl.stages.bench.options import BenchOptions
from benchctl.stages.cli import DbOpt, JsonOpt, PresetOpt, SetOpt, console, db_path_of, err_console, split_list

app = typer.Typer()


@app.command(short_help="Time each architecture's training step, or generation.")
def bench(
    preset: PresetOpt = "paper",
    archs: Annotated[str | None, typer.Option("--archs", help="Comma list (default: all registered).")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Timed optimizer steps per repeat.")] = 10,
    repeats: Annotated[int, typer.Option("--repeats", help="Repeats (median and spread are over these).")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed steps first (compilation happens there).")] = 2,
    compile_: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile the model [default: as train decides from "
            "train.compile; auto compiles a bf16 CPU step].",
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    reference: Annotated[
        bool, typer.Option("--reference/--no-reference", help="Time the eager llama2.c reference beside the control.")
    ] = True,
    check_steps: Annotated[
        int, typer.Option("--check-steps", help="Also train control and reference N seeded steps; compare losses.")
    ] = 0,
    threads: Annotated[int | None, typer.Option("--threads", help="torch intra-op threads [default: torch's].")] = None,
    record: Annotated[
        Path | None,
        typer.Option(
            "--record",
            help="Also write the measurement, with the machine, commit and command, to "
            "DIR/<preset>_<hardware>_<date>.md (e.g. benchmarks/).",
            metavar="DIR",
        ),
    ] = None,
    decode: Annotated[
        bool,
        typer.Option(
            "--decode",
            help="Time generation instead of training: prefill and decode tokens/s of the decode path and the "
            "reference loop, tokens checked against the reference in fp32 (--compile compiles the decode step).",
        ),
    ] = False,
    batches: Annotated[str, typer.Option("--batches", help="With --decode: batch sizes, a comma list.")] = "1,16",
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="With --decode: prompt length of every row.")
    ] = 16,
    new_tokens: Annotated[
        int | None,
        typer.Option("--new-tokens", help="With --decode: new tokens per row [default: what the context leaves]."),
    ] = None,
    precisions: Annotated[
        str,
        typer.Option(
            "--precisions",
            help="With --decode: the precisions the decode path's weights are cast to, a comma list including "
            "float32; sample and eval use the fastest measured.",
        ),
    ] = "float32,bfloat16",
    llama2c: Annotated[
        Path | None,
        typer.Option(
            "--llama2c",
            help="With --decode: a checkout of karpathy/llama2.c; its run.c is compiled with the Makefile's "
            "runfast flags into a temporary folder and timed on the llama2c export (batch 1, one thread).",
            metavar="DIR",
        ),
    ] = None,
    set_: SetOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Tokens/s, step time, memory, FLOPs, MFU per architecture, and the speed-up over an eager llama2.c step."""
    opts = BenchOptions(
        preset=preset,
        archs=split_list(archs),
        steps=steps,
        repeats=repeats,
        warmup=warmup,
        compile=compile_,
        device=device,
        overrides=parse_set(set_),
        reference=reference,
        check_steps=check_steps,
        threads=threads,
        decode=decode,
        decode_batches=_batches(batches),
        decode_prompt_tokens=prompt_tokens,
        decode_new_tokens=new_tokens,
        decode_precisions=tuple(split_list(precisions) or []),
        llama2c=llama2c,
    )
    from benchctl.stages.bench import engine as B  # torch: kept out of 'benchctl --help'

    out = err_console if as_json else console  # keep stdout pure JSON with --json

    def log(msg: str) -> None:
        out.print(msg, highlight=False)

    path = db_path_of(db)
    objs = B.run(opts, path, log=log)
    notes = notes_of(objs, path)
    if as_json:
        print(B.to_json(objs))
    else:
        if decode:
            console.print(_decode_table(objs, preset))
        else:
            console.print(_table(objs, preset))
        for n in notes:
            console.print(n, highlight=False, soft_wrap=True)
    if record is not None:
        from benchctl.stages.bench import record as R

        heads, rows = (DECODE_RECORD_HEADS, decode_rows(objs, record=True)) if decode else (HEADS, table_rows(objs))
        log(f"wrote {R.write(record, objs, preset, heads, rows, notes, decode=decode)}")


def notes_of(objs: list[dict], path: Path) -> list[str]:
    """The lines printed under the table: what the columns mean, the comparison with the reference, the load."""
    from benchctl.stages.bench import engine as B

    if objs and objs[0].get("mode") == "decode":
        return [
            f"device: {objs[0]['device_name']}; tok/s: median over repeats (decode: min-max beside it); agreement: "
            f"share of tokens equal to the reference loop's in fp32",
            "llama2c-runfast: run.c built with its Makefile's runfast flags, on one thread; --record's file "
            "gives each row's decode tok/s over transformers' and run.c's at the same architecture and batch size",
            f"bench id {objs[0]['bench_id']} (table 'bench' in {path})",
        ]
    o0 = objs[0]
    loads = [f"{o['arch']} {o['load_avg']:.2f}" for o in objs if o["load_avg"] is not None]
    notes = [
        f"device: {o0['device_name']}; tok/s: median over repeats, spread: half their range; MF/tok: "
        "training MFLOP per token; MiB: the step's peak memory",
        f"MFU: {o0['peak_flops_source']}" + (f" = {B._fmt_flops(o0['peak_flops'])}" if o0["peak_flops"] else ""),
        "load average during the repeats: " + ", ".join(loads),
        "cost = (time per token / control's) / (FLOPs per token / control's); target <= 1.15",
        f"bench id {o0['bench_id']} (table 'bench' in {path})",
    ]
    ctrl = next((o for o in objs if "speedup" in o), None)
    if ctrl is not None:
        notes = _reference_notes(ctrl, B.PROFILED_STEPS) + notes
    return notes


HEADS = ("arch", "dtype", "tok/s", "spread", "step", "MF/tok", "GF/s", "MFU", "MiB", "cost")


def table_rows(objs: list[dict]) -> list[tuple[str, ...]]:
    """One row per architecture, plus the reference's rows under the control, formatted as printed (HEADS)."""
    out: list[tuple[str, ...]] = []
    for o in objs:
        rows = [
            (
                o["arch"],
                o.get("dtype"),
                o["tokens_per_s"],
                o["tokens_per_s_min"],
                o["tokens_per_s_max"],
                o["step_seconds"],
                o["peak_mem_bytes"],
                o.get("cost_ratio"),
            )
        ]
        if "reference_tokens_per_s" in o:
            rows.append(
                (
                    "reference",
                    o.get("reference_dtype"),
                    o["reference_tokens_per_s"],
                    o["reference_tokens_per_s_min"],
                    o["reference_tokens_per_s_max"],
                    o["reference_step_seconds"],
                    o["reference_peak_mem_bytes"],
                    None,
                )
            )
            if o.get("reference_dtype") != "float32":
                rows.append(
                    (
                        "reference",
                        "float32",
                        o["reference_fp32_tokens_per_s"],
                        o["reference_fp32_tokens_per_s_min"],
                        o["reference_fp32_tokens_per_s_max"],
                        o["reference_fp32_step_seconds"],
                        o["reference_fp32_peak_mem_bytes"],
                        None,
                    )
                )
        for name, dtype, tps, lo, hi, step_s, mem, ratio in rows:
            achieved = tps * o["flops_per_token"]
            mfu = f"{achieved / o['peak_flops']:.0%}" if o["peak_flops"] else "-"
            out.append(
                (
                    name,
                    _short(dtype),
                    f"{tps:,.0f}",
                    f"±{(hi - lo) / 2 / tps:.0%}",
                    f"{step_s:.2f}s",
                    f"{o['flops_per_token'] / 1e6:.1f}",
                    f"{achieved / 1e9:.1f}",
                    mfu,
                    f"{mem / 2**20:,.0f}",
                    f"{ratio:.2f}" if ratio is not None else "",
                )
            )
    return out


def _table(objs: list[dict], preset: str) -> Table:
    t = Table(title=f"training step — preset '{preset}'", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for head in HEADS:
        t.add_column(head, justify="left" if head in ("arch", "dtype") else "right", no_wrap=True)
    for row in table_rows(objs):
        t.add_row(*row)
    return t


def _batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in split_list(text) or [])
    except ValueError:
        raise ConfigError(f"--batches takes a comma list of batch sizes, got {text!r}") from None


DECODE_HEADS = ("arch", "impl", "dtype", "batch", "compiled", "prefill tok/s", "decode tok/s", "min-max", "agreement")
# the file --record writes also has the threads and the ratios (too wide for a terminal)
DECODE_RECORD_HEADS = (*DECODE_HEADS, "threads", "x transformers", "x runfast")


def _ratio(r: dict, objs: list[dict], impl: str) -> str:
    """The row's decode tok/s over `impl`'s for the same architecture and batch size ('-' when either is missing)."""
    key = (r["arch"], r["batch"], impl)
    other = next((o for o in objs if (o["arch"], o["batch"], o["impl"]) == key), None)
    if other is None or not other.get("tokens_per_s") or r.get("tokens_per_s") is None:
        return "-"
    return f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}"


def decode_rows(objs: list[dict], record: bool = False) -> list[tuple[str, ...]]:
    """One row per architecture, implementation and batch size, formatted as printed (DECODE_HEADS; with `record`,
    DECODE_RECORD_HEADS)."""
    out = []
    for r in objs:
        tps, lo, hi, pre = r["tokens_per_s"], r["tokens_per_s_min"], r["tokens_per_s_max"], r["prefill_tokens_per_s"]
        row = (
            r["arch"],
            r["impl"],
            _short(r["dtype"]),
            str(r["batch"]),
            "yes" if r["compiled"] else "no",
            "-" if pre is None else f"{pre:,.0f}",
            "-" if tps is None else f"{tps:,.0f}",
            "-" if lo is None else f"{lo:,.0f}-{hi:,.0f}",
            f"{r['agreement']:.1%}",
        )
        if record:
            row += (str(r["threads"]), _ratio(r, objs, "transformers"), _ratio(r, objs, "llama2c-runfast"))
        out.append(row)
    return out


def _decode_table(objs: list[dict], preset: str) -> Table:
    t = Table(title=f"generation — preset '{preset}'", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for head in DECODE_HEADS:
        t.add_column(head, justify="left" if head in ("arch", "impl", "dtype") else "right", no_wrap=True)
    for row in decode_rows(objs):
        t.add_row(*row)
    return t


def _short(dtype: str | None) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype or "", dtype or "-")


def _reference_notes(ctrl: dict, profiled_steps: int) -> list[str]:
    """What the control's comparison with the eager reference showed: both speed-ups (against the reference in fp32,
    as llama2.c runs on a CPU, and at the same precision), then the loss check, then the kernel-time ceiling (each
    only when measured)."""
    notes = [
        f"speed-up over the eager llama2.c reference in fp32 (as llama2.c runs on a CPU; control, same run, "
        f"steps interleaved): {ctrl['speedup_fp32']:.2f}x in tokens/s"
    ]
    notes.append(
        f"speed-up over the same reference at benchctl's precision ({_short(ctrl.get('reference_dtype'))}): "
        f"{ctrl['speedup']:.2f}x in tokens/s, {ctrl['speedup_cpu']:.2f}x in CPU time per step"
    )
    if "equivalence" in ctrl:
        e = ctrl["equivalence"]
        notes.append(
            f"loss after {e['steps']} seeded steps: benchctl {e['loss']:.6f}, reference "
            f"{e['reference_loss']:.6f} (max |difference| over the steps {e['max_abs_diff']:.2e})"
        )
    if "speedup_ceiling" in ctrl:
        notes.append(
            f"ceiling: the control's step spends {ctrl['kernel_seconds']:.2f}s in matmul and attention "
            f"kernels (best of {profiled_steps} profiled steps); with everything else free it would "
            f"be {ctrl['speedup_ceiling']:.2f}x the reference at the same precision"
            + (
                f" and {ctrl['speedup_ceiling_fp32']:.2f}x the reference in fp32"
                if ctrl.get("reference_dtype") != "float32" and "speedup_ceiling_fp32" in ctrl
                else ""
            )
        )
    return notes

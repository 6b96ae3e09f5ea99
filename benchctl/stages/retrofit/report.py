"""Report section of retrofitted runs (`benchctl retrofit`): is converting a trained control cheaper than training the
recurrent model from scratch for the same loss?

Compute is counted in training FLOPs and always includes the parent's: a retrofitted run starts at the FLOPs its
parent cost and adds its own healing steps (at their actual depth under a depth curriculum). Beside each retrofitted
run: the same architecture trained from scratch at the preset's defaults, its final loss and what it cost, and the
FLOPs the retrofitted run needed (parent included) to first reach that loss at an evaluation. The loss right after
conversion (the step-0 evaluation) compares the init methods before any training.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

import architectures
from benchctl.core.config import RunConfig
from benchctl.report.figures import _figure, _style, tick
from benchctl.report.fmt import fnum, md_table, missing
from benchctl.report.frames import Frames
from benchctl.stages.train import curriculum

FIGURE = "retrofit_loss_flops.png"


def _is_retrofit(runs: pd.DataFrame) -> pd.Series:
    if "parent_run_id" not in runs:
        return pd.Series(False, index=runs.index)
    return runs["parent_run_id"].notna()


def _flops_at(config_json: str, steps: list[int]) -> list[float]:
    """Training FLOPs spent after each of `steps` optimizer steps of a run with this config (the depth curriculum's
    actual depths included), counted on a model built for its shapes (`architectures.build_shapes`)."""
    cfg = RunConfig.from_json(config_json)
    model = architectures.build_shapes(cfg.arch, cfg.model)
    if not curriculum.enabled(cfg):
        per_step = model.flops_per_token(cfg.model.max_seq_len) * cfg.tokens_per_step
        return [s * per_step for s in steps]
    counter = curriculum.FlopCounter(model, cfg)
    return [counter.advance_to(s) for s in sorted(steps)]


def _curve(run: dict[str, Any], metrics: pd.DataFrame, offset: float) -> pd.DataFrame:
    """Validation loss against cumulative training FLOPs (plus `offset`, the parent's) for one run."""
    m = metrics[(metrics["run_id"] == run["id"]) & (metrics["name"] == "val_loss")].copy()
    if m.empty:
        return pd.DataFrame(columns=["step", "flops", "loss"])
    m["step"] = pd.to_numeric(m["step"]).astype(int)
    m = m.sort_values("step")
    flops = _flops_at(run["config_json"], m["step"].tolist())
    return pd.DataFrame(
        {
            "step": m["step"].to_numpy(),
            "flops": [offset + f for f in flops],
            "loss": pd.to_numeric(m["value"]).to_numpy(),
        }
    )


def _reach(curve: pd.DataFrame, target: float | None) -> float | None:
    """FLOPs at the first evaluation whose loss is at or below `target`."""
    if target is None or curve.empty:
        return None
    hit = curve[curve["loss"] <= target]
    return None if hit.empty else float(hit["flops"].iloc[0])


def _scratch(frames: Frames, arch: str) -> list[dict[str, Any]]:
    """Done runs of `arch` at the preset's defaults (the base model of the architecture), not retrofitted."""
    done = frames.ctx.done
    sel = done[(done["model"] == arch) & ~_is_retrofit(done)]
    return sel.to_dict("records")


def _row(frames: Frames, run: dict[str, Any], parents: dict[str, dict[str, Any]]) -> tuple[list[str], dict]:
    metrics = frames.data.metrics
    parent = parents.get(run["parent_run_id"], {})
    offset = 0.0 if missing(run.get("parent_flops")) else float(run["parent_flops"])
    curve = _curve(run, metrics, offset)
    scratch = _scratch(frames, run["arch"])
    s_final = [float(s["final_val_loss"]) for s in scratch if not missing(s.get("final_val_loss"))]
    s_loss = sum(s_final) / len(s_final) if s_final else None
    s_cost = [_curve(s, metrics, 0.0) for s in scratch]
    s_flops = [float(c["flops"].iloc[-1]) for c in s_cost if not c.empty]
    reach = _reach(curve, s_loss)
    heal = None if curve.empty else float(curve["flops"].iloc[-1]) - offset
    cells = [
        run["model"],
        str(run.get("init_method") or "-"),
        fnum(parent.get("final_val_loss"), 4),
        fnum(run.get("initial_val_loss"), 4),
        fnum(run.get("final_val_loss"), 4),
        fnum(offset / 1e12, 3),
        fnum(None if heal is None else heal / 1e12, 3),
        fnum(s_loss, 4),
        fnum(sum(s_flops) / len(s_flops) / 1e12 if s_flops else None, 3),
        fnum(None if reach is None else reach / 1e12, 3) if s_loss is not None else "-",
    ]
    if s_loss is not None and reach is None and run["status"] == "done":
        cells[-1] = "not reached"
    return cells, {
        "curve": curve,
        "scratch": s_cost,
        "arch": run["arch"],
        "label": f"{run['model']} ({run.get('init_method')})",
    }


def retrofit_section(frames: Frames) -> list[str]:
    runs = frames.ctx.runs
    mask = _is_retrofit(runs)
    if not mask.any():
        return []
    out = ["## Retrofit", ""]
    out.append(
        "Recurrent models started from a trained control's weights (`benchctl retrofit`) and then trained "
        "(healed). Compute is training FLOPs (TFLOP) and includes the parent's: a converted model is only "
        "cheaper if parent + healing costs less than training the same architecture from scratch to the same "
        "loss."
    )
    out.append("")
    all_runs = frames.data.runs
    parents = {r["id"]: r for r in all_runs.to_dict("records")}
    rows, curves = [], []
    for run in runs[mask].sort_values(["arch", "init_method", "id"]).to_dict("records"):
        cells, curve = _row(frames, run, parents)
        rows.append(cells)
        curves.append(curve)
    headers = [
        "model",
        "init",
        "parent final",
        "after conversion",
        "final",
        "parent TFLOP",
        "healing TFLOP",
        "scratch final",
        "scratch TFLOP",
        "TFLOP to scratch final",
    ]
    out += md_table(headers, rows, right=range(2, len(headers))) + [""]
    out.append(
        "after conversion = validation loss at step 0, before any healing step (the init methods compared "
        "as such); scratch = the same architecture at the preset's defaults trained from scratch (mean over "
        "its seeds); TFLOP to scratch final = parent + healing FLOPs at the first evaluation whose loss is at "
        "or below the scratch run's final loss."
    )
    out.append("")
    fig = _figure_of(frames, curves)
    if fig is not None:
        frames.figures[FIGURE] = fig
        out += [f"![Validation loss against training FLOPs, parent included](figures/{FIGURE})", ""]
    return out


def _figure_of(frames: Frames, curves: list[dict[str, Any]]) -> Any:
    """One line per retrofitted run (starting at its parent's FLOPs) and, dashed, the first from-scratch run of
    each architecture involved."""
    if all(c["curve"].empty for c in curves):
        return None
    scratch: dict[str, pd.DataFrame] = {}
    for c in curves:
        first = next((s for s in c["scratch"] if not s.empty), None)
        if first is not None:
            scratch.setdefault(c["arch"], first)
    with _style():
        fig = _figure(9.0, 5.2)
        ax = fig.subplots()
        for c in curves:
            if not c["curve"].empty:
                ax.plot(
                    c["curve"]["flops"] / 1e12,
                    c["curve"]["loss"],
                    marker="o",
                    markersize=3,
                    linewidth=1.6,
                    label=tick(c["label"]),
                )
        for arch, s in scratch.items():
            ax.plot(
                s["flops"] / 1e12,
                s["loss"],
                linestyle="--",
                linewidth=1.4,
                color=frames.ctx.colours.get(arch, "grey"),
                label=f"{arch} from scratch",
            )
        ax.set_xlabel("training FLOPs including the parent's (TFLOP)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.legend(fontsize=8)
        fig.suptitle(
            f"Retrofit against training from scratch · preset {frames.ctx.preset}", fontsize=12, fontweight="bold"
        )
    return fig

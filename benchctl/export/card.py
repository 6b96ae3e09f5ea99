"""The model card (README.md) an export writes: what the model is, where it came from, how to load it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from benchctl.core.config import RunConfig, make_config
from benchctl.export.llama import LlamaShape


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _value(v: Any) -> str:
    if v is None:
        return "auto"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def train_command(cfg: RunConfig) -> str:
    """The `benchctl train` command that trains this config: its preset, seed and every key that differs from it."""
    base = _flat(make_config(cfg.preset, cfg.arch, cfg.seed).to_dict())
    mine = _flat(cfg.to_dict())
    parts = ["benchctl", "train", "--arch", cfg.arch, "--preset", cfg.preset, "--seed", str(cfg.seed)]
    for key in sorted(mine):
        if key == "data.source" or key.startswith("log.") or mine[key] == base.get(key):
            continue
        parts += ["--set", f"{key}={_value(mine[key])}"]
    if cfg.data.source != "hub":
        parts += ["--data", cfg.data.source]
    return shlex.join(parts)


@dataclass(frozen=True)
class CardInfo:
    row: dict[str, Any]  # the run's row of the runs table
    cfg_json: str
    fmt: str
    n_recur: int
    extrapolate: str | None
    shape: LlamaShape
    unique_params: int
    exported_params: int
    train_command: str


def _loss(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}"


def render(c: CardInfo) -> str:
    r, s = c.row, c.shape
    unrolled = c.exported_params != c.unique_params
    what = (
        f"the `{r['arch']}` model unrolled into {s.n_layers} Llama layers ({c.n_recur} passes over its blocks, each "
        "pass's LoRA merged into its own copy of the shared weights): the same function as the looped model, with "
        "its shared weights stored once per pass"
        if unrolled
        else f"the `{r['arch']}` model as a plain {s.n_layers}-layer Llama, weight for weight"
    )
    if c.extrapolate:
        what += f" (passes past the trained ones follow the `{c.extrapolate}` rule)"
    if c.fmt == "hf":
        use = (
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'tok = AutoTokenizer.from_pretrained("PATH")\nmodel = AutoModelForCausalLM.from_pretrained("PATH")\n'
            'ids = tok("Once upon a time", return_tensors="pt").input_ids  # BOS first, as in training\n'
            "print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))\n```\n\n"
            "The tokenizer starts every text with BOS (`<s>`, id 1), as every training sequence started; the model "
            "ends a story by emitting BOS, so generation stops there. With lm-eval: `lm_eval --model hf --model_args "
            "pretrained=PATH,dtype=float32 --tasks ...`."
        )
    else:
        use = (
            '```bash\n./run model.bin -z tokenizer.bin -t 0 -n 64 -i "Once upon a time"\n```\n\n'
            "`run` is karpathy/llama2.c's `run.c` (`gcc -O3 -o run run.c -lm`). model.bin has the version-0 "
            "layout (a 7-int32 header, then float32 tensors); tokenizer.bin is written as llama2.c's tokenizer.py "
            "writes it."
        )
    lines = [
        f"# {r['id']}",
        "",
        f"A TinyStories language model trained with benchctl, exported as `{c.fmt}`: {what}.",
        "",
        "## Use",
        "",
        use,
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {r['arch']} (variant {r.get('variant') or r['arch']}) |",
        f"| exported as | {s.n_layers} layers, dim {s.dim}, FFN {s.hidden_dim}, {s.n_heads} heads "
        f"({s.n_kv_heads} key/value), vocab {s.vocab_size}, context {s.max_seq_len} |",
        f"| RMSNorm eps, RoPE theta | {s.norm_eps:g}, {s.rope_theta:g} |",
        f"| recurrence exported | {c.n_recur} (trained: {_trained_recur(c.cfg_json)}) |",
        f"| unique (trained) parameters | {c.unique_params:,} |",
        f"| exported parameters | {c.exported_params:,} (tied embedding counted once) |",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| preset, seed | {r['preset']}, {r['seed']} |",
        f"| steps, tokens seen | {r.get('step')}, {r.get('tokens_seen')} |",
        f"| validation loss (nats/token) | {_loss(r.get('initial_val_loss'))} at step 0, "
        f"{_loss(r.get('final_val_loss'))} at the end |",
        f"| data | {r.get('data_source')}, fingerprint `{r.get('data_fingerprint')}` |",
        f"| benchctl | {r.get('benchctl_version')}, commit {r.get('git_commit') or '-'} |",
        f"| precision, device | {r.get('dtype')}, {r.get('device')} ({r.get('device_name')}) |",
        "",
        "Trained by:",
        "",
        f"```bash\n{c.train_command}\n```",
        "",
        "Its resolved configuration:",
        "",
        f"```json\n{c.cfg_json}\n```",
        "",
    ]
    return "\n".join(lines)


def _trained_recur(cfg_json: str) -> int:
    return int(RunConfig.from_json(cfg_json).model.n_recur or 1)

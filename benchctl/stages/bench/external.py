"""Other implementations of the same weights for `benchctl bench --decode`: transformers and llama2.c's run.c.

Both run the model as `benchctl export` writes it (a plain Llama, `benchctl.export.llama`), so only an architecture
that declares the format takes part; the others get a logged line saying why not.

- `transformers`: the `hf` export (config and safetensors) written to a temporary folder and loaded in this process
  with `LlamaForCausalLM.from_pretrained` in float32; `generate` greedy with its KV cache on the same prompts and the
  same number of new tokens as benchctl's rows, no stop id. Its decode phase starts when it has chosen its first
  token (a stopping criterion notes the time), so its prefill time includes `generate`'s own set-up.
- `llama2c-runfast`: `run.c` from a checkout of karpathy/llama2.c, compiled into a temporary folder with the command
  its Makefile's `runfast` target uses (never copied into this repository), run on the `llama2c` export (`model.bin`,
  and `tokenizer.bin` from the preset's tokenizer) at batch 1 on one thread (OMP_NUM_THREADS=1), greedy
  (temperature 0). run.c takes a text prompt, prints the prompt's and the new tokens' text and reports
  `achieved tok/s` over every position after the first (it feeds the prompt one token at a time, so it has no
  separate prefill); that figure is the row's decode tokens/s. It stops early at BOS, which delimits stories.
  Agreement is read from the text it prints, against benchctl's eager float32 greedy generation of the same prompt
  (stopping at BOS too), rendered as run.c renders tokens: the share of new tokens before the texts first differ.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from architectures.generate import DecodeReport
from benchctl.core.errors import BenchctlError, ConfigError

RUN_C_IMPL = "llama2c-runfast"
HF_IMPL = "transformers"
RUN_C_PROMPT = "Once upon a time"  # run.c takes text; a story opening every tokenizer of the study splits alike
BOS_ID = 1  # run.c stops at BOS and strips the space after it

# run.c's last line on stderr: fprintf(stderr, "achieved tok/s: %f\n", ...)
_TOKS = re.compile(r"^achieved tok/s: (\S+)$", re.M)


class Llama2cError(BenchctlError):
    """run.c could not be compiled or run."""


# --- transformers ---------------------------------------------------------------------------------------------


def transformers_unavailable() -> str | None:
    """Why the transformers rows cannot be measured here, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install 'benchctl[export]')"
    return None


def load_hf(weights: Any, folder: Path, device: torch.device) -> torch.nn.Module:
    """The `hf` export of `weights`, written to `folder` and loaded back as a float32 `LlamaForCausalLM`."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from benchctl.export.hf import write_hf_model

    hf_logging.disable_progress_bar()  # its weight-loading bar would break into the bench's log
    write_hf_model(weights, folder)
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    gc = model.generation_config
    gc.eos_token_id = None  # benchctl's rows run to their limit: no stop id
    gc.pad_token_id = 0
    gc.do_sample, gc.num_beams, gc.use_cache = False, 1, True
    gc.temperature = gc.top_p = gc.top_k = None
    return model


def hf_generate(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], DecodeReport]:
    """Greedy `generate` of equal-length prompts, prefill and decode timed apart (like `DecodeReport` timing)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class FirstToken(StoppingCriteria):
        """Called after every chosen token; notes when the first one was chosen, never stops."""

        t: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
            if self.t is None:
                self.t = _clock(input_ids.device)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    first = FirstToken()
    with torch.inference_mode():
        t0 = _clock(device)
        out = model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            stopping_criteria=StoppingCriteriaList([first]),
        )
        t2 = _clock(device)
    B, T = ids.shape
    t1 = first.t if first.t is not None else t2
    rep = DecodeReport(path="transformers", dtype="float32", timing=True)
    rep.prefill_tokens, rep.prefill_seconds = B * T, t1 - t0
    rep.decode_tokens, rep.decode_seconds = B * (new_tokens - 1), t2 - t1  # the last token is chosen, never fed
    return out[:, T:].tolist(), rep


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- llama2.c's run.c -----------------------------------------------------------------------------------------


def check_checkout(directory: Path) -> Path:
    """The checkout `--llama2c DIR` names, resolved; a ConfigError when it lacks run.c or its Makefile."""
    d = Path(directory).expanduser()
    missing = [f for f in ("run.c", "Makefile") if not (d / f).is_file()]
    if missing:
        raise ConfigError(
            f"--llama2c {directory}: not a llama2.c checkout (no {' or '.join(missing)}); "
            "pass the folder of a clone of karpathy/llama2.c"
        )
    return d.resolve()


def runfast_command(makefile: str, src: Path, exe: Path) -> list[str]:
    """The compiler call the Makefile's `runfast` target makes for run.c, building `src`/run.c into `exe`.

    The recipe is read, not restated, so the flags are whatever the checkout's Makefile says (`-Ofast` today)."""
    cc = "cc"
    if m := re.search(r"^CC\s*[:?]?=\s*(\S+)", makefile, re.M):
        cc = m.group(1)
    lines = makefile.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^runfast\s*:", line)), None)
    if start is None:
        raise ConfigError("--llama2c: its Makefile has no `runfast` target")
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        words = line.split()
        if "run.c" not in words:
            continue
        cmd = []
        for i, w in enumerate(words):
            if w in ("$(CC)", "${CC}"):
                cmd.append(cc)
            elif i > 0 and words[i - 1] == "-o":
                cmd.append(str(exe))
            elif w == "run.c":
                cmd.append(str(src / "run.c"))
            else:
                cmd.append(w)
        return cmd
    raise ConfigError("--llama2c: the Makefile's `runfast` target does not compile run.c")


def checkout_version(directory: Path) -> str:
    """The checkout's commit, or 'not a git checkout'."""
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return head


def compile_run_c(directory: Path, out: Path) -> tuple[Path, list[str]]:
    """Compile the checkout's run.c with its `runfast` flags into `out`/run; returns the binary and the command."""
    exe = out / "run"
    cmd = runfast_command((directory / "Makefile").read_text(), directory, exe)
    if shutil.which(cmd[0]) is None:
        raise ConfigError(f"--llama2c: the compiler {cmd[0]!r} its Makefile names is not installed")
    done = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Llama2cError(f"compiling run.c failed ({' '.join(cmd)}): {' | '.join(tail)}")
    return exe, cmd


def parse_tok_per_s(stderr: str) -> float | None:
    """run.c's `achieved tok/s: X` as a number; None when it printed none (one position only) or an infinite or
    zero rate (the whole run fell within one tick of its millisecond clock)."""
    m = _TOKS.findall(stderr)
    if not m:
        return None
    try:
        v = float(m[-1])
    except ValueError:
        return None
    return v if 0 < v < float("inf") else None


def read_tokenizer_bin(path: Path) -> list[bytes]:
    """The pieces of a llama2.c tokenizer.bin, by token id (scores skipped)."""
    data = path.read_bytes()
    off = 4  # max_token_length
    pieces = []
    while off < len(data):
        (n,) = struct.unpack_from("<I", data, off + 4)
        pieces.append(data[off + 8 : off + 8 + n])
        off += 8 + n
    return pieces


_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{1,2})")


def run_c_piece(pieces: Sequence[bytes], prev: int, token: int) -> bytes:
    """What run.c prints for `token` after `prev`: its `decode` (the space after BOS stripped, `<0xAB>` pieces as
    the byte) then its `safe_printf` (pieces are C strings; a lone byte that is neither printable nor whitespace is
    skipped)."""
    piece = pieces[token].split(b"\0", 1)[0]
    if prev == BOS_ID and piece[:1] == b" ":
        piece = piece[1:]
    if m := _BYTE_PIECE.match(piece):
        piece = bytes([int(m.group(1), 16)])
    if len(piece) == 1 and not (0x20 <= piece[0] <= 0x7E or 0x09 <= piece[0] <= 0x0D):
        return b""
    return piece.split(b"\0", 1)[0]


def text_agreement(pieces: Sequence[bytes], prompt: Sequence[int], new: Sequence[int], printed: bytes) -> float:
    """Share of the new tokens `new` (after `prompt`, which starts with BOS) whose text, as run.c renders it, is what
    run.c printed, up to the first difference; 1 only when the whole printed text is the expected one."""
    printed = printed.removesuffix(b"\n")  # run.c ends with printf("\n")
    text, prev = b"", prompt[0]
    for t in prompt[1:]:
        text += run_c_piece(pieces, prev, t)
        prev = t
    if not printed.startswith(text):
        return 0.0
    good = 0
    for t in new:
        text += run_c_piece(pieces, prev, t)
        prev = t
        if not printed.startswith(text):
            break
        good += 1
    if good == len(new) and printed != text:  # run.c went on where benchctl stopped: one more token differs
        return good / (len(new) + 1)
    return good / len(new) if new else float(printed == text)


@dataclass
class RunC:
    """A compiled run.c and how it was built."""

    exe: Path
    command: list[str]
    version: str

    def detail(self) -> str:
        return f"llama2.c run.c at {self.version}, built with `{' '.join(Path(c).name for c in self.command)}`"

    def generate(self, model_bin: Path, tokenizer_bin: Path, prompt: str, steps: int) -> tuple[bytes, float | None]:
        """(stdout, achieved tok/s) of one greedy run.c generation on one thread."""
        cmd = [str(self.exe), str(model_bin), "-z", str(tokenizer_bin), "-t", "0", "-s", "1", "-n", str(steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([*cmd, "-i", prompt], capture_output=True, env=env)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-2:]
            raise Llama2cError(f"run.c exited with {done.returncode}: {' | '.join(tail)}")
        return done.stdout, parse_tok_per_s(done.stderr.decode(errors="replace"))


def run_c_steps(n_prompt: int, new_tokens: int, ctx: int) -> int:
    """run.c's `-n`: positions to run, prompt included; the last position's token is chosen, never fed, so
    n_prompt + new - 1 positions give `new` new tokens (run.c caps it at the context)."""
    return min(n_prompt + new_tokens - 1, ctx)


def unavailable_log(log: Callable[[str], None], arch: str, impl: str, why: str) -> None:
    log(f"{arch}: no {impl} rows ({why})")

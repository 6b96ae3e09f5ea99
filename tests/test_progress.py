"""The progress reporter: bounded plain lines off a terminal, nothing drawn when disabled, libraries' tqdm bars
drawing nothing of their own, the lasting ones reported as the reporter's own tasks (and tqdm restored afterwards)."""

from __future__ import annotations

import io

from rich.console import Console

from benchctl.core.progress import Progress


def _plain(enabled: bool = True, interval: float = 3600.0) -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    return Progress(enabled=enabled, console=console, interval=interval), out


def test_plain_mode_prints_a_bounded_number_of_lines():
    progress, out = _plain()
    with progress.task("training control", total=1000, loss="-") as t:
        for step in range(1, 1001):
            t.move_to(step, loss=f"{1.0 / step:.3f}")
    lines = out.getvalue().splitlines()
    # one line when the task starts, one when it ends: 1000 updates inside the interval print nothing more
    assert len(lines) == 2
    assert lines[0].startswith("training control: 0/1,000 (0%)")
    assert lines[-1].startswith("training control: 1,000/1,000 (100%) loss 0.001")
    assert "\r" not in out.getvalue()


def test_plain_mode_prints_again_after_the_interval():
    progress, out = _plain(interval=0.0)
    with progress.task("tokenizing", total=3) as t:
        for _ in range(3):
            t.update(advance=1)
    assert len(out.getvalue().splitlines()) == 5  # start, three updates, close


def test_disabled_draws_no_bars_but_prints_messages():
    progress, out = _plain(enabled=False)
    with progress.task("training control", total=10) as t:
        for step in range(10):
            t.move_to(step + 1)
    assert out.getvalue() == ""
    progress.log("resuming from step 5")
    assert out.getvalue().strip() == "resuming from step 5"


def _tqdm_methods():
    from tqdm import std

    return {name: std.tqdm.__dict__[name] for name in ("__init__", "display", "close")}


def test_a_lasting_library_bar_is_reported_as_the_reporters_own_task_and_tqdm_restored():
    from tqdm.auto import tqdm

    before = _tqdm_methods()
    progress, out = _plain(interval=0.0)
    err = io.StringIO()
    with progress.library_bars(after=0.0):  # every bar counts as lasting
        for _ in tqdm(range(5), desc="downloading: ", mininterval=0.0, file=err):
            pass
    assert _tqdm_methods() == before
    text = out.getvalue()
    lines = [ln for ln in text.splitlines() if ln]
    assert all(ln.startswith("downloading: ") for ln in lines) and lines[-1].startswith("downloading: 5/5 (100%)")
    assert "\r" not in text and "it/s]" not in text and "%|" not in text and err.getvalue() == ""


def test_instant_library_bars_show_nothing():
    """lm-eval builds each task's contexts under a bar of its own that is over in a fraction of a second."""
    from tqdm.auto import tqdm

    progress, out = _plain(interval=0.0)
    with progress.library_bars(after=3600.0):
        for _ in tqdm(range(200), mininterval=0.0):
            pass
        bar = tqdm(total=176, desc="Building contexts")
        bar.update(176)
        bar.close()
    assert out.getvalue() == ""


def test_library_bars_hidden_when_disabled():
    from tqdm.auto import tqdm

    before = _tqdm_methods()
    progress, out = _plain(enabled=False)
    err = io.StringIO()
    with progress.library_bars(after=0.0):
        for _ in tqdm(range(5), desc="downloading", file=err):
            pass
    assert _tqdm_methods() == before
    assert out.getvalue() == "" and err.getvalue() == ""

"""The decode path of `architectures.generate` against the reference path: same tokens, for every architecture.

The reference (`fast=False`) is the plain KV-cached loop in float32 under no_grad; the decode path (`fast=True`) runs
under inference mode with a static cache, looks for finished rows only every few tokens, and can be compiled. Every
registered architecture is covered (new files in `architectures/` are picked up through the registry).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import architectures
from architectures.base import ExitRule
from architectures.generate import (
    DecodeReport,
    cast_for_inference,
    compiler_unavailable,
    generate,
    inference_layout,
    is_column_major,
)
from benchctl.core.config import make_config

ARCHS = architectures.names()
PROMPTS = [[1, 5, 9, 3, 7], [1, 7, 2, 8, 11, 4, 6, 2], [1, 3, 4]]  # ragged: the batch starts at the shortest


def build(arch: str, preset: str, seed: int = 0) -> architectures.BaseLM:
    torch.manual_seed(seed)
    model = architectures.build(arch, make_config(preset, arch).model).eval()
    with torch.no_grad():  # a wider init than llama2.c's 0.02, so greedy choices are far from ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model


def run(model, prompts, **kw):
    """Tokens and finish reasons of one generate call, with the global RNG seeded (three-part's initial states)."""
    torch.manual_seed(123)
    outs = generate(model, prompts, **kw)
    return [(g.tokens, g.finish_reason, g.mean_depth) for g in outs]


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_greedy_decode_path_equals_reference(arch, preset):
    model = build(arch, preset)
    kw = dict(max_new_tokens=12, temperature=0.0)
    # batch 1
    one = run(model, PROMPTS[:1], fast=False, **kw)
    rep = DecodeReport()
    assert run(model, PROMPTS[:1], report=rep, **kw) == one
    assert (rep.path, rep.compiled, rep.dtype, rep.autocast) == ("fast", False, "float32", None)
    # a batch whose rows stop at different points: one at a stop id, one when asked, one at the length limit
    free = run(model, PROMPTS, fast=False, **kw)
    stop = free[0][0][4]  # row 0's fifth new token
    asked_row = 2 if stop not in free[2][0][:6] else 1

    def should_stop(row: int, new: list[int]) -> bool:
        return row == asked_row and len(new) == 6

    kw = dict(kw, stop_ids=(stop,), should_stop=should_stop)
    ref = run(model, PROMPTS, fast=False, **kw)
    assert ref[0][1] == "eos" and len(ref[0][0]) <= 4  # the setup stops rows early, so the comparison means something
    assert ref[asked_row][1] == "eos"
    for every in (1, 3, 8, 100):
        assert run(model, PROMPTS, check_every=every, **kw) == ref, every


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_inference_layout_keeps_the_model_and_its_greedy_output(arch):
    """Linear weights laid out column-major for inference: the same parameters (shapes, values, ties) and, on the
    decode path and the reference loop alike, the greedy tokens of the model as trained."""
    trained = build(arch, "tiny")
    laid = inference_layout(copy.deepcopy(trained))
    linears = [m for m in laid.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_column_major(m.weight) for m in linears)
    before, after = trained.state_dict(), laid.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(list(laid.parameters())) == len(list(trained.parameters()))  # a tied weight is still one parameter
    idx = torch.tensor(PROMPTS[1])[None]
    with torch.no_grad():
        torch.manual_seed(0)
        want = trained(idx)[0]
        torch.manual_seed(0)
        got = laid(idx)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    kw = dict(max_new_tokens=12, temperature=0.0)
    ref = run(trained, PROMPTS, fast=False, **kw)
    assert run(laid, PROMPTS, **kw) == ref
    assert run(laid, PROMPTS, fast=False, **kw) == ref


def test_projections_of_column_major_weights_equal_row_major():
    from architectures.blocks import project_group

    layers = [torch.nn.Linear(16, n, bias=False) for n in (16, 8, 24)]
    x = torch.randn(5, 16)
    want = project_group(layers, x, None, ["a", "b", "c"])
    for m in layers:
        m.weight.data = m.weight.data.t().contiguous().t()
    torch.testing.assert_close(project_group(layers, x, None, ["a", "b", "c"]), want)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_sampled_decode_path_equals_reference(arch):
    model = build(arch, "tiny")

    def gens():
        return [torch.Generator().manual_seed(10 + i) for i in range(len(PROMPTS))]

    kw = dict(max_new_tokens=10, temperature=0.9, top_k=40, stop_ids=(3,))
    assert run(model, PROMPTS, generators=gens(), **kw) == run(model, PROMPTS, generators=gens(), fast=False, **kw)
    # the global RNG for every row: other rows' draws depend on which rows are left, so finished rows leave at once
    rep = DecodeReport()
    assert run(model, PROMPTS, report=rep, **kw) == run(model, PROMPTS, fast=False, **kw)
    assert rep.check_every == 1


@pytest.mark.parametrize("arch", [a for a in ARCHS if architectures.get(a).iterable()])
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_decode_path_with_test_time_depth(arch):
    model = build(arch, "tiny")
    deeper = model.args.n_recur + 2
    for kw in (
        dict(n_recur=deeper),
        dict(n_recur=deeper, exit=ExitRule("latent", 0.3)),
        dict(exit=ExitRule("kl", 1e-3)),
    ):
        kw = dict(kw, max_new_tokens=8, temperature=0.0, stop_ids=(5,))
        ref = run(model, PROMPTS, fast=False, **kw)
        got = run(model, PROMPTS, **kw)
        assert [(t, r) for t, r, _ in got] == [(t, r) for t, r, _ in ref]
        if "exit" in kw:  # the mean exit depth counts the same positions
            assert [d for *_, d in got] == pytest.approx([d for *_, d in ref], rel=1e-9)


def test_decode_path_per_row_limits_and_past_the_context():
    model = build("control", "tiny")
    ctx = model.args.max_seq_len
    limits = [3, 9, 5]
    got = run(model, PROMPTS, max_new_tokens=limits, temperature=0.0)
    assert [len(t) for t, *_ in got] == limits
    assert got == run(model, PROMPTS, max_new_tokens=limits, temperature=0.0, fast=False)
    # exactly filling the context still runs the decode path; one token more slides the window on the reference path
    fits, rep = ctx - len(PROMPTS[1]) + 1, DecodeReport()
    run(model, PROMPTS[1:2], max_new_tokens=fits, temperature=0.0, report=rep)
    assert rep.path == "fast"
    over = run(model, PROMPTS[1:2], max_new_tokens=fits + 1, temperature=0.0, report=rep)
    assert rep.path == "reference" and "context" in rep.reason
    assert over == run(model, PROMPTS[1:2], max_new_tokens=fits + 1, temperature=0.0, fast=False)
    with pytest.raises(ValueError, match="2 max_new_tokens for 3 prompts"):
        generate(model, PROMPTS, max_new_tokens=[1, 2])
    with pytest.raises(ValueError, match="check_every"):
        generate(model, PROMPTS, max_new_tokens=2, check_every=0)


def test_decode_path_in_another_dtype_casts_a_copy_once():
    model = build("relaxed", "tiny")
    rep = DecodeReport()
    outs = generate(model, PROMPTS, max_new_tokens=6, temperature=0.0, dtype=torch.bfloat16, report=rep)
    assert rep.dtype == "bfloat16" and [len(g.tokens) for g in outs] == [6, 6, 6]
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is left alone
    cast = cast_for_inference(build("relaxed", "tiny"), torch.bfloat16)
    assert cast.rope_cos.dtype == torch.float32 and cast.output.weight.dtype == torch.bfloat16
    generate(cast, PROMPTS, max_new_tokens=6, temperature=0.0, report=rep)
    assert rep.dtype == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the eval adapter calls it
        generate(model, PROMPTS, max_new_tokens=6, temperature=0.0, report=rep)
    assert (rep.path, rep.dtype, rep.autocast) == ("fast", "float32", "bfloat16")


def test_compile_falls_back_to_eager_with_the_reason(monkeypatch, caplog):
    import architectures.generate as gen

    model = build("control", "tiny")
    ref = run(model, PROMPTS, max_new_tokens=6, temperature=0.0, fast=False)
    monkeypatch.setattr(gen, "compiler_unavailable", lambda device: "no C++ compiler found (test)")
    rep = DecodeReport()
    with caplog.at_level(logging.WARNING, logger="architectures.generate"):
        assert run(model, PROMPTS, max_new_tokens=6, temperature=0.0, compile=True, report=rep) == ref
    assert not rep.compiled and rep.reason == "no C++ compiler found (test)"
    assert "no C++ compiler found (test)" in caplog.text

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded\nmore detail")

    monkeypatch.setattr(gen, "compiler_unavailable", lambda device: None)
    monkeypatch.setattr(gen, "_compiled_step", lambda *a, **k: broken)
    assert run(model, PROMPTS, max_new_tokens=6, temperature=0.0, compile=True, report=rep) == ref
    assert not rep.compiled and rep.reason == "compilation failed: RuntimeError: inductor exploded"


def _dynamo_eager(monkeypatch, limit: int):
    """torch.compile with dynamo's eager backend (graphs captured and guarded, nothing built), and a context in which
    dynamo keeps at most `limit` graphs per code object. The limit goes through dynamo's own config.patch: its
    settings are not module attributes, and monkeypatch's undo deletes such an attribute (pytest 9.2), which hides
    the setting from dynamo for the rest of the process."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, backend, options: real(fn, backend="eager"))
    return torch._dynamo.config.patch(recompile_limit=limit)


@pytest.mark.slow  # dynamo traces each model's decode step
def test_each_model_has_its_own_compiled_graphs(monkeypatch):
    """Dynamo keeps at most recompile_limit graphs per code object: models that shared one step function would
    use that up between them, and the later ones would run eagerly while reported as compiled."""
    import architectures.generate as gen

    monkeypatch.setattr(gen, "compiler_unavailable", lambda device: None)
    kw = dict(max_new_tokens=6, temperature=0.0)
    # a graph each (batch of one, one span): two models past a limit of one show a shared step function as well as
    # four past a limit of two, at half the tracing
    with _dynamo_eager(monkeypatch, limit=1):
        for arch in ("control", "three-part"):
            model = build(arch, "tiny")
            rep = DecodeReport()
            ref = run(model, PROMPTS[:1], fast=False, **kw)
            assert run(model, PROMPTS[:1], compile=True, report=rep, **kw) == ref
            assert rep.compiled and rep.reason == "", (arch, rep.reason)


@pytest.mark.slow  # dynamo traces the step for every batch shape
def test_a_step_past_the_graph_limit_is_reported_eager(monkeypatch):
    """A generation that needs more graphs than dynamo keeps (rows leave the batch: new shapes) says it fell back,
    instead of running eagerly under the name of the compiled step."""
    import architectures.generate as gen

    monkeypatch.setattr(gen, "compiler_unavailable", lambda device: None)
    monkeypatch.setattr(gen, "compile_attempts", lambda device: [("only", {})])
    with _dynamo_eager(monkeypatch, limit=1):
        model = build("control", "tiny")

        def should_stop(row: int, new: list[int]) -> bool:  # rows leave: new batch shapes, a graph each
            return len(new) == {0: 2, 2: 4}.get(row, 0)

        kw = dict(max_new_tokens=8, temperature=0.0, should_stop=should_stop)
        ref = run(model, PROMPTS, fast=False, **kw)
        assert [len(r[0]) for r in ref] == [2, 8, 4]
        rep = DecodeReport()
        assert run(model, PROMPTS, compile=True, check_every=1, report=rep, **kw) == ref
        assert (
            not rep.compiled
            and rep.reason == "the step needs more than 1 compiled graphs (torch._dynamo recompile_limit)"
        )
        # a later call with this model and settings is not compiled (and failed) all over again
        monkeypatch.setattr(gen, "_compiled_step", lambda *a, **k: pytest.fail("compiled again"))
        rep = DecodeReport()
        assert run(model, PROMPTS, compile=True, check_every=1, report=rep, **kw) == ref
        assert not rep.compiled and "recompile_limit" in rep.reason


def test_compiled_step_tries_the_python_wrapper_and_rechecks_guards_it_skipped(monkeypatch):
    """On a CPU the C++ wrapper is tried first, then the Python one; past the first steps of a batch the guards are
    skipped, and a step they cannot place runs again with every guard (fakes stand in for inductor)."""
    from torch._dynamo import eval_frame

    import architectures.generate as gen

    calls: list[tuple[str, bool]] = []

    def fake_compiled_step(model, key, options):
        name = key[-1]
        assert ("cpp_wrapper" in options) == (name == "cpp-wrapper")

        def step(m, tokens, cache, pos, kw, greedy):
            skipping = eval_frame._stance.skip_guard_eval_unsafe
            calls.append((name, skipping))
            if name == "cpp-wrapper":
                raise RuntimeError("C++ wrapper build failed")
            if len(calls) == 5:  # a step the skipped guards could not place
                raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance")
            return gen._decode_step(m, tokens, cache, pos, kw, greedy)

        return step

    model = build("control", "tiny")
    looks: list[bool] = []  # whether guards were skipped while the caller's should_stop ran

    def should_stop(row: int, new: list[int]) -> bool:
        looks.append(eval_frame._stance.skip_guard_eval_unsafe)
        return False

    kw = dict(max_new_tokens=6, temperature=0.0, should_stop=should_stop)
    ref = run(model, PROMPTS, fast=False, **kw)
    monkeypatch.setattr(gen, "compiler_unavailable", lambda device: None)
    monkeypatch.setattr(gen, "_compiled_step", fake_compiled_step)
    rep = DecodeReport()
    looks.clear()
    assert run(model, PROMPTS, compile=True, report=rep, check_every=64, **kw) == ref
    assert rep.compiled and rep.compile_mode == "python-wrapper" and rep.reason == ""
    # the stance that skips guards covers the compiled steps only: not the caller's code, nor what runs afterwards
    assert looks and not any(looks) and not eval_frame._stance.skip_guard_eval_unsafe
    assert calls[:7] == [
        ("cpp-wrapper", False),
        ("python-wrapper", False),
        ("python-wrapper", False),
        ("python-wrapper", True),
        ("python-wrapper", True),  # raised: run again with every guard, and the next step too
        ("python-wrapper", False),
        ("python-wrapper", False),
    ]
    assert calls[7:] and all(skipping for _, skipping in calls[7:])


@pytest.mark.slow  # inductor compiles C++ kernels for every batch shape the generation passes through
@pytest.mark.skipif(compiler_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler for inductor")
@pytest.mark.parametrize("arch", ["control", "three-part"])
def test_compiled_decode_path_equals_reference(arch):
    model = build(arch, "tiny")
    kw = dict(max_new_tokens=8, temperature=0.0, stop_ids=(5,))
    rep = DecodeReport()
    assert run(model, PROMPTS, compile=True, report=rep, **kw) == run(model, PROMPTS, fast=False, **kw)
    assert rep.compiled and rep.reason == ""


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_attention_reads_the_filled_span_and_crosses_its_steps(arch, monkeypatch):
    """The decode path's attention reads each slot up to the next multiple of SPAN_STEP past the last written
    position; generating past two of those boundaries gives the reference's tokens."""
    _check_attended_span(arch, False, monkeypatch)


# A test of its own, apart from the per-architecture one above: CI's pass with the extension examples reruns the
# tests parametrised over the registry, and this one compiles a fixed architecture.
@pytest.mark.slow  # inductor compiles the step once more for every attended length
@pytest.mark.skipif(compiler_unavailable(torch.device("cpu")) is not None, reason="no C++ compiler for inductor")
def test_compiled_attention_reads_the_filled_span_and_crosses_its_steps(monkeypatch):
    _check_attended_span("control", True, monkeypatch)


def _check_attended_span(arch: str, compile: bool, monkeypatch) -> None:
    from architectures import blocks
    from architectures.generate import SPAN_STEP

    model = build(arch, "small")
    ctx = model.args.max_seq_len
    new = 2 * SPAN_STEP + 5  # from prompts of 3 to 8 tokens: three attended lengths below the context
    assert max(map(len, PROMPTS)) + new < ctx
    lengths: list[int] = []
    write = blocks.StaticKVCache.write

    def recording(self, k, v):
        ck, cv, mask = write(self, k, v)
        lengths.append(ck.shape[2])
        assert mask.shape[-1] == ck.shape[2] == cv.shape[2]
        return ck, cv, mask

    if not compile:  # a compiled step reads the lengths only when it traces
        monkeypatch.setattr(blocks.StaticKVCache, "write", recording)
    kw = dict(max_new_tokens=new, temperature=0.0)
    rep = DecodeReport()
    assert run(model, PROMPTS, compile=compile, report=rep, **kw) == run(model, PROMPTS, fast=False, **kw)
    assert rep.compiled == compile
    if not compile:  # every attention call of every step read a bounded span, three lengths in all
        assert sorted(set(lengths)) == [SPAN_STEP, 2 * SPAN_STEP, 3 * SPAN_STEP]


def test_cuda_attempts_make_a_skipped_cuda_graph_an_error_then_run_plain_inductor():
    """Inductor leaves a step out of CUDA graphs with only a logged warning: the attempt named `cudagraphs` must fail
    instead, so a step launched kernel by kernel is never stored under that name."""
    import architectures.generate as gen

    attempts = gen.compile_attempts(torch.device("cuda", 0))
    assert [name for name, _ in attempts] == ["cudagraphs", "inductor"]
    assert attempts[0][1]["triton.cudagraphs"] and attempts[0][1]["triton.cudagraph_or_error"]
    assert not any(k.startswith("triton.cudagraph") for k in attempts[1][1])


def test_a_cuda_graph_step_keeps_its_cache_and_outputs_out_of_the_graph_pool(monkeypatch):
    """A step replayed as a CUDA graph returns tensors in the graphs' memory pool, which the next replay reuses: the
    decode loop copies the outputs and the cache slots the prefill created out of it, once, and marks the slots as
    static addresses so later steps write them inside their graph. The tokens are the reference path's; when that
    way fails (inductor refused the CUDA graph), the next way runs and is the one reported."""
    import architectures.generate as gen

    seen: list[tuple[str, list[bool]]] = []  # (way, whether each cache slot was static when the step began)

    def fake_compiled_step(m, key, options):
        name = key[-1]

        def step(m, tokens, cache, pos, kw, greedy):
            if name == "cudagraphs" and fail:
                raise RuntimeError("skipping cudagraphs due to mutated inputs")
            seen.append((name, [getattr(t, "_benchctl_static", False) for t in cache.k + cache.v]))
            return gen._decode_step(m, tokens, cache, pos, kw, greedy)

        return step

    monkeypatch.setattr(gen, "compiler_unavailable", lambda device: None)
    monkeypatch.setattr(gen, "compile_attempts", lambda device: [("cudagraphs", {}), ("inductor", {})])
    monkeypatch.setattr(gen, "_compiled_step", fake_compiled_step)
    model = build("control", "tiny")
    kw = dict(max_new_tokens=6, temperature=0.0)
    ref = run(model, PROMPTS, fast=False, **kw)
    for fail in (False, True):
        seen.clear()
        rep = DecodeReport()
        assert run(model, PROMPTS, compile=True, report=rep, **kw) == ref
        way = "inductor" if fail else "cudagraphs"
        assert rep.compiled and rep.compile_mode == way and {s[0] for s in seen} == {way}
        if not fail:  # a step replayed as a CUDA graph finds every slot a static copy
            assert seen and all(s[1] and all(s[1]) for s in seen)

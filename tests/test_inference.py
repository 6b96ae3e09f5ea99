"""The skipping inference engine (`architectures.inference`) against plain references, for every architecture.

- `full` at threshold 0 is today's `generate` / `iterate`; with an exit it is `iterate`'s adaptive exit.
- Every KV strategy, with or without an exit, equals its non-skipping reference: the loop of `iterate` written out
  here, every token computed at every iteration, with a cache that hands attention the entries the strategy names.
- Each strategy's cache holds what it declares; FLOPs are counted at the real context length.
- Speculative greedy decoding gives full-depth greedy decoding's tokens; warm start equals its plain reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import architectures
from architectures.base import ExitRule, RecurrenceError
from architectures.blocks import KVCache
from architectures.generate import generate
from architectures.inference import (
    InferenceSetting,
    _Engine,
    evaluate_adaptive,
    generate_adaptive,
    kv_bytes_per_token,
    kv_slots,
    reads_like_generation,
    speculative_generate,
    supports,
)
from benchctl.core.config import make_config

ITERABLE = [n for n in architectures.names() if architectures.get(n).iterable()]
FIXED = [n for n in architectures.names() if not architectures.get(n).iterable()]
STRATEGIES = ["full", "last", "budget:2", "first"]
# random initial states off, so that two runs of different shapes compute the same thing
DETERMINISTIC = {"huginn": {"model.state_std": 0.0}, "three-part": {"model.state_init_std": 0.0}}


def build(arch: str, seed: int = 0, deterministic: bool = False) -> architectures.BaseLM:
    overrides = DETERMINISTIC.get(arch, {}) if deterministic else {}
    torch.manual_seed(seed)
    model = architectures.build(arch, make_config("tiny", arch, overrides=overrides).model).eval()
    with torch.no_grad():  # a wider init than llama2.c's 0.02: greedy choices far from ties, states that move
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def models():
    cache: dict[tuple[str, bool], architectures.BaseLM] = {}

    def get(arch: str, deterministic: bool = False) -> architectures.BaseLM:
        if (arch, deterministic) not in cache:
            cache[arch, deterministic] = build(arch, deterministic=deterministic)
        return cache[arch, deterministic]

    return get


def batch(T: int = 10, B: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 500, (B, T), generator=g)


# ---- the settings ----------------------------------------------------------------------------------------------------


def test_setting_label_and_parse_are_inverse():
    for s in [
        InferenceSetting(),
        InferenceSetting(n_recur=4, exit_threshold=1e-3, kv="last"),
        InferenceSetting(exit_threshold=0.01, exit_rule="latent", kv="budget:2", warm_start=True),
        InferenceSetting(n_recur=1, kv="first"),
    ]:
        assert InferenceSetting.parse(s.label()) == s, s.label()
    assert InferenceSetting(n_recur=4, exit_threshold=0.001, kv="last").label() == "n=4 exit=0.001 kv=last"
    assert InferenceSetting.parse("") == InferenceSetting()


@pytest.mark.parametrize(
    "text, words",
    [
        ("kv=budget:0", "budget must be a whole number"),
        ("kv=ring", "unknown kv strategy"),
        ("n=two", "n= needs a number"),
        ("exit=-1", "exit threshold must be >= 0"),
        ("rule=entropy", "unknown exit rule"),
        ("n=2 n=3", "given twice"),
        ("depth=3", "cannot read 'depth=3'"),
    ],
)
def test_a_bad_setting_is_one_clear_error(text, words):
    with pytest.raises(ValueError, match=words):
        InferenceSetting.parse(text)


def test_supports_names_what_an_architecture_cannot_run(models):
    for arch in FIXED:
        m = models(arch)
        assert supports(m, InferenceSetting()) is None
        assert "fixed-depth" in (supports(m, InferenceSetting(kv="last")) or "")
        assert "fixed-depth" in (supports(m, InferenceSetting(exit_threshold=0.01)) or "")
        with pytest.raises(RecurrenceError, match="fixed-depth"):
            generate_adaptive(m, [[1, 2]], 2, InferenceSetting(n_recur=m.args.n_recur + 1))
    for arch in ITERABLE:
        m = models(arch)
        warm = supports(m, InferenceSetting(warm_start=True))
        assert (warm is None) == type(m).warm_startable, arch
        if warm is not None:
            assert "no warm start" in warm
    relaxed = models("relaxed") if "relaxed" in ITERABLE else None
    if relaxed is not None and type(relaxed).max_n_recur(relaxed.args) is not None:
        assert supports(relaxed, InferenceSetting(n_recur=10_000)) is not None


# ---- full at threshold 0 is today's path -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", architectures.names())
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_full_depth_reproduces_generate_and_iterate(models, arch):
    model = models(arch)
    prompts = [[1, 5, 9, 3, 7], [1, 7, 2, 8, 11, 4, 6, 2], [1, 3, 4]]  # ragged
    torch.manual_seed(7)
    ref = [g.tokens for g in generate(model, prompts, max_new_tokens=6, temperature=0.0)]
    torch.manual_seed(7)
    got = generate_adaptive(model, prompts, 6, InferenceSetting())
    assert got.tokens == ref
    assert got.new_tokens == 18
    n = model.resolve_n_recur(None)
    assert got.mean_depth == n
    assert got.prefill_seconds > 0 and got.decode_seconds > 0
    tokens = batch()
    torch.manual_seed(3)
    loss, flops, depth = evaluate_adaptive(model, tokens, tokens.roll(-1, 1), InferenceSetting())
    torch.manual_seed(3)
    with torch.no_grad():
        ref_loss = model(tokens, tokens.roll(-1, 1))[1]
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    assert depth == n


def test_sampling_draws_what_generate_draws(models):
    model = models(ITERABLE[0])
    kw = dict(temperature=0.9, top_k=40)
    got = generate_adaptive(
        model, [[1, 5, 9, 3]], 8, InferenceSetting(), generator=torch.Generator().manual_seed(4), **kw
    )
    ref = generate(model, [[1, 5, 9, 3]], max_new_tokens=8, generators=[torch.Generator().manual_seed(4)], **kw)
    assert got.tokens == [ref[0].tokens]
    # a stop id ends its row and is not kept
    stop = ref[0].tokens[3]
    cut = generate_adaptive(
        model, [[1, 5, 9, 3]], 8, InferenceSetting(), generator=torch.Generator().manual_seed(4), stop_ids=(stop,), **kw
    )
    assert cut.tokens == [ref[0].tokens[: ref[0].tokens.index(stop)]]


@pytest.mark.parametrize("arch", ITERABLE)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_full_with_an_exit_is_iterates_adaptive_exit(models, arch):
    model = models(arch)
    tokens = batch(12)
    for rule, threshold in thresholds(model, tokens):
        torch.manual_seed(3)
        with torch.no_grad():
            out = model.iterate(tokens, tokens, exit=ExitRule(rule, threshold))
        torch.manual_seed(3)
        eng = _Engine(model, InferenceSetting(exit_threshold=threshold, exit_rule=rule), 2, 12)
        with torch.inference_mode():
            h, depths = eng.forward(tokens, InferenceSetting(exit_threshold=threshold, exit_rule=rule))
            logits = model.output(model.norm(h))
        assert torch.equal(depths, out.depths)
        torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)
        # `full` computes every iteration of every token, whatever the exit says
        assert eng.take()[1] == model.resolve_n_recur(None) * tokens.numel()
        torch.manual_seed(9)
        prompts = [[1, 5, 9, 3, 7], [2, 7, 2, 8, 11]]
        ref = generate(model, prompts, max_new_tokens=5, temperature=0.0, exit=ExitRule(rule, threshold))
        torch.manual_seed(9)
        got = generate_adaptive(model, prompts, 5, InferenceSetting(exit_threshold=threshold, exit_rule=rule))
        assert got.tokens == [g.tokens for g in ref]
        assert got.mean_depth == model.resolve_n_recur(None)  # computed
        skipping = generate_adaptive(
            model, prompts, 5, InferenceSetting(exit_threshold=threshold, exit_rule=rule, kv="last")
        )
        assert skipping.mean_depth == skipping.mean_exit_depth <= got.mean_depth


# ---- every strategy against its plain, non-skipping reference -------------------------------------------------------


class _RefSlot:
    def __init__(self, cache: RefCache, j: int):
        self.cache, self.j = cache, j

    def update(self, k, v, pos, max_len):
        return self.cache.update(self.j, k, v, pos)


class RefCache(KVCache):
    """A `KVCache` whose slots follow a KV strategy, for the reference loop below: every token computes every
    iteration, and what attention reads at an exited position is replaced by what the strategy says."""

    def __init__(self, max_len: int, kv: str):
        super().__init__(max_len)
        self.kv = kv
        self.store: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per step call: each position's latest entry
        self.phase: tuple = ("p",)
        self.active: torch.Tensor | None = None  # (B, T) of the current forward

    def next_layer(self):
        slot = _RefSlot(self, self._next)
        self._next += 1
        return slot

    def set_phase(self, *phase) -> None:
        self.phase, self._next = phase, 0

    def _tensors(self, key, k):
        if key not in self.store:
            B, H, _, D = k.shape
            self.store[key] = (k.new_zeros(B, H, self.max_len, D), k.new_zeros(B, H, self.max_len, D))
        return self.store[key]

    def update(self, j, k, v, pos):
        T = k.shape[2]
        some_exited = self.active is not None and not bool(self.active.all())
        keep = self.active[:, None, :, None] if some_exited else None  # (B, 1, T, 1)
        if self.phase[0] == "r":
            t = self.phase[1]
            if self.kv == "first" and t > 0:
                ck, cv = self.store[("r", 0, j)]
                return ck[:, :, : pos + T], cv[:, :, : pos + T]
            if self.kv != "full" and keep is not None:  # an exited position offers its last computed entry
                lk, lv = self.last[j]
                k = torch.where(keep, k, lk[:, :, pos : pos + T])
                v = torch.where(keep, v, lv[:, :, pos : pos + T])
            lk, lv = self._tensors(("last", j), k)
            lk[:, :, pos : pos + T], lv[:, :, pos : pos + T] = k, v
            self.last[j] = (lk, lv)
            slot = t % int(self.kv.split(":")[1]) if self.kv.startswith("budget:") else t
            key = ("r", 0 if self.kv == "first" else slot, j)
        elif self.phase[0] == "probe":  # the exit's coda probe: exited positions keep their last probe's entries
            key = ("c", j)
            if self.kv != "full" and keep is not None and key in self.store:
                ok, ov = self.store[key]
                k = torch.where(keep, k, ok[:, :, pos : pos + T])
                v = torch.where(keep, v, ov[:, :, pos : pos + T])
        else:
            key = (self.phase[0], j)
        ck, cv = self._tensors(key, k)
        ck[:, :, pos : pos + T], cv[:, :, pos : pos + T] = k, v
        return ck[:, :, : pos + T], cv[:, :, : pos + T]


def reference_forward(model, tokens, cache: RefCache, setting: InferenceSetting, warm=None):
    """`BaseLM._iterate` written out with a strategy cache: (hidden states before the final norm, depths, states)."""
    n = model.resolve_n_recur(setting.n_recur)
    rule = model.resolve_extrapolate(None)
    B, T = tokens.shape
    pos = cache.pos
    cos, sin = model.rope_cos[pos : pos + T], model.rope_sin[pos : pos + T]
    exit = setting.exit()
    cache.active = None
    cache.set_phase("p")
    s, ctx = model.prelude(model.embed(tokens), cos, sin, cache)
    if warm is not None:
        s = warm
    depths = torch.full((B, T), n)
    active = torch.ones(B, T, dtype=torch.bool)
    prev = torch.full((B, T, model.args.vocab_size), -math.log(model.args.vocab_size))
    for t in range(n):
        cache.active = active
        cache.set_phase("r", t)
        new = model.core_step(s, ctx, t, cos, sin, cache, rule)
        if exit is None:
            s = new
            continue
        if exit.rule == "kl":
            cache.set_phase("probe")
            cur = F.log_softmax(model.output(model.norm(model.coda(new, cos, sin, cache))).float(), dim=-1)
            crit = F.kl_div(cur, prev, log_target=True, reduction="none").sum(-1)
            prev = torch.where(active[..., None], cur, prev)
        else:
            crit = (new - s).float().norm(dim=-1) / new.float().norm(dim=-1).clamp_min(1e-12)
        s = torch.where(active[..., None], new, s)
        done = active & (crit < exit.threshold)
        depths = torch.where(done, torch.full_like(depths, t + 1), depths)
        active = active & ~done
    cache.active = None
    cache.set_phase("c")
    h = model.coda(s, cos, sin, cache)
    cache.advance(T)
    return h, depths, s


CANDIDATES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.3, 1.6)


def thresholds(model, tokens) -> list[tuple[str, float]]:
    """For each exit rule, a threshold at which this model's tokens exit at mixed depths (what the comparisons
    need to mean something): the candidate whose mean exit depth under `iterate` is nearest the middle."""
    key = (id(model), tuple(tokens.flatten().tolist()))
    if key in _THRESHOLDS:
        return _THRESHOLDS[key]
    n = model.resolve_n_recur(None)
    out = []
    for rule in ("latent", "kl"):
        with torch.no_grad():
            depth = {
                thr: model.iterate(tokens, exit=ExitRule(rule, thr)).depths.float().mean().item() for thr in CANDIDATES
            }
        out.append((rule, min(CANDIDATES, key=lambda thr: abs(depth[thr] - (1 + n) / 2))))
    _THRESHOLDS[key] = out
    return out


_THRESHOLDS: dict[tuple, list[tuple[str, float]]] = {}  # per model (the fixture keeps them alive) and tokens


@pytest.mark.parametrize("kv", STRATEGIES)
@pytest.mark.parametrize("arch", ITERABLE)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_strategy_equals_its_non_skipping_reference(models, arch, kv):
    model = models(arch)
    tokens = batch(12)
    n = model.resolve_n_recur(None)
    for rule, threshold in [("kl", 0.0)] + thresholds(model, tokens):
        setting = InferenceSetting(exit_threshold=threshold, exit_rule=rule, kv=kv)
        with torch.no_grad():
            # teacher-forced: a prefix forward, then one token at a time (the decode case), then a chunk
            chunks = [(0, 6), (6, 7), (7, 8), (8, 12)]
            torch.manual_seed(5)
            ref = RefCache(12, kv)
            ref_out = [reference_forward(model, tokens[:, a:b], ref, setting)[:2] for a, b in chunks]
            torch.manual_seed(5)
            eng = _Engine(model, setting, 2, 12)
            with torch.inference_mode():
                got = [eng.forward(tokens[:, a:b], setting) for a, b in chunks]
        for (h_ref, d_ref), (h, d) in zip(ref_out, got):
            assert torch.equal(d, d_ref), (rule, threshold)
            torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
        depths = torch.cat([d for _, d in got], 1)
        computed = eng.take()[1]
        if kv == "full":
            assert computed == n * tokens.numel()
        else:  # the skipping strategies compute exactly each token's depth
            assert computed == int(depths.sum())
        if threshold > 0:  # the thresholds make some tokens exit early, or the test would not test skipping
            assert int(depths.min()) < n, (arch, rule)


@pytest.mark.parametrize("arch", ITERABLE)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_budget_loss_is_what_token_by_token_generation_reads(models, arch):
    """Under budget:K one forward over a sequence never reads another iteration's keys, so the teacher-forced loss is
    taken one token at a time: the reference fed token by token gives it, and it differs from full depth."""
    model = models(arch, deterministic=True)
    tokens = batch(10)
    setting = InferenceSetting(kv="budget:2")
    assert not reads_like_generation(setting) and reads_like_generation(InferenceSetting(kv="last"))
    loss, flops, depth = evaluate_adaptive(model, tokens, tokens.roll(-1, 1), setting)
    with torch.no_grad():
        ref = RefCache(10, "budget:2")
        h = torch.cat([reference_forward(model, tokens[:, i : i + 1], ref, setting)[0] for i in range(10)], 1)
        want = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), tokens.roll(-1, 1).flatten())
    assert loss == pytest.approx(float(want), rel=1e-5)
    full = evaluate_adaptive(model, tokens, tokens.roll(-1, 1), InferenceSetting())
    if model.resolve_n_recur(None) > 2:  # depth above the budget: the slots hold later iterations
        assert loss != pytest.approx(full[0], rel=1e-6)
    else:  # two slots hold every iteration: full depth
        assert loss == pytest.approx(full[0], rel=1e-5)
    assert flops == pytest.approx(full[1], rel=1e-9) and depth == full[2]  # the same work, token by token


@pytest.mark.parametrize("arch", ITERABLE)
def test_skipping_spends_less_when_tokens_exit(models, arch):
    model = models(arch)
    tokens = batch(16)
    rule, thr = thresholds(model, tokens)[0]
    full = evaluate_adaptive(model, tokens, tokens.roll(-1, 1), InferenceSetting(exit_threshold=thr, exit_rule=rule))
    last = evaluate_adaptive(
        model, tokens, tokens.roll(-1, 1), InferenceSetting(exit_threshold=thr, exit_rule=rule, kv="last")
    )
    n = model.resolve_n_recur(None)
    assert full[2] == n and last[2] < n
    assert last[1] < full[1]


# ---- what the cache holds and what compute costs ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ITERABLE)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_each_strategy_holds_the_cache_it_declares(models, arch):
    model = models(arch)
    n = model.resolve_n_recur(None)
    slots = {kv: kv_slots(model, InferenceSetting(kv=kv)) for kv in STRATEGIES + ["budget:1", "budget:99"]}
    step = (slots["full"] - slots["first"]) // (n - 1) if n > 1 else 0
    outer = slots["first"] - step
    assert step > 0 and outer >= 0
    assert slots["last"] == slots["full"] == outer + n * step
    assert slots["budget:2"] == outer + min(2, n) * step
    assert slots["budget:1"] == slots["first"] and slots["budget:99"] == slots["full"]
    prompts = [[1, 5, 9, 3], [1, 7, 2, 8]]
    rule, threshold = thresholds(model, batch(12))[0]
    for kv in STRATEGIES:
        setting = InferenceSetting(kv=kv, exit_threshold=threshold, exit_rule=rule)
        torch.manual_seed(0)
        got = generate_adaptive(model, prompts, 4, setting)
        positions = 4 + 4 - 1  # the last new token is never fed
        assert got.kv_bytes == kv_bytes_per_token(model, setting) * 2 * positions, kv
    a = model.args
    kv_width = a.n_kv_heads * (a.dim // a.n_heads)
    assert kv_bytes_per_token(model, InferenceSetting()) == slots["full"] * kv_width * 2 * 4
    # `first` computes no keys or values past the first iteration: two projections fewer per step call
    tokens = batch(8)
    full = evaluate_adaptive(model, tokens, tokens, InferenceSetting())
    first = evaluate_adaptive(model, tokens, tokens, InferenceSetting(kv="first"))
    per_projection = 2.0 * a.dim * kv_width
    if arch == "relaxed":  # and their LoRA deltas
        per_projection += 2.0 * model.arch_args.lora_rank * (a.dim + kv_width)
    assert full[1] - first[1] == pytest.approx((n - 1) * step * 2 * per_projection, rel=1e-9)


@pytest.mark.parametrize("arch", architectures.names())
def test_flops_are_counted_at_the_real_context(models, arch):
    model = models(arch)
    n = model.resolve_n_recur(None)
    head = 2.0 * model.args.dim * model.args.vocab_size
    # training-only pieces of the analytic count: TRM scores its n - 1 earlier answers (deep supervision)
    extra = (n - 1) * head if arch == "trm" else 0.0
    got = generate_adaptive(model, [[1, 5, 9, 3]], 6, InferenceSetting())
    # the decode steps feed positions 4 .. 8, each attending to position + 1 keys
    want = sum(model.flops_per_token(p + 1, n, training=False) - extra for p in range(4, 9)) / 5
    assert got.flops_per_token == pytest.approx(want, rel=1e-9)
    tokens = batch(8, B=1)
    loss, flops, _ = evaluate_adaptive(model, tokens, tokens, InferenceSetting())
    want = sum(model.flops_per_token(p + 1, n, training=False) - extra for p in range(8)) / 8
    assert flops == pytest.approx(want, rel=1e-9)


# ---- speculative decoding --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ITERABLE)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_speculative_greedy_equals_full_depth_greedy(models, arch):
    model = models(arch, deterministic=True)
    prompts = [[1, 5, 9, 3, 7], [1, 7, 2]]
    ref = [g.tokens for g in generate(model, prompts, max_new_tokens=9, temperature=0.0)]
    for depth, k in ((1, 3), (2, 2)):
        got = speculative_generate(model, prompts, 9, draft=InferenceSetting(n_recur=depth), k=k)
        assert got.tokens == ref, (depth, k)
        assert got.proposed > 0 and 0 <= got.accepted <= got.proposed
        assert got.acceptance_rate == got.accepted / got.proposed
        assert got.new_tokens == 18
    # a draft at the verifier's own depth is always accepted
    same = speculative_generate(model, prompts, 9, draft=InferenceSetting(), k=3)
    assert same.tokens == ref and same.accepted == same.proposed
    # other strategies: greedy decoding under the verifier's setting, drafts with a loose exit included
    rule, thr = thresholds(model, batch(12))[0]
    for draft in (
        InferenceSetting(exit_threshold=thr, exit_rule=rule, kv="last"),
        InferenceSetting(n_recur=1, kv="first"),
    ):
        verify = InferenceSetting(kv=draft.kv)
        want = generate_adaptive(model, prompts[:1], 6, verify).tokens
        got = speculative_generate(model, prompts[:1], 6, draft=draft, k=3, verify=verify)
        assert got.tokens == want, draft.label()
    with pytest.raises(ValueError, match="share one cache"):
        speculative_generate(model, prompts, 4, draft=InferenceSetting(n_recur=1, kv="first"), k=2)


# ---- warm start ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [a for a in ITERABLE if architectures.get(a).warm_startable])
def test_warm_start_equals_its_plain_reference(models, arch):
    model = models(arch, deterministic=True)
    tokens = batch(6)
    cache = RefCache(6, "full")
    hs, state = [], None
    with torch.no_grad():
        for i in range(6):
            h, _, s = reference_forward(model, tokens[:, i : i + 1], cache, InferenceSetting(), warm=state)
            hs.append(h)
            state = s
        logits = model.output(model.norm(torch.cat(hs, 1)))
    want = F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    warm = evaluate_adaptive(model, tokens, tokens.roll(-1, 1), InferenceSetting(warm_start=True))
    cold = evaluate_adaptive(model, tokens, tokens.roll(-1, 1), InferenceSetting())
    assert warm[0] == pytest.approx(float(want), rel=1e-5)
    assert warm[0] != pytest.approx(cold[0], rel=1e-6)  # the warm state changes something
    # generation runs it too, the prompt one token at a time
    got = generate_adaptive(model, [[1, 5, 9, 3]], 4, InferenceSetting(warm_start=True, kv="last"))
    assert len(got.tokens[0]) == 4

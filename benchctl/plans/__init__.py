"""Study plans: which models a study trains, as a small TOML file of named variants.

A plan has a `name`, a one-line `description`, optionally a default `preset` and `seeds`, and `[[variant]]` tables:

    [[variant]]
    name = "control-2x"            # the label tables and figures show
    arch = "control"               # a registered architecture
    set = ["model.n_layers=8"]     # optional config overrides, as with --set
    # optional, at most one of:
    steps = 1200                   # train.max_steps
    train_tokens = 5_000_000       # steps = ceil(tokens / tokens per step)
    match_train_flops = "frailt"   # steps so that training FLOPs equal that variant's

A variant can instead be a conversion of another variant of the same plan (a retrofit, see
benchctl.stages.retrofit.engine):

    [[variant]]
    name = "relaxed-avg-svd"
    arch = "relaxed"
    from = "control-16"            # a variant of this plan trained from scratch, converted at each seed
    init = "average"               # stepwise | average (looped models) | select (three-part)
    lora_init = "svd"              # svd (default) | zero; only for an architecture with per-pass LoRA (relaxed)
    set = ["train.recur_curriculum=linear"]
    steps = 400                    # healing steps (any length key; default: the preset's max_steps)

The conversion's config is its parent's preset, seed, widths and data with the target architecture and the overrides;
it runs after the plan's other variants are trained (the study's `retrofit` stage), from the same seed's parent.

A plan of `kind = "isoflop"` is an IsoFLOP grid instead (see `IsoFlop`): its `[[variant]]` tables name architectures
(`name`, `arch`, `set`: depth and recurrence fixed here) and the plan lists the `budgets` (training FLOPs), the
`widths` and optionally `head_dim` and `max_epochs`:

    kind = "isoflop"
    budgets = [5e11, 1.2e12, 3e12]  # training FLOPs each run spends
    widths = [32, 48, 64, 96]       # model.dim; heads = width / head_dim, FFN width by llama2.c's rule
    head_dim = 16                   # optional: default the preset's dim / n_heads
    max_epochs = 4                  # optional: the most passes over the training split a run may make

Each (architecture, width, budget) becomes a variant named `<name>-w<width>-<budget>` (`control-w64-1.2e12`) whose
steps make its analytic training FLOPs equal the budget, with its warm-up, evaluation and checkpoint intervals
scaled with its steps (their share of the preset's steps kept); the rest of the plan machinery treats it as any
variant.

The built-in plans live beside this module (`study`, the default, `controls`, `depth`, `retrofit`); any other path
to a TOML file is a plan too. A variant is a label, not part of a run's identity: the run id is still the hash of
the resolved config and data, so the same model reached from two plans is trained once.

Everything is checked before anything is trained or written: an unknown key, an unknown architecture, a bad
config key or value, a duplicate variant name, a `match_train_flops` naming a missing variant, for every variant
at every seed; for a conversion also a `from` naming a missing variant or another conversion, an init or LoRA init
the target architecture does not take and a parent whose layers or widths the conversion cannot map (the weight
surgery is tried on shape-only models). Each problem is one ConfigError line naming the plan file and the offending key.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchctl.core.config import RunConfig, make_config, overrides_for, parse_set, validate
from benchctl.core.errors import ConfigError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML through the backport
    import tomli as tomllib

DEFAULT_PLAN = "study"
DEFAULT_SEEDS = (0, 1, 2)  # three seeds: the fewest that give a t-interval with a usable width
_DIR = Path(__file__).parent
_TOP_KEYS = ("name", "description", "preset", "seeds", "variant", "kind")
_ISOFLOP_KEYS = ("budgets", "widths", "head_dim", "max_epochs")
_ISOFLOP_VARIANT_KEYS = ("name", "arch", "set")
# Keys an IsoFLOP plan sets from the width (heads from head_dim, the FFN width by llama2.c's rule): a variant or the
# command line setting one would break the width rule.
WIDTH_KEYS = ("model.dim", "model.n_heads", "model.n_kv_heads", "model.hidden_dim")
DEFAULT_MAX_EPOCHS = 4.0  # beyond this many passes over the training split a run measures memorisation, not scaling
_VARIANT_KEYS = ("name", "arch", "set", "steps", "train_tokens", "match_train_flops", "from", "init", "lora_init")
_LENGTH_KEYS = ("steps", "train_tokens", "match_train_flops")  # at most one: each decides the training length


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str
    sets: dict[str, str]  # config overrides from `set`
    steps: int | None = None
    train_tokens: int | None = None
    match_train_flops: str | None = None
    parent: str | None = None  # `from`: the variant this one is converted from (None: trained from scratch)
    init: str | None = None  # how the parent's weights are mapped (a conversion's only)
    lora_init: str | None = None  # how per-pass LoRAs start (a conversion's; None: the default, svd)
    # An IsoFLOP grid point: the architecture entry it comes from, its width and its training-FLOPs budget.
    point: IsoPoint | None = None


@dataclass(frozen=True)
class IsoPoint:
    """Where an IsoFLOP plan's variant sits in its grid."""

    arch_name: str  # the plan's [[variant]] name this point is a size of (e.g. "control")
    width: int  # model.dim
    budget: float  # training FLOPs its steps are set to spend (analytic count)


@dataclass(frozen=True)
class IsoFlop:
    """The grid of an IsoFLOP plan: every architecture entry at every width and budget.

    Rules, stated once: heads = n_kv_heads = width / head_dim; the FFN width follows llama2.c's rule from the width
    (model.hidden_dim auto); depth, recurrence and the architecture's own keys stay as the preset and the entry set
    them. Steps = round(budget / (analytic FLOPs/token x tokens/step)), at least 1; warm-up, evaluation and checkpoint
    intervals keep the share of the steps the preset gives them (the learning-rate schedule, warm-up then cosine to
    the last step, stretches with the steps by construction). The FLOPs are the analytic count, which for an
    architecture whose depth depends on the data (halting, routing) is its upper bound: such a run spends at most the
    budget, and the report shows what it spent."""

    budgets: tuple[float, ...]
    widths: tuple[int, ...]
    head_dim: int | None  # None: the preset's dim / n_heads
    max_epochs: float
    archs: tuple[Variant, ...]  # the [[variant]] entries: name, arch, set


@dataclass(frozen=True)
class Plan:
    name: str
    description: str
    path: Path
    sha256: str  # of the file's bytes: which version of the plan a study ran
    variants: tuple[Variant, ...]
    preset: str | None = None
    seeds: tuple[int, ...] | None = None
    isoflop: IsoFlop | None = None  # an IsoFLOP plan's grid (its variants are the grid's points)

    @property
    def kind(self) -> str:
        return "isoflop" if self.isoflop is not None else "variants"

    @property
    def archs(self) -> list[str]:
        return list(dict.fromkeys(v.arch for v in self.variants))


@dataclass(frozen=True)
class PlannedRun:
    """One run of a plan: its variant name and its resolved config."""

    variant: str
    cfg: RunConfig


@dataclass(frozen=True)
class PlannedConversion:
    """One conversion of a plan at one seed: the converted model's config (without `train.init_from`, which names the
    parent's run id, known once the parent is trained: see benchctl.stages.retrofit.engine.attach) and its parent's
    config."""

    variant: str
    parent: str  # the parent's variant name
    cfg: RunConfig
    parent_cfg: RunConfig
    init: str
    lora_init: str | None  # svd | zero for an architecture with per-pass LoRA, else None


def builtin_names() -> list[str]:
    """The plans shipped with benchctl: the default first, then by name."""
    names = sorted(p.stem for p in _DIR.glob("*.toml"))
    return sorted(names, key=lambda n: (n != DEFAULT_PLAN, n))


def builtin() -> list[Plan]:
    return [load(n) for n in builtin_names()]


def load(name_or_path: str | Path) -> Plan:
    """A built-in plan by name, or a plan file by path: checked as `read` checks it, then against the models (each
    architecture registered, each conversion's init methods ones the weight surgery has); not yet for configs."""
    plan = read(name_or_path)
    _check_models(plan)
    return plan


def read(name_or_path: str | Path) -> Plan:
    """A built-in plan by name, or a plan file by path, parsed and checked for everything the models are not needed
    for (keys, types, names and how the variants refer to each other): what `benchctl plans` lists, without the
    torch that the model registry imports."""
    text = str(name_or_path)
    path = _DIR / f"{text}.toml" if text in builtin_names() else Path(text)
    if not path.is_file():
        raise ConfigError(
            f"unknown plan '{text}'{did_you_mean(text, builtin_names())} built-in plans: "
            f"{', '.join(builtin_names())}; or give the path of a plan file"
        )
    raw_bytes = path.read_bytes()
    try:
        raw = tomllib.loads(raw_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a valid TOML file: {e}") from None
    return _parse(raw, path, hashlib.sha256(raw_bytes).hexdigest())


def _unknown(path: Path, where: str, key: str, allowed: tuple[str, ...]) -> ConfigError:
    return ConfigError(f"{path}: {where}unknown key '{key}'{did_you_mean(key, allowed)} allowed: {', '.join(allowed)}")


def _typed(path: Path, where: str, key: str, value: Any, tp: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{path}: {where}'{key}' must be {what}, got {value!r}")
    return value


def _parse(raw: dict[str, Any], path: Path, sha: str) -> Plan:
    kind = raw.get("kind", "variants")
    if kind not in ("variants", "isoflop"):
        raise ConfigError(f'{path}: \'kind\' must be "variants" (the default) or "isoflop", got {kind!r}')
    allowed = _TOP_KEYS + (_ISOFLOP_KEYS if kind == "isoflop" else ())
    for key in raw:
        if key not in allowed:
            hint = ' (an IsoFLOP plan\'s key: set kind = "isoflop")' if key in _ISOFLOP_KEYS else ""
            if hint:
                raise ConfigError(f"{path}: unknown key '{key}'{hint}")
            raise _unknown(path, "", key, allowed)
    for key in ("name", "description"):
        if key not in raw:
            raise ConfigError(f"{path}: missing key '{key}'")
        _typed(path, "", key, raw[key], str, "a string")
    preset = None if "preset" not in raw else _typed(path, "", "preset", raw["preset"], str, "a string")
    seeds = None
    if "seeds" in raw:
        items = _typed(path, "", "seeds", raw["seeds"], list, "a list of integers >= 0")
        if not items or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in items):
            raise ConfigError(f"{path}: 'seeds' must be a non-empty list of integers >= 0, got {items!r}")
        seeds = tuple(dict.fromkeys(items))
    tables = raw.get("variant")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(
            f"plan {path} defines no [[variant]] tables; add one per model to compare, each with a name and an "
            "arch (the format: docs/plans.md)"
        )
    iso = None
    if kind == "isoflop":
        iso = _isoflop(raw, tables, path)
        variants = _grid(iso)
    else:
        variants = [_variant(t, path, i) for i, t in enumerate(tables, 1)]
    names = [v.name for v in variants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{path}: variant name '{dup[0]}' is used twice; each variant needs its own name")
    for v in variants:
        if v.match_train_flops is not None and v.match_train_flops not in names:
            raise ConfigError(
                f"{path}: variant '{v.name}': match_train_flops names no variant of this plan: "
                f"'{v.match_train_flops}'{did_you_mean(v.match_train_flops, names)}"
            )
        _check_parent(v, variants, path)
    return Plan(
        name=raw["name"],
        description=raw["description"],
        path=path,
        sha256=sha,
        variants=tuple(variants),
        preset=preset,
        seeds=seeds,
        isoflop=iso,
    )


def budget_label(budget: float) -> str:
    """A budget as variant names show it: 1.2e12, 5e11 (three significant digits, no '+')."""
    mant, exp = f"{budget:.2e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def _isoflop(raw: dict[str, Any], tables: list[dict[str, Any]], path: Path) -> IsoFlop:
    def numbers(key: str, tp: type | tuple[type, ...], what: str) -> list[Any]:
        if key not in raw:
            raise ConfigError(f"{path}: an IsoFLOP plan needs '{key}' ({what})")
        items = raw[key]
        ok = isinstance(items, list) and items and all(isinstance(x, tp) and not isinstance(x, bool) for x in items)
        if not ok or any(x <= 0 for x in items):
            raise ConfigError(f"{path}: '{key}' must be a non-empty list of {what}, got {items!r}")
        if len(set(items)) != len(items):
            raise ConfigError(f"{path}: '{key}' lists a value twice: {items!r}")
        return sorted(items)

    budgets = numbers("budgets", (int, float), "positive numbers: training FLOPs per run")
    widths = numbers("widths", int, "positive integers: model.dim of each size")
    labels = [budget_label(float(b)) for b in budgets]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{path}: 'budgets' has two values that agree to three significant digits: {budgets!r}")
    head_dim = None
    if "head_dim" in raw:
        head_dim = _typed(path, "", "head_dim", raw["head_dim"], int, "a positive integer")
        if head_dim < 1:
            raise ConfigError(f"{path}: 'head_dim' must be a positive integer, got {head_dim!r}")
        bad = [w for w in widths if w % head_dim]
        if bad:
            raise ConfigError(f"{path}: every width must be a multiple of head_dim {head_dim}; {bad[0]} is not")
    max_epochs = DEFAULT_MAX_EPOCHS
    if "max_epochs" in raw:
        max_epochs = _typed(path, "", "max_epochs", raw["max_epochs"], (int, float), "a positive number")
        if max_epochs <= 0:
            raise ConfigError(f"{path}: 'max_epochs' must be a positive number, got {max_epochs!r}")
    archs = []
    for i, t in enumerate(tables, 1):
        label = f"'{t['name']}'" if isinstance(t.get("name"), str) else f"#{i}"
        for key in t:
            if key not in _ISOFLOP_VARIANT_KEYS:
                why = (
                    " (an IsoFLOP plan sets every run's steps from its budget)"
                    if key in _LENGTH_KEYS
                    else " (an IsoFLOP plan trains every size from scratch)"
                    if key in ("from", "init", "lora_init")
                    else ""
                )
                if why:
                    raise ConfigError(f"{path}: variant {label}: '{key}' is not allowed{why}")
                raise _unknown(path, f"variant {label}: ", key, _ISOFLOP_VARIANT_KEYS)
        v = _variant(t, path, i)
        fixed = [k for k in v.sets if k in WIDTH_KEYS]
        if fixed:
            raise ConfigError(
                f"{path}: variant {label}: set: '{fixed[0]}' is set by the width (widths, head_dim); "
                "fix depth and recurrence here, not widths"
            )
        archs.append(v)
    names = [v.name for v in archs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{path}: variant name '{dup[0]}' is used twice; each variant needs its own name")
    return IsoFlop(
        budgets=tuple(float(b) for b in budgets),
        widths=tuple(widths),
        head_dim=head_dim,
        max_epochs=float(max_epochs),
        archs=tuple(archs),
    )


def _grid(iso: IsoFlop) -> list[Variant]:
    """Every (architecture, width, budget) of an IsoFLOP plan as a variant, budget-major then architecture, width."""
    return [
        replace(
            a,
            name=f"{a.name}-w{w}-{budget_label(b)}",
            point=IsoPoint(arch_name=a.name, width=w, budget=b),
        )
        for b in iso.budgets
        for a in iso.archs
        for w in iso.widths
    ]


def _variant(t: dict[str, Any], path: Path, i: int) -> Variant:
    label = f"'{t['name']}'" if isinstance(t.get("name"), str) else f"#{i}"
    where = f"variant {label}: "
    for key in t:
        if key not in _VARIANT_KEYS:
            raise _unknown(path, where, key, _VARIANT_KEYS)
    for key in ("name", "arch"):
        if key not in t:
            raise ConfigError(f"{path}: {where}missing key '{key}'")
        _typed(path, where, key, t[key], str, "a string")
    if not t["name"].strip():
        raise ConfigError(f"{path}: {where}'name' must not be empty")
    items = _typed(path, where, "set", t.get("set", []), list, 'a list of "section.key=value" strings')
    if not all(isinstance(s, str) for s in items):
        raise ConfigError(f"{path}: {where}'set' must be a list of \"section.key=value\" strings, got {items!r}")
    try:
        sets = parse_set(items)
    except ConfigError as e:
        raise ConfigError(f"{path}: {where}set: {e}") from None
    given = [k for k in _LENGTH_KEYS if k in t]
    if len(given) > 1:
        raise ConfigError(f"{path}: {where}'{given[0]}' and '{given[1]}' both set the training length; keep one")
    for key in ("steps", "train_tokens"):
        if key in t and (_typed(path, where, key, t[key], int, "a positive integer") < 1):
            raise ConfigError(f"{path}: {where}'{key}' must be a positive integer, got {t[key]!r}")
    match = t.get("match_train_flops")
    if match is not None:
        _typed(path, where, "match_train_flops", match, str, "a variant name")
    parent, init, lora_init = _conversion_keys(t, path, where)
    return Variant(
        name=t["name"],
        arch=t["arch"],
        sets=sets,
        steps=t.get("steps"),
        train_tokens=t.get("train_tokens"),
        match_train_flops=match,
        parent=parent,
        init=init,
        lora_init=lora_init,
    )


def _conversion_keys(t: dict[str, Any], path: Path, where: str) -> tuple[str | None, str | None, str | None]:
    """(from, init, lora_init) of a variant table: all None for a model trained from scratch. Which init methods
    there are is the models' business (`_check_models`)."""
    if "from" not in t:
        for key in ("init", "lora_init"):
            if key in t:
                raise ConfigError(f"{path}: {where}'{key}' needs 'from' (the variant to convert)")
        return None, None, None
    parent = _typed(path, where, "from", t["from"], str, "a variant name")
    return parent, t.get("init"), t.get("lora_init")


def _check_models(plan: Plan) -> None:
    """Each variant's architecture is registered; a conversion has an `init`, and its `init` and `lora_init` are
    methods the weight surgery has."""
    # torch: kept out of 'benchctl plans', which lists the plans with `read`
    import architectures
    from architectures.retrofit import INITS, LORA_INITS

    for v in plan.variants:
        where = f"{plan.path}: variant '{v.name}': "
        try:
            architectures.get(v.arch)
        except architectures.UnknownArchitectureError as e:
            raise ConfigError(f"{where}arch: {e}") from None
        if v.parent is None:
            continue
        if v.init is None:
            raise ConfigError(f"{where}a conversion needs 'init' ({', '.join(INITS)})")
        for key, value, allowed in (("init", v.init, INITS), ("lora_init", v.lora_init, LORA_INITS)):
            if value is not None and value not in allowed:
                raise ConfigError(f"{where}'{key}' must be one of {', '.join(allowed)}, got {value!r}")


def _check_parent(v: Variant, variants: list[Variant], path: Path) -> None:
    """A conversion's `from` names another variant of the plan that is trained from scratch (so every parent is
    trained before any conversion, and conversions cannot form a chain or a circle)."""
    if v.parent is None:
        return
    by = {o.name: o for o in variants}
    where = f"{path}: variant '{v.name}': from"
    if v.parent not in by:
        raise ConfigError(f"{where} names no variant of this plan: '{v.parent}'{did_you_mean(v.parent, list(by))}")
    if v.parent == v.name:
        raise ConfigError(f"{where} names the variant itself")
    if by[v.parent].parent is not None:
        raise ConfigError(
            f"{where} '{v.parent}' is itself a conversion (from '{by[v.parent].parent}'); "
            "convert a variant trained from scratch"
        )


def planned_runs(
    plan_name: str,
    preset: str | None,
    archs: list[str] | None,
    seeds: list[int] | None,
    overrides: dict[str, Any] | None = None,
) -> tuple[Plan, str, list[PlannedRun]]:
    """(plan, preset, runs): the plan by name or path, the preset (given, else the plan's, else paper) and every
    (variant, config) at the seeds (given, else the plan's, else 0, 1, 2), all validated before anything runs."""
    plan = load(plan_name)
    preset = preset or plan.preset or "paper"
    seeds = seeds or list(plan.seeds or DEFAULT_SEEDS)
    return plan, preset, resolve(plan, preset, seeds, overrides, archs)


def train_flops(cfg: RunConfig) -> float:
    """Training FLOPs of a run: the model's FLOPs per token (forward + backward, recurrence and attention included)
    times the tokens it trains on (max_steps x tokens per step)."""
    from benchctl.core import accounting  # torch: kept out of 'benchctl plans'

    return float(accounting.describe(cfg)["flops_per_token"]) * cfg.train.max_steps * cfg.tokens_per_step


def iso_flop_steps(cfg: RunConfig, target_flops: float) -> int:
    """The optimizer steps at which `cfg` spends `target_flops` training FLOPs (nearest step, at least 1)."""
    from benchctl.core import accounting  # torch: kept out of 'benchctl plans'

    per_step = float(accounting.describe(cfg)["flops_per_token"]) * cfg.tokens_per_step
    return max(1, round(target_flops / per_step))


def resolve(
    plan: Plan,
    preset: str,
    seeds: list[int],
    overrides: dict[str, Any] | None = None,
    archs: list[str] | None = None,
) -> list[PlannedRun]:
    """Every (variant, seed) run of `plan` trained from scratch, seed-major like `benchctl.stages.train.sweep.sweep`,
    each config built and validated; the plan's conversions (see `conversions`) are validated too, so nothing starts
    when one is wrong.

    `overrides` (the command line's --set and --data) apply to every variant, then the variant's own `set` on top
    (it is what makes the variant), then its training length. `archs` keeps only the variants of those
    architectures, and the parents of the conversions it keeps; a variant they match against is still resolved for
    its FLOPs, just not trained.
    """
    return _resolve(plan, preset, seeds, overrides, archs)[0]


def conversions(
    plan: Plan,
    preset: str,
    seeds: list[int],
    overrides: dict[str, Any] | None = None,
    archs: list[str] | None = None,
) -> list[PlannedConversion]:
    """Every (conversion variant, seed) of `plan`, seed-major, validated as in `resolve` (same arguments)."""
    return _resolve(plan, preset, seeds, overrides, archs)[1]


def _resolve(
    plan: Plan, preset: str, seeds: list[int], overrides: dict[str, Any] | None, archs: list[str] | None
) -> tuple[list[PlannedRun], list[PlannedConversion]]:
    import architectures  # torch: kept out of 'benchctl plans'

    for a in archs or []:
        try:
            architectures.get(a)
        except architectures.UnknownArchitectureError as e:
            raise ConfigError(f"--archs: {e}") from None
    kept = {v.name for v in plan.variants if not archs or v.arch in archs}
    if not kept:
        raise ConfigError(
            f"plan '{plan.name}' has no variant of architecture(s) {', '.join(archs or [])}; "
            f"its architectures: {', '.join(plan.archs)}"
        )
    kept |= {v.parent for v in plan.variants if v.name in kept and v.parent is not None}  # a conversion needs it
    keep = [v for v in plan.variants if v.name in kept]
    scope = list(dict.fromkeys(v.arch for v in keep))  # an architecture's own --set key skips the others
    base: dict[str, RunConfig] = {}
    for v in sorted(plan.variants, key=lambda v: v.parent is not None):  # parents first
        base[v.name] = (
            _base_config(plan, v, preset, overrides, scope)
            if v.parent is None
            else _conversion_config(plan, v, base[v.parent], overrides, scope)
        )
    lengths: dict[str, RunConfig] = {}
    for v in plan.variants:
        _with_length(plan, v, base, lengths, ())
    runs: list[PlannedRun] = []
    convs: list[PlannedConversion] = []
    for seed in seeds:
        for v in keep:
            cfg = _at_seed(plan, v, lengths[v.name], seed)
            if v.parent is None:
                runs.append(PlannedRun(v.name, cfg))
                continue
            parent = _at_seed(plan, v, lengths[v.parent], seed)
            convs.append(PlannedConversion(v.name, v.parent, cfg, parent, v.init or "", _lora_init(v, cfg)))
    return runs, convs


def _lora_init(v: Variant, cfg: RunConfig) -> str | None:
    from benchctl.stages.retrofit.engine import has_lora  # torch: kept out of 'benchctl plans'

    return (v.lora_init or "svd") if has_lora(cfg) else None


def _conversion_config(
    plan: Plan, v: Variant, parent: RunConfig, overrides: dict[str, Any] | None, scope: list[str]
) -> RunConfig:
    """A conversion's config (as `benchctl retrofit` builds it from the parent's), checked by trying the weight
    surgery on shape-only models of the parent and the target."""
    from benchctl.stages.retrofit import engine as rf  # torch: kept out of 'benchctl plans'

    sets = {**overrides_for(v.arch, overrides, scope), **v.sets}
    try:
        cfg = rf.target_config(parent, v.arch, sets)
    except ConfigError as e:
        raise ConfigError(f"{_where(plan, v)}: {e}") from None
    if v.lora_init is not None and not rf.has_lora(cfg):
        raise ConfigError(
            f"{_where(plan, v)}: lora_init: {v.arch} has no per-pass LoRA (model.lora_rank) to initialise; drop the key"
        )
    try:
        rf.check_conversion(parent, cfg, v.init or "", _lora_init(v, cfg))
    except ConfigError as e:
        raise ConfigError(f"{_where(plan, v)}: from '{v.parent}', init '{v.init}': {e}") from None
    return cfg


def _where(plan: Plan, v: Variant) -> str:
    return f"{plan.path}: variant '{v.name}'"


def _base_config(plan: Plan, v: Variant, preset: str, overrides: dict[str, Any] | None, scope: list[str]) -> RunConfig:
    sets = {**overrides_for(v.arch, overrides, scope), **v.sets}
    try:
        if v.point is not None:
            sets.update(_width_sets(plan, v.point.width, preset, sets))
        return make_config(preset, v.arch, 0, sets)
    except ConfigError as e:
        raise ConfigError(f"{_where(plan, v)}: {e}") from None


def head_dim_of(plan: Plan, preset: str) -> int:
    """The head width an IsoFLOP plan divides its widths by: the plan's, else the preset's dim / n_heads."""
    if plan.isoflop is not None and plan.isoflop.head_dim is not None:
        return plan.isoflop.head_dim
    base = make_config(preset, "control")
    return base.model.dim // base.model.n_heads


def _width_sets(plan: Plan, width: int, preset: str, sets: dict[str, Any]) -> dict[str, Any]:
    """The width rule: model.dim = width, heads (query and key/value) = width / head_dim, FFN width auto."""
    given = [k for k in sets if k in WIDTH_KEYS]
    if given:
        raise ConfigError(f"'{given[0]}' is set by the IsoFLOP plan's widths; leave it out of --set")
    hd = head_dim_of(plan, preset)
    if width % hd:
        raise ConfigError(f"width {width} is not a multiple of the head width {hd} (set head_dim in the plan)")
    heads = width // hd
    return {"model.dim": width, "model.n_heads": heads, "model.n_kv_heads": heads, "model.hidden_dim": "auto"}


def _with_length(
    plan: Plan, v: Variant, base: dict[str, RunConfig], done: dict[str, RunConfig], chain: tuple[str, ...]
) -> RunConfig:
    """The variant's config with its training length set; a variant it matches is resolved first."""
    if v.name in done:
        return done[v.name]
    if v.name in chain:
        raise ConfigError(
            f"{_where(plan, v)}: match_train_flops goes round in a circle: {' -> '.join([*chain, v.name])}"
        )
    cfg = base[v.name]
    steps = v.steps
    if v.train_tokens is not None:
        steps = math.ceil(v.train_tokens / cfg.tokens_per_step)
    if v.match_train_flops is not None:
        other = next(o for o in plan.variants if o.name == v.match_train_flops)
        target = train_flops(_with_length(plan, other, base, done, (*chain, v.name)))
        steps = iso_flop_steps(cfg, target)
    if v.point is not None:
        cfg = _checked(plan, v, scaled_schedule(cfg, iso_flop_steps(cfg, v.point.budget)), "budgets")
    elif steps is not None:
        cfg = _checked(plan, v, replace(cfg, train=replace(cfg.train, max_steps=steps)), "steps")
    done[v.name] = cfg
    return cfg


def scaled_schedule(cfg: RunConfig, steps: int) -> RunConfig:
    """`cfg` trained for `steps` optimizer steps with its warm-up, evaluation and checkpoint intervals scaled by the
    same factor (each at least 1, warm-up at most the steps): a run of any length warms up over the same share of
    its steps and is evaluated about as often. The cosine decay runs to the last step whatever the length."""
    t = cfg.train
    f = steps / t.max_steps

    def scaled(n: int) -> int:
        return max(1, round(n * f))

    return replace(
        cfg,
        train=replace(
            t,
            max_steps=steps,
            warmup_steps=min(steps, scaled(t.warmup_steps)) if t.warmup_steps else 0,
            eval_interval=scaled(t.eval_interval),
            ckpt_interval=scaled(t.ckpt_interval),
        ),
    )


def epochs(cfg: RunConfig, train_split_tokens: int) -> float:
    """Passes over the training split a run makes: the tokens it trains on over the split's tokens."""
    return cfg.train.max_steps * cfg.tokens_per_step / max(1, train_split_tokens)


def check_epochs(plan: Plan, runs: list[PlannedRun], train_split_tokens: int) -> None:
    """An IsoFLOP plan refuses runs that would pass over the training split more than its max_epochs: their loss
    would measure memorisation, not the compute-optimal trade-off (a ConfigError naming the first such run)."""
    if plan.isoflop is None:
        return
    over = [r for r in runs if epochs(r.cfg, train_split_tokens) > plan.isoflop.max_epochs]
    if over:
        worst = max(over, key=lambda r: r.cfg.train.max_steps * r.cfg.tokens_per_step)
        raise ConfigError(
            f"plan '{plan.name}': {len(over)} run(s) would pass over the {train_split_tokens:,}-token training split "
            f"more than max_epochs = {plan.isoflop.max_epochs:g} times (e.g. {worst.variant}: "
            f"{epochs(worst.cfg, train_split_tokens):.1f}); lower the budgets, widen the smallest width or give more "
            "data (see 'benchctl plans show NAME --data DIR')"
        )


def _checked(plan: Plan, v: Variant, cfg: RunConfig, key: str) -> RunConfig:
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{_where(plan, v)}: {key}: {e}") from None
    return cfg


def _at_seed(plan: Plan, v: Variant, cfg: RunConfig, seed: int) -> RunConfig:
    return _checked(plan, v, replace(cfg, seed=seed), "seeds")

"""lm-eval integration: a `TemplateLM` adapter for benchctl checkpoints, bundled offline TinyStories tasks, and the
runner behind `benchctl eval` that stores every metric in results.db (`eval_results`).

Follows EleutherAI lm-evaluation-harness 0.4.13 (`lm_eval/models/huggingface.py` for the request handling).

    import benchctl.stages.eval.api, lm_eval   # importing the package registers the "benchctl" model with lm-eval
    lm_eval.simple_evaluate(model="benchctl", model_args="checkpoint=PATH,n_recur=14,batch_size=32,device=cpu", ...)

Modules:
- `adapter`  `BenchctlLM`, the checkpoint as an lm-eval language model (log-likelihoods, rolling windows,
             generation), seeded so that three-part's random initial state gives reproducible numbers.
- `tasks`    the bundled tasks: document generators (pure functions of the validation stories), their versions,
             the rendered task YAMLs, and the lm-eval TaskManager that finds them (and standard or user tasks).
- `engine`   `evaluate_runs`: every finished run x tasks through `lm_eval.simple_evaluate`, rows into results.db,
             with the hub-offline, quiet-output and RNG-preserving wrappers lm-eval needs.
- `options`  `EvalOptions`, what one `benchctl eval` decides (checked when built), and the bundled task names.
- `summary`  the closing tables of `benchctl eval`.
"""

from __future__ import annotations

from benchctl.stages.eval.adapter import DEFAULT_SEED, BenchctlLM  # noqa: E402
from benchctl.stages.eval.engine import (  # noqa: E402
    BOOTSTRAP_ITERS,
    HUB_PROBE_TIMEOUT,
    EvalSummary,
    allowed_recurrence,
    check_recurrence,
    evaluate_runs,
    hub_offline,
    hub_reachable,
    result_rows,
)
from benchctl.stages.eval.options import BUNDLED_TASKS, DEFAULT_BATCH_SIZE, DEFAULT_DOCS, EvalOptions  # noqa: E402
from benchctl.stages.eval.summary import summary_tables  # noqa: E402
from benchctl.stages.eval.tasks import (  # noqa: E402
    GENERATORS,
    NOT_CONTENT,
    NOT_NAMES,
    SWAP_WORDS,
    TASK_SEED,
    TASK_VERSIONS,
    TASKS_SUBDIR,
    TEMPLATES,
    BundledTasks,
    build_bundled_tasks,
    find_protagonist,
    last_sentence_split,
    make_ending_docs,
    make_names_docs,
    make_order_docs,
    make_ppl_docs,
    order_pairs,
    swap_words,
)

__all__ = [
    "BOOTSTRAP_ITERS",
    "BUNDLED_TASKS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_DOCS",
    "DEFAULT_SEED",
    "GENERATORS",
    "HUB_PROBE_TIMEOUT",
    "NOT_CONTENT",
    "NOT_NAMES",
    "SWAP_WORDS",
    "TASKS_SUBDIR",
    "TASK_SEED",
    "TASK_VERSIONS",
    "TEMPLATES",
    "BenchctlLM",
    "BundledTasks",
    "EvalOptions",
    "EvalSummary",
    "allowed_recurrence",
    "build_bundled_tasks",
    "check_recurrence",
    "evaluate_runs",
    "find_protagonist",
    "hub_offline",
    "hub_reachable",
    "last_sentence_split",
    "make_ending_docs",
    "make_names_docs",
    "make_order_docs",
    "make_ppl_docs",
    "order_pairs",
    "result_rows",
    "summary_tables",
    "swap_words",
]

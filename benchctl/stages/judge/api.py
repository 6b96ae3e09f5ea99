"""The judge: grade every generated story on grammar, creativity, consistency and plot (1 to 10 each).

The protocol is the TinyStories paper's GPT-4 grading, adapted to today's judges: the grading prompt is the study's
grading text, with the story shown as the paper shows it — the beginning, then `***`, then the model's completion —
and an instruction for the structured answer. Two answer protocols: `assess` (default; `judge_prompts/
story_grading_assess.md`) has the judge write the general assessment the text asks for, then the four grades, and
the assessment is stored with the grade; `json` (`judge_prompts/story_grading.md`) asks for the grades only.

Two backends: Gemini (google-genai), and any OpenAI-compatible server (the openai SDK; `--model openai:<name>`).

    prompt.py       the template and its version (the hash of the file), how a story is shown
    judges.py       which judge a --model names: backend, model, base URL, the name its grades are stored under
    client.py       shared by the backends: the answer's schema and strict parser, retries, the concurrent job
    gemini.py       the Gemini backend: key, request, errors, reading an answer
    openai_chat.py  the OpenAI-compatible backend: the same, for the chat-completions protocol
    storage.py      what is read from and written to results.db (the queries themselves are in tables.py)
    tables.py       the judge's tables (judge_requests, judge_grades) and the SQL that writes and reads them
    summary.py      per-architecture means with 95% t-intervals over samples, failures, tokens and cost
    engine.py       `judge_all`: the keys still to grade, sent concurrently, each answer stored as it arrives

    summary = judge_all(db, JudgeOptions(judge_model="openai:gpt-4.1-mini"), progress=Progress(enabled=True))
"""

from benchctl.stages.judge.client import (
    CHARS_PER_TOKEN,
    CRITERIA,
    OUTPUT_TOKENS_ESTIMATE,
    PRICES_USD_PER_M,
    SCORE_MAX,
    SCORE_MIN,
    AssessedGrade,
    Grade,
    Outcome,
    Usage,
    WorkItem,
    answer_schema,
    backoff_delay,
    estimate_cost,
    parse_answer,
    parse_grade,
    retry_after,
)
from benchctl.stages.judge.engine import has_key, judge_all, judge_all_async, require_key
from benchctl.stages.judge.gemini import API_KEY_VARS, api_key, has_api_key, require_api_key, server_retry_delay
from benchctl.stages.judge.judges import BACKENDS, JudgeSpec, default_thinking_budget, resolve
from benchctl.stages.judge.options import (
    AUTO,
    DEFAULT_MODEL,
    DEFAULT_PROTOCOL,
    DEFAULT_TEMPERATURE,
    PROTOCOLS,
    JudgeOptions,
)
from benchctl.stages.judge.prompt import (
    PROMPT_PATH,
    PROMPT_PATHS,
    STORY_SEPARATOR,
    STORY_SLOT,
    Template,
    format_story,
    load_template,
)
from benchctl.stages.judge.storage import select_samples
from benchctl.stages.judge.summary import ArchSummary, CriterionStat, JudgeSummary, criterion_stat

__all__ = [
    "API_KEY_VARS",
    "BACKENDS",
    "JudgeSpec",
    "has_key",
    "parse_answer",
    "require_key",
    "resolve",
    "retry_after",
    "AUTO",
    "DEFAULT_PROTOCOL",
    "PROTOCOLS",
    "PROMPT_PATHS",
    "AssessedGrade",
    "answer_schema",
    "CHARS_PER_TOKEN",
    "CRITERIA",
    "DEFAULT_MODEL",
    "DEFAULT_TEMPERATURE",
    "JudgeOptions",
    "OUTPUT_TOKENS_ESTIMATE",
    "PRICES_USD_PER_M",
    "PROMPT_PATH",
    "SCORE_MAX",
    "SCORE_MIN",
    "STORY_SEPARATOR",
    "STORY_SLOT",
    "ArchSummary",
    "CriterionStat",
    "Grade",
    "JudgeSummary",
    "Outcome",
    "Template",
    "Usage",
    "WorkItem",
    "api_key",
    "backoff_delay",
    "criterion_stat",
    "default_thinking_budget",
    "estimate_cost",
    "format_story",
    "has_api_key",
    "judge_all",
    "judge_all_async",
    "load_template",
    "parse_grade",
    "require_api_key",
    "select_samples",
    "server_retry_delay",
]

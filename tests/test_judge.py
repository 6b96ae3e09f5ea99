"""Tests of the Gemini judge against a local server that speaks the Gemini REST protocol (tests/fake_gemini.py).

The real google-genai client talks to the fake server over HTTP; nothing touches the internet. Retry delays are made
tiny (base_delay 0.01 s) so that any wait longer than that comes from the server's own retryDelay.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import math
import re
import socket
import threading
import time
from pathlib import Path

import fake_gemini as fg  # tests/ is on sys.path under pytest (no package __init__)
import pytest
from scipy import stats as sps
from typer.testing import CliRunner

from benchctl import stages
from benchctl.cli import main
from benchctl.core.config import make_config
from benchctl.core.errors import ConfigError, JudgeError
from benchctl.stages import RunSelection
from benchctl.stages.judge import api as judge

# The shipped grading prompt's version. Every stored grade carries it, so an edit to the prompt file starts a new set
# of grades; change this only together with a deliberate change of the prompt.
PROMPT_HASH = "e7a999193150"
# google-genai 3.4 subclasses aiohttp.ClientSession, which aiohttp 3.14 flags; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")


def judge_all(db, *, progress=True, run_ids=None, **options):
    """`judge_all` with its options as keywords, the run selection among them as on the command line."""
    return judge.judge_all(db, judge.JudgeOptions(select=RunSelection(run_ids=run_ids), **options), progress=progress)


FAST = dict(base_delay=0.01, max_delay=0.05, progress=False, seed=0, protocol="json")  # the assess tests override it
ARCHS = ("control", "frailt")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in (
        "GEMINI_API_KEY",
        "GOOGLE_API_KEY",
        "GOOGLE_GEMINI_BASE_URL",
        "GOOGLE_GENAI_API_VERSION",
        "GOOGLE_GENAI_USE_VERTEXAI",
        "GOOGLE_GENAI_USE_ENTERPRISE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GEMINI_API_KEY", "test-key")


@pytest.fixture
def server():
    with fg.FakeGemini() as s:
        yield s


def make_db(path: Path, n_prompts: int = 3, archs=ARCHS):
    """results.db with one run per architecture, `n_prompts` prompts and one sample per (run, prompt)."""
    db = stages.connect(path)
    with db.conn:
        for i in range(n_prompts):
            text = f"Once upon a time, {i} cats met."
            db["prompts"].insert({"id": f"ps1:{i}", "prompt_set": "ps1", "idx": i, "text": text})
        for arch in archs:
            run = f"run-{arch}"
            db["runs"].insert(
                {
                    "id": run,
                    "arch": arch,
                    "preset": "tiny",
                    "seed": 0,
                    "status": "done",
                    "config_json": make_config("tiny", arch).to_json(),
                }
            )
            for i in range(n_prompts):
                db["samples"].insert(
                    {
                        "id": f"s-{arch}-{i}",
                        "run_id": run,
                        "prompt_id": f"ps1:{i}",
                        "completion": f" The {arch} cat number {i} was happy. The end.",
                    }
                )
    return db


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers: a hung judge server. It reads and
    writes nothing until closed, so a client waits for as long as its read timeout lets it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:  # the 0.1 s poll, or the socket closed
                continue

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for c in [*self.held, self.sock]:
            c.close()


class UnacceptingServer:
    """A port on 127.0.0.1 whose accept queue is full: a new connection is never accepted (Linux drops its SYN), as
    with a host that is down behind a firewall. A client waits for as long as its connect timeout lets it."""

    def __enter__(self) -> UnacceptingServer:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port = int(self.sock.getsockname()[1])
        self.filler = socket.create_connection(("127.0.0.1", self.port))  # the one connection the queue holds
        return self

    def __exit__(self, *exc) -> None:
        self.filler.close()
        self.sock.close()


def this_machine_by_name() -> tuple[str, str]:
    """(this machine's host name, the address it resolves to): a URL with the name names no loopback address, so the
    key check treats it as another machine, while a test server listening on the address still answers it."""
    name = socket.gethostname()
    return name, socket.gethostbyname(name)


def grades(db, status=None):
    sql = "select * from judge_grades" + (" where status = ?" if status else "") + " order by sample_id, repeat"
    return list(db.query(sql, [status] if status else []))


def tokens(row):
    return row["prompt_tokens"], row["output_tokens"], row["thinking_tokens"], row["total_tokens"]


# ------------------------------------------------------------------------------------------------------------------
# The prompt template and parsing (pure).


def test_template_is_the_pinned_study_prompt_with_one_story_slot():
    t = judge.load_template()
    raw = judge.PROMPT_PATH.read_bytes()
    assert t.hash == hashlib.sha256(raw).hexdigest()[:12] == PROMPT_HASH
    assert t.text.count("{story}") == 1
    assert t.text.startswith("In the following exercise, the student is given a task of writing a short story.")
    assert "***" in t.text[t.text.index("each on a scale from 1 to 10.") :]  # the appended part explains the separator
    for c in judge.CRITERIA:
        assert f'"{c}"' in t.text
    filled = t.fill("Tom had a {red} ball.", " He lost it.")
    assert "Tom had a {red} ball. *** He lost it." in filled  # braces in stories survive


def test_template_without_slot_is_a_config_error(tmp_path):
    p = tmp_path / "t.md"
    p.write_text("no slot here")
    with pytest.raises(ConfigError, match=r"\{story\}"):
        judge.load_template(p)


@pytest.mark.parametrize(
    "text, finish, block, why",
    [
        ('{"grammar": 7, "creativity": 6, "consistency": 5, "plot": 4}', "STOP", None, None),
        ('{"grammar": 7, "creativity": 6, "consistency": 5, "plot": 4', "STOP", None, "unparseable JSON"),
        ('{"grammar": 7, "creativity": 6, "consistency": 5, "plot": 4}', "MAX_TOKENS", None, "MAX_TOKENS"),
        ('{"grammar": 7, "creativity": 6, "consistency": 5}', "STOP", None, "missing field(s): plot"),
        ('{"grammar": 11, "creativity": 6, "consistency": 5, "plot": 4}', "STOP", None, "grammar=11 out of range"),
        ('{"grammar": 0, "creativity": 6, "consistency": 5, "plot": 4}', "STOP", None, "grammar=0 out of range"),
        ('{"grammar": 7.5, "creativity": 6, "consistency": 5, "plot": 4}', "STOP", None, "not an integer"),
        ('{"grammar": "7", "creativity": 6, "consistency": 5, "plot": 4}', "STOP", None, "not an integer"),
        ('{"grammar": true, "creativity": 6, "consistency": 5, "plot": 4}', "STOP", None, "not an integer"),
        ("[7, 6, 5, 4]", "STOP", None, "not an object"),
        ("", "STOP", None, "empty"),
        (None, "SAFETY", None, "finishReason SAFETY"),
        (None, None, "PROHIBITED_CONTENT", "blockReason PROHIBITED_CONTENT"),
    ],
)
def test_parse_grade_never_turns_a_bad_answer_into_a_score(text, finish, block, why):
    g, err = judge.parse_grade(text, finish, block)
    if why is None:
        assert err is None and (g.grammar, g.creativity, g.consistency, g.plot) == (7, 6, 5, 4) and g.average == 5.5
    else:
        assert g is None and why in err


def test_criterion_stat_is_a_t_interval_and_refuses_n_below_2():
    vals = [3.0, 4.0, 6.0, 5.5]
    s = judge.criterion_stat(vals)
    lo, hi = sps.t.interval(0.95, len(vals) - 1, loc=sum(vals) / 4, scale=sps.sem(vals))
    assert s.mean == pytest.approx(4.625) and s.ci_low == pytest.approx(lo) and s.ci_high == pytest.approx(hi)
    one = judge.criterion_stat([4.0])
    assert one.mean == 4.0 and one.ci_low is None and one.ci_high is None


def test_prices():
    assert judge.estimate_cost("gemini-2.5-flash", 1_000_000, 1_000_000) == pytest.approx(2.80)
    assert judge.estimate_cost("models/gemini-2.5-pro", 2_000_000, 0) == pytest.approx(2.50)
    assert judge.estimate_cost("gemini-9-ultra", 100, 100) is None


def test_retry_delay_is_read_from_retry_info():
    from google.genai import errors

    body = {
        "error": {
            "code": 429,
            "status": "RESOURCE_EXHAUSTED",
            "message": "quota",
            "details": [
                {"@type": "type.googleapis.com/google.rpc.QuotaFailure"},
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "17.5s"},
            ],
        }
    }
    assert judge.server_retry_delay(errors.ClientError(429, body)) == 17.5
    assert judge.server_retry_delay(errors.ServerError(503, {"error": {"code": 503}})) is None


# ------------------------------------------------------------------------------------------------------------------
# Against the fake server, with the real client.


def test_grades_are_stored_with_prompt_hash_tokens_and_the_request(tmp_path, server):
    db = make_db(tmp_path / "r.db")
    summary = judge_all(db, judge_model="gemini-2.5-flash", base_url=server.url, **FAST)

    assert server.count == 6 and summary.n_ok == 6 and summary.n_failed == 0 and summary.n_requests == 6
    req = server.requests[0]
    # What google-genai 3.4 sends: /v1/models/{model}:generateContent, key in x-goog-api-key, camelCase config.
    assert req.api_version == "v1" and req.model == "gemini-2.5-flash"
    assert req.headers["x-goog-api-key"] == "test-key"
    gc = req.generation_config
    assert gc["responseMimeType"] == "application/json" and gc["temperature"] == 0.0
    assert set(gc["responseSchema"]["required"]) == set(judge.CRITERIA)
    assert gc["responseSchema"]["properties"]["plot"]["maximum"] == 10
    assert gc["thinkingConfig"] in ({"thinkingBudget": 0}, {"thinking_budget": 0})

    t = judge.load_template()
    rows = grades(db)
    assert len(rows) == 6
    by_prompt = {r.prompt: r for r in server.requests}
    for row in rows:
        sample = db["samples"].get(row["sample_id"])
        beginning = db["prompts"].get(sample["prompt_id"])["text"]
        prompt = t.fill(beginning, sample["completion"])
        assert f"{beginning} *** {sample['completion'].strip()}" in prompt
        expected = json.loads(fg.default_grade(by_prompt[prompt]).body["candidates"][0]["content"]["parts"][0]["text"])
        assert {c: row[c] for c in judge.CRITERIA} == expected
        assert row["average"] == pytest.approx(sum(expected.values()) / 4)
        assert row["status"] == "ok" and row["prompt_hash"] == t.hash and row["finish_reason"] == "STOP"
        assert tokens(row) == (180, 24, 0, 204)
    reqs = list(db.query("select * from judge_requests"))
    assert len(reqs) == 6
    r0 = reqs[0]
    assert r0["key"] == f"gemini-2.5-flash|{t.hash}|{r0['sample_id']}|0"
    assert r0["http_status"] == 200 and r0["attempts"] == 1 and r0["thinking_budget"] == 0 and r0["temperature"] == 0.0
    assert json.loads(r0["request_json"])["contents"].startswith("In the following exercise")
    assert json.loads(r0["response_json"])["usage_metadata"]["total_token_count"] == 204
    assert summary.usage.prompt_tokens == 6 * 180 and summary.usage.output_tokens == 6 * 24
    assert summary.cost_usd == pytest.approx((6 * 180 * 0.30 + 6 * 24 * 2.50) / 1e6)
    # Per-architecture table: 3 samples each, a t-interval around the mean.
    assert [a.arch for a in summary.per_arch] == list(ARCHS)
    for a in summary.per_arch:
        assert a.n_samples == 3 and a.n_failed == 0 and a.n_pending == 0
        vals = [r["average"] for r in rows if r["sample_id"].startswith(f"s-{a.arch}-")]
        assert a.stats["average"].mean == pytest.approx(sum(vals) / 3)
        assert a.stats["average"].ci_low < a.stats["average"].mean < a.stats["average"].ci_high


def test_thinking_tokens_are_counted_and_priced_as_output(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    server.push(fg.grade(prompt_tokens=100, output_tokens=20, thinking_tokens=300))
    s = judge_all(db, judge_model="gemini-2.5-pro", base_url=server.url, **FAST)
    row = grades(db)[0]
    assert tokens(row) == (100, 20, 300, 420)
    assert s.cost_usd == pytest.approx((100 * 1.25 + 320 * 10.0) / 1e6)
    assert "thinkingConfig" not in server.requests[0].generation_config  # 2.5-pro keeps its default thinking


def test_429_with_retry_delay_is_honoured_then_succeeds(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    server.push(fg.rate_limited("0.3s"))
    t0 = time.monotonic()
    s = judge_all(db, base_url=server.url, **FAST)
    assert time.monotonic() - t0 >= 0.3
    assert server.count == 2 and s.n_ok == 1 and s.n_requests == 2
    gap = server.requests[1].received_at - server.requests[0].received_at
    assert gap >= 0.3  # the server's delay, not the 0.01 s backoff
    req = next(db.query("select * from judge_requests"))
    assert req["attempts"] == 2 and req["status"] == "ok" and req["http_status"] == 200


def test_repeated_500s_are_recorded_as_a_failure(tmp_path):
    with fg.FakeGemini(script=lambda r: fg.server_error(500)) as server:
        db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
        s = judge_all(db, base_url=server.url, max_attempts=4, **FAST)
        assert server.count == 4
    assert s.n_failed == 1 and s.n_ok == 0
    assert "gave up after 4 attempts" in s.failures[0]["error"] and "500" in s.failures[0]["error"]
    row = grades(db)[0]
    assert row["status"] == "failed" and row["grammar"] is None and row["average"] is None and "500" in row["error"]
    req = next(db.query("select * from judge_requests"))
    assert req["http_status"] == 500 and req["attempts"] == 4
    assert json.loads(req["response_json"])["error"]["status"] == "INTERNAL"
    assert s.per_arch[0].n_failed == 1 and s.per_arch[0].n_samples == 0
    assert s.per_arch[0].stats["average"].mean is None


HTML_PAGE = "<html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1></body></html>"


@pytest.mark.parametrize("status", [502, 200, 500])
def test_a_body_labelled_json_that_is_not_is_stored_as_a_failed_grade(tmp_path, status):
    """A proxy's HTML error page sent as application/json: an error status is read as any error's (a 5xx retried,
    the page kept as its message), a 200 whose body is not JSON is retried too; then stored as a failure, never a
    crash."""
    with fg.FakeGemini(script=lambda r: fg.Reply(status, HTML_PAGE)) as server:
        db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
        s = judge_all(db, base_url=server.url, max_attempts=3, **FAST)
        assert server.count == 3
    assert s.n_failed == 1 and s.n_ok == 0
    row = grades(db)[0]
    assert row["status"] == "failed" and row["average"] is None
    assert (
        "not JSON" in row["error"]
        if status == 200
        else f"HTTP {status}" in row["error"] and "Bad Gateway" in row["error"]
    )


def test_an_html_401_refuses_the_job_as_a_json_one_does(tmp_path):
    with fg.FakeGemini(script=lambda r: fg.Reply(401, HTML_PAGE)) as server:
        db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
        with pytest.raises(JudgeError, match=r"refused the job \(HTTP 401"):
            judge_all(db, base_url=server.url, max_attempts=3, **FAST)
        assert server.count == 1
    assert grades(db)[0]["status"] == "failed"


def test_a_non_json_body_then_an_answer_is_graded(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    server.push(fg.Reply(502, HTML_PAGE))
    s = judge_all(db, base_url=server.url, **FAST)
    assert server.count == 2 and s.n_ok == 1 and s.n_failed == 0


def test_other_4xx_fail_at_once(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    server.push(fg.error(400, "INVALID_ARGUMENT", "Request contains an invalid argument."))
    s = judge_all(db, base_url=server.url, **FAST)
    assert server.count == 1 and s.n_failed == 1 and "400" in grades(db)[0]["error"]


def test_connection_dropped_is_retried(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    server.push(fg.Reply(drop=True))
    s = judge_all(db, base_url=server.url, **FAST)
    assert server.count == 2 and s.n_ok == 1


@pytest.mark.parametrize(
    "reply, finish, raw, why",
    [
        (fg.text('{"grammar": 7, "creativity": six}'), "STOP", '{"grammar": 7, "creativity": six}', "unparseable JSON"),
        (
            fg.text('{"grammar": 7, "creativity": 6, "consis', finish_reason="MAX_TOKENS"),
            "MAX_TOKENS",
            '{"grammar": 7, "creativity": 6, "consis',
            "truncated",
        ),
        (fg.grade(7, 6, 5, 12), "STOP", None, "plot=12 out of range"),
        (fg.grade(7, 6, 5, 0), "STOP", None, "plot=0 out of range"),
        (fg.text('{"grammar": 7, "creativity": 6, "consistency": 5}'), "STOP", None, "missing field(s): plot"),
        (fg.blocked("SAFETY"), None, None, "blockReason SAFETY"),
        (fg.text("", finish_reason="SAFETY"), "SAFETY", None, "finishReason SAFETY"),
    ],
    ids=["invalid-json", "truncated", "above-range", "below-range", "missing-field", "prompt-blocked", "safety-stop"],
)
def test_bad_answers_are_stored_as_failures_with_raw_text_never_as_scores(tmp_path, server, reply, finish, raw, why):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    server.push(reply)
    s = judge_all(db, base_url=server.url, **FAST)
    assert server.count == 1  # a bad answer is not retried within the run (it was paid for)
    row = grades(db)[0]
    assert row["status"] == "failed" and why in row["error"]
    assert all(row[c] is None for c in (*judge.CRITERIA, "average"))
    assert row["finish_reason"] == finish
    if raw is not None:
        assert row["raw_text"] == raw
    assert row["prompt_tokens"] == 180  # still counted: failures cost tokens too
    assert s.n_failed == 1 and s.usage.prompt_tokens == 180


def test_second_run_sends_nothing_and_failed_grades_are_retried(tmp_path, server):
    db = make_db(tmp_path / "r.db")
    server.push(fg.text("not json"))
    first = judge_all(db, base_url=server.url, **FAST)
    assert first.n_ok == 5 and first.n_failed == 1 and server.count == 6
    second = judge_all(db, base_url=server.url, **FAST)
    assert server.count == 7 and second.n_cached == 5 and second.n_todo == 1 and second.n_ok == 1
    third = judge_all(db, base_url=server.url, **FAST)
    assert server.count == 7 and third.n_requests == 0 and third.n_cached == 6
    assert len(grades(db, "ok")) == 6 and len(grades(db)) == 6
    # the failed answer's tokens are kept: the retried key was billed twice
    failed_key = next(db.query("select * from judge_requests where attempts = 2"))
    assert failed_key["prompt_tokens"] == 360
    assert third.usage_total.prompt_tokens == 7 * 180 and third.usage.prompt_tokens == 0


def test_skip_failed_keeps_stored_failures(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    server.push(fg.text("not json"))
    judge_all(db, base_url=server.url, **FAST)
    s = judge_all(db, base_url=server.url, retry_failed=False, **FAST)
    assert server.count == 1 and s.n_todo == 0 and s.per_arch[0].n_failed == 1


def test_repeats_and_limit(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=3)
    s = judge_all(db, base_url=server.url, repeats=2, limit=4, **FAST)
    assert server.count == 8 and s.n_samples == 4 and s.n_keys == 8
    rows = grades(db)
    # limit takes the first prompts of every run, not all of one run
    assert {r["sample_id"] for r in rows} == {"s-control-0", "s-control-1", "s-frailt-0", "s-frailt-1"}
    assert sorted({r["repeat"] for r in rows}) == [0, 1]
    s2 = judge_all(db, base_url=server.url, repeats=2, run_ids=["run-frailt"], **FAST)
    assert server.count == 10 and s2.n_cached == 4 and [a.arch for a in s2.per_arch] == ["frailt"]


def test_interrupted_run_resumes_without_duplicates(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=4)  # 8 samples
    release = threading.Event()
    for _ in range(3):
        server.push(fg.grade())
    server.push(*(fg.Reply(hang=release) for _ in range(5)))

    async def interrupt():
        opts = judge.JudgeOptions(
            base_url=server.url, concurrency=1, base_delay=0.01, max_delay=0.05, seed=0, protocol="json"
        )
        task = asyncio.create_task(judge.judge_all_async(db, opts, progress=False))
        while server.count < 4:  # three answered, the fourth hangs
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()  # what Ctrl-C does to asyncio.run
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupt())
    release.set()
    assert len(grades(db)) == 3 and server.count == 4
    with server._lock:
        server._queue.clear()
    s = judge_all(db, base_url=server.url, concurrency=3, **FAST)
    assert s.n_cached == 3 and s.n_todo == 5 and server.count == 4 + 5
    rows = grades(db)
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
    keys = list(db.query("select key, count(*) as n from judge_requests group by key"))
    assert len(keys) == 8 and all(k["n"] == 1 for k in keys)


def test_rate_limited_run_picks_up_where_it_stopped(tmp_path):
    # The service starts refusing after 3 requests (503 with no end in sight): the run records failures, the rerun
    # with a healthy service grades exactly those.
    state = {"n": 0}
    lock = threading.Lock()

    def flaky(req):
        with lock:
            state["n"] += 1
            return fg.default_grade(req) if state["n"] <= 3 else fg.rate_limited(retry_delay=None)

    db = make_db(tmp_path / "r.db")
    with fg.FakeGemini(script=flaky) as server:
        s1 = judge_all(db, base_url=server.url, concurrency=1, max_attempts=2, **FAST)
        assert s1.n_ok == 3 and s1.n_failed == 3 and server.count == 3 + 3 * 2
    with fg.FakeGemini() as server:
        s2 = judge_all(db, base_url=server.url, **FAST)
        assert server.count == 3 and s2.n_ok == 3 and s2.n_cached == 3
    assert len(grades(db, "ok")) == 6 and len(grades(db)) == 6


def test_concurrency_never_exceeds_the_limit(tmp_path):
    db = make_db(tmp_path / "r.db", n_prompts=6)  # 12 requests
    with fg.FakeGemini(latency=0.1) as server:
        s = judge_all(db, base_url=server.url, concurrency=3, **FAST)
        assert server.count == 12 and s.n_ok == 12
        assert server.max_in_flight == 3  # reached, never exceeded


def test_progress_is_reported_through_the_given_reporter(tmp_path, server):
    from benchctl.core.progress import Progress

    out = io.StringIO()
    reporter = Progress(enabled=True, interactive=False, stream=out, interval=0.0)
    db = make_db(tmp_path / "r.db", n_prompts=2)
    server.push(fg.text("not json"))
    s = judge_all(db, base_url=server.url, **{**FAST, "progress": reporter}, concurrency=1)
    lines = out.getvalue().splitlines()
    assert s.n_ok == 3 and s.n_failed == 1
    assert lines[0].startswith("gemini-2.5-flash judging: 0/4") and "ok 0 failed 0" in lines[0]
    assert lines[-1].startswith("gemini-2.5-flash judging: 4/4 (100%)") and "ok 3 failed 1" in lines[-1]
    assert not reporter._tasks  # the job closed its task; the reporter stays usable for the next stage


def test_missing_key_is_a_clean_error_before_any_request(tmp_path, server, monkeypatch):
    monkeypatch.delenv("GEMINI_API_KEY")
    db = make_db(tmp_path / "r.db")
    assert not judge.has_api_key()
    with pytest.raises(JudgeError, match="GEMINI_API_KEY.*GOOGLE_API_KEY"):
        judge_all(db, base_url=server.url, **FAST)
    assert server.count == 0 and grades(db) == []
    monkeypatch.setenv("GOOGLE_API_KEY", "test-key")
    assert judge.has_api_key()
    judge_all(db, base_url=server.url, **FAST)
    assert server.count == 6


def test_invalid_key_stops_the_job(tmp_path, server, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", "wrong-key")
    db = make_db(tmp_path / "r.db", n_prompts=5)
    with pytest.raises(JudgeError, match="refused the job.*API key not valid"):
        judge_all(db, base_url=server.url, concurrency=2, **FAST)
    assert server.count <= 2  # the ones already in flight; nothing after the refusal


def test_dry_run_sends_nothing_and_needs_no_key(tmp_path, server, monkeypatch):
    monkeypatch.delenv("GEMINI_API_KEY")
    db = make_db(tmp_path / "r.db")
    s = judge_all(db, base_url=server.url, dry_run=True, repeats=2, **FAST)
    assert server.count == 0 and grades(db) == []
    assert s.n_todo == 12 and s.n_requests == 0
    t = judge.load_template()
    expect = (
        sum(
            math.ceil(len(t.fill(p["text"], smp["completion"])) / 4)
            for smp in db["samples"].rows
            for p in [db["prompts"].get(smp["prompt_id"])]
        )
        * 2
    )
    assert s.estimated_prompt_tokens == expect
    assert s.estimated_output_tokens == 12 * judge.OUTPUT_TOKENS_ESTIMATE
    assert s.estimated_cost_usd == pytest.approx((expect * 0.30 + 12 * 40 * 2.50) / 1e6)
    assert any("estimate" in n for n in s.notes)


def test_options_select_runs_and_name_the_bad_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("GEMINI_API_KEY")
    db = make_db(tmp_path / "r.db")
    assert judge_all(db, dry_run=True, progress=False).n_samples == 6
    frailt = judge.JudgeOptions(select=RunSelection(archs=["frailt"]), dry_run=True)
    assert judge.judge_all(db, frailt, progress=False).n_samples == 3
    with pytest.raises(JudgeError, match="no samples to judge"):  # the runs are of preset tiny
        judge.judge_all(db, judge.JudgeOptions(select=RunSelection(preset="paper"), dry_run=True), progress=False)
    for bad, flag in (
        ({"concurrency": 0}, "--concurrency"),
        ({"repeats": 0}, "--repeats"),
        ({"limit": 0}, "--limit"),
        ({"max_attempts": 0}, "--max-attempts"),
        ({"protocol": "essay"}, "--protocol"),
        ({"judge_model": " "}, "--model"),
    ):
        with pytest.raises(ConfigError, match=flag):
            judge.JudgeOptions(**bad)


def test_unknown_model_has_no_cost(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    s = judge_all(db, judge_model="gemini-test-model", base_url=server.url, **FAST)
    assert server.requests[0].model == "gemini-test-model" and s.n_ok == 1
    assert s.cost_usd is None and s.cost_total_usd is None and any("no price" in n for n in s.notes)


def test_no_samples_and_unknown_runs_are_user_errors(tmp_path, server):
    db = stages.connect(tmp_path / "empty.db")
    with pytest.raises(JudgeError, match="benchctl sample"):
        judge_all(db, base_url=server.url, **FAST)
    db = make_db(tmp_path / "r.db")
    with pytest.raises(ConfigError, match="unknown run id"):
        judge_all(db, base_url=server.url, run_ids=["nope"], **FAST)
    assert server.count == 0


def test_cli_judges_through_the_base_url_env(tmp_path, server, monkeypatch):
    from benchctl.cli import app

    path = tmp_path / "r.db"
    make_db(path)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", server.url)
    runner = CliRunner()
    res = runner.invoke(app, ["judge", "--model", "gemini-2.5-flash", "--db", str(path), "--concurrency", "2"])
    assert res.exit_code == 0, res.output
    assert server.count == 6
    assert "judge grades per model" in res.output and "control" in res.output and "frailt" in res.output
    assert "6 graded, 0 failed" in res.output
    db = stages.connect(path)
    assert len(grades(db, "ok")) == 6
    res = runner.invoke(app, ["judge", "--db", str(path), "--dry-run"])
    assert res.exit_code == 0 and "0 request(s) would be sent" in res.output and server.count == 6
    monkeypatch.delenv("GEMINI_API_KEY")
    res = runner.invoke(app, ["judge", "--db", str(path)])
    assert isinstance(res.exception, JudgeError) and server.count == 6


def test_summary_averages_repeats_per_sample_then_takes_a_t_interval_over_samples(tmp_path):
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def scripted(req):
        # grammar = prompt number + 1 on the first repeat, + 3 on the second; the rest fixed
        i = int(re.search(r"cat number (\d)", req.prompt).group(1))
        with lock:
            k = seen[req.prompt] = seen.get(req.prompt, 0) + 1
        return fg.grade(i + (1 if k == 1 else 3), 5, 5, 5)

    db = make_db(tmp_path / "r.db", n_prompts=4, archs=("control",))
    with db.conn:  # a run of another preset is reported apart, labelled with its preset
        db["runs"].insert(
            {
                "id": "run-small",
                "arch": "control",
                "preset": "small",
                "seed": 0,
                "status": "done",
                "config_json": make_config("small", "control").to_json(),
            }
        )
        db["samples"].insert(
            {
                "id": "s-small-0",
                "run_id": "run-small",
                "prompt_id": "ps1:0",
                "completion": " The small cat number 0 was happy.",
            }
        )
    with fg.FakeGemini(script=scripted) as server:
        s = judge_all(db, base_url=server.url, repeats=2, **FAST)
        assert server.count == 10
    assert [a.label for a in s.per_arch] == ["control (small)", "control (tiny)"]
    tiny = s.per_arch[1]
    per_sample = [i + 2 for i in range(4)]  # mean of (i+1, i+3)
    lo, hi = sps.t.interval(0.95, 3, loc=sum(per_sample) / 4, scale=sps.sem(per_sample))
    g = tiny.stats["grammar"]
    assert tiny.n_samples == 4 and tiny.n_grades == 8
    assert g.mean == pytest.approx(3.5) and g.ci_low == pytest.approx(lo) and g.ci_high == pytest.approx(hi)
    assert tiny.stats["plot"].ci_low == pytest.approx(5.0)  # no spread, zero-width interval
    small = s.per_arch[0]
    assert small.n_samples == 1 and small.stats["grammar"].mean == 2.0 and small.stats["grammar"].ci_low is None


def test_cached_grades_made_with_other_settings_are_flagged(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    judge_all(db, base_url=server.url, **FAST)
    s = judge_all(db, base_url=server.url, temperature=0.7, **FAST)
    assert server.count == 1 and s.n_requests == 0  # the key is (model, prompt hash, sample, repeat): not regraded
    assert any("another temperature" in n for n in s.notes)


def test_cli_json_summary(tmp_path, server, monkeypatch):
    from benchctl.cli import app

    path = tmp_path / "r.db"
    make_db(path)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", server.url)
    res = CliRunner().invoke(app, ["judge", "--db", str(path), "--runs", "run-control", "--repeats", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["n_ok"] == 6 and out["n_requests"] == 6 and out["usage"]["prompt_tokens"] == 6 * 180
    assert [a["arch"] for a in out["per_arch"]] == ["control"] and out["per_arch"][0]["n_grades"] == 6


# ------------------------------------------------------------------------------------------------------------------
# The assess protocol: the judge writes its general assessment first, and it is stored with the grade.

ASSESS = {**FAST, "protocol": "assess"}


def test_assess_template_hashes_the_protocol_with_the_file():
    raw = judge.PROMPT_PATHS["assess"].read_bytes()
    t = judge.load_template(protocol="assess")
    assert t.hash == hashlib.sha256(b"protocol: assess\n" + raw).hexdigest()[:12] and t.protocol == "assess"
    assert '"assessment"' in t.text and t.text.count("{story}") == 1
    # one file under both protocols: two prompt versions, so neither protocol's cache answers the other
    assert judge.load_template(judge.PROMPT_PATH, "assess").hash != judge.load_template(judge.PROMPT_PATH).hash
    with pytest.raises(ConfigError, match="protocol"):
        judge.load_template(protocol="essay")


@pytest.mark.parametrize(
    "obj,why",
    [
        ({"grammar": 7, "creativity": 6, "consistency": 5, "plot": 4}, "no assessment"),
        ({"assessment": "  ", "grammar": 7, "creativity": 6, "consistency": 5, "plot": 4}, "not a non-empty text"),
        ({"assessment": 3, "grammar": 7, "creativity": 6, "consistency": 5, "plot": 4}, "not a non-empty text"),
        ({"assessment": "Fine.", "grammar": 11, "creativity": 6, "consistency": 5, "plot": 4}, "out of range"),
    ],
)
def test_parse_assess_needs_an_assessment_and_valid_grades(obj, why):
    grade, err = judge.parse_grade(json.dumps(obj), "STOP", None, "assess")
    assert grade is None and why in err


def test_assess_stores_assessments_and_is_cached_apart_from_json(tmp_path, server):
    db = make_db(tmp_path / "r.db")
    s = judge_all(db, judge_model="gemini-2.5-flash", base_url=server.url, **ASSESS)
    assert s.n_ok == 6 and s.protocol == "assess" and server.count == 6
    gc = server.requests[0].generation_config
    assert server.requests[0].schema_fields[0] == "assessment"  # written before the grades
    assert gc["maxOutputTokens"] == 2048 and gc["responseSchema"]["properties"]["assessment"]["type"] == "STRING"
    t = judge.load_template(protocol="assess")
    rows = grades(db, "ok")
    assert len(rows) == 6
    for row in rows:
        assert row["protocol"] == "assess" and row["prompt_hash"] == t.hash
        assert row["assessment"].startswith("Assessment ") and f"plot {row['plot']}." in row["assessment"]
    assert {r["protocol"] for r in db.query("select protocol from judge_requests")} == {"assess"}
    # the json protocol is graded again, never answered from the assess cache; and a rerun of assess sends nothing
    j = judge_all(db, judge_model="gemini-2.5-flash", base_url=server.url, **FAST)
    assert j.n_cached == 0 and j.n_ok == 6 and server.count == 12
    assert {(r["protocol"], r["assessment"]) for r in grades(db) if r["prompt_hash"] == PROMPT_HASH} == {("json", None)}
    again = judge_all(db, judge_model="gemini-2.5-flash", base_url=server.url, **ASSESS)
    assert again.n_cached == 6 and server.count == 12


def test_assess_survives_errors_and_bad_answers_without_losing_or_inventing_grades(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=3, archs=("control",))
    server.push(
        fg.rate_limited("0.01s"),
        fg.server_error(503),  # retried within the key
        fg.text('{"assessment": "A nice sto', finish_reason="MAX_TOKENS"),  # truncated mid-assessment
        fg.text("I think this story is lovely. 7/10"),  # not JSON
        fg.grade(),  # grades but no assessment: the protocol was not followed
    )
    s = judge_all(db, judge_model="gemini-2.5-flash", base_url=server.url, concurrency=1, max_attempts=3, **ASSESS)
    assert s.n_ok + s.n_failed == 3 and s.n_failed == 3
    failed = grades(db, "failed")
    assert len(failed) == 3 and all(r["grammar"] is None and r["assessment"] is None for r in failed)
    assert sorted(r["error"].split(":")[0] for r in failed) == ["no assessment", "truncated", "unparseable JSON"]
    assert sum(r["attempts"] for r in db.query("select attempts from judge_requests")) == 5  # 429 and 503 retried
    rerun = judge_all(db, judge_model="gemini-2.5-flash", base_url=server.url, **ASSESS)
    assert rerun.n_ok == 3 and len(grades(db, "ok")) == 3 and not grades(db, "failed")
    assert all(r["assessment"] for r in grades(db, "ok"))


def test_cli_protocol_option(tmp_path, server, monkeypatch):
    from benchctl.cli import app

    path = tmp_path / "r.db"
    make_db(path)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", server.url)
    res = CliRunner().invoke(app, ["judge", "--db", str(path), "--protocol", "json", "--repeats", "2"])
    assert res.exit_code == 0, res.output
    assert "protocol json" in res.output and "12 graded, 0 failed" in res.output
    assert {r["protocol"] for r in grades(stages.connect(path))} == {"json"}
    res = CliRunner().invoke(app, ["judge", "--db", str(path), "--protocol", "essay"])
    assert isinstance(res.exception, ConfigError)


def test_per_model_rows_keep_a_plans_variants_of_one_architecture_apart():
    """control and control-16 are both `control` runs, but different models: their grades are never pooled."""
    from benchctl.stages.judge.summary import per_arch

    samples = [
        {"sample_id": f"{v}-{i}", "preset": "tiny", "arch": "control", "variant": v}
        for v in ("control-16", "control")
        for i in range(2)
    ]
    grade = {"grammar": 6, "creativity": 4, "consistency": 5, "plot": 5, "average": 5.0}
    grades = [
        {
            "sample_id": s["sample_id"],
            "repeat": 0,
            "status": "ok",
            **{k: (v + 2 if s["variant"] == "control-16" else v) for k, v in grade.items()},
        }
        for s in samples
    ]
    rows = per_arch(samples, grades, repeats=1)
    assert [(r.arch, r.label, r.n_samples) for r in rows] == [("control", "control", 2), ("control", "control-16", 2)]
    assert [r.stats["average"].mean for r in rows] == [5.0, 7.0]


# ------------------------------------------------------------------------------------------------------------------
# Where the key may go, and how long a call may wait.


def test_the_key_goes_over_plain_http_to_another_host_only_with_the_flag(tmp_path, capsys, monkeypatch):
    name, address = this_machine_by_name()
    path = tmp_path / "r.db"
    db = make_db(path, n_prompts=1)
    with fg.FakeGemini(bind=address) as server:  # it checks the key: a grade means the key arrived
        url = f"http://{name}:{server.port}"
        with pytest.raises(SystemExit) as info:
            main(["judge", "--db", str(path), "--base-url", url, "--no-progress"])
        err = capsys.readouterr().err
        assert info.value.code == JudgeError.exit_code == 6 and len(err.strip().splitlines()) == 1
        assert "refusing to send GEMINI_API_KEY in clear text" in err and "--allow-insecure-key" in err
        monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", url)  # the study's judge reads the variable: refused too
        with pytest.raises(JudgeError, match="refusing to send GEMINI_API_KEY"):
            judge_all(db, **FAST)
        assert server.count == 0 and grades(db) == []
        monkeypatch.delenv("GOOGLE_GEMINI_BASE_URL")
        with pytest.raises(SystemExit) as info:
            main(["judge", "--db", str(path), "--base-url", url, "--allow-insecure-key", "--no-progress"])
        assert info.value.code == 0 and server.count == 2
    assert [r["status"] for r in grades(db)] == ["ok", "ok"]


def test_a_server_that_never_answers_costs_the_read_timeout_per_attempt(tmp_path):
    db = make_db(tmp_path / "r.db", n_prompts=1)
    with SilentServer() as silent:
        started = time.monotonic()
        s = judge_all(
            db,
            base_url=f"http://127.0.0.1:{silent.port}",
            connect_timeout_s=5,
            read_timeout_s=0.3,
            max_attempts=2,
            **FAST,
        )
        elapsed = time.monotonic() - started
    assert s.n_failed == 2 and s.n_ok == 0 and elapsed < 15  # not 2 x 120 s
    assert all("gave up after 2 attempts" in r["error"] and "Timeout" in r["error"] for r in grades(db))


def test_a_host_that_never_accepts_costs_the_connect_timeout_not_the_read_timeout(tmp_path):
    db = make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))
    with UnacceptingServer() as closed:
        started = time.monotonic()
        s = judge_all(
            db,
            base_url=f"http://127.0.0.1:{closed.port}",
            connect_timeout_s=0.3,
            read_timeout_s=600,
            max_attempts=2,
            **FAST,
        )
        elapsed = time.monotonic() - started
    assert s.n_failed == 1 and elapsed < 15 and "ConnectTimeout" in grades(db)[0]["error"]

"""Tests of the OpenAI-compatible judge against a local server that speaks the chat-completions protocol
(tests/fake_openai.py), with the real `openai` client over HTTP on 127.0.0.1; nothing touches the internet.

Each failure mode a real server shows — rate limits with Retry-After, 5xx, a truncated answer, a refusal, a body
that is not JSON, a server that ignores `response_format`, a connection refused — is stored as a failed grade (or
refuses the job in one line), never a score and never a traceback. The same samples graded by the fake Gemini server
and by this one are two judges, named fully, cached apart, and compared in the report.
"""

from __future__ import annotations

import json
import socket
import time

import fake_gemini as fg
import fake_openai as fo
import pytest
from test_judge import FAST as _FAST
from test_judge import SilentServer, UnacceptingServer, grades, make_db, this_machine_by_name, tokens
from typer.testing import CliRunner

from benchctl import stages
from benchctl.cli import main
from benchctl.core.errors import ConfigError, JudgeError
from benchctl.stages.judge import api as judge
from benchctl.stages.judge import judges

pytestmark = pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GEMINI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def server():
    with fo.FakeOpenAI() as s:
        yield s


FAST = {k: v for k, v in _FAST.items() if k != "progress"}  # JudgeOptions' fields only


def run(db, server_url, *, model="openai:fake-model", progress=False, **options):
    opts = judge.JudgeOptions(judge_model=model, base_url=server_url, **{**FAST, **options})
    return judge.judge_all(db, opts, progress=progress)


def name_at(server) -> str:
    return f"openai:fake-model@{server.host}/v1"


def one(tmp_path):
    return make_db(tmp_path / "r.db", n_prompts=1, archs=("control",))


# ------------------------------------------------------------------------------------------------------------------
# Naming a judge (pure).


def test_model_prefix_picks_the_backend_and_the_base_url_names_the_judge(monkeypatch):
    g = judges.resolve("gemini-2.5-flash", "http://127.0.0.1:9/")
    assert (g.backend, g.model, g.name, g.endpoint) == ("gemini", "gemini-2.5-flash", "gemini-2.5-flash", "127.0.0.1:9")
    assert judges.resolve("gemini:gemini-2.5-pro").name == "gemini-2.5-pro"
    assert judges.resolve("gemini-2.5-flash").endpoint == "generativelanguage.googleapis.com"
    o = judges.resolve("openai:gpt-4.1-mini")
    assert (o.backend, o.model, o.name, o.endpoint, o.official) == (
        "openai",
        "gpt-4.1-mini",
        "openai:gpt-4.1-mini",
        "api.openai.com/v1",
        True,
    )
    # a local server: its host is part of the name; credentials, query and fragment never are
    v = judges.resolve("openai:Qwen/Qwen3-8B", "http://user:secret@localhost:8000/v1/?token=abc#x")
    assert v.name == "openai:Qwen/Qwen3-8B@localhost:8000/v1" and not v.official and "secret" not in v.endpoint
    assert judges.resolve("openai:llama3.1:8b", "http://localhost:11434/v1").model == "llama3.1:8b"  # Ollama's tags
    monkeypatch.setenv("OPENAI_BASE_URL", "http://10.0.0.5:30000/v1")  # the SDK's own variable, followed
    assert judges.resolve("openai:m").name == "openai:m@10.0.0.5:30000/v1"
    for bad, needle in (
        ("anthropic:claude", "unknown judge backend 'anthropic'"),
        ("qwen3:8b", "openai:qwen3:8b"),
        ("openai:", "names no model"),
        ("  ", "--model"),
    ):
        with pytest.raises(ConfigError, match=needle):
            judges.resolve(bad)
    with pytest.raises(ConfigError, match="--base-url"):
        judges.resolve("openai:m", "localhost:8000/v1")


def test_prices_apply_only_to_the_service_that_charges_them():
    assert judge.estimate_cost("openai:gpt-4.1-mini", 1_000_000, 1_000_000) == pytest.approx(2.00)
    assert judge.estimate_cost("openai:gpt-4.1-mini@localhost:8000/v1", 1_000_000, 1_000_000) is None


def test_retry_after_reads_seconds_milliseconds_and_dates():
    assert judge.retry_after({"Retry-After": "2"}) == 2.0
    assert judge.retry_after({"retry-after-ms": "250", "Retry-After": "9"}) == 0.25
    later = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < judge.retry_after({"Retry-After": later}) <= 31
    assert judge.retry_after({"Retry-After": "soon"}) is None and judge.retry_after({}) is None


def test_the_schema_is_one_strict_structured_output_takes():
    from benchctl.stages.judge.openai_chat import json_schema

    for protocol in judge.PROTOCOLS:
        schema = json_schema(protocol)
        assert schema["additionalProperties"] is False and schema["required"] == list(schema["properties"])
        assert "minLength" not in json.dumps(schema)
        assert schema["properties"]["plot"]["minimum"] == 1 and schema["properties"]["plot"]["maximum"] == 10
    assert json_schema("assess")["required"][0] == "assessment"  # written before the grades


# ------------------------------------------------------------------------------------------------------------------
# Against the local server, with the real client.


def test_grades_are_stored_with_the_judge_named_fully(tmp_path, server):
    db = make_db(tmp_path / "r.db")
    s = run(db, server.url, repeats=2)
    assert server.count == 12 and s.n_ok == 12 and s.n_failed == 0 and s.n_requests == 12
    req = server.requests[0]
    body = req.body
    assert req.path == "/v1/chat/completions" and body["model"] == "fake-model"
    assert body["messages"] == [{"role": "user", "content": req.prompt}]
    assert req.prompt.startswith("In the following exercise")
    assert body["temperature"] == 0.0 and body["max_tokens"] == 8192 and "max_completion_tokens" not in body
    rf = body["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True and rf["json_schema"]["name"] == "Grade"
    assert set(rf["json_schema"]["schema"]["required"]) == set(judge.CRITERIA)
    # the seed is sent: repeat k gets seed + k, so repeats differ and a rerun asks for the same grades
    assert sorted({r.body["seed"] for r in server.requests}) == [0, 1]
    assert req.headers["authorization"] == "Bearer not-needed"  # a local server needs no key

    name = name_at(server)
    assert s.judge_model == name and s.backend == "openai" and s.endpoint == f"{server.host}/v1"
    rows = grades(db)
    assert len(rows) == 12
    by_prompt = {r.prompt: r for r in server.requests}
    t = judge.load_template()
    for row in rows:
        assert row["judge_model"] == name and row["backend"] == "openai" and row["model"] == "fake-model"
        assert row["endpoint"] == f"{server.host}/v1" and row["model_revision"] == fo.FINGERPRINT
        assert row["status"] == "ok" and row["finish_reason"] == "stop" and row["prompt_hash"] == t.hash
        sample = db["samples"].get(row["sample_id"])
        prompt = t.fill(db["prompts"].get(sample["prompt_id"])["text"], sample["completion"])
        expected = json.loads(fo.default_grade(by_prompt[prompt]).body["choices"][0]["message"]["content"])
        assert {c: row[c] for c in judge.CRITERIA} == expected
        assert tokens(row) == (180, 24, 0, 204)
    reqs = list(db.query("select * from judge_requests order by key"))
    r0 = reqs[0]
    assert r0["key"] == f"{name}|{t.hash}|{r0['sample_id']}|{r0['repeat']}" and r0["seed"] == r0["repeat"]
    assert r0["backend"] == "openai" and r0["model_revision"] == fo.FINGERPRINT and r0["http_status"] == 200
    assert r0["temperature"] == 0.0 and r0["thinking_budget"] is None and r0["max_output_tokens"] == 8192
    sent = json.loads(r0["request_json"])
    assert sent["model"] == "fake-model" and sent["seed"] == r0["repeat"] and "response_format" in sent
    assert json.loads(r0["response_json"])["system_fingerprint"] == fo.FINGERPRINT
    assert s.cost_usd is None and any("no price" in n for n in s.notes)  # a local server's tokens cost nothing known
    # rerun: everything is cached
    again = run(db, server.url, repeats=2)
    assert server.count == 12 and again.n_requests == 0 and again.n_cached == 12


def test_assess_protocol_and_openais_own_service_settings(tmp_path, server, monkeypatch):
    db = make_db(tmp_path / "r.db", n_prompts=2, archs=("control",))
    s = run(db, server.url, protocol="assess", temperature=0.5, judge_seed=7)
    assert s.n_ok == 2
    body = server.requests[0].body
    assert body["response_format"]["json_schema"]["name"] == "AssessedGrade" and body["seed"] == 7
    assert body["temperature"] == 0.5
    rows = grades(db, "ok")
    assert all(r["protocol"] == "assess" and r["assessment"].startswith("Assessment ") for r in rows)
    # OpenAI's own service takes max_completion_tokens (its reasoning models refuse max_tokens); the judge is
    # named without a host there. Pointed at the fake server through the SDK's client, as OpenAI's base URL.
    from benchctl.stages.judge import openai_chat
    from benchctl.stages.judge.client import Settings, WorkItem

    spec = judges.resolve("openai:gpt-4.1-mini")
    settings = Settings(spec.name, "h", 0.0, None, 1024, 1, 0.01, 0.01, backend="openai", model=spec.model, seed=0)
    sent = openai_chat.request_body(WorkItem("s", "r", "control", 1, "p"), settings, spec.official)
    assert sent["max_completion_tokens"] == 1024 and "max_tokens" not in sent and sent["seed"] == 1


def test_official_service_needs_a_key_and_a_refused_key_stops_the_job(tmp_path, monkeypatch):
    db = make_db(tmp_path / "r.db", n_prompts=4)
    with pytest.raises(JudgeError, match="OPENAI_API_KEY"):
        judge.judge_all(db, judge.JudgeOptions(judge_model="openai:gpt-4.1-mini", **FAST), progress=False)
    with fo.FakeOpenAI(api_key="right-key") as server:
        monkeypatch.setenv("OPENAI_API_KEY", "wrong-key")
        with pytest.raises(JudgeError, match=r"refused the job \(HTTP 401: Incorrect API key.*OPENAI_API_KEY"):
            run(db, server.url, concurrency=2)
        assert server.count <= 2  # the ones already in flight; nothing after the refusal
        assert server.requests[0].headers["authorization"] == "Bearer wrong-key"
        monkeypatch.setenv("OPENAI_API_KEY", "right-key")
        assert run(db, server.url).n_ok == 8


def test_a_setting_the_server_rejects_stops_the_job(tmp_path, server):
    db = make_db(tmp_path / "r.db", n_prompts=3)
    msg = "Unsupported value: 'temperature' does not support 0.0 with this model."
    server.script = lambda r: fo.error(400, msg, "invalid_request_error", "unsupported_value", param="temperature")
    with pytest.raises(JudgeError, match="refused the job.*temperature"):
        run(db, server.url, concurrency=1)
    assert server.count == 1


def test_other_400s_fail_the_key_at_once(tmp_path, server):
    db = one(tmp_path)
    server.push(fo.error(400, "This model's maximum context length is 512 tokens.", "BadRequestError"))
    s = run(db, server.url)
    assert server.count == 1 and s.n_failed == 1 and "HTTP 400: This model's maximum context" in grades(db)[0]["error"]


def test_429_with_retry_after_is_honoured_then_succeeds(tmp_path, server):
    db = one(tmp_path)
    server.push(fo.rate_limited(retry_after=0.3))
    s = run(db, server.url)
    assert server.count == 2 and s.n_ok == 1 and s.n_requests == 2
    gap = server.requests[1].received_at - server.requests[0].received_at
    assert gap >= 0.3  # the server's delay, not the 0.01 s backoff
    req = next(db.query("select * from judge_requests"))
    assert req["attempts"] == 2 and req["status"] == "ok" and req["http_status"] == 200


def test_repeated_5xx_are_recorded_as_a_failure(tmp_path):
    with fo.FakeOpenAI(script=lambda r: fo.server_error(503)) as server:
        db = one(tmp_path)
        s = run(db, server.url, max_attempts=3)
        assert server.count == 3
    row = grades(db)[0]
    assert s.n_failed == 1 and row["status"] == "failed" and row["average"] is None
    assert "gave up after 3 attempts" in row["error"] and "HTTP 503" in row["error"]
    req = next(db.query("select * from judge_requests"))
    assert req["http_status"] == 503 and req["attempts"] == 3
    assert json.loads(req["response_json"])["error"]["type"] == "server_error"


HTML_PAGE = "<html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1></body></html>"


@pytest.mark.parametrize("status", [200, 502])
def test_a_body_that_is_not_json_is_stored_as_a_failed_grade(tmp_path, status):
    with fo.FakeOpenAI(script=lambda r: fo.Reply(status, HTML_PAGE)) as server:
        db = one(tmp_path)
        s = run(db, server.url, max_attempts=2)
        assert server.count == 2  # a passing fault (a proxy's page): retried
    row = grades(db)[0]
    assert s.n_failed == 1 and row["status"] == "failed" and row["average"] is None
    assert ("not JSON" if status == 200 else "HTTP 502: <html>") in row["error"]


def test_a_non_json_body_then_an_answer_is_graded(tmp_path, server):
    db = one(tmp_path)
    server.push(fo.Reply(200, HTML_PAGE))
    s = run(db, server.url)
    assert server.count == 2 and s.n_ok == 1


@pytest.mark.parametrize(
    "reply, finish, raw, why",
    [
        (fo.completion('{"grammar": 7, "creativity": 6, "consis', finish_reason="length"), "length", None, "truncated"),
        (
            fo.completion(None, refusal="I'm sorry, I cannot help with that."),
            "stop",
            "I'm sorry, I cannot help with that.",
            "refused: I'm sorry",
        ),
        (fo.completion("", finish_reason="content_filter"), "content_filter", None, "blocked: finish_reason"),
        (fo.completion('{"grammar": 7, "creativity": six}'), "stop", None, "unparseable JSON"),
        (fo.grade(7, 6, 5, 11), "stop", None, "plot=11 out of range"),
        (fo.grade(7, 6, 5, 4.5), "stop", None, "not an integer"),
        (fo.Reply(200, {"object": "chat.completion", "choices": []}), None, None, "not a chat completion: no choices"),
        (fo.Reply(200, [7, 6, 5, 4]), None, None, "not a chat completion: the body is JSON list"),
    ],
    ids=["truncated", "refusal", "content-filter", "invalid-json", "out-of-range", "float", "no-choices", "list"],
)
def test_bad_answers_are_stored_as_failures_with_raw_text_never_as_scores(tmp_path, server, reply, finish, raw, why):
    db = one(tmp_path)
    server.push(reply)
    s = run(db, server.url)
    assert server.count == 1  # an answer, even a bad one, is not retried within the run (it was paid for)
    row = grades(db)[0]
    assert row["status"] == "failed" and why in row["error"], row["error"]
    assert all(row[c] is None for c in (*judge.CRITERIA, "average"))
    assert row["finish_reason"] == finish
    body = reply.body
    if raw is not None:
        assert row["raw_text"] == raw
    elif isinstance(body, dict) and body.get("choices"):
        assert row["raw_text"] == body["choices"][0]["message"]["content"]
    assert s.n_failed == 1
    assert json.loads(next(db.query("select response_json from judge_requests"))["response_json"]) is not None
    rerun = run(db, server.url)  # failed grades are regraded on the next run
    assert rerun.n_ok == 1 and server.count == 2


def test_truncated_answer_tokens_are_counted_with_reasoning_as_thinking(tmp_path, server):
    db = one(tmp_path)
    server.push(fo.completion("{", finish_reason="length", completion_tokens=300, reasoning_tokens=280))
    run(db, server.url)
    row = grades(db)[0]
    assert "truncated" in row["error"] and tokens(row) == (180, 20, 280, 480) and row["raw_text"] == "{"


@pytest.mark.parametrize("style, ok", [("plain", True), ("fenced", False)])
def test_a_server_that_ignores_response_format_goes_through_the_same_strict_parser(tmp_path, style, ok):
    with fo.FakeOpenAI(honour_response_format=False, answer_style=style) as server:
        db = make_db(tmp_path / "r.db", n_prompts=2, archs=("control",))
        s = run(db, server.url, protocol="assess")
        assert server.count == 2
    rows = grades(db)
    if ok:  # the prompt asks for the same JSON: a model that follows it is graded
        assert s.n_ok == 2 and all(r["assessment"] for r in rows)
    else:  # JSON inside prose is not an answer in the requested form: stored with its text, never scored
        assert s.n_failed == 2
        assert all(r["error"].startswith("unparseable JSON") and "```json" in r["raw_text"] for r in rows)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_connection_refused_is_retried_then_stored_as_a_failure(tmp_path):
    db = one(tmp_path)
    s = run(db, f"http://127.0.0.1:{_closed_port()}/v1", max_attempts=3)
    row = grades(db)[0]
    assert s.n_failed == 1 and s.n_requests == 3
    assert row["status"] == "failed" and "gave up after 3 attempts" in row["error"]
    assert "connection error: APIConnectionError" in row["error"]
    assert next(db.query("select http_status from judge_requests"))["http_status"] is None


def test_dropped_connection_is_retried(tmp_path, server):
    db = one(tmp_path)
    server.push(fo.Reply(drop=True))
    s = run(db, server.url)
    assert server.count == 2 and s.n_ok == 1


def test_concurrency_never_exceeds_the_limit(tmp_path):
    db = make_db(tmp_path / "r.db", n_prompts=6)
    with fo.FakeOpenAI(latency=0.1) as server:
        s = run(db, server.url, concurrency=3)
        assert server.count == 12 and s.n_ok == 12 and server.max_in_flight == 3


def test_dry_run_needs_no_key_and_sends_nothing(tmp_path, server):
    db = make_db(tmp_path / "r.db")
    s = judge.judge_all(db, judge.JudgeOptions(judge_model="openai:gpt-4.1-mini", dry_run=True, **FAST), progress=False)
    assert server.count == 0 and s.n_todo == 6 and s.estimated_cost_usd is not None and grades(db) == []


# ------------------------------------------------------------------------------------------------------------------
# Two judges on the same samples, and the command line.


def test_gemini_and_an_openai_compatible_server_are_two_judges_cached_apart(tmp_path, server, monkeypatch):
    monkeypatch.setenv("GEMINI_API_KEY", "test-key")
    db = make_db(tmp_path / "r.db")
    with fg.FakeGemini() as gemini:
        g = judge.judge_all(db, judge.JudgeOptions(base_url=gemini.url, **FAST), progress=False)
        o = run(db, server.url)
        assert g.n_ok == 6 and o.n_ok == 6 and gemini.count == 6 and server.count == 6  # never answered from the other
        # rerunning either judge sends nothing
        assert judge.judge_all(db, judge.JudgeOptions(base_url=gemini.url, **FAST), progress=False).n_requests == 0
        assert run(db, server.url).n_requests == 0 and gemini.count == 6 and server.count == 6
    rows = list(db.query("select judge_model, backend, endpoint, count(*) as n from judge_grades group by 1, 2, 3"))
    gemini_host = gemini.url.removeprefix("http://")
    assert rows == [
        {"judge_model": "gemini-2.5-flash", "backend": "gemini", "endpoint": gemini_host, "n": 6},
        {"judge_model": name_at(server), "backend": "openai", "endpoint": f"{server.host}/v1", "n": 6},
    ]
    # a second server with the same model name is a third judge, not the cache of the second
    with fo.FakeOpenAI() as other:
        assert run(db, other.url).n_ok == 6 and other.count == 6


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_report_names_both_judges_and_their_agreement(tmp_path, server, monkeypatch):
    from benchctl.stages.report import engine as report_engine

    monkeypatch.setenv("GEMINI_API_KEY", "test-key")
    db = make_db(tmp_path / "r.db", n_prompts=4)
    with fg.FakeGemini() as gemini:
        judge.judge_all(db, judge.JudgeOptions(base_url=gemini.url, repeats=2, **FAST), progress=False)
    run(db, server.url)
    md = report_engine.build(tmp_path / "r.db").markdown
    judge_sec = md.split("## Judge reliability")[0].split("## Judge\n")[1]
    assert f"backend `openai`, model `fake-model`, endpoint `{server.host}/v1`" in judge_sec
    assert f"system_fingerprint `{fo.FINGERPRINT}`" in judge_sec
    assert "backend `gemini`, model `gemini-2.5-flash`" in judge_sec and "modelVersion `fake-gemini`" in judge_sec
    rel = md.split("## Judge reliability")[1].split("\n## ")[0]
    pairs = rel.split("### Agreement and ranking between every pair of judges")[1]
    assert "gemini-2.5-flash / json" in pairs and f"{name_at(server)} / json" in pairs
    assert "Kendall" in pairs and "ranked differently" in pairs


def test_cli_grades_with_an_openai_compatible_server(tmp_path, server):
    from benchctl.cli import app

    path = tmp_path / "r.db"
    make_db(path)
    runner = CliRunner()
    for protocol in ("json", "assess"):
        argv = ["judge", "--model", "openai:fake-model", "--base-url", server.url, "--db", str(path), "-c", "2"]
        res = runner.invoke(app, [*argv, "--protocol", protocol, "--seed", "3", "--max-output-tokens", "600"])
        assert res.exit_code == 0, res.output
        out = " ".join(res.output.split())  # the console wraps at 80 columns
        assert f"{name_at(server)} (backend openai, model fake-model, at {server.host}/v1)" in out
        assert "6 graded, 0 failed" in out and "seed 3, repeats 1" in out  # no thinking budget: Gemini's setting
    assert server.count == 12 and {r.body["max_tokens"] for r in server.requests} == {600}
    assert {r.body["seed"] for r in server.requests} == {3}
    db = stages.connect(path)
    assert {(r["protocol"], r["status"]) for r in grades(db)} == {("json", "ok"), ("assess", "ok")}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "anthropic:claude"], "unknown judge backend"),
        (["--model", "openai:"], "names no model"),
        (["--model", "openai:m", "--base-url", "localhost:8000"], "--base-url"),
        (["--model", "openai:m", "--thinking-budget", "64"], "--thinking-budget applies to Gemini models only"),
        (["--model", "openai:m", "--max-output-tokens", "0"], "--max-output-tokens"),
        (["--model", "openai:m", "--seed", "-1"], "--seed"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, argv, needle):
    path = tmp_path / "r.db"
    make_db(path)
    with pytest.raises(SystemExit) as info:
        main(["judge", "--db", str(path), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_refused_key_exits_with_the_judge_code(tmp_path, capsys, monkeypatch):
    path = tmp_path / "r.db"
    make_db(path)
    with pytest.raises(SystemExit) as info:
        main(["judge", "--db", str(path), "--model", "openai:gpt-4.1-mini"])
    err = capsys.readouterr().err
    assert info.value.code == JudgeError.exit_code == 6 and "OPENAI_API_KEY" in err and "Traceback" not in err


def test_study_stage_grades_with_an_openai_compatible_judge(tmp_path, server, monkeypatch):
    """The study's judge stage takes openai:<model> too (its server from OPENAI_BASE_URL) and needs no key for it."""
    from benchctl.stages.judge import stage

    monkeypatch.setenv("OPENAI_BASE_URL", server.url)
    db = make_db(tmp_path / "r.db", n_prompts=1)
    said: list[str] = []

    class Study:
        opts = stages.StudyOptions(judge_model="openai:fake-model", progress=False)
        run_ids = ["run-control", "run-frailt"]
        db = None

        def skips(self, name):
            return False

        def say(self, text):
            said.append(text)

        def log(self, text):
            said.append(text)

    study = Study()
    study.db = db
    stage.run(study)  # type: ignore[arg-type]
    assert said[0] == "grading with openai:fake-model" and "2 graded, 0 failed" in said[1]
    assert {r["judge_model"] for r in grades(db)} == {name_at(server)}


# ------------------------------------------------------------------------------------------------------------------
# Where the key may go, how long a call may wait, and a run that obtains no grade.


def test_only_a_loopback_address_or_localhost_counts_as_this_machine():
    for host in ("127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST", "localhost.", "::ffff:127.0.0.1"):
        assert judges.is_loopback(host), host
    for host in ("10.0.0.1", "192.168.1.5", "128.0.0.1", "0.0.0.0", "example.com", "localhost.example.com", "::2", ""):
        assert not judges.is_loopback(host), host


def test_which_urls_a_key_may_travel_to(monkeypatch):
    def refused(url: str, allow: bool = False) -> bool:
        try:
            judges.check_key_transport(judges.resolve("openai:m", url), "OPENAI_API_KEY", allow)
        except JudgeError:
            return True
        return False

    assert refused("http://10.0.0.7:8000/v1") and refused("http://gpu-box.example.com/v1")
    assert not refused("https://gpu-box.example.com/v1") and not refused("https://10.0.0.7:8000/v1")
    assert not refused("http://127.0.0.1:8000/v1") and not refused("http://[::1]:8000/v1")
    assert not refused("http://localhost:11434/v1") and not refused("http://10.0.0.7:8000/v1", allow=True)
    # no key set: the placeholder a local server ignores is no secret, and goes anywhere
    assert judge.require_key(judges.resolve("openai:m", "http://10.0.0.7:8000/v1")) == "not-needed"
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with pytest.raises(JudgeError, match="refusing to send OPENAI_API_KEY in clear text to http://10.0.0.7:8000/v1"):
        judge.require_key(judges.resolve("openai:m", "http://10.0.0.7:8000/v1"))


def test_a_key_goes_over_plain_http_to_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with fo.FakeOpenAI(api_key="sk-test") as server:  # it checks the bearer token: a grade means the key arrived
        s = run(one(tmp_path), server.url)
    assert s.n_ok == 1


def test_the_key_goes_over_plain_http_to_another_host_only_with_the_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    name, address = this_machine_by_name()
    path = tmp_path / "r.db"
    db = make_db(path, n_prompts=1)
    with fo.FakeOpenAI(api_key="sk-test", bind=address) as server:
        url = f"http://{name}:{server.port}/v1"
        argv = ["judge", "--db", str(path), "--model", "openai:fake-model", "--base-url", url, "--no-progress"]
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == JudgeError.exit_code == 6 and len(err.strip().splitlines()) == 1
        assert f"refusing to send OPENAI_API_KEY in clear text to http://{name}:{server.port}/v1" in err
        assert "--allow-insecure-key" in err and "sk-test" not in err
        monkeypatch.setenv("OPENAI_BASE_URL", url)  # the study's judge reads the variable: refused too
        with pytest.raises(JudgeError, match="refusing to send OPENAI_API_KEY"):
            judge.judge_all(db, judge.JudgeOptions(judge_model="openai:fake-model", **FAST), progress=False)
        assert server.count == 0 and grades(db) == []
        monkeypatch.delenv("OPENAI_BASE_URL")
        with pytest.raises(SystemExit) as info:
            main([*argv, "--allow-insecure-key"])
        assert info.value.code == 0 and server.count == 2
    assert [r["status"] for r in grades(db)] == ["ok", "ok"]


def test_a_server_that_never_answers_costs_the_read_timeout_per_attempt(tmp_path):
    db = make_db(tmp_path / "r.db", n_prompts=1)
    with SilentServer() as silent:
        started = time.monotonic()
        s = run(db, f"http://127.0.0.1:{silent.port}/v1", connect_timeout_s=5, read_timeout_s=0.3, max_attempts=2)
        elapsed = time.monotonic() - started
    assert s.n_failed == 2 and s.n_ok == 0 and elapsed < 15  # not 2 x 120 s
    assert all("gave up after 2 attempts" in r["error"] and "timed out" in r["error"] for r in grades(db))


def test_a_host_that_never_accepts_costs_the_connect_timeout_not_the_read_timeout(tmp_path):
    with UnacceptingServer() as closed:
        started = time.monotonic()
        s = run(one(tmp_path), f"http://127.0.0.1:{closed.port}/v1", connect_timeout_s=0.3, read_timeout_s=600)
        elapsed = time.monotonic() - started
    assert s.n_failed == 1 and elapsed < 15


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_timeout_must_be_a_positive_number_of_seconds(tmp_path, capsys, value):
    path = tmp_path / "r.db"
    make_db(path)
    for flag in ("--connect-timeout", "--read-timeout"):
        with pytest.raises(SystemExit) as info:
            main(["judge", "--db", str(path), "--model", "openai:m", flag, value])
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"{flag} must be a number of seconds above 0" in err


def _judge_cli(path, url: str, *more: str) -> list[str]:
    return ["judge", "--db", str(path), "--model", "openai:fake-model", "--base-url", url, "--no-progress", *more]


@pytest.mark.parametrize("down", ["never answers", "refuses connections"])
def test_judge_exits_6_when_the_server_could_not_be_reached_for_any_grade(tmp_path, capsys, down):
    path = tmp_path / "r.db"
    make_db(path, n_prompts=2)
    quick = ("--connect-timeout", "0.3", "--read-timeout", "0.3", "--max-attempts", "2")
    started = time.monotonic()
    if down == "never answers":
        with SilentServer() as silent, pytest.raises(SystemExit) as info:
            main(_judge_cli(path, f"http://127.0.0.1:{silent.port}/v1", *quick))
    else:
        with pytest.raises(SystemExit) as info:
            main(_judge_cli(path, f"http://127.0.0.1:{_closed_port()}/v1", *quick))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == JudgeError.exit_code == 6 and time.monotonic() - started < 30
    assert err[-1].startswith("error: the judge service at 127.0.0.1:") and "could not be reached" in err[-1]
    assert "no grade obtained, 4 grade(s) failed and were stored as failures" in err[-1]
    rows = grades(stages.connect(path))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"failed"}  # stored as failures, as before


def test_judge_exits_6_when_every_answer_failed_and_0_when_one_grade_was_obtained(tmp_path, capsys):
    path = tmp_path / "r.db"
    make_db(path, n_prompts=1)
    too_long = fo.error(400, "This model's maximum context length is 512 tokens.", "BadRequestError")
    with fo.FakeOpenAI(script=lambda r: too_long) as server:
        with pytest.raises(SystemExit) as info:
            main(_judge_cli(path, server.url))
        err = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 6 and err[-1].startswith("error: no grade obtained from the judge service at")
        assert "HTTP 400: This model's maximum context length" in err[-1]
    with fo.FakeOpenAI() as server:  # a rerun regrades the failures; then a run that grades one of two is a success
        server.push(too_long)
        with pytest.raises(SystemExit) as info:
            main(_judge_cli(path, server.url, "--concurrency", "1"))
        assert info.value.code == 0 and "1 graded, 1 failed" in capsys.readouterr().out


def test_a_dead_server_stops_the_job_after_a_few_unanswered_calls_not_every_keys_attempts(tmp_path, capsys):
    """With the default six attempts a key, a server that accepts and never answers would cost every key six read
    timeouts; the job stops once its first calls have all gone unanswered, leaving the other keys unsent."""
    path = tmp_path / "r.db"
    make_db(path, n_prompts=6)
    quick = ("--connect-timeout", "0.3", "--read-timeout", "0.3", "--max-attempts", "6")
    started = time.monotonic()
    with SilentServer() as silent, pytest.raises(SystemExit) as info:
        main(_judge_cli(path, f"http://127.0.0.1:{silent.port}/v1", *quick))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 6 and time.monotonic() - started < 30
    assert "the job stopped after" in err[-1] and "other samples were not sent" in err[-1]
    rows = grades(stages.connect(path))
    # the keys in flight when it stopped are stored as failures; the rest stay unsent
    assert 0 < len(rows) < 12 and {r["status"] for r in rows} == {"failed"}
    assert any("answered none of the job's" in r["error"] for r in rows)


def test_calls_without_an_answer_stop_a_job_only_before_any_call_was_answered():
    """One dropped connection after the service has answered is a passing fault, retried as usual."""
    from benchctl.stages.judge.client import UNANSWERED_CALLS, CallFailed, Job

    def dropped() -> CallFailed:
        return CallFailed("connection error: ReadTimeout", retryable=True, unanswered=True)

    fresh = Job.__new__(Job)
    fresh.answered, fresh.n_unanswered, fresh.unreachable = False, 0, None
    for _ in range(UNANSWERED_CALLS - 1):
        fresh._count(dropped())
    assert fresh.unreachable is None
    fresh._count(dropped())
    assert fresh.unreachable is not None
    seen = Job.__new__(Job)
    seen.answered, seen.n_unanswered, seen.unreachable = False, 0, None
    seen._count(CallFailed("HTTP 503", http_status=503, retryable=True))  # an answer, though an error
    for _ in range(10 * UNANSWERED_CALLS):
        seen._count(dropped())
    assert seen.unreachable is None

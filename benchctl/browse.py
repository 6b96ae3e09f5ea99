"""`benchctl browse`: results.db in Datasette, with a title, a description and units for every table and column, and
the queries a user would otherwise write by hand.

Titles, descriptions, units and facets come from the tables the stages declare (`benchctl.core.tables.Table`, in
`benchctl/stages/<name>/tables.py`), the same descriptions that create the file, so a column cannot exist without
its description (a test checks that none is empty), nor a description outlive its column.

The database is served read-only but live: Datasette opens it with `mode=ro`, which, unlike `immutable=1`, reads the
WAL, so a run still training shows its latest rows; and the write connection Datasette would hand to plugins is
refused (`_ReadOnlyDatabase`), so nothing reachable from a web page can change results.db. Canned queries come from
the stages that own the tables they read, built from the columns the served file actually has (a `variant` column,
a `depth_results` table), so one benchctl can browse databases written by older and newer versions.

Pages are laid out for reading: a table's column descriptions are one click away in a collapsed list (each column's
header menu shows its own). A stage's canned query can say that it summarises a table (whose page then points to it)
or that a column of that name in any query's results links to it with the value filled in (`LINK_KEY`,
`SUMMARY_KEY`): so the runs table points to a runs overview, and a run id to that run's validation curve.

Every answer is a page or an HTTP error, never a server error: a request with any method but GET or HEAD is answered
405 before it reaches Datasette (there is nothing to post to), an unknown route 404 (`_quiet_errors`), and a query
parameter Datasette cannot read (`?_timelimit=abc`, `?_through=notjson`, `?_sort=nosuch`) 400 with a short message
(`_bad_request`), while a genuine server error keeps its 500 and its traceback.
"""

from __future__ import annotations

import json
import os
import socket
import sysconfig
import threading
import types
import urllib.parse
import webbrowser
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasette as datasette_package
import uvicorn
from datasette import hookimpl
from datasette.app import Datasette
from datasette.database import Database
from datasette.plugins import pm
from datasette.utils.asgi import BadRequest
from datasette.views.base import DatasetteError
from markupsafe import Markup, escape

from benchctl.core import db as dbm
from benchctl.core.errors import BenchctlError, DatabaseError
from benchctl.core.tables import Table

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8001  # Datasette's own default, so its documentation's URLs keep working
TITLE = "benchctl results"

# Datasette renders these columns' numbers with units through its vendored pint; "token" and "FLOP" are units pint
# does not know. Losses keep their unit in the description only: pint would turn 0.5 nats into "500 mnat".
CUSTOM_UNITS = ["token = [token]", "FLOP = [flop]"]
_PINT = {"s": "s", "bytes": "byte", "FLOPs/token": "FLOP/token", "tokens/s": "token/s", "FLOP/s": "FLOP/s"}


def described_tables() -> dict[str, Table]:
    """Every table benchctl describes, by name: the registered stages' tables and core's `meta`."""
    from benchctl import stages
    from benchctl.core.db import META

    return {t.name: t for t in (*stages.tables(), META)}


def describe(table: str, column: str) -> str | None:
    """The column's description with its unit, as Datasette shows it; None for a column benchctl does not know."""
    spec = described_tables().get(table)
    col = spec.column(column) if spec is not None else None
    if col is None:
        return None
    return f"{col.description} [{col.unit}]" if col.unit else col.description


# ====================================================================================================================
# The database being served


@dataclass(frozen=True)
class Served:
    path: Path
    name: str  # Datasette's name for it: the file name without extension, as in /results/runs
    columns: dict[str, list[str]]  # table -> columns, as found in the file


def check_database(path: str | Path) -> Served:
    """Check that `path` is a benchctl results database and list its tables; DatabaseError (one line) otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory, not" if p.is_dir() else "does not exist; expected"
        raise DatabaseError(f"{p} {what} a results database; train something first or pass --db PATH")
    if dbm.check_file(p).kind == "new":
        raise DatabaseError(f"{p} is an empty SQLite file, not a results database; train something first")
    columns = dbm.file_columns(p)
    return Served(path=p.resolve(), name=p.stem, columns=columns)


# ====================================================================================================================
# Canned queries

# Keys of a stage's canned query that are benchctl's, not Datasette's: read here, and left out of the metadata
# Datasette is given. LINK_KEY names a column and a parameter of the query: that column, in the results of any query,
# links to this query with the value as the parameter. SUMMARY_KEY names a table whose page points to the query.
LINK_KEY = "link_column"
SUMMARY_KEY = "summarises"


def canned_queries(served: Served) -> dict[str, dict[str, Any]]:
    """Datasette canned queries over the tables the file has, keyed by their URL name: each registered stage's
    queries over its own tables (`Stage.queries`), in stage order, with benchctl's own keys."""
    from benchctl import stages

    return stages.canned_queries(served.columns)


@dataclass(frozen=True)
class Layout:
    """What the canned queries' own keys ask of the pages: column -> the query its values link to, and table -> the
    query its page points to. Also what marks a Datasette as benchctl's (the plugin's hooks look for it)."""

    links: dict[str, str]
    summaries: dict[str, str]


def layout(queries: dict[str, dict[str, Any]]) -> Layout:
    links = {q[LINK_KEY]: name for name, q in queries.items() if q.get(LINK_KEY)}
    summaries = {q[SUMMARY_KEY]: name for name, q in queries.items() if q.get(SUMMARY_KEY)}
    return Layout(links=links, summaries=summaries)


def _layout_of(datasette: Any) -> Layout | None:
    """The layout of a benchctl browser; None for another Datasette in this process."""
    found = getattr(datasette, "_benchctl", None)
    return found if isinstance(found, Layout) else None


# ====================================================================================================================
# Metadata and server


def metadata(served: Served) -> dict[str, Any]:
    """Datasette metadata: titles, descriptions, units and facets per table, and the canned queries."""
    known = described_tables()
    ours = (LINK_KEY, SUMMARY_KEY)
    queries = {name: {k: v for k, v in q.items() if k not in ours} for name, q in canned_queries(served).items()}
    tables: dict[str, Any] = {}
    for table, cols in served.columns.items():
        entry: dict[str, Any] = {}
        spec = known.get(table)
        if spec is not None:
            entry["title"], entry["description"] = spec.title, spec.description
        described = {c: describe(table, c) for c in cols}
        entry["columns"] = {c: d for c, d in described.items() if d}
        units = (
            {} if spec is None else {c.name: _PINT[c.unit] for c in spec.columns if c.name in cols and c.unit in _PINT}
        )
        if units:
            entry["units"] = units
        if spec is not None and spec.facets:
            entry["facets"] = [c for c in spec.facets if c in cols]
        if entry:
            tables[table] = entry
    return {
        "title": TITLE,
        "description": "Every number benchctl measured: runs, training curves, samples, judge grades, lm-eval "
        "results and benchmarks. Read-only. Column headers show descriptions and units; the "
        "canned queries below the tables answer the usual questions.",
        "custom_units": CUSTOM_UNITS,
        "databases": {served.name: {"tables": tables, "queries": queries}},
    }


def url(host: str, port: int, served: Served) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/{served.name}"


def _check_port(host: str, port: int) -> None:
    """Fail with one line before Datasette starts when the address is taken (uvicorn would log and exit)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise BenchctlError(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --port") from None


class _ReadOnlyDatabase(Database):
    """results.db as Datasette sees it: the write connection it would hand to plugins is refused."""

    def connect(self, write: bool = False):
        if write:
            raise PermissionError("benchctl browse serves results.db read-only")
        return super().connect(write=False)


READ_METHODS = ("GET", "HEAD")


@hookimpl
def _asgi_wrapper(datasette):
    """A Datasette plugin hook: on a benchctl browser, any method but GET and HEAD is answered 405 with an Allow
    header. Datasette itself answers a POST to a table with a server error (it only takes POSTs to writable canned
    queries, which benchctl has none of)."""

    def wrap(asgi_app):
        async def only_reads(scope, receive, send):
            if (
                scope.get("type") != "http"
                or scope.get("method", "GET") in READ_METHODS
                or _layout_of(datasette) is None  # another Datasette in this process: not ours
            ):
                return await asgi_app(scope, receive, send)
            body = b"benchctl browse serves results.db read-only: only GET and HEAD requests\n"
            headers = [
                (b"allow", ", ".join(READ_METHODS).encode()),
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 405, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return only_reads

    return wrap


# What Python's own parsing raises on malformed text: int("abc") and json.loads("[") a ValueError, a key missing from
# a JSON object a KeyError, indexing a JSON number or list by name a TypeError.
_MALFORMED = (ValueError, LookupError, TypeError)
_DATASETTE_DIR = os.path.dirname(datasette_package.__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


def _raised_in_datasette(exception: BaseException) -> bool:
    """Whether every frame the exception passed through is Datasette's or the standard library's: Datasette reading
    a parameter (`int(...)`, `json.loads(...)`), not benchctl's code or a plugin's, whose errors are bugs."""
    tb = exception.__traceback__
    if tb is None:
        return False
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.startswith(_DATASETTE_DIR) or name.startswith(_STDLIB_DIR)):
            return False
        tb = tb.tb_next
    return True


def _reason(exception: BaseException) -> str:
    if isinstance(exception, json.JSONDecodeError):
        return f"not valid JSON ({exception.msg})"
    if isinstance(exception, KeyError):
        return f"missing key {exception.args[0]!r}" if exception.args else "missing key"
    return str(exception) or type(exception).__name__


def _bad_request(datasette: Datasette, request: Any, exception: BaseException) -> Exception | None:
    """The 400 a request deserves when `exception` is Datasette failing to read the request's own query parameters on
    a database, table, row or query page; None when it is anything else (a server error keeps its 500).

    Datasette checks some parameters itself (`?_size=abc` is a 400), but reads others with a bare `int()` or
    `json.loads()` and indexes the result without a check (`?_timelimit=`, `?_through=`, `?col__in=[`, `_next`),
    so a typo in a URL ends as a server error with a traceback. What counts here is where the error came from, not
    which parameter: an error Python's parsing raises (`_MALFORMED`) in a request that has a query string, from
    Datasette's own code alone. Datasette's deliberate complaints about a request (an unknown `_sort`, an invalid
    `_through`) come with its message but its default status 500; they keep the message and become 400. An error
    Datasette wraps (an SQLite error) keeps the status Datasette chose."""
    if _layout_of(datasette) is None or "database" not in request.url_vars or not request.query_string:
        return None
    if not _raised_in_datasette(exception):
        return None
    if isinstance(exception, DatasetteError):
        if exception.status != 500 or exception.__context__ is not None:
            return None
        return DatasetteError(
            exception.message, title=exception.title, status=400, message_is_html=exception.message_is_html
        )
    if isinstance(exception, _MALFORMED):
        query = urllib.parse.unquote_plus(request.query_string)
        shown = query if len(query) <= 200 else query[:200] + "..."
        return BadRequest(f"bad query parameter in ?{shown}: {_reason(exception)}")
    return None


@hookimpl(hookwrapper=True)
def _handle_exception(datasette, request, exception):
    """A Datasette plugin hook around its error pages: a request whose query parameters Datasette could not read
    gets Datasette's own error page with status 400 instead of 500 (`_bad_request`). A wrapper, not a plain hook:
    every implementation's page is rendered, and Datasette's default one prints the traceback while rendering, so a
    400 must replace the default page rather than be added before it."""
    outcome = yield
    replacement = _bad_request(datasette, request, exception)
    if replacement is not None:
        from datasette import handle_exception as error_pages

        page = error_pages.handle_exception(datasette=datasette, request=request, exception=replacement)
        outcome.force_result([page])


def _description_html(meta: dict[str, Any], described: dict[str, str], summary: tuple[str, str] | None) -> str:
    """A table page's description: the table's own, a pointer to the query that summarises it (`summary`: its URL
    and title), and the column descriptions in a collapsed list. Datasette lists them open above the rows, which for
    the runs table is the whole first screen."""
    parts = [f"<p>{escape(meta.get('description') or '')}</p>"]
    if summary is not None:
        href, title = summary
        parts.append(f'<p>Read it first in <a href="{escape(href)}">{escape(title)}</a>.</p>')
    items = "".join(f"<dt>{escape(c)}</dt><dd>{escape(d)}</dd>" for c, d in described.items())
    parts.append(
        f"<details><summary>What each of the {len(described)} columns holds</summary>"
        f'<dl class="column-descriptions">{items}</dl></details>'
    )
    return "".join(parts)


@hookimpl
def _extra_template_vars(database, table, view_name, datasette):
    """A Datasette plugin hook: on a table page, the template's table metadata without its column descriptions
    (Datasette would list them all, open, above the rows) and with a description that holds them collapsed. The
    column headers' menus still show each description: Datasette reads those from the metadata itself."""
    found = _layout_of(datasette)
    if found is None or view_name != "table" or table is None:
        return None
    meta = datasette.table_metadata(database, table)
    described = meta.get("columns")
    if not described:
        return None
    summary = None
    query = found.summaries.get(table)
    if query is not None:
        title = (datasette.metadata("queries", database=database) or {}).get(query, {}).get("title") or query
        summary = (datasette.urls.query(database, query), title)
    shown = {k: v for k, v in meta.items() if k != "columns"}
    shown["description_html"] = _description_html(meta, described, summary)
    return {"metadata": shown}


@hookimpl
def _render_cell(value, column, table, database, datasette):
    """A Datasette plugin hook: a column a canned query links from (`LINK_KEY`: a run id), in the results of any
    query (canned or typed in), is a link to that query with the value filled in, so nobody pastes a hash into its
    box. Table pages keep Datasette's own links (a foreign key to the row it names)."""
    found = _layout_of(datasette)
    if found is None or table is not None or column not in found.links or not isinstance(value, str) or not value:
        return None
    href = datasette.urls.query(database, found.links[column]) + "?" + urllib.parse.urlencode({column: value})
    return Markup(f'<a href="{escape(href)}">{escape(value)}</a>')


# Datasette's plugins are modules (it lists them by __name__): the hooks go in one of its own
_PLUGIN = types.ModuleType("benchctl_browse")
_PLUGIN.asgi_wrapper = _asgi_wrapper  # type: ignore[attr-defined]
_PLUGIN.handle_exception = _handle_exception  # type: ignore[attr-defined]
_PLUGIN.extra_template_vars = _extra_template_vars  # type: ignore[attr-defined]
_PLUGIN.render_cell = _render_cell  # type: ignore[attr-defined]


def _quiet_errors() -> None:
    """Datasette's error page prints each error as a rich traceback on the server's console first; for a route no
    view matched (an unknown path) there is no exception being handled, rich refuses to print one, and the request
    ends in a server error instead of its 404 page. The error pages need no console traceback (a real server error
    still prints Python's own), so the rich one is turned off."""
    # imported here, after datasette.app: imported first, this module would be registered half-initialised
    from datasette import handle_exception as error_pages

    error_pages.rich = None  # a module global, read on every error
    if not pm.is_registered(_PLUGIN):
        pm.register(_PLUGIN, name="benchctl-browse")


def app(served: Served):
    """The Datasette instance serving `served` read-only (also what tests can drive without a server)."""
    _quiet_errors()
    ds = Datasette(files=[], metadata=metadata(served), settings={"sql_time_limit_ms": 5000})
    ds._benchctl = layout(canned_queries(served))  # type: ignore[attr-defined]  # what the plugin's hooks look for
    ds.remove_database("_memory")  # Datasette adds a scratch database when started without files
    ds.add_database(_ReadOnlyDatabase(ds, path=str(served.path), is_mutable=True), name=served.name)
    return ds


def serve(
    served: Served,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    open_browser: bool = False,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve until interrupted. `on_ready` runs once the server accepts connections (then the browser opens)."""
    _check_port(host, port)
    ds = app(served)  # Datasette runs its own start-up hooks on the first request
    server = uvicorn.Server(
        uvicorn.Config(ds.app(), host=host, port=port, log_level="warning", lifespan="on", workers=1)
    )

    def when_started() -> None:
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            if on_ready is not None:
                on_ready()
            if open_browser:
                webbrowser.open(url(host, port, served))  # False (no browser here) is fine: the URL was printed

    threading.Thread(target=when_started, daemon=True).start()
    server.run()

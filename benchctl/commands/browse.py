"""`benchctl browse`: serve results.db read-only in Datasette, with descriptions, units and canned queries.

Thin: check the database, print where it is served, run the server. See benchctl/browse.py.
"""

from __future__ import annotations

from typing import Annotated

import typer

from benchctl.core.errors import ConfigError
from benchctl.stages.cli import DbOpt, console, db_path_of

app = typer.Typer()

_LOCAL = ("127.0.0.1", "localhost", "::1")


@app.command(short_help="Browse results.db in Datasette (read-only).")
def browse(
    db: DbOpt = None,
    port: Annotated[int, typer.Option("--port", help="TCP port to listen on.")] = 8001,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind; the default keeps results on this machine.")
    ] = "127.0.0.1",
    open_browser: Annotated[
        bool, typer.Option("--open/--no-open", help="Open a web browser on the database page once the server is up.")
    ] = False,
) -> None:
    """Browse results.db in Datasette (read-only): every table and column described, canned queries included."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {port}")
    from benchctl import browse as engine  # datasette: kept out of 'benchctl --help'

    served = engine.check_database(db_path_of(db))
    address = engine.url(host, port, served)
    if host not in _LOCAL:
        console.print(
            f"note: listening on {host}: anyone who can reach this machine can read these results",
            highlight=False,
            soft_wrap=True,
        )
    engine.serve(
        served,
        host=host,
        port=port,
        open_browser=open_browser,
        on_ready=lambda: console.print(
            f"serving {served.path} read-only at {address} (Ctrl+C stops)", highlight=False, soft_wrap=True
        ),
    )

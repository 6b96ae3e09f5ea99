"""The tables of results.db, described as data: one `Table` per table, one `Column` per column.

A description is the single source for everything that follows from a table: `benchctl.core.db` creates and
migrates the file from it (missing tables are created, missing columns added, indexes made), `benchctl browse` shows
its titles, descriptions, units and facets in Datasette, and the report's loader reads it into a DataFrame (which
columns it skips, how it sorts the rows, which rows it keeps). Each stage declares the tables it owns in
`benchctl/stages/<name>/tables.py`, next to the functions that write and query them; core owns only `meta`.

Changing a description changes no stored byte; adding a column adds it to every database the next time one is
opened. Table and column names, types, keys and NOT NULL constraints are the stored format: users query them by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Column:
    """One column: its SQLite type as a Python type (str -> TEXT, int -> INTEGER, float -> REAL), what it holds,
    and its unit where a number has one ("s", "bytes", "tokens", "FLOPs/token", "nats/token", "1-10", ...)."""

    name: str
    type: type
    description: str
    unit: str | None = None


@dataclass(frozen=True)
class Table:
    """One table of results.db and how it is created, browsed and read by the report.

    `pk` is a column name or a tuple of them. `foreign_keys` are (column, other table, other column) triples.
    `defaults` maps a column to its SQL default. `indexes` lists the column tuples to index beyond the primary key.
    `backfill` maps a column to the SQL that fills it in for the rows already there when migration adds it to an
    existing table. `facets` are the columns Datasette offers to facet by.

    The report reads every table into one DataFrame: `report_skip` names large text columns it leaves out,
    `report_sort` the columns it sorts by (the primary key's when empty), and `report_where` an SQL condition on the
    rows it keeps (None: every row).
    """

    name: str
    title: str
    description: str
    columns: tuple[Column, ...]
    pk: str | tuple[str, ...]
    foreign_keys: tuple[tuple[str, str, str], ...] = ()
    not_null: tuple[str, ...] = ()
    defaults: Mapping[str, object] = field(default_factory=dict)
    indexes: tuple[tuple[str, ...], ...] = ()
    backfill: Mapping[str, str] = field(default_factory=dict)
    facets: tuple[str, ...] = ()
    report_skip: tuple[str, ...] = ()
    report_sort: tuple[str, ...] = ()
    report_where: str | None = None

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        keys = (self.pk,) if isinstance(self.pk, str) else self.pk
        named = [
            *keys,
            *(fk[0] for fk in self.foreign_keys),
            *self.not_null,
            *self.defaults,
            *(c for index in self.indexes for c in index),
            *self.backfill,
            *self.facets,
            *self.report_skip,
            *self.report_sort,
        ]
        unknown = sorted({c for c in named if c not in names})
        if len(set(names)) != len(names) or unknown:
            raise ValueError(
                f"table {self.name}: columns named twice or not declared: "
                f"{sorted({n for n in names if names.count(n) > 1} | set(unknown))}"
            )

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def sort_keys(self) -> tuple[str, ...]:
        """The columns the report sorts this table's rows by."""
        return self.report_sort or ((self.pk,) if isinstance(self.pk, str) else self.pk)

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)

    def browse_select(self, alias: str, present: Iterable[str], *, exact: Iterable[str] = (), digits: int = 4) -> str:
        """The select list of a canned query that shows the columns `present` (those of the served file, in its
        order) of this table, aliased `alias`: each REAL column rounded to `digits` decimals under its own name,
        since Datasette prints a float with all of its 15-17 significant digits. Key columns, and those named in
        `exact` (a threshold that names a setting), are shown as stored; so is a column this description does not
        know (a newer file's)."""
        keys = {self.pk} if isinstance(self.pk, str) else set(self.pk)
        keep = keys | set(exact)
        parts = []
        for name in present:
            col = self.column(name)
            if col is not None and col.type is float and name not in keep:
                parts.append(f"round({alias}.{name}, {digits}) as {name}")
            else:
                parts.append(f"{alias}.{name}")
        return ", ".join(parts)

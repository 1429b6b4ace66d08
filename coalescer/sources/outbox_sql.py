"""The SQL of the outbox: its PostgreSQL NOTIFY trigger, and the statements a node runs.

Shared by the writers (``coalescer.integrations``: the SQLAlchemy table and the Django
migration create the trigger) and the source (``coalescer.sources.outbox``). Table
names come from the rules file, checked there (``name`` or ``schema.name``, letters,
digits and ``_``), and are quoted here.
"""

from __future__ import annotations

from coalescer.config.sources import DEFAULT_OUTBOX_TABLE

__all__ = ["DEFAULT_OUTBOX_TABLE", "channel", "postgres_ddl", "quoted"]


def _parts(table: str, schema: str | None) -> tuple[str | None, str]:
    if schema is None and "." in table:
        schema, table = table.split(".", 1)
    return schema, table


def quoted(table: str, schema: str | None = None) -> str:
    """``table`` (``name`` or ``schema.name``) as a quoted SQL identifier."""
    found_schema, name = _parts(table, schema)
    parts = [*([found_schema] if found_schema else []), name]
    return ".".join('"' + part.replace('"', '""') + '"' for part in parts)


def channel(table: str, schema: str | None = None) -> str:
    """The NOTIFY channel of an outbox table: its name, schema-qualified if given one."""
    found_schema, name = _parts(table, schema)
    return f"{found_schema}.{name}" if found_schema else name


def postgres_ddl(table: str, schema: str | None = None) -> list[str]:
    """The statements that make ``table`` NOTIFY its channel once per transaction that
    inserts rows into it (identical notifications of one transaction are delivered
    once, at commit). Idempotent: safe to run again."""
    found_schema, name = _parts(table, schema)
    full = quoted(name, found_schema)
    function = quoted(f"{name}_notify", found_schema)
    trigger = quoted(f"{name}_notify")
    listen = channel(name, found_schema).replace("'", "''")
    return [
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN PERFORM pg_notify('{listen}', ''); RETURN NULL; END $$",
        f"DROP TRIGGER IF EXISTS {trigger} ON {full}",
        f"CREATE TRIGGER {trigger} AFTER INSERT ON {full} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
    ]

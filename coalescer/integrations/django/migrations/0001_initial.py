"""The outbox table, and on PostgreSQL the trigger that NOTIFYs the nodes."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models

from coalescer.sources.outbox_sql import DEFAULT_OUTBOX_TABLE, postgres_ddl


def notify_trigger(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for statement in postgres_ddl(DEFAULT_OUTBOX_TABLE):
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="OutboxTouch",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("key", models.TextField()),
                ("item", models.TextField(null=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
            ],
            options={"db_table": DEFAULT_OUTBOX_TABLE},
        ),
        migrations.RunPython(notify_trigger, migrations.RunPython.noop),
    ]

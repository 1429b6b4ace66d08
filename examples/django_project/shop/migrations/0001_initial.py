"""The shop's tables: orders and each customer's stats."""

from __future__ import annotations

from typing import ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies: ClassVar[list[tuple[str, str]]] = []

    operations: ClassVar[list[migrations.operations.base.Operation]] = [
        migrations.CreateModel(
            name="CustomerStats",
            fields=[
                ("customer_id", models.IntegerField(primary_key=True, serialize=False)),
                ("orders", models.IntegerField()),
                ("total_cents", models.IntegerField()),
                ("refreshed_at", models.DateTimeField(auto_now=True)),
            ],
        ),
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("customer_id", models.IntegerField(db_index=True)),
                ("total_cents", models.IntegerField()),
            ],
        ),
    ]

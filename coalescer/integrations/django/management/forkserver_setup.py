"""Imported first by the fork server that starts the child processes of plain-function
handlers (``isolation: process``, the default; ``manage.py coalescer run`` has it
preloaded there): it sets Django up in that server, so every child forked from it can
import models.

A set-up that fails here is left to fail again, with its cause, where the child
imports the handler (the node reports it on the rule's runs).
"""

from __future__ import annotations

import contextlib

import django

with contextlib.suppress(Exception):
    django.setup()

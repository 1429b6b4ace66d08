"""``python -m coalescer.cli``: the ``coalescer`` command."""

from __future__ import annotations

import sys

from coalescer.cli.main import main

sys.exit(main())

"""Logging set-up for every ``tft-bridge`` command.

Imports nothing of the bridge, so any command (``bridge.cli``, the platform agent, the
simulations) can import it at module level.
"""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: str) -> None:
    """Plain lines to stderr under journald (``JOURNAL_STREAM`` set: it stamps each line
    itself), timestamped lines otherwise."""
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)

"""``python -m bridge.platform [options]``: the same as ``tft-bridge platform [options]``."""

import sys

from bridge.platform.cli import main

sys.exit(main())

"""The real controller with no bridge: a test drives its notify functions by hand.

Run as ``python -m tests.conformance.bare_controller --world-size N --port P`` with the
real MindIO build on PYTHONPATH. Each callback prints one line ``CALLBACK {"name": ...,
"args": [...]}``; each stdin line ``NAME JSON-ARGS`` calls
``tft_notify_controller_NAME(*args)`` (a JSON object with decimal keys becomes a rank
map) and prints ``NOTIFY {"name": ..., "rc": ...}``. For facts about the controller
alone, e.g. what a notify the bridge withholds would have done.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _arg(value: Any) -> Any:
    if isinstance(value, dict) and all(key.isdigit() for key in value):
        return {int(key): int(kind) for key, kind in value.items()}
    return value


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    options = parser.parse_args()
    from mindio_ttp import controller_ttp as m

    def callback(name: str) -> Any:
        def record(*args: Any) -> int:
            print("CALLBACK " + json.dumps({"name": name, "args": _plain(args)}), flush=True)
            return 0
        return record

    for name in ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result"):
        assert m.tft_register_mindx_callback(name, callback(name)) == 0
    m.tft_init_controller(-1, options.world_size, False, True, False)
    m.tft_start_controller("127.0.0.1", options.port, False, "")
    print("READY", flush=True)
    for line in sys.stdin:
        name, _, text = line.strip().partition(" ")
        if not name:
            continue
        args = [_arg(arg) for arg in json.loads(text or "[]")]
        rc = getattr(m, f"tft_notify_controller_{name}")(*args)
        print("NOTIFY " + json.dumps({"name": name, "rc": rc}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

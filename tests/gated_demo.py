"""``python -m tests.gated_demo demo --scenario NAME ...``: ``tft-bridge demo``, unchanged,
except that the fault waits for a line on stdin.

The demo injects its fault about a second after the bridge subscribes, which can be before
any scraper has read the bridge's metrics once. A dashboard test needs the state before the
fault in Prometheus (rate() and increase() need a sample on each side of an event), so it
starts this, waits until Prometheus has scraped the bridge, then writes the line. The gate
is the only difference: it holds the first ``SimulatedJob.subscribed`` the demo awaits.
"""

from __future__ import annotations

import asyncio
import sys

from bridge import cli
from bridge.sim import scenario

GATE_TIMEOUT = 120.0  # seconds: the test writes the line long before; never wait forever
GATE_PROMPT = "gated_demo: subscribed, waiting for a line on stdin to inject the fault"

_subscribed = scenario.SimulatedJob.subscribed
_opened = False


async def _gated_subscribed(self: scenario.SimulatedJob, timeout: float = 10.0) -> None:
    """The demo's wait for the subscription, then (once) the wait for the line."""
    global _opened
    await _subscribed(self, timeout)
    if _opened:
        return
    _opened = True
    loop = asyncio.get_running_loop()
    line: asyncio.Future[None] = loop.create_future()
    stdin = sys.stdin.fileno()
    loop.add_reader(stdin, lambda: line.done() or line.set_result(None))
    print(GATE_PROMPT, flush=True)
    try:
        await asyncio.wait_for(line, GATE_TIMEOUT)
    finally:
        loop.remove_reader(stdin)


def main(argv: list[str]) -> int:
    """Install the gate (only in this process: importing the module changes nothing), run the CLI."""
    scenario.SimulatedJob.subscribed = _gated_subscribed  # type: ignore[method-assign]
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

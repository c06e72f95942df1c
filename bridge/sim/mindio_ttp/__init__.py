"""A faithful, stateful stub of the MindIO TFT controller (``mindio_ttp.controller_ttp``).

The real controller is unforgiving, and a kinder stand-in would hide the bugs that kill
training jobs. So this stub reproduces, from the controller's sources and from runs of a
real build (shared/spec/mindio-tft-controller.md, shared/spec/deep/tft-research.md):

* the API: names, signatures, defaults, 0/1 returns, ``Exception`` from init,
  ``SystemExit(2)`` from start, a real listening socket, destroy that blocks;
* one state-machine thread that runs every callback synchronously and is blocked until
  it returns (each wait's timeout starts afterwards); callback durations are recorded;
* the fault flow in its observed order, including the second report_fault_ranks, the
  deferred report_result(0) after one training step, the strategy lists, 405/406/499,
  dump, exit (no report_result), pause/continue, downgrade/upgrade and hot switch;
* the one-slot wake-up that is not cleared before the first wait of a fault flow: a
  duplicated, stale or racing notify is consumed as the wrong event and the controller
  exits (see ``_engine``);
* the punishments: an Exception in report_fault_ranks / report_stop_complete /
  report_strategies kills the flow; a BaseException aborts the process (recorded in
  ``training.aborted``, the test process survives); destroy from inside a callback
  deadlocks (recorded in ``training.violations``, the call returns).

Use::

    from bridge.sim import mindio_ttp
    mindio_ttp.install()                      # import mindio_ttp.controller_ttp -> the stub
    from bridge.sim.mindio_ttp import training
    training.reset(); training.wait_time = 0.3; training.connect_ranks(range(8))
    ...register callbacks, init, start...
    training.inject_fault({0: 0})             # rank 0 reports a UCE; the flow starts
    training.wait_callback("report_fault_ranks")

Modules: ``_constants`` (names, codes, messages, transitions), ``_engine`` (the wake-up
slot, waits, reports, notify handlers), ``_flows`` (one method per state), ``_controller``
(thread, start, destroy), ``_server`` (the socket), ``_registry`` (callbacks),
``_training`` (the test-facing job and observations), ``_log`` (records), ``_api`` (the
public functions).
"""

from __future__ import annotations

import sys
from types import ModuleType

from . import controller_ttp
from ._constants import State
from ._log import Record
from ._training import Rank, Training, training

__all__ = ["Rank", "Record", "State", "Training", "controller_ttp", "install", "training", "uninstall"]


def install() -> None:
    """Make ``import mindio_ttp.controller_ttp`` return this stub (idempotent). Refuses
    to shadow a real ``mindio_ttp`` that is already imported."""
    this = sys.modules[__name__]
    present = sys.modules.get("mindio_ttp")
    if present is not None and present is not this:
        raise RuntimeError(f"a different mindio_ttp is already imported ({present!r}); not installing the stub")
    sys.modules["mindio_ttp"] = this
    sys.modules["mindio_ttp.controller_ttp"] = controller_ttp


def uninstall() -> None:
    """Undo ``install`` (only the entries that point at this stub)."""
    this: ModuleType = sys.modules[__name__]
    if sys.modules.get("mindio_ttp") is this:
        del sys.modules["mindio_ttp"]
    if sys.modules.get("mindio_ttp.controller_ttp") is controller_ttp:
        del sys.modules["mindio_ttp.controller_ttp"]

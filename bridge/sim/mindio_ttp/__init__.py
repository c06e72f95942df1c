"""A faithful, stateful stub of the MindIO TFT controller (``mindio_ttp.controller_ttp``).

The real controller is unforgiving, and a kinder stand-in would hide the bugs that kill
training jobs. So this stub reproduces, from the controller's sources and from runs of a
real build (docs/mindio-controller.md, the reference to read before changing it):

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
  deadlocks (recorded in ``training.violations``, the call returns);
* the real timings by default (``REAL_TIMINGS``): report_fault_ranks 2.0 s after a rank
  raises, report_result 2.3 s after change_strategy retry and 2.9 s after the restarted
  ranks of a recover registered, destroy blocking 5 s. A bridge tuned on a faster
  stand-in is too tight against the real controller, so speed is opt-in and visible:
  ``training.use_timings(FAST_TIMINGS)`` or ``SimulatedJob(controller_timings=...)``;
* ``MINDIO_WAIT_MINDX_TIME`` read from the environment at ``tft_init_controller`` and from
  nowhere else (``training.wait_mindx_time`` shows what was read), so a bridge that does
  not export its configured wait is caught; ``training.wait_scale`` only runs the MindX
  waits and pause timeouts on a faster clock in the stub's own unit tests;
* destroy as observed: while the controller waits for a notify it ends in FINAL (via
  EXIT); during a retry repair no report_result follows; during the recover wait a 406
  arrives while destroy blocks;
* the node agent's pod restart (``training.restart_pods``, ``training.devices_per_pod``):
  a recover restarts every rank of a pod holding a process-faulty rank, and a repair
  that finds a rank restarted under it that it was not told about hangs, as the real
  one does when it is given fewer ranks than ClusterD's globalFault named;
* dead ranks as observed: one killed in normal training is reported about 10 s later
  (``heartbeat_loss_time`` + ``fault_detect_delay``), one killed while training is
  paused for a recovery (after stop-complete, before the strategy) only in that
  cycle's second report_fault_ranks, if silent ``heartbeat_loss_time`` by then, and
  never after; a recover whose repair meets a dead rank fails (406) after
  ``repair_action_timeout``.

Known differences, kept on purpose (docs/mindio-controller.md section 9): the aborts and
deadlocks above are recorded instead of happening; ranks are simulated through
``training``, not TCP processors; no TLS and no log files; the NORMAL loop polls every
20 ms instead of 2 s; bind retries last 0.5 s instead of ~5 s; only the retry and recover
repairs take time (one block in REPAIR), downgrade, upgrade, migration and dump none;
destroy blocks ``destroy_delay`` and then for the current action; backup controllers
and the X1 strategy generator are not simulated.

The bridge loads it by name only (``controller.module = "stub"``:
``bridge.job.host.controller.STUB_PACKAGE``); the product never imports it. Use::

    from bridge.sim import mindio_ttp
    mindio_ttp.install()                      # import mindio_ttp.controller_ttp -> the stub
    from bridge.sim.mindio_ttp import training
    training.reset(); training.use_timings(mindio_ttp.FAST_TIMINGS)
    os.environ["MINDIO_WAIT_MINDX_TIME"] = "1"  # read at init, like the real one
    training.connect_ranks(range(8))
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

from bridge.sim.mindio_ttp import controller_ttp
from bridge.sim.mindio_ttp._constants import State
from bridge.sim.mindio_ttp._log import Record
from bridge.sim.mindio_ttp._training import FAST_TIMINGS, REAL_TIMINGS, Rank, Training, training

__all__ = ["FAST_TIMINGS", "REAL_TIMINGS", "Rank", "Record", "State", "Training", "controller_ttp", "install",
           "training", "uninstall"]


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

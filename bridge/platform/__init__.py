"""A reference AI-platform policy agent for ClusterD's platform mode (seed 003).

ClusterD lets a platform steer process-level recovery through PodGroup annotations.
The real server is unforgiving (docs/clusterd.md section 10): one space
in a fault string makes it recover with no ranks at all; a ProcessConfirmFault or
ProcessResultFault left from the last cycle fails the next fault with 509 (or answers
it with stale faults); a missing or wrong RankTableReady stalls ``recover`` for 300 s
and then falls back. ``tft-bridge platform`` is one cluster-level agent that gets all
of that right for every platform-mode PodGroup it watches.

How the agent knows a fault cycle is starting
----------------------------------------------
It does not, at first, and cannot: ClusterD's first platform step polls
``ProcessRecoverStrategy`` (every 3 s, up to 300 s, 508 afterwards) *before* it sends
stopTrain or writes anything, so the platform learns of the fault only from the
``ProcessConfirmFault`` ClusterD writes *after* that step. Hence two strategies:

* a **standing** strategy (policy ``standing_strategy``, ``dump`` by default) is kept
  written on every platform-mode PodGroup between cycles, so the first step always
  passes at once; it is refreshed whenever the policy changes (SIGHUP) and after every
  cycle;
* when ClusterD's ``ProcessConfirmFault`` appears, that *is* the start of the cycle for
  the agent: it reads the faults (ClusterD's own lenient parse; dropped, rejected and
  poisoned elements counted), merges the faults its pluggable source knows (none by
  default), decides the **answer** strategy from the policy (retry for retryable-only
  faults, recover when RankTableReady can be asserted, dump otherwise; per-namespace
  overrides), and writes strategy, ``ProcessResultFault`` (strict canonical form, always
  ``format_faults`` output) and ``RankTableReady`` in **one** patch. ClusterD re-reads
  the strategy right after it sees the result, so it always gets the answer meant for
  that result.

After the cycle
---------------
``ProcessRecoverStatus`` (or, for the exit path that writes none, the FaultRetry
``pause`` of the ``process-recover-enable`` label; or, failing both, a timeout) ends
the step, and the agent clears what ClusterD never clears: ProcessConfirmFault,
ProcessResultFault, RankTableReady, and resets ProcessRecoverStrategy to ``""``. The
key is reset rather than deleted because ClusterD decides platform mode by the key's
*presence* (frozen at the job's first Init): deleting it would silently turn platform
control off when the job next restarts. The standing value is written again right
after the reset. The previous status stays visible until the next answer deletes it
(so the next status write, even of the same value, is a visible change).

Every write is a merge patch conditioned on the resourceVersion it was decided on
(409 -> re-read, re-decide); the watch survives expiry (410 -> list again) and API
server restarts (back off, list again). Module map: ``annotations`` (keys, a PodGroup
view), ``confirm`` (fault strings in and out), ``policy`` (the TOML rules), ``cycle``
(the per-PodGroup state machine, pure), ``sources`` (platform fault sources), ``kube``
(the official client, imported lazily: the bridge daemon never needs it), ``watcher``
(list and watch on a thread), ``agent`` (the asyncio controller), ``metrics``, ``cli``;
``sim`` holds the stand-in API server and ClusterD used by the tests.
"""

from __future__ import annotations

from bridge.platform.cli import add_platform_parser, cmd_platform

__all__ = ["add_platform_parser", "cmd_platform"]

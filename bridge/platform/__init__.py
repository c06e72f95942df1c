"""``tft-bridge platform``: a reference AI-platform agent for ClusterD's platform mode.

One agent per cluster steers process-level recovery through the annotations of every
platform-mode PodGroup it watches (those carrying ``ProcessRecoverStrategy``), as
ClusterD reads them (docs/clusterd.md section 10):

* between cycles it keeps a **standing** strategy written (policy ``standing_strategy``,
  ``dump`` by default), because ClusterD waits for a strategy before it writes anything,
  so the agent cannot know a cycle has started until ClusterD's confirm appears;
* when ``ProcessConfirmFault`` appears it reads the faults as ClusterD does, merges those
  of its fault source, decides the **answer** from the policy, and writes the strategy,
  a canonical ``ProcessResultFault`` and ``RankTableReady`` in one patch;
* when the cycle ends (``ProcessRecoverStatus``, the FaultRetry ``pause`` label, or a
  timeout) it clears what ClusterD never clears and resets ``ProcessRecoverStrategy`` to
  ``""`` (the key's presence is what keeps platform mode on), then writes the standing
  strategy again.

Every write is a merge patch conditioned on the resourceVersion it was decided on. Module
map: ``annotations`` (keys, a PodGroup view), ``confirm`` (fault strings in and out),
``policy`` (the TOML rules), ``cycle`` (the per-PodGroup state machine, pure),
``sources`` (platform fault sources), ``podgroup_api`` (the bounded PodGroup calls),
``agent`` (the asyncio controller, over :class:`bridge.core.kube_watch.ListWatcher`),
``metrics``, ``cli``. The Kubernetes client is imported only when the agent runs.
"""

from __future__ import annotations

from bridge.platform.cli import add_platform_parser, cmd_platform

__all__ = ["add_platform_parser", "cmd_platform"]

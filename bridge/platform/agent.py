"""The platform agent: watches PodGroups and answers ClusterD's platform-mode cycles.

Shape: a controller in the Kubernetes sense. A watch thread (``watcher``) keeps a cache
of the platform-mode PodGroups (those carrying ``ProcessRecoverStrategy``) current; each
received version is *observed* (``cycle.observe``: short-lived states such as the
FaultRetry pause are caught here, before coalescing can hide them) and its key queued.
A few workers take keys from the queue, one PodGroup at a time per key, and apply the
next step of ``cycle.next_step`` until there is nothing left to do. A periodic resync
queues every key again, for the time-based rules and policy reloads.

Every write is a JSON merge patch carrying the ``metadata.resourceVersion`` the decision
was made on, so the API server refuses it (409 Conflict) if anything changed since:
ClusterD writing its confirm or status, another agent replica, an operator. On a
conflict the worker re-reads the PodGroup and decides again; the agent never
overwrites a change it has not seen. API errors back the key off (jittered, capped)
and try again; a deleted PodGroup is forgotten.

The Kubernetes client is synchronous: reads and writes run in worker threads
(``asyncio.to_thread``), each with its own timeout; the watch has a thread of its own.
Lifecycle: ``async start()`` (workers and resync, then the watch) and ``async stop()``
(the watch, then the tasks), both on the agent's event loop; ``run`` is start, wait for
``request_stop`` (any thread's signal handler on the loop) or a dying part, stop. A
dying watch thread or task stops the agent with ``failure`` set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from bridge.platform import cycle
from bridge.platform.annotations import CONFIRM, RANK_TABLE_READY, PodGroupView, resource_version_newer
from bridge.platform.confirm import read_confirm, result_for
from bridge.core.kube import Conflict, KubeError, NotFound, RequestFailed
from bridge.platform.podgroup_api import PodGroupApi
from bridge.platform.metrics import PlatformMetrics
from bridge.platform.policy import Policy, Situation, decide
from bridge.platform.sources import FaultSource, FaultSourceError, NoFaults, ask
from bridge.core.backoff import Backoff
from bridge.core.kube_watch import Changed, Delivery, Listed, ListWatcher

log = logging.getLogger("tft_bridge.platform")

Key = tuple[str, str]
T = TypeVar("T")


@dataclass(frozen=True)
class AgentSettings:
    """Scope, periods and limits of one agent (the ``tft-bridge platform`` options)."""
    namespace: str | None = None  # None: all namespaces
    selector: str | None = None  # a label selector, e.g. "platform=ours"
    resync_seconds: float = 30.0
    stale_after: float = 1800.0  # no end of cycle seen for this long: clear anyway
    watch_timeout: int = 300  # the server ends each watch after this long; then re-watch
    source_timeout: float = 5.0
    workers: int = 4
    max_conflicts: int = 5  # conflicts in a row on one PodGroup before it backs off
    backoff_initial: float = 0.2
    backoff_max: float = 30.0


class PlatformAgent:
    """The agent's cache, queue and workers; every method but :meth:`request_stop` runs on
    the event loop :meth:`start` ran on."""

    def __init__(self, api: PodGroupApi, policy: Policy, settings: AgentSettings | None = None,
                 metrics: PlatformMetrics | None = None, fault_source: FaultSource | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.policy = policy
        self.settings = settings or AgentSettings()
        self.metrics = metrics or PlatformMetrics()
        self.fault_source: FaultSource = fault_source or NoFaults()
        self._clock = clock
        self._cache: dict[Key, PodGroupView] = {}
        self._memory: dict[Key, cycle.Memory] = {}
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._active: set[Key] = set()
        self._retry_handles: dict[Key, asyncio.TimerHandle] = {}
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._synced = asyncio.Event()
        s = self.settings
        self._watcher = ListWatcher(api, s.namespace, s.selector, self._deliver_threadsafe, self.metrics,
                                    on_death=self._watch_died, watch_timeout=s.watch_timeout,
                                    backoff=Backoff(s.backoff_initial, s.backoff_max))
        self._tasks: list[asyncio.Task[None]] = []
        #: what ended the agent early (a dying watch thread or task); None after a requested stop
        self.failure: str | None = None
        self.metrics.bind_podgroup_count(lambda: len(self._cache))

    # ----------------------------------------------------------------- lifecycle

    async def run(self) -> int:
        """start, wait for :meth:`request_stop` or a dying part, stop: 0, or 1 after a
        dying part (``failure`` says which)."""
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.stop()
        if self.failure is not None:
            log.error("platform agent ended: %s", self.failure)
            return 1
        return 0

    async def start(self) -> None:
        """Start the workers and the resync, then the watch thread."""
        self._loop = asyncio.get_running_loop()
        s = self.settings
        self._tasks = [asyncio.create_task(self._worker(i), name=f"platform-worker-{i}") for i in range(s.workers)]
        self._tasks.append(asyncio.create_task(self._resync(), name="platform-resync"))
        for task in self._tasks:
            task.add_done_callback(self._task_ended)
        self._watcher.start()
        log.info("platform agent started: namespace=%s selector=%s policy=%s",
                 s.namespace or "(all)", s.selector or "(none)", self.policy.origin)

    async def stop(self) -> None:
        """Stop the watch thread, then cancel the tasks and the pending retries."""
        await asyncio.to_thread(self._watcher.stop)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for handle in self._retry_handles.values():
            handle.cancel()
        log.info("platform agent stopped")

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop (the loop's thread, e.g. a signal handler)."""
        self._stop.set()

    def _fail(self, failure: str) -> None:
        """A part died (on the loop): the agent stops with ``failure`` set."""
        if self.failure is None:
            self.failure = failure
        self._stop.set()

    def _watch_died(self, error: BaseException) -> None:
        """The watch thread failed (called on it): stop the agent from its loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._fail, f"the PodGroup watch thread failed: {error!r}")
            except RuntimeError:  # the loop closed between the check and the call
                pass

    async def wait_synced(self, timeout: float) -> bool:
        """Whether the first list arrived within ``timeout`` (tests, start-up logs)."""
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def set_policy(self, policy: Policy) -> None:
        """Use ``policy`` from now on (a reload); every PodGroup is looked at again."""
        self.policy = policy
        for key in list(self._cache):
            self._enqueue(key)

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        """A worker or the resync ended (only a cancel is expected): a failure stops the agent."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("platform task %s failed", task.get_name(), exc_info=error)
            self.metrics.loop_errors.inc()
        self._fail(f"the task {task.get_name()} ended: {error!r}")

    # ----------------------------------------------------------------- ingest (loop thread)

    def _deliver_threadsafe(self, delivery: Delivery) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._ingest_delivery, delivery)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    def _ingest_delivery(self, delivery: Delivery) -> None:
        try:
            if isinstance(delivery, Listed):
                seen: set[Key] = set()
                for obj in delivery.items:
                    view = PodGroupView.from_object(obj)
                    seen.add(view.key)
                    self._ingest(view)
                for key in set(self._cache) - seen:
                    self._forget(key)
                self._synced.set()
            elif isinstance(delivery, Changed):
                view = PodGroupView.from_object(delivery.obj)
                if delivery.kind == "DELETED":
                    self._forget(view.key)
                else:
                    self._ingest(view)
        except Exception:
            log.exception("could not take in a PodGroup update")
            self.metrics.loop_errors.inc()

    def _ingest(self, view: PodGroupView, from_watch: bool = True) -> None:
        """Take in one version of a PodGroup, from the watch, a write's answer or a re-read.

        Those three arrive out of order (a write's answer can come back after the watch
        already delivered ClusterD's next change, or the PodGroup's deletion), so a
        version older than the cached one is dropped when the resourceVersions can be
        compared (``resource_version_newer``; they are global to the resource, so this
        holds across a delete and re-create too), and only the watch may add a PodGroup
        or replace it by another of the same name. Where versions cannot be compared, the
        conditional writes still keep a decision made on a stale version harmless.
        """
        cached = self._cache.get(view.key)
        if not from_watch and (cached is None or cached.uid != view.uid):
            return
        if cached is not None and resource_version_newer(view.resource_version, cached.resource_version) is False:
            return
        if not view.platform_mode:
            if view.key in self._cache:
                log.warning("%s/%s: ProcessRecoverStrategy was removed; no longer managed. ClusterD keeps "
                            "platform mode until the job's next Init and waits 300 s (508) at every fault "
                            "meanwhile", view.namespace, view.name)
            self._forget(view.key)
            return
        self._cache[view.key] = view
        memory = self._memory.setdefault(view.key, cycle.Memory())
        seen = cycle.observe(view, memory, self._clock())
        if seen.new_cycle:
            self.metrics.confirms.inc()
            log.info("%s/%s: ClusterD asks to confirm faults %r", view.namespace, view.name, view.confirm[:200])
        if seen.new_status:
            self.metrics.status_ended(seen.new_status)
            log.info("%s/%s: ClusterD wrote ProcessRecoverStatus=%s", view.namespace, view.name, seen.new_status)
        for key, kind in seen.invalid:
            self.metrics.malformed.labels(key, kind).inc()
            log.warning("%s/%s: %s=%r is not a value ClusterD accepts", view.namespace, view.name, key,
                        view.annotations.get(key, "")[:200])
        self._enqueue(view.key)

    def _forget(self, key: Key) -> None:
        self._cache.pop(key, None)
        self._memory.pop(key, None)
        handle = self._retry_handles.pop(key, None)
        if handle is not None:
            handle.cancel()

    # ----------------------------------------------------------------- queue

    def _enqueue(self, key: Key) -> None:
        if key in self._queued:
            return
        self._queued.add(key)
        if key not in self._active:
            self._queue.put_nowait(key)

    async def _worker(self, index: int) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._active.add(key)
            try:
                await self._reconcile(key)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s/%s: reconcile failed", *key)
                self.metrics.loop_errors.inc()
                self._retry_later(key)
            finally:
                self._active.discard(key)
                if key in self._queued:
                    self._queue.put_nowait(key)

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            for key in list(self._cache):
                self._enqueue(key)

    def _retry_later(self, key: Key) -> None:
        memory = self._memory.get(key)
        if memory is None or self._loop is None:
            return
        memory.failures += 1
        delay = min(self.settings.backoff_max, self.settings.backoff_initial * 2 ** (memory.failures - 1))
        old = self._retry_handles.pop(key, None)
        if old is not None:
            old.cancel()
        self._retry_handles[key] = self._loop.call_later(delay, self._retry_now, key)

    def _retry_now(self, key: Key) -> None:
        self._retry_handles.pop(key, None)
        if key in self._cache:
            self._enqueue(key)

    # ----------------------------------------------------------------- reconcile

    async def _reconcile(self, key: Key) -> None:
        """Apply the next step to one PodGroup; on a conflict, re-read and decide again."""
        for _ in range(self.settings.max_conflicts):
            view = self._cache.get(key)
            memory = self._memory.get(key)
            if view is None or memory is None:
                return
            rules = self.policy.rules_for(view.namespace)
            step = cycle.next_step(view, memory, rules, self._clock(), self.settings.stale_after)
            if step.kind is cycle.Kind.NOTHING:
                memory.failures = 0
                return
            try:
                if step.kind is cycle.Kind.ANSWER:
                    written = await self._answer(view, memory)
                elif step.kind is cycle.Kind.CLEAR:
                    written = await self._patch("clear", view, cycle.clear_patch(view, rules, step))
                    self._cleared(view, memory, step)
                else:
                    written = await self._patch("arm", view, cycle.arm_patch(view, rules))
                    self.metrics.strategies.labels(rules.standing_strategy, "standing").inc()
                    log.info("%s/%s: standing ProcessRecoverStrategy=%s written", *key, rules.standing_strategy)
            except Conflict:
                self.metrics.conflicts.inc()
                log.info("%s/%s: %s refused with 409 (changed meanwhile); re-reading", *key, step.kind.value)
                try:
                    fresh = PodGroupView.from_object(await self._call("get", self.api.get, *key))
                except NotFound:
                    self._forget(key)
                    return
                except KubeError as error:
                    self._failed(key, "re-read", error)
                    return
                if fresh.uid != view.uid:
                    return  # deleted and re-created: the watch brings the new one
                self._ingest(fresh, from_watch=False)
                continue
            except NotFound:
                self._forget(key)
                return
            except KubeError as error:
                self._failed(key, step.kind.value, error)
                return
            memory.failures = 0
            # The answer queues the key again: the next step runs on the written version
            # (or a newer one), after other PodGroups waiting in the queue had their turn.
            self._ingest(PodGroupView.from_object(written), from_watch=False)
            return
        log.warning("%s/%s: %d conflicts in a row; trying again later", *key, self.settings.max_conflicts)
        self._retry_later(key)

    def _failed(self, key: Key, what: str, error: KubeError) -> None:
        level = logging.ERROR if isinstance(error, RequestFailed) else logging.WARNING
        log.log(level, "%s/%s: %s failed: %s; trying again later", *key, what, error)
        self._retry_later(key)

    async def _answer(self, view: PodGroupView, memory: cycle.Memory) -> dict[str, Any]:
        """Read ClusterD's confirm, merge the platform's faults, decide, write it all at once."""
        reading = read_confirm(view.confirm)
        seen_at = memory.confirm_seen_at  # the watch may deliver our own write before we return
        platform: dict[int, int] = {}
        try:
            platform = await ask(self.fault_source, view.namespace, view.name, reading.faults,
                                 self.settings.source_timeout)
        except FaultSourceError as error:
            self.metrics.source_errors.inc()
            log.warning("%s/%s: fault source failed (%s); answering with ClusterD's faults only",
                        view.namespace, view.name, error)
        faults, text = result_for(reading.faults, platform)
        rules = self.policy.rules_for(view.namespace)
        decision = decide(rules, Situation(
            faults=faults,
            # Poisoned: ClusterD merges its own copy of the confirm back in and runs on no
            # ranks whatever the answer says. Empty: nothing to retry or recover.
            unusable=reading.poisoned or not faults,
            after_failed_retry=cycle.after_failed_retry(view),
            rank_table_ready=view.annotations.get(RANK_TABLE_READY, ""),
        ))
        written = await self._patch("answer", view, cycle.answer_patch(view, decision, text))
        # Counted once the answer is stored, so a conflict's retry does not count twice.
        for kind, count in reading.malformed_counts().items():
            self.metrics.malformed.labels(CONFIRM, kind).inc(count)
        if reading.malformed_counts():
            log.warning("%s/%s: ProcessConfirmFault %r is malformed (dropped %r, rejected %r, poisoned %s); "
                        "answered %r", view.namespace, view.name, view.confirm[:200], reading.clusterd.dropped[:5],
                        reading.clusterd.rejected[:5], reading.poisoned, text[:200])
        if seen_at is not None:
            self.metrics.answer_seconds.observe(max(0.0, self._clock() - seen_at))
        memory.answer_rv = str((written.get("metadata") or {}).get("resourceVersion") or "")
        # A pause the watch delivered while the write was on its way may be newer.
        memory.pause_pending = memory.last_pause_rv is not None \
            and resource_version_newer(memory.last_pause_rv, memory.answer_rv) is True
        self.metrics.answers.labels(decision.strategy).inc()
        self.metrics.strategies.labels(decision.strategy, "answer").inc()
        log.info("%s/%s: answered %s with ProcessResultFault=%r (%s)", view.namespace, view.name,
                 decision.strategy, text[:200], decision.reason)
        return written

    def _cleared(self, view: PodGroupView, memory: cycle.Memory, step: cycle.Step) -> None:
        self.metrics.clears.labels(step.reason).inc()
        if view.strategy != "":
            self.metrics.strategies.labels("none", "reset").inc()
        if step.reason == "paused":
            memory.pause_pending = False
        memory.wait_signature = None
        log.info("%s/%s: cleared the cycle's keys (%s)", view.namespace, view.name, step.reason)

    async def _patch(self, operation: str, view: PodGroupView, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(operation, self.api.patch, view.namespace, view.name, body)

    async def _call(self, operation: str, function: Callable[..., T], *args: Any) -> T:
        started = time.monotonic()
        try:
            result = await asyncio.to_thread(function, *args)
        except KubeError as error:
            self.metrics.api_requests.labels(operation, type(error).__name__.lower()).inc()
            raise
        finally:
            self.metrics.api_seconds.labels(operation).observe(time.monotonic() - started)
        self.metrics.api_requests.labels(operation, "ok").inc()
        return result

"""``tft-bridge node``: one service per node that gives every opted-in job whose
controller pod is bound here its bridge, and never orphans one.

One loop (``run``) owns all state; the pod watch (``ListWatcher`` over ``PodApi``)
hands it what the API server says through a queue, Events leave through another
(``EventPoster``), and the metrics endpoint reads only ``targets`` (a list replaced
whole, never mutated). Either thread dying stops the service with exit 1 (systemd
restarts it; the bridges keep running). Each pass of the loop (``reconcile``):

1. evaluates every opted-in pod of the node (``podspec.evaluate``): the controller pods
   get a ``JobSpec`` or a ``Refusal`` (an Event on the pod once per reason, a log line,
   ``tft_bridge_node_refusals_total{reason}``); one whose host IP the kubelet has not
   written yet is waited for (a ``host_ip_unknown`` refusal only after ``node.host_ip_wait``);
   every other pod is counted by why it is ignored (``tft_bridge_node_ignored_pods``), with
   an Event where it looks meant to be served (no ``RANK``);
2. looks at every bridge it runs or adopted: one that ended on its own follows the
   per-job unit's exit-code contract (75 and 76: a fresh bridge; 1, a signal: restarted
   within the start limit; 0: an operator stopped it, left stopped; 2: refused);
3. stops a bridge only on positive evidence that its job is gone from this node -- the
   pod deleted, terminal, or replaced by a pod with another UID (the same job restarted:
   a new incarnation; pod 0 rescheduled elsewhere) -- read from a complete list or
   confirmed by a GET of the pod, never inferred from a watch that broke or an API server
   that does not answer; and then only once the bridge's controller counts no rank
   (``tft_bridge_controller_ranks_connected``) or ``node.ranks_leave_wait`` has passed;
4. starts the bridges of served jobs that have none, from the pod alone.

A start of the service adopts every bridge recorded under ``node.state_root``
(``launcher.py``) before it reports READY to systemd, and every pass of the loop feeds the
service's own watchdog (a loop that hangs gets the service restarted, which adopts the
bridges again); a stop of the service (SIGTERM, an upgrade, a crash) leaves them
running: nothing restarts a bridge under a running job but its own exit code.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import queue
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bridge.core.config import ConfigError
from bridge.core.kube import KubeError, NotFound
from bridge.core.kube_watch import Changed, Delivery, Listed, ListWatcher
from bridge.core.listen_ports import free_port, release
from bridge.core.state_dir import safe_component
from bridge.core.systemd import Notifier
from bridge.node.config import NodeConfig
from bridge.node.jobconfig import job_raw, validated, write_job_config
from bridge.node.kube import PodApi
from bridge.node.launcher import UNKNOWN_EXIT, BridgeProcess, Launcher, Record, adopt_launcher, records
from bridge.node.metrics import NodeMetrics, Target, read_sample
from bridge.node.podspec import HostIpPending, Ignored, JobSpec, Refusal, evaluate, is_terminal, meta, pod_uid

log = logging.getLogger("tft_bridge.node")

EXIT_RESCHEDULED = 75  # bridge/job/daemon.py: killMaster
EXIT_CONTROLLER_ENDED = 76  # bridge/job/daemon.py: the controller ended on its own
EXIT_CONFIG = 2
RANKS_GAUGE = "tft_bridge_controller_ranks_connected"
#: The bridge keys a pod's variables become, to name them in a refusal.
POD_SOURCES = {"controller.wait_mindx_time": "MINDIO_WAIT_MINDX_TIME", "controller.world_size": "WORLD_SIZE or "
               "MS_WORKER_NUM", "controller.port": "TTP_PORT", "clusterd.address": "MINDX_SERVER_IP"}
CONFIRM_INTERVAL = 5.0  # a pod that left the view is asked about at most this often
SWEEP_INTERVAL = 60.0  # finished jobs' directories are looked at this often
EVENT_QUEUE = 256


@dataclass
class Served:
    """One job's bridge on this node, run or adopted by the service."""

    spec: JobSpec | None  # None: adopted, its pod not seen yet
    record: Record
    directory: Path
    process: BridgeProcess
    adopted: bool = False
    starts: deque[float] = field(default_factory=deque)  # monotonic times, for the start limit
    stop_evidence: str = ""  # why it is being stopped ("" = it is not)
    stop_since: float = 0.0
    terminated: bool = False  # SIGTERM sent
    last_confirm: float = 0.0
    exit_code: int | None = None  # it ended; the code decides what follows
    restart_at: float = 0.0
    restart_cause: str = ""


class EventPoster:
    """Posts Events from a thread of its own, so an API server that is down or slow never
    holds the loop; a full queue drops (and counts) the newest. :meth:`post` is called on
    the service's loop, before :meth:`start` too (queued); ``on_death`` is called on the
    poster's thread if it fails."""

    def __init__(self, api: PodApi, metrics: NodeMetrics, on_death: Callable[[BaseException], None]) -> None:
        self._api = api
        self._metrics = metrics
        self._on_death = on_death
        self._queue: queue.Queue[tuple[dict[str, Any], str, str, str] | None] = queue.Queue(EVENT_QUEUE)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_reported, name="node-events", daemon=True)
        self._thread.start()

    def post(self, pod: Mapping[str, Any], reason: str, message: str, kind: str = "Warning") -> None:
        try:
            self._queue.put_nowait((dict(pod), reason, message, kind))
        except queue.Full:
            self._metrics.events.labels("dropped").inc()

    def stop(self) -> None:
        """Post what is queued (for at most 5 s), then end the thread; no-op before start."""
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=5)

    def _run_reported(self) -> None:
        try:
            self._run()
        except BaseException as error:
            log.exception("the event poster thread failed")
            self._metrics.loop_errors.inc()
            self._on_death(error)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            pod, reason, message, kind = item
            try:
                self._api.event(pod, reason, message, kind)
                self._metrics.events.labels("ok").inc()
            except KubeError as error:
                log.warning("event %s on pod %s/%s not posted: %s", reason, meta(pod).get("namespace"),
                            meta(pod).get("name"), error)
                self._metrics.events.labels("failed").inc()
            except Exception:
                log.exception("posting an event failed")
                self._metrics.events.labels("failed").inc()


def port_problem(ip: str, port: int) -> str | None:
    """Why the controller could not bind ``ip:port`` now (None: it can)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL:
                return f"{ip} is not an address of this host"
            return f"{ip}:{port} is in use ({error.strerror})"
    return None


def resolve_with_deadline(timeout: float) -> Callable[[str], str | None]:
    """A resolver whose lookup gives up after ``timeout`` (getaddrinfo has no deadline of
    its own; the lookup thread is left to finish on its own)."""

    def resolve(name: str) -> str | None:
        result: list[str] = []

        def lookup() -> None:
            try:
                infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
                if infos:
                    result.append(str(infos[0][4][0]))
            except OSError:
                pass

        thread = threading.Thread(target=lookup, name="node-resolve", daemon=True)
        thread.start()
        thread.join(timeout)
        return result[0] if result else None

    return resolve


class NodeService:
    """The node's reconcile loop and its two threads (pod watch, Event poster). ``run``
    blocks on the caller's thread until :meth:`request_stop` (any thread) or a dying
    thread; ``start``/``stop`` around it are its own. Never stops a bridge on its way out."""

    def __init__(self, config: NodeConfig, api: PodApi, launcher: Launcher, metrics: NodeMetrics, *,
                 bridge_argv: Callable[[Path], list[str]], env: Mapping[str, str] | None = None,
                 resolve: Callable[[str], str | None] | None = None,
                 port_check: Callable[[str, int], str | None] = port_problem,
                 notifier: Notifier | None = None) -> None:
        self.config = config
        self._notifier = notifier or Notifier({})  # {}: no systemd, every call a no-op
        self.api = api
        self.launcher = launcher
        self.metrics = metrics
        self._bridge_argv = bridge_argv
        self._env = env
        self._resolve = resolve or resolve_with_deadline(config.node.resolve_timeout)
        self._port_check = port_check
        self.state_root = Path(config.node.state_root)
        self._deliveries: queue.Queue[Delivery] = queue.Queue()
        self._pods: dict[str, dict[str, Any]] = {}  # pod uid -> pod, the watch's view
        self._listed = False  # a complete list arrived since the start
        self.jobs: dict[str, Served] = {}  # job id -> its bridge
        self._refused: dict[str, Refusal] = {}  # pod uid -> the refusal in force
        self._reported: set[tuple[str, str]] = set()  # (pod uid, reason) already posted
        self._host_ip_waits: dict[str, float] = {}  # pod uid -> when it was first seen without a host IP
        self._given_up: dict[str, str] = {}  # pod uid -> why no bridge is started for it again
        self._given_up_at: dict[str, float] = {}  # pod uid -> when (monotonic), for node.refusal_retry
        self._kept_warned: set[str] = set()
        self._swept = 0.0  # monotonic time of the last retention sweep
        self.targets: list[Target] = []  # read by the metrics thread: replaced whole, never mutated
        #: job id -> whether it has a running bridge, for every job whose controller pod is
        #: served here (refused ones too); read by the metrics thread: replaced whole
        self.served: dict[str, bool] = {}
        self._stop = threading.Event()
        #: what ended the service early (a thread that died), set once from that thread
        self.failure: str | None = None
        self.events = EventPoster(api, metrics, on_death=partial(self._part_died, "event poster"))
        self.watcher = ListWatcher(api, None, config.node.selector, self._deliveries.put, metrics,
                                   on_death=partial(self._part_died, "pod watch"),
                                   watch_timeout=config.kubernetes.watch_timeout, what="Pod")
        metrics.bridges.set_function(lambda: float(len(self.targets)))

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        self._stop.set()

    def _part_died(self, part: str, error: BaseException) -> None:
        """A thread of the service failed (on that thread): the service stops with exit 1."""
        if self.failure is None:
            self.failure = f"the {part} thread failed: {error!r}"
        self._stop.set()

    def start(self) -> None:
        """Adopt the recorded bridges, start the Event poster then the pod watch, tell
        systemd READY."""
        self.adopt()
        self.events.start()
        self.watcher.start()
        self._notifier.ready(f"node {self.config.node_name}: {len(self.jobs)} bridge(s) adopted")

    def stop(self) -> None:
        """Stop the pod watch then the Event poster; the bridges are left running."""
        self.watcher.stop()
        self.events.stop()
        log.info("node service stopped; %d bridge(s) left running: %s", len(self.jobs),
                 ", ".join(sorted(self.jobs)) or "none")

    def run(self) -> int:
        """start, the loop until ``request_stop`` or a dying thread, stop: 0, or 1 after
        a dying thread."""
        self.start()
        interval = self._notifier.watchdog_interval
        pinged = time.monotonic()
        try:
            while not self._stop.is_set():
                if interval is not None and time.monotonic() - pinged >= min(1.0, interval / 4):
                    self._notifier.watchdog()
                    pinged = time.monotonic()
                self._drain(self.config.node.tick)
                try:
                    self.reconcile()
                except Exception:  # one bad pass must not end the service that keeps jobs' bridges
                    log.exception("a reconcile pass failed")
                    self.metrics.loop_errors.inc()
        finally:
            self.stop()
        if self.failure is not None:
            log.error("node service ended: %s; the bridges keep running", self.failure)
            return 1
        return 0

    def _drain(self, timeout: float) -> None:
        try:
            item = self._deliveries.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._apply(item)
            try:
                item = self._deliveries.get_nowait()
            except queue.Empty:
                return

    def _apply(self, delivery: Delivery) -> None:
        if isinstance(delivery, Listed):
            self._pods = {pod_uid(p): p for p in delivery.items if pod_uid(p)}
            self._listed = True
        elif isinstance(delivery, Changed):
            uid = pod_uid(delivery.obj)
            if delivery.kind == "DELETED":
                self._pods.pop(uid, None)
            elif uid:
                self._pods[uid] = delivery.obj

    # ------------------------------------------------------------------ adoption

    def adopt(self) -> None:
        """Every bridge recorded under the state root, running or ended while the service
        was away; nothing is started or stopped here."""
        for directory, record in records(self.state_root):
            launcher = adopt_launcher(record, self.launcher, self._env)
            process = launcher.adopt(directory, record)
            served = Served(None, record, directory, process, adopted=True)
            code = process.poll()
            if code is None:
                log.info("adopted the running bridge of job %s (pod %s/%s, %s)", record.job_id, record.namespace,
                         record.pod_name, record.unit or f"pid {record.pid}")
                self.metrics.adopted.inc()
            else:
                served.exit_code = code
                log.info("the bridge of job %s ended while the node service was away (exit %s)", record.job_id,
                         code)
            self.jobs[record.job_id] = served
        self._publish_targets()

    # ------------------------------------------------------------------ reconcile

    def reconcile(self) -> None:
        now = time.monotonic()
        desired: dict[str, JobSpec] = {}
        refused: dict[str, Refusal] = {}
        ignored: dict[str, int] = {}
        waiting: set[str] = set()
        for uid, pod in self._pods.items():
            if is_terminal(pod) or meta(pod).get("deletionTimestamp"):
                reason = "terminal" if is_terminal(pod) else "deleting"
                ignored[reason] = ignored.get(reason, 0) + 1
                continue
            result = evaluate(pod, host_ip=self.config.node.host_ip,
                              clusterd_address=str((self.config.bridge.get("clusterd") or {}).get("address") or ""),
                              resolve=self._resolve)
            if isinstance(result, HostIpPending):
                waiting.add(uid)
                since = self._host_ip_waits.setdefault(uid, now)
                if now - since < self.config.node.host_ip_wait:
                    ignored["host_ip_pending"] = ignored.get("host_ip_pending", 0) + 1
                    continue
                result = dataclasses.replace(result.refusal, message=f"{result.refusal.message}, "
                                             f"{self.config.node.host_ip_wait:.0f} s (node.host_ip_wait) after the "
                                             f"service first saw the pod")
            if isinstance(result, Ignored):
                ignored[result.reason] = ignored.get(result.reason, 0) + 1
                if result.notify:
                    self._report_ignored(uid, pod, result)
            elif isinstance(result, Refusal):
                refused[uid] = result
            elif isinstance(result, JobSpec):
                if result.job_id in desired:
                    log.warning("two controller pods for job %s on this node (%s, %s); serving the first",
                                result.job_id, desired[result.job_id].pod_name, result.pod_name)
                    continue
                desired[result.job_id] = result
        self._host_ip_waits = {uid: since for uid, since in self._host_ip_waits.items() if uid in waiting}
        self.metrics.set_ignored(ignored)
        for job_id, served in list(self.jobs.items()):
            self._look_after(job_id, served, desired.get(job_id), now)
        self._retry_given_up(now)
        for job_id, spec in desired.items():
            if job_id not in self.jobs and spec.pod_uid not in self._given_up:
                refusal = self._start(spec, "job", now)
                if refusal is not None:
                    refused[spec.pod_uid] = refusal
        for uid, why in self._given_up.items():
            if uid in self._pods and uid not in refused and why:
                refused[uid] = why_refusal(self._pods[uid], why)
        self._report_refusals(refused)
        self._given_up = {uid: why for uid, why in self._given_up.items() if uid in self._pods}
        self._given_up_at = {uid: at for uid, at in self._given_up_at.items() if uid in self._given_up}
        self._publish_targets()
        served = {refusal.job_id: False for refusal in refused.values() if refusal.job_id}
        served.update({job_id: job_id in self.jobs and self.jobs[job_id].exit_code is None for job_id in desired})
        self.served = served
        if self.config.node.retention and now - self._swept >= SWEEP_INTERVAL:
            self._swept = now
            self.sweep(set(desired) | {refusal.job_id for refusal in refused.values()}, time.time())

    # ------------------------------------------------------------------ retention

    def sweep(self, in_view: set[str], wall: float) -> list[Path]:
        """Remove the directories under the state root of jobs that have no bridge here
        (none running, none adopted, none waiting for a restart) and no pod in view, whose
        newest file is older than ``node.retention``; the removed ones."""
        keep = {safe_component(job_id) for job_id in self.jobs} | {safe_component(j) for j in in_view if j}
        removed = []
        if not self.state_root.is_dir():
            return removed
        for directory in self.state_root.iterdir():
            if not directory.is_dir() or directory.is_symlink() or directory.name in keep:
                continue
            try:
                newest = max((entry.stat().st_mtime for entry in directory.iterdir()),
                             default=directory.stat().st_mtime)
            except OSError:
                continue
            if wall - newest < self.config.node.retention:
                continue
            try:
                shutil.rmtree(directory)
            except OSError as error:
                log.warning("%s: the finished job's directory could not be removed: %s", directory, error)
                continue
            log.info("%s: removed, %.0f s after the job's last write (node.retention)", directory, wall - newest)
            removed.append(directory)
        return removed

    def _look_after(self, job_id: str, served: Served, spec: JobSpec | None, now: float) -> None:
        if served.exit_code is None:
            code = served.process.poll()
            if code is not None:
                self._ended(job_id, served, code, now)
        if served.exit_code is not None:
            self._after_exit(job_id, served, spec, now)
            return
        if served.spec is None and spec is not None and spec.pod_uid == served.record.pod_uid:
            served.spec = spec  # an adopted bridge meets its pod again
        if not served.stop_evidence:
            evidence = self._evidence_gone(served, spec, now)
            if evidence:
                served.stop_evidence, served.stop_since = evidence, now
                log.info("job %s: pod %s/%s %s; stopping its bridge once its ranks have left", job_id,
                         served.record.namespace, served.record.pod_name, evidence)
        if served.stop_evidence and not served.terminated:
            self._maybe_terminate(job_id, served, now)

    def _evidence_gone(self, served: Served, spec: JobSpec | None, now: float) -> str:
        """Positive evidence that ``served``'s pod no longer hosts a running job here, or "".
        Before the first complete list nothing is known, so nothing is concluded."""
        uid = served.record.pod_uid
        if spec is not None:
            return "" if spec.pod_uid == uid else "replaced"
        if not self._listed:
            return ""
        pod = self._pods.get(uid)
        if pod is not None:
            if is_terminal(pod):
                return "terminal"
            if meta(pod).get("deletionTimestamp"):
                return "deleted"
            return ""  # still there, only not served now (a refusal): a running job keeps its bridge
        if now - served.last_confirm < CONFIRM_INTERVAL:
            return ""
        served.last_confirm = now
        try:
            current = self.api.get(served.record.namespace, served.record.pod_name)
        except NotFound:
            return "deleted"
        except KubeError as error:
            log.info("job %s: its pod left the view, and the API server cannot confirm it is gone (%s); "
                     "the bridge keeps running", served.record.job_id, error)
            return ""
        if pod_uid(current) != uid:
            return "replaced"
        if is_terminal(current):
            return "terminal"
        if meta(current).get("deletionTimestamp"):
            return "deleted"
        if uid not in self._kept_warned:
            self._kept_warned.add(uid)
            log.warning("job %s: pod %s/%s runs but no longer carries the opt-in label %r; its bridge is kept "
                        "until the job ends", served.record.job_id, served.record.namespace,
                        served.record.pod_name, self.config.node.selector)
        return ""

    def _give_up(self, pod_uid: str, why: str, now: float) -> None:
        """No bridge for this pod until ``node.refusal_retry`` has passed or it is replaced."""
        self._given_up[pod_uid] = why
        self._given_up_at[pod_uid] = now

    def _retry_given_up(self, now: float) -> None:
        """Forget give-ups older than ``node.refusal_retry`` (0: never), so the next pass
        starts the job's bridge again; an operator's stop (exit 0) is never retried."""
        retry = self.config.node.refusal_retry
        if retry <= 0:
            return
        for uid, why in list(self._given_up.items()):
            if why and now - self._given_up_at.get(uid, now) >= retry:
                pod = meta(self._pods.get(uid, {}))
                log.info("pod %s/%s: its bridge is tried again (%s %.0f s ago; node.refusal_retry)",
                         pod.get("namespace"), pod.get("name"), why, now - self._given_up_at[uid])
                del self._given_up[uid], self._given_up_at[uid]
                self._reported.discard((uid, why))  # a new failure is reported again

    def _maybe_terminate(self, job_id: str, served: Served, now: float) -> None:
        waited = now - served.stop_since
        if waited < self.config.node.ranks_leave_wait:
            connected = read_sample(served.record.metrics_port, RANKS_GAUGE, timeout=1.0)
            if connected is None or connected > 0:
                # ranks still attached, or the bridge did not say (busy, stuck): a stop now could
                # orphan them; ranks_leave_wait bounds the wait either way
                return
        served.terminated = True
        served.process.terminate()
        self.metrics.stops.labels(served.stop_evidence).inc()
        log.info("job %s: bridge stopped (%s; waited %.0f s for the ranks)", job_id, served.stop_evidence, waited)

    def _ended(self, job_id: str, served: Served, code: int, now: float) -> None:
        served.exit_code = code
        release(served.record.metrics_port)
        self.metrics.exits.labels(str(code) if code != UNKNOWN_EXIT else "unknown").inc()
        if served.stop_evidence:
            return
        level = logging.INFO if code in (EXIT_RESCHEDULED, EXIT_CONTROLLER_ENDED) else logging.WARNING
        log.log(level, "job %s: its bridge ended on its own with exit %s", job_id,
                code if code != UNKNOWN_EXIT else "unknown")

    def _after_exit(self, job_id: str, served: Served, spec: JobSpec | None, now: float) -> None:
        """What the per-job unit's exit-code contract says, for a job still served here."""
        code = served.exit_code
        if served.stop_evidence or spec is None or spec.pod_uid != served.record.pod_uid:
            if served.stop_evidence or self._listed:
                del self.jobs[job_id]  # stopped on evidence, or its pod is no longer served here
            return
        if served.restart_at:
            if now >= served.restart_at:
                del self.jobs[job_id]
                refusal = self._start(spec, served.restart_cause, now, served.starts)
                if refusal is not None:
                    self._give_up(spec.pod_uid, refusal.reason, now)
            return
        pod = self._pods.get(spec.pod_uid, {})
        if code == 0:
            log.warning("job %s: its bridge was stopped by someone else (exit 0); not restarted until the job's "
                        "pod is replaced", job_id)
            self.events.post(pod, "TftBridgeStopped", "the bridge was stopped (exit 0) by an operator; not "
                             "restarted for this pod", "Warning")
            self._given_up[spec.pod_uid] = ""
            del self.jobs[job_id]
            return
        if code == EXIT_CONFIG:
            self._give_up(spec.pod_uid, "bridge_config", now)
            del self.jobs[job_id]
            return
        cause = {EXIT_RESCHEDULED: "rescheduled", EXIT_CONTROLLER_ENDED: "controller_ended"}.get(code, "failure")
        window = self.config.node.start_limit_interval
        while served.starts and now - served.starts[0] > window:
            served.starts.popleft()
        if len(served.starts) >= self.config.node.start_limit_burst:
            log.error("job %s: its bridge started %d times in %.0f s; giving up (start limit)", job_id,
                      len(served.starts), window)
            self._give_up(spec.pod_uid, "bridge_failing", now)
            del self.jobs[job_id]
            return
        served.restart_at = now + self.config.node.restart_delay
        served.restart_cause = cause

    # ------------------------------------------------------------------ start

    def _start(self, spec: JobSpec, cause: str, now: float, starts: deque[float] | None = None) -> Refusal | None:
        for other_id, other in self.jobs.items():
            if other_id != spec.job_id and other.record.port == spec.port and other.record.bind_ip == spec.bind_ip:
                return refusal_of(spec, "port_taken", f"{spec.bind_ip}:{spec.port} is the controller port of "
                                                      f"job {other_id}'s bridge on this node")
        problem = self._port_check(spec.bind_ip, spec.port)
        if problem is not None:
            reason = "host_ip_mismatch" if "not an address" in problem else "port_taken"
            return refusal_of(spec, reason, f"the controller cannot listen: {problem}")
        directory = self.state_root / safe_component(spec.job_id)
        try:
            validated(job_raw(spec, self.config.bridge, directory, 0))
        except ConfigError as error:
            text = "; ".join(error.problems)
            sources = [f"{key} is the pod's {variable}" for key, variable in POD_SOURCES.items() if key in text]
            return refusal_of(spec, "bridge_config", f"the bridge would refuse the configuration built from the pod "
                                                     f"and the node's [bridge]: {text}"
                                                     + (f" ({'; '.join(sources)})" if sources else ""))
        # Outside the ephemeral range: no connection takes it before the bridge binds it.
        # Given back when the bridge ends (_ended), so years of jobs do not use the range up.
        metrics_port = free_port()
        path = write_job_config(directory, job_raw(spec, self.config.bridge, directory, metrics_port))
        record = Record(job_id=spec.job_id, pod_uid=spec.pod_uid, namespace=spec.namespace,
                        pod_name=spec.pod_name, bind_ip=spec.bind_ip, port=spec.port, metrics_port=metrics_port,
                        launcher=self.launcher.kind)
        if cause == "job" and (directory / "node.json").exists():
            previous = Record.load(directory / "node.json")
            if previous is not None and previous.pod_uid != spec.pod_uid:
                cause = "incarnation"
        try:
            process = self.launcher.start(directory, record, self._bridge_argv(path))
        except OSError as error:
            release(metrics_port)
            log.error("job %s: its bridge could not be started: %s", spec.job_id, error)
            self.metrics.loop_errors.inc()
            return refusal_of(spec, "bridge_failing", f"the bridge could not be started: {error}")
        served = Served(spec, record, directory, process, starts=starts if starts is not None else deque())
        served.starts.append(now)
        self.jobs[spec.job_id] = served
        self.metrics.starts.labels(cause).inc()
        log.info("job %s (%s/%s): bridge started (%s): controller %s:%d, world size %d, ClusterD %s", spec.job_id,
                 spec.namespace, spec.pod_name, cause, spec.bind_ip, spec.port, spec.world_size,
                 spec.clusterd_address)
        self.events.post(self._pods.get(spec.pod_uid, {}), "TftBridgeStarted",
                         f"bridge started ({cause}): controller {spec.bind_ip}:{spec.port}, world size "
                         f"{spec.world_size}, ClusterD {spec.clusterd_address}", "Normal")
        return None

    # ------------------------------------------------------------------ refusals and metrics

    def _report_refusals(self, refused: dict[str, Refusal]) -> None:
        counts: dict[str, int] = {}
        for uid, refusal in refused.items():
            counts[refusal.reason] = counts.get(refusal.reason, 0) + 1
            if (uid, refusal.reason) in self._reported:
                continue
            self._reported.add((uid, refusal.reason))
            self.metrics.refusals.labels(refusal.reason).inc()
            log.error("job %s (pod %s/%s) gets no bridge: %s: %s", refusal.job_id or "?", refusal.namespace,
                      refusal.pod_name, refusal.reason, refusal.message)
            self.events.post(self._pods.get(uid, {"metadata": {"uid": uid, "name": refusal.pod_name,
                                                               "namespace": refusal.namespace}}),
                             "TftBridgeRefused", f"{refusal.reason}: {refusal.message}")
        self._refused = refused
        self._reported = {key for key in self._reported if key[0] in self._pods}
        self.metrics.set_refused(counts)

    def _report_ignored(self, uid: str, pod: Mapping[str, Any], ignored: Ignored) -> None:
        """Once per pod and reason: a log line and a Warning Event on a pod that carries the
        opt-in label but cannot be served as it is."""
        key = (uid, f"ignored:{ignored.reason}")
        if key in self._reported:
            return
        self._reported.add(key)
        log.warning("pod %s/%s is opted in but ignored: %s: %s", ignored.namespace, ignored.pod_name,
                    ignored.reason, ignored.message)
        self.events.post(pod, "TftBridgeIgnored", f"{ignored.reason}: {ignored.message}")

    def _publish_targets(self) -> None:
        self.targets = [(job_id, served.record.metrics_port) for job_id, served in sorted(self.jobs.items())
                        if served.exit_code is None]

    @property
    def refused(self) -> dict[str, Refusal]:
        return dict(self._refused)


def refusal_of(spec: JobSpec, reason: str, message: str) -> Refusal:
    return Refusal(spec.job_id, spec.pod_uid, spec.namespace, spec.pod_name, reason, message)


def why_refusal(pod: Mapping[str, Any], reason: str) -> Refusal:
    m = meta(pod)
    messages = {"bridge_config": "the bridge refused the configuration built for this job (exit 2); see the "
                                 "node service's log",
                "bridge_failing": "the bridge failed to start too often (start limit); see its log"}
    return Refusal("", pod_uid(pod), str(m.get("namespace") or ""), str(m.get("name") or ""), reason,
                   messages.get(reason, reason))

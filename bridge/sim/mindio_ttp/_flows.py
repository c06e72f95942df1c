"""The controller's state actions: what it does in each state, which callbacks it calls,
which notify it waits for, and what it returns (the transition table is in
``_constants.TRANSITIONS``). One method per state, named after the real callback.

The training side (processors) is simulated by ``Training``: a rank's fault, its link,
its heartbeat, the global step. Anything the real controller learns from processor
messages (device stop/clean/repair replies, checkpoint saves) succeeds unless a test
armed a failure with ``training.fail_next_repair`` / ``fail_next_dump``.
"""

from __future__ import annotations

import time

from bridge.sim.mindio_ttp._constants import CHOOSE_ZIT_RANK_SUCCESS, FAILED_ALLOW_DUMP, FAILED_ALLOW_RECOVER, HCCL_ERROR, MSG_CLEAN_NOT_DUMP, MSG_CONTINUE_OK, MSG_DUMP_OK, MSG_DUMP_SAVE_FAILED, MSG_DUMP_UNSUPPORTED, MSG_INVALID_STRATEGY, MSG_INVALID_STRATEGY_ZIT, MSG_ISOLATE, MSG_LAST_REPAIR_FAILED, MSG_MIGRATION_FAILED, MSG_NO_DUPLICATION, MSG_PAUSE_OK, MSG_PAUSE_WAIT_FAILED, MSG_RANK0_DOWNGRADE, MSG_REPAIR_FAILED, MSG_REPAIR_OK, MSG_STOP_OK, NO_PROCESSORS, PROCESS_ERROR, REPAIR_COMMON_ERROR, REPAIR_SUCCESS, UCE_ERROR, Event, RepairType, Ret, msg_device_clean_failed, msg_device_stop_failed
from bridge.sim.mindio_ttp._engine import MindXEngine

MSG_DOWNGRADE_FAILED = "controller do downgarde repair failed"  # sic


class Flows(MindXEngine):
    """State actions. Every method runs on the controller thread, without the lock held
    except in short ``with self.cond`` blocks that never invoke a callback."""

    # ------------------------------------------------------------------ helpers

    def exit_because(self, reason: str) -> Ret:
        """Return STOP_SERVICE (-> EXIT) and remember why, for ``training.exit_reason``."""
        with self.cond:
            self.exit_reason = reason
        self.note("exit", reason)
        return Ret.STOP_SERVICE

    def unexpected(self, expecting: str, got: Event) -> Ret:
        self.note("unexpected event", expecting, str(got))
        return self.exit_because(f"mindx calling action unexpected: got {got} while waiting for {expecting}")

    def bad_ranks(self) -> dict[int, tuple[int, str]]:
        """Registered, non-isolated ranks whose processor reports a fault or whose
        heartbeat is lost: rank -> (fault type, error code). Caller holds the lock."""
        training, now = self.training, time.monotonic()
        bad: dict[int, tuple[int, str]] = {}
        for rank in self.registered:
            info = training.ranks.get(rank)
            if info is None or rank in self.isolated:
                continue
            if info.fault is not None:
                bad[rank] = (info.fault, info.code)
            elif (not info.connected and (not info.unwatched or self.paused_for_recovery)
                  and info.disconnected_at is not None
                  and now - info.disconnected_at > training.heartbeat_loss_time):
                bad[rank] = (PROCESS_ERROR, "")
        return bad

    def check_train_status(self) -> Ret:
        """CheckTrainStatus: advance auto-steps, send the deferred report_result(0) once
        training has stepped past the repair step, and say whether a rank is faulty."""
        training = self.training
        with self.cond:
            bad = self.bad_ranks()
            if not bad:
                training.auto_advance()
            healthy = any(r not in bad and r not in self.isolated for r in self.registered)
            max_step = training.step_count if healthy else 0
            report = self.need_report and max_step > self.repair_step
            if report:
                self.need_report = False
            ready = bool(self.isolated) and self.isolated <= self.prerepair_ready
        if report:
            self.report_result(REPAIR_SUCCESS, MSG_REPAIR_OK)
        if bad:
            return Ret.ERROR
        if ready:
            return Ret.NEED_RETRY
        return Ret.OK

    def do_pause(self) -> bool:
        """DoPause/Prelock: lock the current step on the healthy ranks; fails when no
        step has finished yet (step 0 carries no optimizer data)."""
        with self.cond:
            self.repair_step = self.training.step_count
            return self.repair_step > 0

    def select_error_ranks(self) -> None:
        """SelectErrorRanks: add faulty ranks not yet in the error map, with their codes."""
        with self.cond:
            for rank, (kind, code) in self.bad_ranks().items():
                if rank not in self.errors:
                    self.errors[rank] = kind
                    self.codes[rank] = code

    def check_dp_group(self) -> bool:
        """CheckDpGroup: replica (DP-group) info complete and a locked step > 0."""
        return self.training.replica_info == "complete" and self.repair_step > 0

    def confirm_repair_type(self) -> RepairType:
        with self.cond:
            retry_flag = node_error = False
            for rank, kind in self.errors.items():
                info = self.training.ranks.get(rank)
                if info is not None and info.fault in (UCE_ERROR, HCCL_ERROR):
                    retry_flag = True
                if info is not None and (info.fault == PROCESS_ERROR or not info.connected):
                    node_error = True
                if kind == PROCESS_ERROR:
                    node_error = True
                else:
                    retry_flag = True
        if node_error or not retry_flag:
            if self.arf and self.is_registered:
                return RepairType.ARF
            if self.zit and self.is_registered:
                return RepairType.DOWNGRADE
            return RepairType.DUMP
        return RepairType.RETRY  # processors report retry (enable_uce) switched on

    def generate_strategies(self, prelocked: bool) -> list[str]:
        """GenerateStrategyDefault: always "exit" first."""
        strategies = ["exit"]
        if self.check_dp_group() and prelocked:
            strategies.append("dump")
            self.repair_type = self.confirm_repair_type()
            if self.repair_type is RepairType.RETRY:
                strategies.append("retry")
                if self.arf:
                    strategies.append("recover")
            elif self.repair_type is RepairType.ARF:
                strategies.append("recover")
                if self.zit:
                    strategies += ["downgrade", "upgrade"]
            elif self.repair_type is RepairType.DOWNGRADE:
                strategies += ["downgrade", "upgrade"]
        return strategies

    def already_retried(self) -> bool:
        """Every error rank is one a retry already repaired and none has faulted since."""
        with self.cond:
            ranks = self.training.ranks
            return bool(self.errors) and all(
                rank in self.retried and rank in ranks and ranks[rank].fault is None for rank in self.errors)

    def heal_repaired_ranks(self) -> None:
        """After a successful repair the error ranks train again, from the locked step."""
        training = self.training
        with self.cond:
            if self.repair_type is RepairType.RETRY:
                self.retried |= set(self.errors)
            else:
                self.retried.clear()
            for rank in list(self.errors) + list(self.isolated):
                info = training.ranks.get(rank)
                if info is not None:
                    info.fault, info.code = None, ""
                    if not info.connected:
                        info.connected, info.disconnected_at = True, None
            training.step_count = self.repair_step
            if self.is_registered:
                self.need_report = True

    # ------------------------------------------------------------------ INIT / NORMAL

    def on_init(self) -> Ret:
        """InitCallback: the one-time "all four callbacks registered?" check, then the
        notify handlers exist. Ranks that are already up register now."""
        training = self.training
        with self.cond:
            if self.rank in (-1, 0):  # only a master controller registers with MindX
                self.is_registered = training.registry.all_registered()
            count = training.registry.count()
            self.handlers_ready = True
            for rank, info in training.ranks.items():
                if info.connected and 0 <= rank < self.world_size:
                    self.registered.add(rank)
        self.note("register check", f"{count} actions registered", f"all registered: {self.is_registered}")
        return Ret.OK

    def initialize_variables(self) -> None:
        """InitializeVariables, on every entry into NORMAL: the event slot is reset, the
        wake-up flag is NOT."""
        with self.cond:
            self.started = True
            self.repair_type = RepairType.NONE
            self.can_retry_clean = False
            self.event = Event.NONE
            self.zit_param = ""
            self.isolated = set()
            self.prerepair_ready = set()
            self.errors = {}
            self.codes = {}
            self.hot_switch_ranks = set()
            self.paused_for_recovery = False
            self.cond.notify_all()

    def on_normal(self) -> Ret:
        self.initialize_variables()
        while True:
            with self.cond:
                if self.stopping:
                    break
            status = self.check_train_status()
            with self.cond:
                event = self.event
                hot_switch_ready = self.hot_switch_ranks <= self.hot_switch_registered
            if event in (Event.STOP_TRAIN, Event.ELEGANT_DUMP):
                self.note("NORMAL found mindx event", str(event))
                return Ret.ERROR
            if event is Event.PAUSE_TRAIN:
                return Ret.PAUSE
            if event is Event.HOT_SWITCH and hot_switch_ready:
                return Ret.SWITCH
            if status is Ret.ERROR:
                self.sleep(self.training.fault_detect_delay)
                self.check_train_status()
                return Ret.ERROR
            self.checker_wait(self.training.poll_interval)
        return Ret.STOP_SERVICE

    # ------------------------------------------------------------------ the fault flow

    def on_abnormal(self) -> Ret:
        prelocked = self.do_pause()
        self.select_error_ranks()
        return self.process_repair_flow(prelocked)

    def process_repair_flow(self, prelocked: bool) -> Ret:
        if self.is_registered:
            if self.need_report:
                with self.cond:
                    self.need_report = False
                self.report_result(FAILED_ALLOW_DUMP, MSG_LAST_REPAIR_FAILED)
                return self.wait_dump_or_exit()
            if self.event is Event.ELEGANT_DUMP:
                return Ret.ERROR
            ret = self.inner_interaction()
            if ret is not Ret.OK:
                return ret
            return self.confirm_strategy(prelocked)
        # Standalone (callbacks not all registered): the controller decides alone.
        if not self.check_dp_group() or not prelocked:
            return self.exit_because("standalone: cannot repair")
        self.repair_type = self.confirm_repair_type()
        return Ret.ERROR if self.repair_type is RepairType.DUMP else Ret.OK

    def inner_interaction(self) -> Ret:
        """MindXInnerInteraction: fault_ranks -> stop -> stop_complete -> global_rank ->
        fault_ranks again."""
        if not self.report_fault_ranks():
            return self.exit_because("report_fault_ranks failed")
        if not self.mindx_wait(self.wait_mindx(self.wait_pause_time), "stop_train"):
            return self.exit_because("timed out waiting for stop_train")
        event = self.event
        if event is Event.ELEGANT_DUMP:
            return Ret.ERROR
        if event is not Event.STOP_TRAIN:
            return self.unexpected("stop_train", event)
        code = NO_PROCESSORS if self.training.replica_info == "missing" else REPAIR_SUCCESS
        if not self.report_stop_complete(code, MSG_STOP_OK):
            return self.exit_because("report_stop_complete failed")
        if code == NO_PROCESSORS:
            return self.exit_because("no processor reported its replica info (404)")
        with self.cond:
            self.paused_for_recovery = True
        if not self.mindx_wait(self.wait_mindx(), "on_global_rank"):
            return self.exit_because("timed out waiting for on_global_rank")
        event = self.event
        if event is not Event.NOTIFY_FAULT_RANKS:
            return self.unexpected("on_global_rank", event)
        self.select_error_ranks()
        self.report_fault_ranks()  # the second one; a failure here is only logged
        return Ret.OK

    def confirm_strategy(self, prelocked: bool = True) -> Ret:
        """MindXConfirmStrategy: offer the list, wait max(time, MINDIO_WAIT_MINDX_TIME)."""
        strategies = self.generate_strategies(prelocked)
        if not self.report_strategies(strategies):
            return self.exit_because("report_strategies failed")
        woken = self.mindx_wait(self.wait_mindx(self.wait_hccl_time), "change_strategy")
        with self.cond:
            self.paused_for_recovery = False
        if not woken:
            return self.exit_because("timed out waiting for change_strategy")
        return self.handle_recover_strategy()

    def handle_recover_strategy(self) -> Ret:
        event = self.event
        if event is Event.ARF:
            self.repair_type = RepairType.ARF
            return Ret.OK
        if event is Event.RETRY:
            self.repair_type = RepairType.RETRY
            return Ret.OK
        if event is Event.DOWNGRADE:
            self.repair_type = RepairType.DOWNGRADE
            return Ret.OK
        if event is Event.UPGRADE:
            self.repair_type = RepairType.UPGRADE
            return Ret.OK
        if event is Event.DUMP:
            self.repair_type = RepairType.DUMP
            return Ret.ERROR
        if event is Event.EXIT:
            return self.exit_because("strategy exit")
        if event is Event.INVALID:
            self.report_result(REPAIR_COMMON_ERROR, MSG_INVALID_STRATEGY)
            return self.exit_because("invalid strategy")
        return self.unexpected("change_strategy", event)

    def reconfirm_strategy(self) -> Ret:
        """MindXReConfirmStrategy (after a 405): on_global_rank again, then a new list."""
        if not self.mindx_wait(self.wait_mindx(), "on_global_rank"):
            return self.exit_because("timed out waiting for on_global_rank (after 405)")
        event = self.event
        if event is not Event.NOTIFY_FAULT_RANKS:
            return self.unexpected("on_global_rank", event)
        return self.confirm_strategy()

    def wait_dump_or_exit(self) -> Ret:
        if not self.is_registered:
            return self.exit_because("standalone: repair failed")
        if not self.mindx_wait(self.wait_mindx(), "change_strategy dump or exit"):
            return self.exit_because("timed out waiting for dump or exit")
        event = self.event
        if event is Event.DUMP:
            return Ret.ERROR
        if event is Event.EXIT:
            return self.exit_because("strategy exit")
        return self.unexpected("change_strategy dump or exit", event)

    # ------------------------------------------------------------------ repair

    def on_env_clear(self) -> Ret:
        """EnvClearCallback: device stop + clean on the ranks; a failure reports 499, or
        405 when a clean failed and ARF is on (the rank becomes a process fault)."""
        failure = self.training.take_failure(("device_stop", "device_clean"))
        if failure is None and self.repair_type is RepairType.RETRY and self.already_retried():
            failure = "device_stop"
        if failure is not None:
            result = REPAIR_COMMON_ERROR
            if failure == "device_stop":
                msg = msg_device_stop_failed(self.rank)
            else:
                msg = msg_device_clean_failed(self.rank)
                if self.arf:
                    with self.cond:
                        self.can_retry_clean = True
                        for rank in self.errors:
                            self.errors[rank] = PROCESS_ERROR
                    result = FAILED_ALLOW_RECOVER
            self.report_result(result, msg)
            if self.event is Event.RETRY and self.can_retry_clean:
                ret = self.reconfirm_strategy()
            else:
                ret = self.wait_dump_or_exit()
            if ret is Ret.ERROR:
                self.report_result(REPAIR_COMMON_ERROR, MSG_CLEAN_NOT_DUMP)
                ret = self.exit_because("dump refused after a failed device stop/clean")
            return ret
        if self.repair_type is RepairType.DOWNGRADE:
            return Ret.DOWNGRADE
        return Ret.OK

    def on_repair(self) -> Ret:
        """RepairCallback. A retry's device stop, clean, repair and rollback take
        ``training.retry_repair_time`` (real: 1-5 s, 2.3 s typical) whatever the outcome;
        a destroy meanwhile does not cut it short (the real Destroy waits for this action
        to end) and, since the state machine stops before NORMAL runs, no report_result
        follows."""
        repair_type = self.repair_type
        if repair_type is RepairType.RETRY:
            self.sleep(self.training.retry_repair_time)
        failed = self.training.take_failure(("repair",)) is not None
        if repair_type is RepairType.ARF:
            ret = self.arf_repair(failed)
            if self.event in (Event.DUMP, Event.EXIT, Event.DOWNGRADE):
                if ret is Ret.STOP_SERVICE:
                    return self.exit_because("strategy exit during ARF")
                return ret
            failed = ret is not Ret.OK
        elif repair_type not in (RepairType.RETRY, RepairType.UPGRADE):
            self.note("unknown repair type", repair_type.value)
            return Ret.ERROR
        if failed:
            code = FAILED_ALLOW_DUMP if repair_type in (RepairType.ARF, RepairType.UPGRADE) else REPAIR_COMMON_ERROR
            self.report_result(code, MSG_REPAIR_FAILED)
            return self.wait_dump_or_exit()
        self.heal_repaired_ranks()
        return Ret.OK

    def arf_repair(self, failed: bool) -> Ret:
        """ARFRepair: wait (up to ``training.arf_wait_time``, real ~10 min) for the error
        ranks to be restarted and register again; ClusterD may cut the wait short with
        dump, exit or downgrade, and a destroy ends it as a failure (the real one reported
        406 while its destroy was blocking). With ``training.auto_restart`` MindCluster's
        node agent restarts them at once, and with them every other rank of a pod that
        holds a rank whose process faulted (``Training.restart_pods``). Once they are back,
        the repair itself takes ``training.recover_repair_time`` (real: 2.9 s).

        The repair rebuilds each error rank from a peer. A rank restarted under it that
        is not among the error ranks (the controller was told too few: ClusterD named the
        whole pod, the controller got one rank) lost the state the repair copies from,
        and the repair never completes: the real controller hung there until ClusterD gave
        up with exit. So does this one: no result, only dump, exit, downgrade or a destroy
        end it (``training.repair_hang_ranks`` names the ranks).

        A rank that is neither
        repaired nor alive (its process died during the recovery, after the controller's
        second fault report) fails the repair ``training.repair_action_timeout`` after
        the restarted ranks are back: the real one's repair action to it was never
        answered, and it reported 406.

        With no error ranks at all (a recover after a stop_train without fault ranks,
        ClusterD's answer to a declined NIC switch) the real controller stops and cleans
        every device and then waits for new workers that never come ("arf wait new
        workers register..."): no result until the ARF wait runs out. So does this one."""
        training = self.training
        with self.cond:
            wanted = set(self.errors)
            self.arf_restarted = set()
            dead = {rank for rank, info in training.ranks.items() if info.fault == PROCESS_ERROR}
            dead |= {rank for rank in wanted if rank in training.ranks and not training.ranks[rank].connected}
            restart = training.auto_restart and not failed
        if restart:
            with self.cond:
                for rank in wanted - training.pod_ranks(dead):  # a live process: only its rank
                    info = training.ranks.get(rank)
                    if info is not None:
                        info.fault, info.code, info.connected, info.disconnected_at = None, "", True, None
                        self.arf_restarted.add(rank)
                training.restart_pods(dead)
        deadline = time.monotonic() + training.arf_wait_time
        hang_noted = False
        while True:
            with self.cond:
                event = self.event
                done = bool(wanted) and wanted <= self.arf_restarted
                under = self.arf_restarted - wanted
            if event is Event.DUMP:
                return Ret.ERROR
            if event is Event.EXIT:
                return Ret.STOP_SERVICE
            if event is Event.DOWNGRADE:
                return Ret.DOWNGRADE
            if failed or self.stopping:
                return Ret.ERROR
            if under:
                if not hang_noted:
                    hang_noted = True
                    with self.cond:
                        if self.generation == training.generation:
                            training.repair_hang_ranks = tuple(sorted(under))
                    self.note("repair hangs: ranks restarted under it", sorted(under), sorted(wanted))
                self.checker_wait(training.poll_interval)
                continue
            if done:
                with self.cond:
                    dead = sorted(rank for rank in self.registered - wanted
                                  if rank in training.ranks and not training.ranks[rank].connected)
                if dead:  # the repair's action to them is never answered (real: ActionSend failed)
                    self.note("repair action to dead ranks failed", dead)
                    self.sleep(training.repair_action_timeout)
                    return Ret.ERROR
                self.sleep(training.recover_repair_time)
                return Ret.OK
            if time.monotonic() >= deadline:
                self.note("ARF wait timed out", sorted(wanted - self.arf_restarted))
                return Ret.ERROR
            self.checker_wait(min(training.poll_interval, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ dump / exit

    def on_dump(self) -> Ret:
        if not self.check_dp_group():
            self.report_result(REPAIR_COMMON_ERROR, MSG_DUMP_UNSUPPORTED)
            return Ret.ERROR
        if self.training.take_failure(("dump",)) is not None:
            self.report_result(REPAIR_COMMON_ERROR, MSG_DUMP_SAVE_FAILED)
            return Ret.ERROR
        self.report_result(REPAIR_SUCCESS, MSG_DUMP_OK)
        return Ret.OK

    def on_exit(self) -> Ret:
        """ExitCallback: wait MINDIO_WAIT_MINDX_TIME for MindX to kill the job (any notify
        ends the wait); on timeout tell every processor to exit and destroy itself. When
        an external destroy brought it here (it woke the wait that led to EXIT), it ends
        at once: the real controller reaches FINAL while its destroy is still blocking."""
        with self.cond:
            destroyed = self.stopping
        if destroyed:
            self.note("exit during destroy: no wait")
            return Ret.STOP_SERVICE
        if self.is_registered and self.mindx_wait(self.wait_mindx(), "MindX to kill the job"):
            self.note("exit acknowledged by a notify")
            return Ret.STOP_SERVICE
        training = self.training
        with self.cond:
            training.processors_exited = True
            now = time.monotonic()
            for info in training.ranks.values():
                if info.connected:
                    info.connected, info.disconnected_at = False, now
        self.note("controller told every processor to exit")
        self.destroy_inner()
        return Ret.STOP_SERVICE

    def destroy_inner(self) -> None:
        """Destroy(isInner=true): stop the server; init/start need a full destroy now."""
        raise NotImplementedError

    # ------------------------------------------------------------------ pause

    def on_pause(self) -> Ret:
        self.report_stop_complete(REPAIR_SUCCESS, MSG_PAUSE_OK)  # its result is ignored here
        ret = self.pause_wait()
        if ret is not Ret.OK:
            return ret
        self.report_result(REPAIR_SUCCESS, MSG_CONTINUE_OK)
        return Ret.OK

    def pause_wait(self) -> Ret:
        """Poll for continue (-> NORMAL) or stop_train (-> the fault flow) for the pause
        timeout; a rank fault or the timeout reports 406 and goes to the fault flow."""
        deadline = time.monotonic() + self.pause_seconds()
        while time.monotonic() < deadline:
            with self.cond:
                if self.stopping:
                    return Ret.STOP_SERVICE
            event = self.event
            if event is Event.CONTINUE_TRAIN:
                return Ret.OK
            if event is Event.STOP_TRAIN:
                return Ret.ERROR
            if self.check_train_status() is Ret.ERROR:
                self.sleep(self.training.fault_detect_delay)
                self.check_train_status()
                break
            self.checker_wait(min(self.training.poll_interval, max(0.0, deadline - time.monotonic())))
        self.report_result(FAILED_ALLOW_DUMP, MSG_PAUSE_WAIT_FAILED)
        return Ret.ERROR

    # ------------------------------------------------------------------ ZIT (downgrade / upgrade)

    def on_dg_repair(self) -> Ret:
        with self.cond:
            self.isolated = set(self.errors)
            for rank in self.isolated:
                self.errors.setdefault(rank, PROCESS_ERROR)
            rank0 = 0 in self.errors
        if self.training.replica_info != "complete":
            self.report_result(REPAIR_COMMON_ERROR, MSG_NO_DUPLICATION)
            return self.exit_because("no complete duplication for downgrade")
        if rank0:
            self.report_result(FAILED_ALLOW_DUMP, MSG_RANK0_DOWNGRADE)
            return self.wait_dump_or_exit()
        self.report_result(CHOOSE_ZIT_RANK_SUCCESS, MSG_ISOLATE)
        if self.training.take_failure(("repair",)) is not None:
            self.report_result(FAILED_ALLOW_DUMP, MSG_DOWNGRADE_FAILED)
            return self.wait_dump_or_exit()
        with self.cond:
            if self.is_registered:
                self.need_report = True
        return Ret.OK

    def on_downgrade(self) -> Ret:
        """DowngradeRunning: train without the isolated ranks until they are back and
        ClusterD says upgrade, or a new fault runs the reduced interaction."""
        while True:
            with self.cond:
                if self.stopping:
                    break
            status = self.check_train_status()
            event = self.event
            if status is Ret.NEED_RETRY and event is Event.UPGRADE:
                self.repair_type = RepairType.UPGRADE
                return Ret.NEED_RETRY
            if status is Ret.ERROR or event is Event.STOP_TRAIN:
                return self.zit_new_fault()
            self.checker_wait(self.training.poll_interval)
        return Ret.STOP_SERVICE

    def zit_new_fault(self) -> Ret:
        self.do_pause()
        self.select_error_ranks()
        if self.inner_interaction() is not Ret.OK:
            return Ret.STOP_SERVICE
        if not self.report_strategies(["exit", "dump"]):
            return self.exit_because("report_strategies failed")
        woken = self.mindx_wait(self.wait_mindx(), "change_strategy")
        with self.cond:
            self.paused_for_recovery = False
        if not woken:
            return self.exit_because("timed out waiting for change_strategy")
        event = self.event
        if event is Event.DUMP:
            self.repair_type = RepairType.DUMP
            return Ret.ERROR
        if event is Event.EXIT:
            return self.exit_because("strategy exit")
        self.report_result(REPAIR_COMMON_ERROR, MSG_INVALID_STRATEGY_ZIT)
        return self.exit_because("invalid strategy in zit")

    def on_upgrade(self) -> Ret:
        self.do_pause()
        return Ret.OK

    # ------------------------------------------------------------------ hot switch

    def on_step_finish(self) -> Ret:
        """StepFinishCallback: pause training, offer ``["migration"]`` (``["exit"]`` when
        the pause failed: ``training.fail_next_pause``, or no step finished yet), wait
        MINDIO_WAIT_MINDX_TIME; anything but migration (an exit, a stop switch, the wait
        running out) ends in EXIT."""
        paused = self.do_pause() and self.training.take_failure(("pause",)) is None
        if not self.report_strategies(["migration"] if paused else ["exit"]):
            return self.exit_because("report_strategies failed")
        if not self.mindx_wait(self.wait_mindx(), "change_strategy migration"):
            return self.exit_because("timed out waiting for migration")
        event = self.event
        if event is not Event.MIGRATION:
            return self.unexpected("change_strategy migration", event)
        return Ret.OK

    def on_migration(self) -> Ret:
        if self.training.take_failure(("repair",)) is not None:
            self.report_result(FAILED_ALLOW_DUMP, MSG_MIGRATION_FAILED)
            return self.wait_dump_or_exit()
        with self.cond:
            self.need_report = True
        return Ret.OK

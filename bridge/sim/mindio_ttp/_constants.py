"""Names, codes, messages and the state-transition table of the real MindIO TFT controller.

Everything here is copied in meaning from the controller's sources and from runs of a
real build (docs/mindio-controller.md):
the strings are the ones the callbacks really receive, so a bridge tested against the
stub sees the same ``msg`` and ``curr_strategy`` values it will see in production.
"""

from __future__ import annotations

import enum
from typing import Final


class State(str, enum.Enum):
    """States of the controller's state machine (controller_state_machine.cpp), plus
    three that only the stub needs: before init, after a process abort, and after the
    state-machine thread died on a missing transition."""

    UNINIT = "UNINIT"  # stub: no controller (never initialised, or destroyed)
    INIT = "INIT"
    NORMAL = "NORMAL"
    PAUSE = "PAUSE"
    STEP_FINISH = "STEP_FINISH"
    MIGRATION = "MIGRATION"
    ENV_CLEAR = "ENV_CLEAR"
    REPAIR = "REPAIR"
    ABNORMAL = "ABNORMAL"
    DG_REPAIR = "DG_REPAIR"
    DOWNGRADE = "DOWNGRADE"
    UPGRADE = "UPGRADE"
    DUMP = "DUMP"
    EXIT = "EXIT"
    FINAL = "FINAL"
    ABORTED = "ABORTED"  # stub: a BaseException escaped a callback (the real process aborts)

    def __str__(self) -> str:
        return self.value


class Ret(enum.Enum):
    """Return codes of the state actions (TResult values that drive transitions)."""

    OK = 0
    ERROR = 1
    PAUSE = "pause"
    SWITCH = "switch"
    STOP_SERVICE = "stop_service"
    RERUN = "rerun"
    DOWNGRADE = "downgrade"
    NEED_RETRY = "need_retry"
    REPAIR = "repair"


class Event(str, enum.Enum):
    """MindXEvent: what the last notify asked for. The controller keeps exactly one of
    these (``repairEvent_``), overwritten by every notify; see ``_engine``."""

    NONE = "none"  # MINDX_EVENT_BUTT: reset on every entry into NORMAL
    STOP_TRAIN = "stop_train"
    PAUSE_TRAIN = "pause_train"
    CONTINUE_TRAIN = "continue_train"
    NOTIFY_FAULT_RANKS = "notify_fault_ranks"  # on_global_rank
    HOT_SWITCH = "hot_switch"
    STOP_SWITCH = "stop_switch"
    MIGRATION = "migration"
    DOWNGRADE = "downgrade"
    UPGRADE = "upgrade"
    ARF = "recover"
    RETRY = "retry"
    DUMP = "dump"
    EXIT = "exit"
    INVALID = "invalid"  # a valid name that was not in the last offered list
    ELEGANT_DUMP = "elegant_dump"  # tft_notify_controller_dump (ClusterD save_and_exit)

    def __str__(self) -> str:
        return self.value


class RepairType(enum.Enum):
    """ControllerRepairType: what the controller will do in ENV_CLEAR/REPAIR."""

    NONE = "none"
    RETRY = "retry"
    ARF = "recover"
    DOWNGRADE = "downgrade"
    UPGRADE = "upgrade"
    DUMP = "dump"


#: The four callback actions, in the registry's order.
ACTIONS: Final = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")

#: Strategy names ``tft_notify_controller_change_strategy`` knows, and the event each fires.
STRATEGY_EVENTS: Final[dict[str, Event]] = {
    "retry": Event.RETRY,
    "recover": Event.ARF,
    "downgrade": Event.DOWNGRADE,
    "upgrade": Event.UPGRADE,
    "dump": Event.DUMP,
    "exit": Event.EXIT,
    "migration": Event.MIGRATION,
    "continue": Event.CONTINUE_TRAIN,
}

HOT_SWITCH: Final = "hot switch"
STOP_SWITCH: Final = "stop switch"

# RepairResult codes carried by report_stop_complete / report_result.
REPAIR_SUCCESS: Final = 0
CHOOSE_ZIT_RANK_SUCCESS: Final = 201
NO_PROCESSORS: Final = 404
FAILED_ALLOW_RECOVER: Final = 405
FAILED_ALLOW_DUMP: Final = 406
REPAIR_COMMON_ERROR: Final = 499

# Fault types in a fault dict.
UCE_ERROR: Final = 0
PROCESS_ERROR: Final = 1
HCCL_ERROR: Final = 2
FAULT_TYPES: Final = (UCE_ERROR, PROCESS_ERROR, HCCL_ERROR)

MAX_WORLD_SIZE: Final = 100_000
MAX_ZIT_PARAM_LEN: Final = 1024
MAX_ERROR_CODE_LEN: Final = 15  # report_status error codes are at most 15 characters
WAIT_MINDX_MIN, WAIT_MINDX_MAX, WAIT_MINDX_DEFAULT = 1, 3600, 30
PORT_MIN, PORT_MAX = 1024, 65535
UINT32_MAX: Final = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
TTP_ERROR_VALUE: Final = 1  # the ``ret: N`` in "do repair failed, ret: N"

# Messages, verbatim.
MSG_STOP_OK: Final = "stop ok"
MSG_PAUSE_OK: Final = "Controller pause train success!"
MSG_PAUSE_WAIT_FAILED: Final = "Controller do pause wait failed."
MSG_CONTINUE_OK: Final = "Controller continue training success."
MSG_REPAIR_OK: Final = "Mindio do repair operation ok"
MSG_LAST_REPAIR_FAILED: Final = "do last repair failed!"
MSG_INVALID_STRATEGY: Final = "invalid strategy"
MSG_INVALID_STRATEGY_ZIT: Final = "invalid strategy in zit"
MSG_DUMP_OK: Final = "do dump success"
MSG_DUMP_UNSUPPORTED: Final = "do not support dump!"
MSG_DUMP_SAVE_FAILED: Final = f"DumpCallback: save ckpt failed, ret: {TTP_ERROR_VALUE}"
MSG_REPAIR_FAILED: Final = f"do repair failed, ret: {TTP_ERROR_VALUE}"
MSG_CLEAN_NOT_DUMP: Final = "stop & clean failed! not allowed to dump!"
MSG_ISOLATE: Final = "controller notify isolate ranks."
MSG_NO_DUPLICATION: Final = "controller find no complete duplication to do downgrade running."
MSG_RANK0_DOWNGRADE: Final = "controller find rank 0 in error ranks, not support downgrade."
MSG_MIGRATION_FAILED: Final = "notify hot switch migration failed"


def msg_device_stop_failed(rank: int) -> str:
    return f"controller:{rank} notify device stop failed"


def msg_device_clean_failed(rank: int) -> str:
    return f"controller:{rank} notify device clean failed"


#: g_stateTransItemTable. A (state, ret) pair that is missing ends the state-machine
#: thread silently in the real controller, and in the stub.
TRANSITIONS: Final[dict[tuple[State, Ret], State]] = {
    (State.INIT, Ret.OK): State.NORMAL,
    (State.INIT, Ret.ERROR): State.FINAL,
    (State.NORMAL, Ret.OK): State.NORMAL,
    (State.NORMAL, Ret.ERROR): State.ABNORMAL,
    (State.NORMAL, Ret.PAUSE): State.PAUSE,
    (State.NORMAL, Ret.SWITCH): State.STEP_FINISH,
    (State.NORMAL, Ret.STOP_SERVICE): State.FINAL,
    (State.PAUSE, Ret.OK): State.NORMAL,
    (State.PAUSE, Ret.ERROR): State.ABNORMAL,
    (State.PAUSE, Ret.STOP_SERVICE): State.EXIT,
    (State.STEP_FINISH, Ret.OK): State.MIGRATION,
    (State.STEP_FINISH, Ret.STOP_SERVICE): State.EXIT,
    (State.MIGRATION, Ret.OK): State.NORMAL,
    (State.MIGRATION, Ret.ERROR): State.DUMP,
    (State.MIGRATION, Ret.STOP_SERVICE): State.EXIT,
    (State.ABNORMAL, Ret.OK): State.ENV_CLEAR,
    (State.ABNORMAL, Ret.RERUN): State.NORMAL,
    (State.ABNORMAL, Ret.ERROR): State.DUMP,
    (State.ABNORMAL, Ret.STOP_SERVICE): State.EXIT,
    (State.ENV_CLEAR, Ret.OK): State.REPAIR,
    (State.ENV_CLEAR, Ret.ERROR): State.DUMP,
    (State.ENV_CLEAR, Ret.STOP_SERVICE): State.EXIT,
    (State.ENV_CLEAR, Ret.DOWNGRADE): State.DG_REPAIR,
    (State.DG_REPAIR, Ret.OK): State.DOWNGRADE,
    (State.DG_REPAIR, Ret.ERROR): State.DUMP,
    (State.DG_REPAIR, Ret.STOP_SERVICE): State.EXIT,
    (State.REPAIR, Ret.OK): State.NORMAL,
    (State.REPAIR, Ret.DOWNGRADE): State.DG_REPAIR,
    (State.REPAIR, Ret.ERROR): State.DUMP,
    (State.REPAIR, Ret.STOP_SERVICE): State.EXIT,
    (State.DOWNGRADE, Ret.OK): State.DOWNGRADE,
    (State.DOWNGRADE, Ret.ERROR): State.DUMP,
    (State.DOWNGRADE, Ret.NEED_RETRY): State.UPGRADE,
    (State.DOWNGRADE, Ret.STOP_SERVICE): State.EXIT,
    (State.UPGRADE, Ret.OK): State.ENV_CLEAR,
    (State.UPGRADE, Ret.ERROR): State.DUMP,
    (State.UPGRADE, Ret.STOP_SERVICE): State.EXIT,
    (State.DUMP, Ret.OK): State.EXIT,
    (State.DUMP, Ret.ERROR): State.EXIT,
    (State.EXIT, Ret.STOP_SERVICE): State.FINAL,
}

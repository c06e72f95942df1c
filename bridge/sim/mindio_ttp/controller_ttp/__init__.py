"""Stub of ``mindio_ttp.controller_ttp``: the MindIO TFT controller API, same names,
signatures, defaults, return codes and exceptions as the real package; see
``bridge.sim.mindio_ttp`` for what it simulates and how tests drive it."""

from __future__ import annotations

import atexit

from bridge.sim.mindio_ttp._api import _destroy_at_exit, tft_destroy_controller as tft_destroy_controller, tft_init_controller as tft_init_controller, tft_notify_controller_change_strategy, tft_notify_controller_dump, tft_notify_controller_on_global_rank, tft_notify_controller_prepare_action, tft_notify_controller_stop_train, tft_query_high_availability_switch, tft_register_mindx_callback, tft_start_controller as tft_start_controller

# As in the real package: init/start/destroy are importable but not in __all__.
__all__ = [
    "tft_notify_controller_change_strategy",
    "tft_notify_controller_dump",
    "tft_notify_controller_on_global_rank",
    "tft_notify_controller_prepare_action",
    "tft_notify_controller_stop_train",
    "tft_query_high_availability_switch",
    "tft_register_mindx_callback",
]

atexit.register(_destroy_at_exit)

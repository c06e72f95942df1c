"""Makes the stub controller's ``tft_destroy_controller`` never return (it blocks for an
hour) while it holds the stub's lifecycle lock, which the module's ``atexit`` destroy
takes too -- as the real package registers ``tft_destroy_controller`` with ``atexit``
(docs/mindio-controller.md section 1) and its destroy can block far beyond any bound
mid-flow (section 6). Import it before ``bridge.cli.main(["run", ...])`` with
``controller.module = "stub"``: the bridge then loads this same stub.

Issue 14 item 9: a bridge that gave up on such a destroy then hung in that exit handler,
far past the unit's stop timeout."""

from __future__ import annotations

from bridge.sim import mindio_ttp as _stub

HANG_SECONDS = 3600.0

_stub.install()
_stub.training.destroy_delay = HANG_SECONDS  # destroy sleeps this long holding the lifecycle lock

"""CI sets BRIDGE_REQUIRE_EXTENSIONS=1: a silent fall back to pure Python must fail the run."""

import os

import pytest

import bridge.faults


@pytest.mark.skipif(not os.environ.get("BRIDGE_REQUIRE_EXTENSIONS"), reason="extension not required here")
def test_compiled_codec_is_active() -> None:
    assert bridge.faults.IMPLEMENTATION == "c"
    import bridge.faults._c as compiled

    assert compiled.__file__.endswith((".so", ".pyd"))


def test_implementation_name_matches_functions() -> None:
    expected = "bridge.faults._c" if bridge.faults.IMPLEMENTATION == "c" else "bridge.faults._python"
    assert bridge.faults.format_faults.__module__ == expected

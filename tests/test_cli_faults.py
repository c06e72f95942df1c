"""``tft-bridge faults``: the operator's view of fault strings, exit 2 on bad input."""

from __future__ import annotations

import pytest

from bridge.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_merge_prints_canonical_merged_string(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "faults", "merge", "1:0,4:1", "1:1") == (0, "1:1,4:1", "")


def test_merge_bad_input_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "faults", "merge", "1:0", "4:1, 2:1")
    assert code == 2 and out == ""
    assert "element 1 ' 2:1' at offset 4: rank must be ASCII decimal digits" in err


def test_parse_and_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "faults", "parse", "40:1,7:2")[:2] == (0, "7:2,40:1")
    assert run(capsys, "faults", "format", '{"4": 1, "1": 0}')[:2] == (0, "1:0,4:1")
    assert run(capsys, "faults", "format", '{"4": 7}')[0] == 2
    assert run(capsys, "faults", "format", '[1]')[0] == 2


def test_lenient_parse_shows_what_clusterd_does(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "faults", "parse", "--lenient", "4:1,1:0,bad,7")
    assert code == 0 and out == "1:0,4:1"
    assert "'bad'" in err and "'7'" in err
    code, out, err = run(capsys, "faults", "parse", "--lenient", "4:1, 2:1")
    assert code == 1 and "POISONED" in err


def test_help_on_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["run", "--help"], ["check-config", "--help"], ["demo", "--help"],
                 ["faults", "--help"], ["faults", "merge", "--help"], ["sim-clusterd", "--help"],
                 ["ranktable", "--help"], ["platform", "--help"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 0
        assert "usage: tft-bridge" in capsys.readouterr().out


def test_check_config(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "job.toml"
    good.write_text('job_id = "j"\n[controller]\nmodule = "stub"\n')
    code, out, _ = run(capsys, "check-config", str(good))
    assert code == 0 and '"job_id": "j"' in out and '"module": "stub"' in out
    bad = tmp_path / "bad.toml"
    bad.write_text('[controller]\nport = 1\n')
    code, out, err = run(capsys, "check-config", str(bad))
    assert code == 2 and "controller.port: must be in 1024..65535" in err

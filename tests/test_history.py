"""``tft-bridge history`` against real stores written by the recorder: the table, one
cycle's timeline, JSON, finding a unit's store, and reading while the bridge writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bridge.cli import main
from bridge.job.recorder.history import HistoryError, find_store
from bridge.core.recorder_config import STORE_NAME

from .conftest import eventually_sync
from .test_recorder import make, run_retry_cycle


def history(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["history", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Two closed cycles (a retry, and a retry that failed into recover) and one open."""
    recorder, writer, flow, clock, _ = make(tmp_path)
    run_retry_cycle(recorder, flow, clock, uuid="aaaa-1111")
    clock.advance(60)
    run_retry_cycle(recorder, flow, clock, uuid="bbbb-2222", result=405)
    recorder.signal("changeStrategy", "bbbb-2222", ["change_strategy"], strategy="retry")
    recorder.refused("strategy_not_offered", "changeStrategy", "bbbb-2222", ["change_strategy"], "offered []")
    flow.on_callback("report_result", code=406, strategy="retry")  # the controller gives up on retry
    recorder.callback("report_result", clock(), code=406, strategy="retry")
    recorder.signal("changeStrategy", "bbbb-2222", ["change_strategy"], strategy="exit")
    flow.notified("change_strategy", "bbbb-2222", "exit")
    recorder.notify("change_strategy", 0, clock(), 0.002, strategy="exit")
    recorder.close()
    flow.__init__(clock=clock)  # a fresh controller (the bridge restarted for the rescheduled job)
    flow.on_callback("report_fault_ranks")
    recorder.callback("report_fault_ranks", clock(), faults={7: 2})
    writer.stop()
    return tmp_path


def test_the_table_shows_each_cycle_with_phases_and_who_was_waited_for(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = history(capsys, "--state-dir", str(store))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["START", "CYCLE", "FAULTS", "STRATEGY"]
    first, second, third = lines[1:4]
    assert "aaaa-1111" in first and "success" in first and "retry" in first
    assert "2 ranks: other 1, uce 1 (5:0,6:1)" in first
    assert "stop=3.0s strat=3.5s result=4.2s" in first
    assert "ranks 60% clusterd 40%" in first
    assert "bbbb-2222" in second and " exit " in second
    assert "open" in third and "1 rank: hccl 1 (7:2)" in third
    assert "--cycle UUID" in out


def test_one_cycle_timeline_lists_every_event_under_its_phase(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = history(capsys, "--state-dir", str(store), "--cycle", "bbbb")
    assert code == 0
    assert "outcome   exit  strategy exit" in out
    assert "REFUSED changeStrategy ['change_strategy']: strategy_not_offered (offered [])" in out
    assert "controller report_result code=405 strategy=retry" in out
    assert "ClusterD ReportRecoverStatus -> 0 in 3.0 ms" in out
    assert "notify controller change_strategy exit -> 0" in out
    order = [line.split()[1] for line in out.splitlines() if line.startswith("  ----")]
    assert order == ["fault_to_stop", "stop_to_strategy", "strategy_to_result", "result_to_result",
                     "result_to_exit"]


def test_json_output_is_complete(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = history(capsys, "--state-dir", str(store), "--json", "--last", "2")
    data = json.loads(out)
    assert code == 0 and [c["uuid"] for c in data["cycles"]] == ["bbbb-2222", None]
    assert data["cycles"][1]["open"] is True
    assert set(data["cycles"][0]["summary"]["waits"]) == {"clusterd", "bridge", "controller", "ranks"}
    code, out, _ = history(capsys, "--state-dir", str(store), "--json", "--cycle", "aaaa-1111")
    one = json.loads(out)
    assert one["outcome"] == "success" and one["events"][0]["name"] == "report_fault_ranks"


def test_unknown_cycle_and_missing_store_are_clear_errors(
        store: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = history(capsys, "--state-dir", str(store), "--cycle", "nope")
    assert code == 1 and "no cycle 'nope'" in err
    empty = tmp_path_factory.mktemp("empty")
    code, _, err = history(capsys, "--state-dir", str(empty))
    assert code == 2 and f"no flight-recorder store at {empty / STORE_NAME}" in err


def test_a_config_file_points_at_its_store(store: Path, tmp_path_factory: pytest.TempPathFactory,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    etc = tmp_path_factory.mktemp("etc")
    config = etc / "job1.toml"
    config.write_text(f'job_id = "job-1"\n[recorder]\ndirectory = "{store}"\n')
    try:
        code, out, _ = history(capsys, "--config", str(config))
    except SystemExit:  # pragma: no cover - [recorder] not wired into config yet
        pytest.skip("the [recorder] section is not part of the configuration")
    assert code == 0 and "aaaa-1111" in out
    # The job id from the unit's environment file only: the file alone is not a valid
    # config in an operator's shell, but it still says where the store is.
    env_only = etc / "job3.toml"
    env_only.write_text(f'[recorder]\ndirectory = "{store}"\n[controller]\nworld_size = 16\n')
    code, out, _ = history(capsys, "--config", str(env_only))
    assert code == 0 and "aaaa-1111" in out
    bare = etc / "job2.toml"
    bare.write_text('job_id = "job-2"\n')
    with pytest.raises(HistoryError, match="/var/lib/tft-bridge/job2/recorder.sqlite3"):
        find_store(None, str(bare))
    assert find_store(None, None, {"STATE_DIRECTORY": str(store)}) == store / STORE_NAME


def test_history_reads_a_store_while_the_bridge_writes_it(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    recorder, writer, flow, clock, _ = make(tmp_path)
    writer.start()
    try:
        run_retry_cycle(recorder, flow, clock, uuid="live-1")
        eventually_sync(lambda: writer.closed == 1, 10, what="the first cycle written")
        code, out, _ = history(capsys, "--state-dir", str(tmp_path))
        assert code == 0 and "live-1" in out
        flow.on_callback("report_fault_ranks")
        recorder.callback("report_fault_ranks", clock(), faults={1: 1})
        eventually_sync(lambda: writer.written >= 15, 10, what="the open cycle's first event written")
        code, out, _ = history(capsys, "--state-dir", str(tmp_path), "--json")
        assert [c["open"] for c in json.loads(out)["cycles"]] == [False, True]
    finally:
        writer.stop()


def test_a_stopped_bridges_store_in_a_read_only_directory(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads anything: the read-only fallback cannot be exercised")
    os.chmod(store, 0o500)
    try:
        code, out, _ = history(capsys, "--state-dir", str(store))
        assert code == 0 and "aaaa-1111" in out
    finally:
        os.chmod(store, 0o700)

"""Rank table schema (seed 002) and the atomic write."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from bridge.core.files import write_atomically
from bridge.job.session.rank_table import RankTableError, validate_rank_table

V10: dict[str, Any] = {
    "version": "1.0", "status": "completed",
    "server_group_list": [{
        "group_id": "2", "deploy_server": "0", "server_count": "1",
        "server_list": [{
            "server_id": "10.0.0.1", "server_ip": "10.1.0.1",
            "device": [
                {"device_id": "0", "device_ip": "192.168.1.1", "device_logical_id": "0", "rank_id": "0"},
                {"device_id": "1", "device_ip": "192.168.1.2", "device_logical_id": "1", "rank_id": "1"},
            ],
        }],
    }],
}
V12: dict[str, Any] = {
    "version": "1.2", "status": "completed",
    "server_group_list": [
        {"group_id": "0", "server_count": "1", "server_list": [{"server_id": "10.0.0.9", "server_ip": "10.1.0.9"}]},
        {"group_id": "2", "deploy_server": "1", "server_count": "1",
         "server_list": [{"server_id": "10.0.0.1", "server_ip": "10.1.0.1", "device": [
             {"device_id": "0", "device_ip": "192.168.1.1", "super_device_id": "37748736",
              "device_logical_id": "0", "rank_id": "0"}]}],
         "super_pod_list": [{"super_pod_id": "0", "server_list": [{"server_id": "10.0.0.1"}]}]},
    ],
}


def test_valid_tables_of_both_versions() -> None:
    assert validate_rank_table(json.dumps(V10))["version"] == "1.0"
    assert validate_rank_table(json.dumps(V12))["version"] == "1.2"


def mutated(base: dict[str, Any], change) -> str:  # type: ignore[no-untyped-def]
    table = copy.deepcopy(base)
    change(table)
    return json.dumps(table)


def device(table: dict[str, Any]) -> dict[str, Any]:
    return table["server_group_list"][-1]["server_list"][0]["device"][0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "rank table: expected an object"),
        (mutated(V10, lambda t: t.update(version="2.0")), "version: expected one of 1.0, 1.2"),
        (mutated(V10, lambda t: t.update(status="initializing")), "status: expected 'completed'"),
        (mutated(V10, lambda t: t.pop("server_group_list")), "server_group_list: expected a list"),
        (mutated(V10, lambda t: device(t).update(rank_id=0)), "device[0].rank_id: expected a number as a string, got 0"),
        (mutated(V10, lambda t: device(t).update(rank_id="1")), "rank 1 appears twice"),
        (mutated(V10, lambda t: device(t).pop("device_ip")), "device[0].device_ip: expected a non-empty string"),
        (mutated(V10, lambda t: t["server_group_list"][0].update(server_count=1)), "server_count"),
        (mutated(V10, lambda t: device(t).update(super_device_id="5")), "only version 1.2 has super devices"),
        (mutated(V12, lambda t: t["server_group_list"][1]["super_pod_list"][0].update(super_pod_id="x")),
         "super_pod_list[0].super_pod_id"),
        (mutated(V10, lambda t: t["server_group_list"][0].update(super_pod_list=[])), "only version 1.2 has super pods"),
    ],
)
def test_bad_tables_are_rejected_with_the_place(text: str, message: str) -> None:
    with pytest.raises(RankTableError, match=__import__("re").escape(message)):
        validate_rank_table(text)


def test_atomic_write_mode_and_content(tmp_path: Path) -> None:
    target = tmp_path / "ranktable.json"
    write_atomically(target, "first")
    write_atomically(target, "second")
    assert target.read_text() == "second"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["ranktable.json"]  # no temp file left


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ranktable.json"
    write_atomically(target, "good")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_atomically(target, "new")
    assert target.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["ranktable.json"]

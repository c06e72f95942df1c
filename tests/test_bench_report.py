"""bench/report.py's rewrite of docs/performance.md: a section carried over from an
earlier run says when it ran, and never takes a date it did not run at."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def report_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def performance_page(header: str) -> str:
    return (f"# Performance\n\nWritten by `bench/report.py`{header}; do not edit by hand.\n\n"
            "## fault codec\n\n"
            "Command: `python bench/bench_faults.py` (run 2026-11-20 10:00 UTC, 30 s; targets met).\n\n"
            "## fault after a recovery\n\nCommand: `python bench/bench_refault.py` (about 4 minutes; targets met).\n\n"
            "## Measurements behind the design\n\nhand-written\n")


def test_an_undated_section_of_a_full_report_takes_the_reports_date(tmp_path: Path) -> None:
    report = report_module()
    page = tmp_path / "performance.md"
    page.write_text(performance_page(" on 2026-11-21 09:00 UTC, in 22.0 minutes"))
    sections = report.benchmark_sections(page)
    assert "(run 2026-11-21 09:00 UTC, about 4 minutes" in sections["fault after a recovery"]
    assert "(run 2026-11-20 10:00 UTC, 30 s" in sections["fault codec"]  # its own date kept


def test_an_undated_section_never_takes_the_date_of_an_only_run(tmp_path: Path) -> None:
    """An ``--only`` run dates the sections it ran; the others did not run then."""
    report = report_module()
    page = tmp_path / "performance.md"
    page.write_text(performance_page(" --only fault codec on 2026-11-21 09:00 UTC, in 0.5 minutes"))
    sections = report.benchmark_sections(page)
    refault = sections["fault after a recovery"]
    assert "Command: `python bench/bench_refault.py` (about 4 minutes; targets met)." in refault
    assert "2026-11-21" not in refault

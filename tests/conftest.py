"""Shared fixtures. ``codec`` runs a test once per fault-codec implementation
(the aio-libs propcache/yarl pattern): the compiled twin and the Python reference."""

from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import pytest


@dataclass(frozen=True)
class CodecImplementation:
    is_pure_python: bool

    def __str__(self) -> str:
        return "pure-python" if self.is_pure_python else "c-extension"

    @property
    def module(self) -> ModuleType:
        name = "bridge._faults_py" if self.is_pure_python else "bridge._faults_c"
        return importlib.import_module(name)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--c-extensions",
        action=argparse.BooleanOptionalAction,
        default=not os.environ.get("BRIDGE_NO_EXTENSIONS"),
        help="run the codec tests against the compiled extension too",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--c-extensions"):
        return
    skip = pytest.mark.skip(reason="--no-c-extensions")
    for item in items:
        if "c_extension" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(
    scope="session",
    params=[
        pytest.param(CodecImplementation(False), marks=pytest.mark.c_extension),
        CodecImplementation(True),
    ],
    ids=str,
)
def codec(request: pytest.FixtureRequest) -> ModuleType:
    impl: CodecImplementation = request.param
    if not impl.is_pure_python:
        pytest.importorskip("bridge._faults_c", reason="C extension not built")
    return impl.module

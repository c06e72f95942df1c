"""Build steps pyproject.toml cannot express: the optional Cython codec and the gRPC stubs.

The extension is optional: without a working compiler the install still succeeds and the
package runs on the pure-Python codec (with a warning). BRIDGE_NO_EXTENSIONS=1 skips it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
NO_EXTENSIONS = bool(os.environ.get("BRIDGE_NO_EXTENSIONS")) or sys.implementation.name != "cpython"


def generate_protos() -> None:
    """Compile protos/*.proto into bridge/_proto with package-absolute imports."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted((ROOT / "protos").glob("*.proto")):
        args = [
            "grpc_tools.protoc",
            f"-I{include}",
            f"-Ibridge/_proto={ROOT / 'protos'}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto.name}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


ext_modules = []
if NO_EXTENSIONS:
    print("*** tft-bridge: pure-Python build (BRIDGE_NO_EXTENSIONS set) ***")
else:
    ext_modules = [
        Extension("bridge._faults_c", ["ext/_faults_c.pyx"], optional=True),
    ]

# Editable installs skip build_py, so the stubs are generated here as well.
if any(arg in sys.argv for arg in ("editable_wheel", "develop", "build_ext")):
    generate_protos()

setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPyWithProtos})

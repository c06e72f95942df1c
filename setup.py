"""Build steps pyproject.toml cannot express: the optional Cython codec and the gRPC stubs.

The extension is optional: without a working compiler the install still succeeds and the
package runs on the pure-Python codec (with a warning). BRIDGE_NO_EXTENSIONS=1 skips it.

The sdist carries ``ext/_faults_c.c``, generated from the ``.pyx`` when the sdist is made,
and a build from an unpacked sdist compiles that C and never runs Cython: the C is then
the same on every architecture the sdist is built on, and an aarch64 build under
emulation (where Cython itself runs emulated and takes minutes) only compiles C. A
build from the git tree always cythonizes the ``.pyx``, so a stale ``.c`` left in
``ext/`` by an earlier sdist can never be compiled instead of the source being edited.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
CODEC_PYX = "ext/_faults_c.pyx"
CODEC_C = "ext/_faults_c.c"
# An unpacked sdist has PKG-INFO at its top; a git checkout never does.
FROM_SDIST = (ROOT / "PKG-INFO").is_file() and (ROOT / CODEC_C).is_file()
NO_EXTENSIONS = bool(os.environ.get("BRIDGE_NO_EXTENSIONS")) or sys.implementation.name != "cpython"


def generate_protos() -> None:
    """Compile protos/*.proto into bridge/_proto with package-absolute imports."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted((ROOT / "protos").glob("*.proto"))
    if not protos:
        # Without this the build went on and made a wheel whose bridge._proto was empty:
        # it installed cleanly and failed at the first import of the ClusterD messages.
        raise RuntimeError(f"no protos/*.proto under {ROOT}: the sdist or checkout is incomplete")
    for proto in protos:
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


class SdistWithCodecC(sdist):
    """Cythonize the codec before the file list is made, so MANIFEST.in's
    ``ext/_faults_c.c`` is there to be packed (see the module docstring)."""

    def run(self) -> None:
        from Cython.Build import cythonize

        # As an Extension of its full name: the C then names its module bridge.faults._c,
        # as setuptools' own cythonizing does (a bare .pyx path would make it _faults_c).
        cythonize([Extension("bridge.faults._c", [CODEC_PYX])], force=True, quiet=True)
        super().run()


ext_modules = []
if NO_EXTENSIONS:
    print("*** tft-bridge: pure-Python build (BRIDGE_NO_EXTENSIONS set) ***")
else:
    ext_modules = [
        Extension("bridge.faults._c", [CODEC_C if FROM_SDIST else CODEC_PYX], optional=True),
    ]

# Editable installs skip build_py, so the stubs are generated here as well.
if any(arg in sys.argv for arg in ("editable_wheel", "develop", "build_ext")):
    generate_protos()

setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPyWithProtos, "sdist": SdistWithCodecC})

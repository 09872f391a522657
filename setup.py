"""The one thing pyproject.toml cannot declare: the per-request hot path in C.

kvlc/compiler/request/native/rows.c (a request's rows) and kvlc/runtime/ipc/table.c (a same-host copy's
row table) are plain C libraries (no Python API) that kvlc loads with ctypes; each is built as an
optional extension so that a machine without a C compiler still installs kvlc (the Python reference
then runs, with identical results). py_limited_api names them .abi3.so: they depend on no Python
version, so a built copy loads on another CPython (a GPU host's 3.12).
"""

from setuptools import Extension, setup

def _library(name: str, source: str) -> Extension:
    return Extension(name, [source], py_limited_api=True, optional=True, extra_compile_args=["-O2", "-std=c11"])


setup(ext_modules=[_library("kvlc.compiler.request.native._rows", "kvlc/compiler/request/native/rows.c"),
                   _library("kvlc.runtime.ipc._table", "kvlc/runtime/ipc/table.c")])

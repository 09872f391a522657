"""The one thing pyproject.toml cannot declare: the per-request hot path in C.

kvlc/compiler/request/native/rows.c (a request's rows), kvlc/runtime/ipc/table.c (a same-host copy's
row table) and kvlc/runtime/ipc/bell.c (a same-host peer's doorbell ring) are plain C libraries (no
Python API), kvlc/compiler/request/native/ids.c (a request's block ids read from the engine's lists)
uses Python's limited C API; kvlc loads each with ctypes. Each is built as an optional extension so
that a machine without a C compiler still installs kvlc (the Python reference then runs, with identical
results; without bell.c, NIXL carries every notification). py_limited_api names them .abi3.so: one
built copy loads on another CPython (a GPU host's 3.12).
"""

from setuptools import Extension, setup

def _library(name: str, source: str) -> Extension:
    return Extension(name, [source], py_limited_api=True, optional=True, extra_compile_args=["-O2", "-std=c11"])


setup(ext_modules=[_library("kvlc.compiler.request.native._rows", "kvlc/compiler/request/native/rows.c"),
                   _library("kvlc.compiler.request.native._ids", "kvlc/compiler/request/native/ids.c"),
                   _library("kvlc.runtime.ipc._table", "kvlc/runtime/ipc/table.c"),
                   _library("kvlc.runtime.ipc._bell", "kvlc/runtime/ipc/bell.c")])

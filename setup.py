"""The one thing pyproject.toml cannot declare: the per-request hot path in C.

kvlc/compiler/request/native/rows.c is a plain C library (no Python API) that kvlc loads with ctypes;
it is built as an optional extension so that a machine without a C compiler still installs kvlc
(the pure-Python reference then runs, with identical results). py_limited_api names it .abi3.so:
it depends on no Python version, so a built copy loads on another CPython (a GPU host's 3.12).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvlc.compiler.request.native._rows", ["kvlc/compiler/request/native/rows.c"],
                             py_limited_api=True, optional=True, extra_compile_args=["-O2", "-std=c11"])])

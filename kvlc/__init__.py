"""kvlc — a declarative KV-cache layout compiler and NIXL transfer runtime.

The compiler (``kvlc.compiler``) needs only pydantic, pyyaml, jinja2 and numpy;
the runtime (``kvlc.runtime``) needs nixl and torch (the ``runtime`` extra).
Per request, a program is checked, bound and instantiated by free functions:
``instantiate(bind(program, local_bases, remote_bases), local_ids, remote_ids, num_tokens)``.
"""

from kvlc.compiler import compile_spec, load_plan, load_spec
from kvlc.compiler.pairing.findings import CompatReport, Finding
from kvlc.compiler.pairing.pair import check_pair, pair
from kvlc.compiler.pairing.program import PartKey, TransferProgram
from kvlc.compiler.plan.model import Plan
from kvlc.compiler.request.bind import BoundProgram, bind
from kvlc.compiler.request.check import check_request
from kvlc.compiler.request.instantiate import instantiate
from kvlc.compiler.request.tokens import TokenRange
from kvlc.compiler.spec.models import LayoutSpec
from kvlc.errors import CompatError, CompileError, KvlcError, SpecError, TransferError

__version__ = "0.1.0"

__all__ = ["compile_spec", "load_spec", "load_plan", "Plan", "LayoutSpec", "check_pair", "pair", "TransferProgram",
           "PartKey", "check_request", "bind", "BoundProgram", "instantiate", "TokenRange", "CompatReport", "Finding",
           "KvlcError", "SpecError", "CompileError", "CompatError", "TransferError", "__version__"]

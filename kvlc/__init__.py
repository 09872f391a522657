"""kvlc — a declarative KV-cache layout compiler and NIXL transfer runtime.

The compiler (``kvlc.compiler``) needs only pydantic, pyyaml, jinja2 and numpy;
the runtime (``kvlc.runtime``) needs nixl and torch (the ``runtime`` extra).
"""

from kvlc.compiler import compile_spec, load_plan, load_spec
from kvlc.compiler.pairing.compat import CompatReport, Finding
from kvlc.compiler.pairing.pair import PartKey, TransferProgram, check_pair, pair
from kvlc.compiler.plan.model import Plan
from kvlc.compiler.spec.models import LayoutSpec
from kvlc.errors import CompatError, CompileError, KvlcError, SpecError, TransferError

__version__ = "0.1.0"

__all__ = ["compile_spec", "load_spec", "load_plan", "Plan", "LayoutSpec", "check_pair", "pair", "TransferProgram",
           "PartKey", "CompatReport", "Finding", "KvlcError", "SpecError", "CompileError", "CompatError",
           "TransferError", "__version__"]

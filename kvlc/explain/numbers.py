"""Number formats of ``kvlc explain``: exact bytes and binary units."""

from __future__ import annotations

from kvlc.compiler.plan.model import PlanField
from kvlc.compiler.spec.dtypes import PACKED


def human(n: int) -> str:
    """Bytes in binary units, exact where the unit divides, else 3 significant digits.

    >>> human(268435456), human(65536), human(1000), human(1536 * 1024 * 1024 + 1)
    ('256 MiB', '64 KiB', '1000 B', '1.50 GiB')
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            if n % scale == 0:
                return f"{n // scale} {unit}"
            v = n / scale
            return f"{v:.{max(0, 2 - len(str(int(v))) + 1)}f} {unit}"
    return f"{n} B"


def exact(n: int) -> str:
    """An exact byte count, grouped by thousands: ``268,435,456``."""
    return f"{n:,}"


def both(n: int) -> str:
    """Human units and exact bytes: ``256 MiB (268,435,456)``."""
    h = human(n)
    return h if h.endswith(" B") else f"{h} ({exact(n)})"


def dim_short(f: PlanField, i: int) -> str:
    """Dim ``i`` of a field: ``head=8/8`` (head: local/global); the innermost dim of a packed dtype
    counts bytes of several values each: ``head_dim=64x2`` (fp4_e2m1: 64 bytes of 2 values)."""
    d = f.dims[i]
    packed = PACKED.get(f.dtype, 1) if i == len(f.dims) - 1 else 1
    return f"{d.name}={d.size}" + (f"/{d.global_size}" if d.role == "head" else "") + \
        (f"x{packed}" if packed > 1 else "")


def field_short(f: PlanField) -> str:
    """A field in short form: ``k@0:bf16[token=16,head=8/8,head_dim=128]`` (head: local/global)."""
    dims = ",".join(dim_short(f, i) for i in range(len(f.dims)))
    return f"{f.name}@{f.offset}:{f.dtype}[{dims}]"


"""Number formats of ``kvlc explain``: exact bytes and binary units."""

from __future__ import annotations

from kvlc.compiler.plan.model import PlanField


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


def field_short(f: PlanField) -> str:
    """A field in short form: ``k@0:bf16[token=16,head=8/8,head_dim=128]`` (head: local/global)."""
    dims = ",".join(f"{d.name}={d.size}" + (f"/{d.global_size}" if d.role == "head" else "")
                    for d in f.dims)
    return f"{f.name}@{f.offset}:{f.dtype}[{dims}]"


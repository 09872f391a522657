"""Compatibility findings: what a check looks at (:class:`Pairing`), one :class:`Finding` per mismatch,
all of a pairing in a :class:`CompatReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from kvlc.collapse import collapse_lines
from kvlc.compiler.plan.model import Plan

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Pairing:
    """What a compatibility check looks at: both plans, the local rank and the direction."""

    local: Plan
    remote: Plan
    local_rank: int
    direction: str


@dataclass(frozen=True)
class Finding:
    """One compatibility finding: ``code`` (stable, for tests and tools), where, both values."""

    code: str
    severity: Severity
    message: str
    region: str = ""
    field: str = ""
    local: str = ""
    remote: str = ""
    fix: str = ""

    def __str__(self) -> str:
        where = ".".join(p for p in (self.region, self.field) if p)
        text = f"{self.severity} [{self.code}]{' ' + where if where else ''}: {self.message}"
        if self.local or self.remote:
            text += f" (local {self.local or '-'}, remote {self.remote or '-'})"
        if self.fix:
            text += f"; fix: {self.fix}"
        return text


@dataclass(frozen=True)
class CompatReport:
    """Every finding of one pairing, errors first in the order checked."""

    local: str
    remote: str
    direction: str
    local_rank: int
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    @property
    def ok(self) -> bool:
        return not self.errors

    def codes(self) -> tuple[str, ...]:
        return tuple(f.code for f in self.findings)

    def summary(self) -> dict:
        """The report as JSON-ready data (``kvlc pair --json``)."""
        return {"compatible": self.ok, "direction": self.direction, "local": self.local, "remote": self.remote,
                "local_rank": self.local_rank, "findings": [asdict(f) for f in self.findings]}

    def render(self) -> str:
        head = (f"pair {self.local} (rank {self.local_rank}) {self.direction} {self.remote}: "
                f"{'compatible' if self.ok else 'INCOMPATIBLE'}, {len(self.errors)} error(s), "
                f"{len(self.warnings)} warning(s)")
        return "\n".join([head, *(f"  {line}" for line in collapse_lines(str(f) for f in self.findings))])

    def render_errors(self) -> str:
        return "\n".join([f"cannot pair {self.local} with {self.remote}:",
                          *(f"  {line}" for line in collapse_lines(str(f) for f in self.errors))])

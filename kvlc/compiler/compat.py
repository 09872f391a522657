"""Compatibility of two plans: every finding at once, with a code and both sides' values.

:func:`check_plans` never raises for a mismatch; errors block pairing, warnings
do not. Checked once, at pairing (start-up), never per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from typing import Literal

from kvlc.compiler.plan import Plan, PlanField, PlanRegion

Severity = Literal["error", "warning"]


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

    def render(self) -> str:
        head = (f"pair {self.local} (rank {self.local_rank}) {self.direction} {self.remote}: "
                f"{'compatible' if self.ok else 'INCOMPATIBLE'}, {len(self.errors)} error(s), "
                f"{len(self.warnings)} warning(s)")
        return "\n".join([head, *(f"  {f}" for f in self.findings)])

    def render_errors(self) -> str:
        return "\n".join([f"cannot pair {self.local} with {self.remote}:",
                          *(f"  {f}" for f in self.errors)])


def _dims_text(f: PlanField) -> str:
    return "(" + ",".join(f"{d.name}={d.global_size if d.role == 'head' else d.size}" for d in f.dims) + ")"


def head_major_order(f: PlanField) -> str:
    """The dim order that keeps a head slice contiguous: head, then token, then the rest."""
    rest = [d.name for d in f.dims if d.role not in ("head", "token")]
    head = [d.name for d in f.dims if d.role == "head"]
    tok = [d.name for d in f.dims if d.role == "token"]
    return "(" + ", ".join(head + tok + rest) + ")"


def _check_fields(lr: PlanRegion, rr: PlanRegion, out: list) -> None:
    lnames = [f.name for f in lr.fields]
    rnames = [f.name for f in rr.fields]
    if sorted(lnames) != sorted(rnames):
        out.append(Finding("field-set", "error", "regions hold different fields", lr.name,
                           local=",".join(lnames), remote=",".join(rnames),
                           fix="declare the same fields on both engines"))
        return
    for lf in lr.fields:
        rf = rr.field(lf.name)
        if lf.dtype != rf.dtype:
            out.append(Finding("field-dtype", "error", "dtypes differ", lr.name, lf.name, lf.dtype, rf.dtype,
                               fix="transfer needs the same dtype; convert after the transfer"))
            continue
        ld = {d.name: d for d in lf.dims}
        rd = {d.name: d for d in rf.dims}
        if set(ld) != set(rd):
            out.append(Finding("field-dims", "error", "dims differ", lr.name, lf.name,
                               ",".join(ld), ",".join(rd), fix="name the same dims on both engines"))
            continue
        for name, a in ld.items():
            b = rd[name]
            if a.role != b.role:
                out.append(Finding("dim-role", "error", f"dim '{name}' has different roles", lr.name,
                                   lf.name, a.role or "plain", b.role or "plain"))
            elif a.role == "head" and a.global_size != b.global_size:
                out.append(Finding("dim-size", "error", f"dim '{name}' holds different head counts",
                                   lr.name, lf.name, str(a.global_size), str(b.global_size)))
            elif not a.role and a.size != b.size:
                out.append(Finding("dim-size", "error", f"dim '{name}' has different sizes", lr.name,
                                   lf.name, str(a.size), str(b.size)))
        if lr.is_state != rr.is_state:
            continue
        if not lr.is_state and lr.block_tokens != rr.block_tokens and lf.dim("token") is None:
            out.append(Finding("token-tiling", "error",
                               "a per-block field (no token dim) cannot be re-tiled across block sizes",
                               lr.name, lf.name, f"{lr.block_tokens} tokens/block",
                               f"{rr.block_tokens} tokens/block",
                               fix="use one kernel block size on both engines or give the field a token dim"))


def check_plans(local: Plan, remote: Plan, local_rank: int, direction: str,
                ) -> CompatReport:
    """Compare two plans for a transfer in ``direction`` from ``local_rank``'s point of view."""
    out: list[Finding] = []
    add = out.append
    if direction not in ("READ", "WRITE"):
        add(Finding("direction", "error", "direction must be READ (pull) or WRITE (push)",
                    local=str(direction)))
    tp = local.parallel.tp_size
    if not 0 <= local_rank < tp:
        add(Finding("rank", "error", "local rank outside the local TP group", local=str(local_rank),
                    remote="", fix=f"use a rank in [0, {tp})"))
    lm, rm = local.model, remote.model
    if lm.name != rm.name:
        add(Finding("model-name", "error", "different models", local=lm.name, remote=rm.name))
    if lm.num_layers != rm.num_layers:
        add(Finding("model-layers", "error", "different layer counts", local=str(lm.num_layers),
                    remote=str(rm.num_layers)))
    for key in sorted(set(lm.sizes) | set(rm.sizes)):
        a, b = lm.sizes.get(key), rm.sizes.get(key)
        if a is not None and b is not None and a != b:
            add(Finding("model-size", "error", f"model size '{key}' differs", local=str(a), remote=str(b)))
    for side, plan in (("local", local), ("remote", remote)):
        if plan.parallel.dcp_size > 1:
            add(Finding("dcp", "error",
                        f"decode context parallelism (dcp_size {plan.parallel.dcp_size}) interleaves tokens "
                        "across ranks; kvlc does not map interleaved tokens yet and refuses rather than "
                        "transfer them to the wrong rank", local=side,
                        fix="pair with dcp_size 1 on both engines"))
    if local.parallel.layers != remote.parallel.layers:
        add(Finding("pp-layers", "error", "engines hold different pipeline layer ranges",
                    local=f"{local.parallel.layers}", remote=f"{remote.parallel.layers}",
                    fix="pair each pipeline stage with the engine holding the same layers"))

    lg = {g.name: g for g in local.groups}
    rg = {g.name: g for g in remote.groups}
    for name in sorted(set(lg) | set(rg)):
        a, b = lg.get(name), rg.get(name)
        if a is None or b is None:
            add(Finding("group-missing", "error", f"group '{name}' exists on one engine only",
                        local="present" if a else "absent", remote="present" if b else "absent"))
        elif (a.kind, a.window) != (b.kind, b.window):
            add(Finding("group-kind", "error", f"group '{name}' differs in kind",
                        local=f"{a.kind} window={a.window}", remote=f"{b.kind} window={b.window}"))

    lnames = [r.name for r in local.regions]
    rnames = [r.name for r in remote.regions]
    rset, lset = set(rnames), set(lnames)
    for r in local.regions:
        if r.name not in rset and not r.optional:
            add(Finding("region-missing", "error", "region exists on the local engine only", r.name,
                        local="present", remote="absent", fix="declare it on both, or mark it optional"))
    for r in remote.regions:
        if r.name not in lset and not r.optional:
            add(Finding("region-missing", "error", "region exists on the remote engine only", r.name,
                        local="absent", remote="present", fix="declare it on both, or mark it optional"))
    common_l = [n for n in lnames if n in rset]
    common_r = [n for n in rnames if n in lset]
    if common_l != common_r:
        first = next(i for i, (a, b) in enumerate(zip(common_l, common_r)) if a != b)
        add(Finding("region-order", "error", "regions appear in a different order", common_l[first],
                    local=f"position {first}: {common_l[first]}", remote=f"position {first}: {common_r[first]}",
                    fix="declare regions in the same order on both engines"))
    for name in common_l:
        a, b = local.region(name), remote.region(name)
        if a.groups != b.groups:
            add(Finding("region-groups", "error", "region belongs to different groups", name,
                        local=",".join(a.groups), remote=",".join(b.groups)))
        if a.is_state != b.is_state:
            add(Finding("token-tiling", "error", "region is per-token on one engine and per-request state "
                        "on the other", name, local="state" if a.is_state else f"{a.block_tokens} tokens",
                        remote="state" if b.is_state else f"{b.block_tokens} tokens"))
        _check_fields(a, b, out)
        if not a.is_state and a.block_tokens and b.block_tokens:
            tile = a.block_tokens * b.block_tokens // gcd(a.block_tokens, b.block_tokens)
            if tile > 4096:
                add(Finding("tile-size", "warning", "block sizes share a large tile", name,
                            local=f"{a.block_tokens}", remote=f"{b.block_tokens}", fix="prefer block sizes "
                            "that divide one another"))
    return CompatReport(local=local.name, remote=remote.name, direction=direction, local_rank=local_rank,
                        findings=tuple(sorted(out, key=lambda f: f.severity != "error")))

"""Pass 4 — build: assemble the frozen, content-hashed :class:`~kvlc.compiler.plan.model.Plan`."""

from __future__ import annotations

from kvlc.compiler.plan.expand import layer_range
from kvlc.compiler.plan.model import Plan, PlanModel, PlanParallel
from kvlc.compiler.plan.resolve import Resolved


def build_plan(res: Resolved) -> Plan:
    """The plan of checked geometry: model identity, parallelism, groups, storages, regions.

    >>> from kvlc.compiler import load_spec
    >>> from kvlc.compiler.plan.expand import expand
    >>> from kvlc.compiler.plan.resolve import resolve
    >>> build_plan(resolve(expand(load_spec("layouts/llama-3.1-8b.yaml")))).parallel.tp_size
    1
    """
    spec = res.spec
    return Plan(
        name=spec.name,
        model=PlanModel(name=spec.model.name, num_layers=spec.model.num_layers,
                        sizes=dict(sorted(spec.model.known_sizes().items()))),
        parallel=PlanParallel(tp_size=spec.parallel.tp_size, pcp_size=spec.parallel.pcp_size,
                              dcp_size=spec.parallel.dcp_size,
                              dcp_interleave=spec.parallel.dcp_interleave, layers=layer_range(spec)),
        groups=res.groups,
        storages=tuple(s.storage for s in res.storages),
        regions=tuple(r.region for r in res.regions),
    )

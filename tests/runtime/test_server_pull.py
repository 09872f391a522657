"""Pull via push, producer side (kvlc.runtime.server.pull_request): the parts it hands the agent.

A stand-in agent records what ``serve_pull`` is given, so the parts can be compared with a push's for the
same ids: only the asking session's share, and a block form on each part exactly where the agent copies
that session's peer by block forms (a GPU's copy kernel reads block ids, as a push's does).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from runtime_engines import tiny_plans

from kvlc import bind, pair
from kvlc.compiler.request.instantiate import instantiate
from kvlc.runtime import server
from kvlc.runtime.channel.wire import PullRequest
from kvlc.runtime.kinds import ConnectionMode


class _Agent:
    """What pull_request asks of a KvAgent, with ``copies_blocks`` as given; records ``serve_pull``."""

    def __init__(self, bound, copies_blocks):
        self.bound, self._blocks, self.asked, self.served = bound, copies_blocks, [], []

    def check_open(self):
        pass

    def is_moving(self, key):
        return False

    def bound_program(self, engine):
        return self.bound

    def copies_blocks(self, peers):
        self.asked.append(list(peers))
        return self._blocks

    def serve_pull(self, s, req, parts, left, refuse):
        self.served.append(parts)


@pytest.fixture(scope="module")
def bound():
    """The TP1 producer x WRITEing into the TP2 consumer y (parts to both of y's ranks)."""
    plans = tiny_plans()
    prog = pair(plans["x"], plans["y"], local_rank=0, direction="WRITE")
    local = {s.name: (1 + i) << 32 for i, s in enumerate(plans["x"].storages)}
    remote = {r: {s.name: (64 + 8 * r + i) << 32 for i, s in enumerate(plans["y"].storages)} for r in (0, 1)}
    return bind(prog, local, remote)


def _pull(agent, rank: int) -> dict:
    session = SimpleNamespace(live=True, mode=ConnectionMode.PULL_VIA_PUSH, conn_id="c1", agent="peer-agent",
                              rank=rank, engine=SimpleNamespace(key="y"))
    msg = PullRequest(req="r1", producer_blocks={"full": (5, 9, 2, 40)}, consumer_blocks={"full": (3, 1)},
                      start=0, stop=60, until=1e18, budget_s=30.0)
    server.pull_request(agent, SimpleNamespace(session=session), msg)
    assert agent.asked == [["peer-agent"]]  # asked about the session's own peer
    (parts,) = agent.served
    return parts


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("forms", [False, True])
def test_a_pull_is_the_sessions_share_with_block_forms_as_the_agent_copies(bound, rank, forms):
    parts = _pull(_Agent(bound, (lambda key: True) if forms else False), rank)
    push = instantiate(bound, {"full": [5, 9, 2, 40]}, {"full": [3, 1]}, tokens=(0, 60))
    share = {k: p for k, p in push.items() if k.peer_rank == rank}
    assert share and list(parts) == list(share)  # this session's share, nothing of the other rank's
    for key, part in parts.items():
        assert (getattr(part, "blocks", None) is not None) is forms, key
        assert np.array_equal(part.local, share[key].local) and np.array_equal(part.remote, share[key].remote)
        assert part.nbytes == share[key].nbytes


def test_a_pull_asks_for_block_forms_only_where_the_agent_says_yes(bound):
    """A test of part keys (the route's VRAM-on-both-sides rule) picks the parts that carry a form."""
    keys = list(instantiate(bound, {"full": [5, 9, 2, 40]}, {"full": [3, 1]}, tokens=(0, 60)))
    yes = {k for k in keys if k.peer_rank == 0}
    parts = _pull(_Agent(bound, lambda key: key in yes), 0)
    assert {k for k, p in parts.items() if getattr(p, "blocks", None) is not None} == yes

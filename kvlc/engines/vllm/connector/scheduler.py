"""The connector's scheduler side: which requests load KV, which hold blocks, what workers do.

Runs in vLLM's EngineCore process. Everything it decides reaches the workers as
:class:`~kvlc.engines.vllm.connector.metadata.KvlcConnectorMetadata` (one per step); what
workers finished comes back through vLLM's own outputs.

Consumer (decode) side: a request given a kvlc prefill engine's ``kv_transfer_params``
loads ``min(remote_num_tokens, prompt length)`` tokens asynchronously (vLLM parks it
in WAITING_FOR_REMOTE_KVS until every worker reports it received). Tokens the local
prefix cache already holds are skipped, at any token offset: the load is the token range
``[cached, n)``, whichever block boundaries of the two engines the hit ends on.

Producer (prefill) side: a request sent with ``{"do_remote_decode": True}`` keeps its
blocks after it finishes (``request_finished`` returns True) until every worker reports
that its consumer is done or the lease ends; the returned dict is
:class:`~kvlc.engines.vllm.connector.params.RemotePrefill`.

Hybrids with Mamba-2 / Gated-DeltaNet state groups: a state block holds the state after
every token computed so far, and the decode engine always computes the last prompt token
itself (vLLM never schedules a request with nothing to compute), so the state it loads must
stop one token short of the prompt: the producer drops a remote-decode request's last prompt
token when it arrives (:meth:`SchedulerSide.on_new_request`; it answers ``remote_num_tokens = n
- 1``) and the consumer loads tokens ``[cached, n - 1)`` plus each state group's one state
block (its last block id, before vLLM's speculative scratch blocks), whatever the cached prefix.
A consumer refuses (computes locally) params whose tokens cover its whole prompt: that state
would count the last token twice. vLLM's NixlConnector does the same (``_prefill_backoff``).

Chunked-local attention (Llama-4) stops one token short too: vLLM frees a request's blocks before the chunk
of the next token it would compute (``ChunkedLocalAttentionManager.get_num_skipped_tokens``), so a producer
that computed all ``n`` prompt tokens has freed, when ``n`` starts a chunk, the chunk that the consumer's
own last token ``n - 1`` attends to. Stopping at ``n - 1`` keeps exactly that chunk, and the consumer loads
only its blocks for those groups (:func:`kvlc.compiler.request.tokens.chunk_start`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvlc.compiler.request.tokens import TokenRange
from kvlc.engines.vllm.connector.config import ConnectorSettings
from kvlc.engines.vllm.connector.metadata import (Hold, KvlcConnectorMetadata, KvlcHandshake, Load, Source,
                                                  plan_block_ids)
from kvlc.engines.vllm.connector.params import RemotePrefill, wants_remote_decode, wants_remote_prefill
from kvlc.engines.vllm.connector.stats import KvlcConnectorStats
from kvlc.errors import KvlcError

log = logging.getLogger("vllm.kvlc")  # under vLLM's logger: its handlers and levels apply
_DONE = "_kvlc_loaded"  # set in a request's params once its load is planned (loaded once)
_SHORT = "_kvlc_one_short"  # set once a hybrid producer dropped the request's last prompt token


def _per_group(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM hands block ids as one list or as one list per group; always per group."""
    if block_ids and isinstance(block_ids[0], int):
        return (tuple(block_ids),)
    return tuple(tuple(int(b) for b in g) for g in block_ids)


def _state_block(ids: tuple[int, ...], scratch: int) -> tuple[int, ...]:
    """A state group's block holding the running state: the last id before ``scratch`` speculative ones.

    >>> _state_block((0, 0, 7, 8, 9), scratch=2), _state_block((5,), scratch=2)
    ((7,), (5,))
    """
    return ids[:len(ids) - min(scratch, len(ids) - 1)][-1:]


def _touched(per_group: Any, tokens: TokenRange, block_size: int,
             state: Mapping[int, int]) -> tuple[tuple[int, ...], ...]:
    """Each group's blocks (of ``block_size`` tokens) that ``tokens`` touches; a state group (index in
    ``state``, with its count of speculative scratch blocks) gives its one state block."""
    first, end = tokens.start // block_size, -(-tokens.stop // block_size)
    return tuple(_state_block(g, state[i]) if i in state else g[first:end]
                 for i, g in enumerate(_per_group(per_group)))


def chunked_groups(kv_cache_config: Any) -> dict[int, int]:
    """vLLM's chunked-local attention groups (Llama-4): group index -> tokens per chunk."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return {i: int(g.kv_cache_spec.attention_chunk_size) for i, g in enumerate(groups)
            if isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec)}


def state_groups(kv_cache_config: Any) -> dict[int, int]:
    """vLLM's Mamba / linear-attention groups: group index -> speculative scratch blocks per request."""
    from vllm.v1.kv_cache_interface import MambaSpec
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return {i: int(g.kv_cache_spec.num_speculative_blocks) for i, g in enumerate(groups)
            if isinstance(g.kv_cache_spec, MambaSpec)}


class SchedulerSide:
    """Scheduler-side state (see the module docstring); its hooks keep vLLM's names."""

    def __init__(self, vllm_config, settings: ConnectorSettings, kv_cache_config: Any = None):
        ktc = vllm_config.kv_transfer_config
        self.engine_id = str(ktc.engine_id)
        self.settings = settings
        # tokens per scheduler block id: with decode context parallelism vLLM's scheduler block is
        # block_size * dcp_size tokens (each DCP rank stores its share in the block of that id)
        dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
        self.block_size = int(vllm_config.cache_config.block_size) * dcp
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.ranks: dict[int, KvlcHandshake] = {}
        self._producing: dict[str, Any] = {}  # prefill requests whose KV a consumer will take
        self._loads: list[Load] = []
        self._holds: list[Hold] = []
        self._dropped: list[str] = []
        self._stats = KvlcConnectorStats()  # requests computed locally despite a remote prefill
        self.state = state_groups(kv_cache_config)  # hybrids: state group index -> scratch blocks
        self.chunked = chunked_groups(kv_cache_config)  # Llama-4: chunked-local group index -> chunk
        # the producer stops one prompt token short: state groups (the state after n - 1 tokens), chunked-local
        # groups (vLLM frees the blocks before token n's chunk, which the consumer's last token may still need)
        self.one_short = bool(self.state or self.chunked)
        # vLLM zeroes new blocks (hybrids, mixed precision), except those a connector loads: loads then end
        # at a block end, so a partly filled last block holds the producer's zeros, not another request's bytes
        self.whole_blocks = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, Any]) -> None:
        for rank, md in metadata.items():
            if not isinstance(md, KvlcHandshake):
                raise KvlcError(f"worker rank {rank} sent {type(md).__name__}, not kvlc's handshake")
            self.ranks[int(rank)] = md

    def _addresses(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        missing = [r for r in range(self.tp_size) if r not in self.ranks]
        if missing:
            raise KvlcError(f"no kvlc address from worker rank(s) {missing}: register_kv_caches did not run")
        ranks = [self.ranks[r] for r in range(self.tp_size)]
        return tuple(r.address for r in ranks), tuple(r.push_address for r in ranks)

    # ------------------------------------------------------------------ consumer
    def _remote(self, request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params) or params.get(_DONE):
            return None
        try:
            return RemotePrefill.from_params(params)
        except KvlcError as exc:
            log.error("kvlc: request %s computes its prompt locally: %s", request.request_id, exc)
            params[_DONE] = True
            self._stats.record_recompute()
            return None

    def may_load_async(self, request) -> bool:
        """Whether :meth:`get_num_new_matched_tokens` may answer an asynchronous load: the request carries
        a kvlc prefill engine's params whose load is not planned yet (cheap: vLLM asks on every queue entry)."""
        params = request.kv_transfer_params
        return wants_remote_prefill(params) and not params.get(_DONE)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        if len(self.ranks) < self.tp_size:  # workers never reported their kvlc addresses
            log.error("kvlc: request %s computes its prompt locally: this engine's workers have no kvlc "
                      "agent (register_kv_caches did not run)", request.request_id)
            self._stats.record_recompute()
            return 0, False
        n = min(remote.remote_num_tokens, request.num_prompt_tokens)
        if self.one_short and n >= request.num_prompt_tokens:
            why = ("state covers all %d prompt tokens, but this hybrid engine computes the last one itself, so "
                   "that state would count it twice" if self.state else
                   "KV covers all %d prompt tokens, so vLLM freed its chunked-local blocks before the last "
                   "token's chunk, which this engine needs to compute the last token itself")
            log.error("kvlc: request %s computes its prompt locally: the prefill engine's " + why + "; fix: "
                      "prefill on a KvlcConnector engine of the same model (it stops one token short)",
                      request.request_id, n)
            request.kv_transfer_params[_DONE] = True
            self._stats.record_recompute()
            return 0, False
        count = n - num_computed_tokens   # a hit may end anywhere in the producer's blocks: a token range
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if wants_remote_decode(params):
            self._producing[request.request_id] = request
            return
        remote = self._remote(request)
        if remote is None:
            return
        params[_DONE] = True
        if num_external_tokens <= 0:
            return
        n = min(remote.remote_num_tokens, request.num_prompt_tokens)
        tokens = TokenRange(n - num_external_tokens, self._load_stop(n, remote.remote_block_size))
        groups = self.ranks[0].groups
        local = _touched(blocks.get_block_ids(), tokens, self.block_size, self.state)
        theirs = _touched(remote.remote_block_ids, tokens, remote.remote_block_size,
                          dict.fromkeys(self.state, 0))   # the producer sent each state group's one block
        self._loads.append(Load(
            req_id=request.request_id,
            remote=remote,
            local_block_ids=plan_block_ids(groups, local),
            remote_block_ids=plan_block_ids(groups, theirs),
            tokens=tokens,
            mode=remote.effective_mode(self.settings.mode),
            consumer_addresses=self._addresses()[0],
        ))

    def _load_stop(self, n: int, remote_block: int) -> int:
        """Where a load of ``n`` tokens ends: ``n``, or with :attr:`whole_blocks` the first block end at or
        after ``n`` of either engine (the tokens past ``n`` are the producer's zeroed slots)."""
        if not self.whole_blocks:
            return n
        return min(-(-n // self.block_size) * self.block_size, -(-n // remote_block) * remote_block)

    def get_kv_connector_stats(self) -> KvlcConnectorStats | None:
        """Requests computed locally since vLLM last asked (None: none); vLLM adds the workers' stats."""
        return None if self._stats.is_empty() else self._stats.clone_and_reset()

    # ------------------------------------------------------------------ producer
    def on_new_request(self, request) -> None:
        """A hybrid's (state or chunked-local groups) remote-decode request stops one prompt token short (see
        the module docstring)."""
        params = request.kv_transfer_params
        if (not self.one_short or not wants_remote_decode(params) or params.get(_SHORT)
                or request.num_prompt_tokens < 2 or request.prompt_token_ids is None):
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]   # vLLM's own token list of the request (NixlConnector trims it too)
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params[_SHORT] = True   # once, also when vLLM preempts and reschedules the request

    def _sources(self, scheduler_output, kv_cache_manager) -> list[Source]:
        out = []
        scheduled = scheduler_output.num_scheduled_tokens or {}
        for req_id, req in list(self._producing.items()):
            if req_id not in scheduled or kv_cache_manager is None:
                continue
            after = min(req.num_computed_tokens + scheduled[req_id], req.num_prompt_tokens)
            complete = after >= req.num_prompt_tokens
            ids = tuple(_state_block(g, self.state[i]) if i in self.state else g
                        for i, g in enumerate(_per_group(kv_cache_manager.get_block_ids(req_id))))
            out.append(Source(req_id, ids, after, complete))
            if complete:
                del self._producing[req_id]
        return out

    def build_connector_meta(self, scheduler_output, kv_cache_manager) -> KvlcConnectorMetadata:
        meta = KvlcConnectorMetadata(
            loads=self._loads,
            sources=self._sources(scheduler_output, kv_cache_manager),
            holds=self._holds,
            dropped=self._dropped,
        )
        self._loads, self._holds, self._dropped = [], [], []
        return meta

    def request_finished(self, request, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM without its hybrid manager: the one group's block ids."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: Sequence[Sequence[int]]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Every KV-cache group's block ids (vLLM's order); a sliding-window group's ids before its
        window are vLLM's null block, placeholders the plan never reads."""
        from vllm.v1.request import RequestStatus

        self._producing.pop(request.request_id, None)
        if not wants_remote_decode(request.kv_transfer_params):
            return False, None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        groups = _per_group(block_ids)
        if not ok or not any(groups):
            self._dropped.append(request.request_id)
            return False, None
        try:
            addresses, pushes = self._addresses()
        except KvlcError as exc:
            log.error("kvlc: request %s: %s", request.request_id, exc)
            self._dropped.append(request.request_id)
            return False, None
        n = int(request.num_computed_tokens)
        nblocks = -(-n // self.block_size)
        self._holds.append(Hold(request.request_id, self.settings.lease))
        host, _, port = addresses[0].rpartition(":")
        return True, RemotePrefill(
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_block_ids=tuple(_state_block(g, self.state[i]) if i in self.state else g[:nblocks]
                                   for i, g in enumerate(groups)),
            remote_num_tokens=n,
            remote_host=host,
            remote_port=int(port),
            tp_size=self.tp_size,
            remote_block_size=self.block_size,
            kvlc_addresses=addresses,
            kvlc_push_addresses=pushes,
            kvlc_plan_digest=self.ranks[0].plan_digest,
            kvlc_cpu_isa=self.ranks[0].cpu_isa,
            kvlc_produced_at=time.time(),
            transfer_mode=self.settings.mode,
        ).to_params()

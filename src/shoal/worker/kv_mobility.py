"""How a worker's streams and KV move to and from other workers: its role, its KV peer, the imports
a continuation asks for (`kv_source`) and the handoffs it makes (shoal.protocol.kv_handoff).

Roles: `colocated` (prefill and decode, the default), `prefill` (hands each stream off after its
first token, so its decode runs elsewhere) and `decode` (takes continuations; the router decides
that, so a decode worker serves like a colocated one). A stream may be handed off only when its
request said the router can continue it (the handoff header) and it has one choice. A prefill
worker hands such streams off after their first token; a draining worker with a KV peer hands each
off at its next token (without one, a recompute would cost more than finishing the stream here).

The KV peer runs when the worker holds the cluster secret and its replica is one process. After a
handoff, and after each fetch its peer serves, a draining worker stays up HANDOFF_HOLD_S more, so
the next worker finds the blocks. An import that fails (peer gone, refusal, layout mismatch,
timeout) costs a recompute, never the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.kv_layout import KVLayoutMismatch
from shoal.engine.kv_transfer import KVRefusedError
from shoal.observability.tracing import Tracing
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.protocol.cluster_secret import configured_secret
from shoal.protocol.frames import BadFrame
from shoal.protocol.kv_handoff import ACCEPTS_KV_HANDOFF, HANDOFF_HEADER, Handoff
from shoal.protocol.worker_load import Role
from shoal.worker.drain import DrainState
from shoal.worker.kv_peer import KVPeer, fetch_kv
from shoal.worker.metrics import WorkerMetrics
from shoal.worker.protocol import SamplingFields
from shoal.worker.request_tracing import WorkerRequestSpan

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 5.0
HANDOFF_HOLD_S = 5.0


class KVMobility:
    """Invariant: `context` is set exactly when `peer` is (both by open_peer, closed by close)."""

    def __init__(self, role: Role, drain: DrainState, metrics: WorkerMetrics, tracing: Tracing):
        self.role, self.drain, self.metrics, self.tracing = role, drain, metrics, tracing
        self.peer: KVPeer | None = None
        self.context: ClusterContext | None = None

    def open_peer(self, engine: AsyncLLMEngine, host: str, advertise_host: str | None = None) -> None:
        """Starts the KV peer on `host` (from the event loop it will serve on), if the worker can
        have one; logs why not otherwise."""
        secret = configured_secret()
        if secret is None or not engine.engine.moves_kv:
            log.warning(
                "no KV peer (%s): streams moved to or from this worker recompute their KV",
                "a multi-process replica" if secret else "no cluster secret",
            )
            return
        self.context = ClusterContext(secret)
        self.peer = KVPeer(
            engine,
            self.context,
            host,
            asyncio.get_running_loop(),
            advertise_host,
            on_request=lambda: self.drain.hold(HANDOFF_HOLD_S),
            on_exported=lambda blocks, seconds: self.metrics.kv_moved("out", blocks, seconds),
        )
        log.info("KV peer at %s (role %s)", self.peer.address, self.role)

    @property
    def kv_peer(self) -> str | None:
        return self.peer.address if self.peer else None

    def handoffs_for(self, headers: Mapping[str, str], body: SamplingFields) -> Callable[[int], Handoff | None] | None:
        """`handoff`, for a one-choice stream whose caller can continue it elsewhere; else None."""
        if body.stream and body.n == 1 and headers.get(HANDOFF_HEADER) == ACCEPTS_KV_HANDOFF:
            return self.handoff
        return None

    def handoff(self, tokens_sent: int) -> Handoff | None:
        """The handoff to make now, for a stream that may be handed off and has sent `tokens_sent`
        tokens so far (None: keep streaming)."""
        if self.drain.draining and self.peer is not None:
            reason = "drain"
        elif self.role == "prefill" and tokens_sent > 0:
            reason = "prefill"
        else:
            return None
        self.drain.hold(HANDOFF_HOLD_S)
        self.metrics.handoffs.labels(self.metrics.model_name, reason).inc()
        return Handoff(reason=reason, kv_peer=self.kv_peer)

    async def import_prefix(
        self, engine: AsyncLLMEngine, source: str, token_ids: list[int], trace: WorkerRequestSpan
    ) -> int:
        """Imports what the worker at `source` holds of `token_ids`' KV; the blocks imported (0 when
        it failed, which the log, a metric and the request's trace say)."""
        span = self.tracing.start("kv.import", parent=trace.span, attributes={"shoal.kv_source": source})
        started = time.monotonic()
        try:
            if self.context is None:
                raise KVRefusedError("this worker has no KV peer (no cluster secret, or a multi-process replica)")
            blocks = await asyncio.to_thread(fetch_kv, self.context, source, token_ids, FETCH_TIMEOUT_S)
            imported = await engine.import_kv(blocks)
        except (TimeoutError, KVRefusedError, KVLayoutMismatch, BadFrame, ValueError, OSError) as exc:
            log.warning("no KV from %s (%s: %s); computing it here", source, type(exc).__name__, exc)
            self.metrics.kv_import_failures.labels(self.metrics.model_name).inc()
            span.set_attribute("shoal.error", f"{type(exc).__name__}: {exc}")
            span.end()
            return 0
        seconds = time.monotonic() - started
        self.metrics.kv_moved("in", blocks, seconds)
        span.set_attributes(
            {
                "shoal.kv_blocks": len(blocks.hashes),
                "shoal.kv_blocks_imported": imported,
                "shoal.kv_bytes": blocks.nbytes,
            }
        )
        span.end()
        return imported

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.context.close()
            self.peer = self.context = None

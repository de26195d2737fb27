"""Load-aware routing among tandem replicas on Ray Serve: a new request goes to the replica whose
engine holds the fewest sequences, then to the one with the most free KV pages; never round robin.

    replica: record_routing_stats() -> {"running", "waiting", "kv_pages_free"}   (ServeLoop.load_stats)
        | Serve's controller polls it every ROUTING_STATS_PERIOD_S and hands it to every router
    router:  sequences = requests in flight there (Serve's queue length cache), else running + waiting
             ranks = replicas grouped by (sequences, -kv_pages_free), least loaded first
        | Serve tries the first rank; within a rank it takes the shortest queue, and a replica
        | already at max_ongoing_requests is passed over for the next rank

Each generation request is one sequence in its replica's engine, so the requests in flight at a
replica are its sequences. Serve's cache of them is current: the replica's own count whenever Serve
probes it, raised by this router when it sends a request and lowered when one completes. The
reported figures lag by up to a period (a request that just finished still counts there), so they
count sequences only where the cache has no entry (a replica not yet probed, or silent for 10 s);
the free KV pages, which only the engine knows, break ties: a replica holding long contexts has
fewer pages left than one with as many short sequences.
Only this module and server/ray_app.py import Ray.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

ROUTING_STATS_PERIOD_S = 0.5   # how often each replica's load is polled (Serve's default is 10 s)
ROUTING_STATS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ReplicaLoad:
    sequences: int                     # requests in flight there, or running + waiting as reported
    kv_pages_free: int | None = None   # None: not reported yet (a replica that just started is empty)

    def key(self) -> tuple[int, float]:
        free = float("inf") if self.kv_pages_free is None else self.kv_pages_free
        return self.sequences, -free


def load_of(stats: dict | None, in_flight: int | None) -> ReplicaLoad:
    """A replica's load from its last report (`ServeLoop.load_stats`; empty before the first) and
    the requests in flight there as Serve's queue length cache knows them (None: no entry)."""
    stats = stats or {}
    reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
    free = stats.get("kv_pages_free")
    return ReplicaLoad(reported if in_flight is None else in_flight, None if free is None else int(free))


def rank_by_load(loads: dict[Hashable, ReplicaLoad]) -> list[list[Hashable]]:
    """Replica ids grouped by equal load, least loaded group first: {a: 2 seqs, b: 0, c: 0} ->
    [[b, c], [a]] when b and c also have as many free pages."""
    ranks: dict[tuple, list] = {}
    for rid, load in sorted(loads.items(), key=lambda item: item[1].key()):
        ranks.setdefault(load.key(), []).append(rid)
    return list(ranks.values())


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    """Serve's request router for the tandem engine deployment (`request_router_class`)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: load_of(r.routing_stats, cache.get(rid)) for rid, r in by_id.items()}
        return [[by_id[rid] for rid in rank] for rank in rank_by_load(loads)]

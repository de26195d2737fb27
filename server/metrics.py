"""Prometheus metrics of the server (one registry per process), and the merge of several replicas' expositions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REGISTRY = CollectorRegistry()
REQUESTS = Counter("tandem_requests", "Finished requests by status", ["status"], registry=REGISTRY)
QUEUE_DEPTH = Gauge("tandem_queue_depth", "Requests waiting for a slot", registry=REGISTRY)
RUNNING = Gauge("tandem_running_requests", "Requests being prefilled or decoded", registry=REGISTRY)
TTFT = Histogram("tandem_time_to_first_token_seconds", "Time to first token", registry=REGISTRY,
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
ITL = Histogram("tandem_inter_token_latency_seconds", "Time between tokens of a request", registry=REGISTRY,
                buckets=_ITL_BUCKETS)
PROMPT_TOKENS = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", registry=REGISTRY)
GENERATION_TOKENS = Counter("tandem_generation_tokens", "Generated tokens", registry=REGISTRY)
ACCEPT_LENGTH = Histogram("tandem_spec_accept_length", "Tokens committed per verify step, per request",
                          registry=REGISTRY, buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 9))
ACCEPTANCE = Gauge("tandem_spec_acceptance_rate", "Draft acceptance rate by draft position", ["position"],
                   registry=REGISTRY)
KV_PAGES_IN_USE = Gauge("tandem_kv_pages_in_use", "KV cache pages allocated to sequences, all page groups",
                        registry=REGISTRY)
PREFIX_QUERIES = Counter("tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                         registry=REGISTRY)
PREFIX_HITS = Counter("tandem_prefix_cache_hits", "Prompt tokens the prefix cache restored", registry=REGISTRY)
PREFIX_ENTRIES = Gauge("tandem_prefix_cache_entries", "Cached prefixes held", registry=REGISTRY)
KV_PAGES_BY_GROUP = Gauge("tandem_kv_pages_in_use_by_group", "KV cache pages allocated to sequences, per page group "
                          "(full attention, or a sliding window whose pages are released as they leave it)",
                          ["group"], registry=REGISTRY)


# ---- the same figures under vLLM's names (docs/server.md, "Metrics"), so dashboards made for vLLM work:
# a `model_name` label as vLLM's; counted as tandem's series are, except the spec_decode counters, which
# follow each verify round as requests report them.
_VLLM = ["model_name"]
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Requests being prefilled or decoded", _VLLM, registry=REGISTRY)
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", _VLLM, registry=REGISTRY)
VLLM_KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full)", _VLLM,
                      registry=REGISTRY)
VLLM_PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", _VLLM, registry=REGISTRY)
VLLM_GENERATION_TOKENS = Counter("vllm:generation_tokens", "Generated tokens", _VLLM, registry=REGISTRY)
VLLM_SUCCESS = Counter("vllm:request_success", "Finished requests by finish reason", [*_VLLM, "finished_reason"],
                       registry=REGISTRY)
VLLM_PREEMPTIONS = Counter("vllm:num_preemptions", "Preemptions (counted when the request finishes)", _VLLM,
                           registry=REGISTRY)
VLLM_TTFT = Histogram("vllm:time_to_first_token_seconds", "Time to first token", _VLLM, registry=REGISTRY,
                      buckets=_LATENCY)
VLLM_ITL = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of a request", _VLLM,
                     registry=REGISTRY, buckets=_ITL_BUCKETS)
VLLM_E2E = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token", _VLLM,
                     registry=REGISTRY, buckets=_LATENCY)
VLLM_REQUEST_PROMPT = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request", _VLLM,
                                registry=REGISTRY, buckets=(1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768))
VLLM_REQUEST_GENERATION = Histogram("vllm:request_generation_tokens", "Generated tokens per finished request",
                                    _VLLM, registry=REGISTRY, buckets=(1, 8, 32, 128, 512, 1024, 2048, 4096, 8192))
VLLM_PREFIX_QUERIES = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", _VLLM,
                              registry=REGISTRY)
VLLM_PREFIX_HITS = Counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache restored", _VLLM,
                           registry=REGISTRY)
VLLM_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Verify rounds (each checks one draft sequence)", _VLLM,
                      registry=REGISTRY)
VLLM_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", _VLLM, registry=REGISTRY)
VLLM_ACCEPTED = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", _VLLM, registry=REGISTRY)
VLLM_ACCEPTED_PER_POS = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted by position",
                                [*_VLLM, "position"], registry=REGISTRY)

class VllmSeries:
    """Feeds the vLLM-named series from what the serve loop sees, labelled with the served model's
    name. The spec_decode counters advance by each request's rounds since it was last seen, so they
    follow the verify steps as they run, not only when requests finish."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self._spec: dict[str, tuple[int, int, int, list[int]]] = {}   # request id -> counts already added

    def tokens(self, n: int, ttft: float | None, gap: float | None) -> None:
        """`n` tokens out; `ttft` for a request's first output, else `gap`: seconds per token since its last."""
        VLLM_GENERATION_TOKENS.labels(**self.labels).inc(n)
        if ttft is not None:
            VLLM_TTFT.labels(**self.labels).observe(ttft)
        elif gap is not None:
            for _ in range(n):
                VLLM_ITL.labels(**self.labels).observe(gap)

    def spec(self, request_id: str, metrics) -> None:
        """A request's verify rounds (pipeline.sequence.RequestMetrics) since it was last seen."""
        rounds, drafted, accepted, per_pos = self._spec.get(request_id, (0, 0, 0, []))
        if metrics.rounds == rounds:
            return
        VLLM_DRAFTS.labels(**self.labels).inc(metrics.rounds - rounds)
        VLLM_DRAFT_TOKENS.labels(**self.labels).inc(metrics.drafted - drafted)
        VLLM_ACCEPTED.labels(**self.labels).inc(metrics.accepted - accepted)
        for i, n in enumerate(metrics.accepted_per_position):
            if n > (before := per_pos[i] if i < len(per_pos) else 0):
                VLLM_ACCEPTED_PER_POS.labels(**self.labels, position=str(i)).inc(n - before)
        self._spec[request_id] = (metrics.rounds, metrics.drafted, metrics.accepted,
                                  list(metrics.accepted_per_position))

    def finished(self, request_id: str, seq, reason: str, e2e: float) -> None:
        self.spec(request_id, seq.metrics)
        self.forget(request_id)
        VLLM_SUCCESS.labels(**self.labels, finished_reason=reason).inc()
        VLLM_PROMPT_TOKENS.labels(**self.labels).inc(len(seq.prompt))
        VLLM_REQUEST_PROMPT.labels(**self.labels).observe(len(seq.prompt))
        VLLM_REQUEST_GENERATION.labels(**self.labels).observe(seq.num_generated)
        VLLM_E2E.labels(**self.labels).observe(e2e)
        if seq.metrics.preemptions:
            VLLM_PREEMPTIONS.labels(**self.labels).inc(seq.metrics.preemptions)

    def forget(self, request_id: str) -> None:
        self._spec.pop(request_id, None)

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Tokens looked up and restored since the last call."""
        VLLM_PREFIX_QUERIES.labels(**self.labels).inc(queries)
        VLLM_PREFIX_HITS.labels(**self.labels).inc(hits)

    def gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        VLLM_RUNNING.labels(**self.labels).set(running)
        VLLM_WAITING.labels(**self.labels).set(waiting)
        VLLM_KV_USAGE.labels(**self.labels).set(kv_usage)


# ---- several replicas (server/ray_app.py) --------------------------------------------------
# Each replica process has its own REGISTRY; its exposition text is merged here. Per replica: every
# series gains a `replica` label. Aggregated: the same names and labels as one `tandem serve`;
# counters, histograms and count-like gauges are summed over replicas, the acceptance rate and the KV usage
# fraction are their mean, and `*_created` (when a counter started) is the earliest.
_MEAN = {"tandem_spec_acceptance_rate", "vllm:kv_cache_usage_perc"}


def merged_exposition(texts: dict[str, str], per_replica: bool) -> str:
    """Prometheus text of several replicas' `/metrics` (replica name -> text) as one exposition."""
    families: dict[str, Metric] = {}
    values: dict[tuple, list[float]] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                labels = {**s.labels, "replica": replica} if per_replica else s.labels
                values.setdefault((fam.name, s.name, tuple(sorted(labels.items()))), []).append(s.value)
    for (family, name, labels), vs in values.items():
        value = min(vs) if name.endswith("_created") else sum(vs) / len(vs) if family in _MEAN else sum(vs)
        families[family].add_sample(name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry).decode()


class _Families:
    """A collector that yields fixed metric families (what generate_latest formats)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families

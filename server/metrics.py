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
ITL = Histogram("tandem_inter_token_latency_seconds", "Time between tokens of a request", registry=REGISTRY,
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
PROMPT_TOKENS = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", registry=REGISTRY)
GENERATION_TOKENS = Counter("tandem_generation_tokens", "Generated tokens", registry=REGISTRY)
ACCEPT_LENGTH = Histogram("tandem_spec_accept_length", "Tokens committed per verify step, per request",
                          registry=REGISTRY, buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 9))
ACCEPTANCE = Gauge("tandem_spec_acceptance_rate", "Draft acceptance rate by draft position", ["position"],
                   registry=REGISTRY)
KV_PAGES_IN_USE = Gauge("tandem_kv_pages_in_use", "KV cache pages allocated to sequences, all page groups",
                        registry=REGISTRY)
KV_PAGES_BY_GROUP = Gauge("tandem_kv_pages_in_use_by_group", "KV cache pages allocated to sequences, per page group "
                          "(full attention, or a sliding window whose pages are released as they leave it)",
                          ["group"], registry=REGISTRY)


# ---- several replicas (server/ray_app.py) --------------------------------------------------
# Each replica process has its own REGISTRY; its exposition text is merged here. Per replica: every
# series gains a `replica` label. Aggregated: the same names and labels as one `tandem serve`;
# counters, histograms and count-like gauges are summed over replicas, the acceptance rate is their
# mean, and `*_created` (when a counter started) is the earliest.
_MEAN = {"tandem_spec_acceptance_rate"}


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

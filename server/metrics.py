"""Prometheus metrics of the server (one registry per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

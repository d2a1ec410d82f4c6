"""``/metrics``: the Prometheus text exposition of the request metrics and the engine's stats.

Request metrics (:mod:`gyrfalcon.client.metrics`) are this process's, or, under gunicorn with
``PROMETHEUS_MULTIPROC_DIR`` set, every API worker's summed by prometheus-client's multiprocess
collector. The engine's gauges and counters are read from its stats at each scrape, under vLLM's
names (``gyrfalcon:num_requests_running``, ``…_waiting``, ``kv_cache_usage_perc``,
``num_preemptions``, ``prefix_cache_queries``/``hits``) and, for every stat, ``gyrfalcon_<stat>``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gyrfalcon.client.metrics import LABELS, PREFIX
from gyrfalcon.engine_api.interface import Engine

#: the engine's stats that only grow: exposed as counters (``gyrfalcon_<stat>_total``)
COUNTER_STATS = frozenset({
    "requests_submitted", "requests_finished", "requests_aborted", "requests_failed", "prompt_tokens",
    "generation_tokens", "steps", "prefill_forwards", "decode_forwards", "preemptions", "prefix_cache_queries",
    "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
})  # fmt: skip


class EngineCollector:
    """The engine's stats, collected at scrape time."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield from self._vllm_names(stats)
        if isinstance(stats.get("decode_path"), str):  # "name (reason)": an info gauge
            name, _, reason = stats["decode_path"].partition(" (")
            info = GaugeMetricFamily("gyrfalcon_decode_path", "The path decode steps take (1), and why.", labels=["path", "reason"])
            info.add_metric([name, reason.removesuffix(")")], 1)
            yield info
        version = self.engine.health().weight_version
        if version:
            info = GaugeMetricFamily("gyrfalcon_weight_version", "The version of the weights being served (1).",
                                     labels=["version"])  # fmt: skip
            info.add_metric([version], 1)
            yield info
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            family = CounterMetricFamily if key in COUNTER_STATS else GaugeMetricFamily
            yield family(f"gyrfalcon_{key}", f"The engine's {key.replace('_', ' ')}.", value=value)

    def _vllm_names(self, stats: dict[str, Any]) -> Iterator[Metric]:
        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        yield gauge("num_requests_running", "Number of requests in model execution batches.", stats.get("running", 0))
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", stats.get("waiting", 0))
        total = stats.get("kv_blocks_total")
        if total:
            used = (total - stats.get("kv_blocks_free", total)) / total
            yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", used)
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", stats.get("preemptions", 0))
        if "prefix_cache_queries" in stats:
            yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                          stats["prefix_cache_queries"] * stats.get("kv_block_size", 1))  # fmt: skip
            yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                          stats["prefix_cache_hits"] * stats.get("kv_block_size", 1))  # fmt: skip
        if "spec_decode_num_drafts" in stats:  # --speculative-config
            yield counter("spec_decode_num_drafts", "Number of spec decoding drafts.", stats["spec_decode_num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", stats["spec_decode_num_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          stats["spec_decode_num_accepted_tokens"])  # fmt: skip
            per = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*LABELS, "position"])  # fmt: skip
            for position, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
                per.add_metric([*self.labels, str(position)], value)
            yield per
        if "lora_max" in stats:  # --enable-lora: vLLM's info gauge, its value the time of the scrape
            info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])  # fmt: skip
            info.add_metric([str(stats["lora_max"]), stats["lora_waiting_adapters"], stats["lora_running_adapters"]],
                            time.time())  # fmt: skip
            yield info


class MetricsExposition:
    """The bytes of one scrape: request metrics (all workers') then the engine's."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine_registry = CollectorRegistry(auto_describe=False)
        self.engine_registry.register(EngineCollector(engine, model_name))

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            requests = CollectorRegistry()
            multiprocess.MultiProcessCollector(requests)
        else:
            requests = REGISTRY
        return generate_latest(requests) + generate_latest(self.engine_registry)

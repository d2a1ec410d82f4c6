"""Request metrics, taken where the API worker reads the engine's outputs, with vLLM's names and
buckets under the ``gyrfalcon:`` prefix (a vLLM dashboard works after replacing ``vllm:``).

Every API worker of a server counts its own requests; under gunicorn the workers share
prometheus-client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, set and cleared by
``gyrfalcon serve``), and ``/metrics`` sums them. The engine's own gauges and counters (running,
waiting, KV-cache usage, preemptions, prefix-cache hits) come from its stats at scrape time
(:mod:`gyrfalcon.api.metrics`).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import Counter, Histogram, disable_created_metrics

from gyrfalcon.engine_api.types import RequestOutput

disable_created_metrics()  # as vLLM: no ``_created`` series beside every counter and histogram

PREFIX = "gyrfalcon:"
#: vLLM's label names: the served model, and the engine's index (one engine: "0")
LABELS = ("model_name", "engine")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ServingMetrics:
    """The request metrics of this process (one set: prometheus-client's registry is global)."""

    def __init__(self, max_model_len: int) -> None:
        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", LABELS)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.", LABELS)
        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                       (*LABELS, "finished_reason"))  # fmt: skip
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS)  # fmt: skip
        self.inter_token = Histogram(PREFIX + "inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.", LABELS,
                                     buckets=INTER_TOKEN_BUCKETS)  # fmt: skip
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", LABELS,
                             buckets=REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LABELS,
                                    buckets=REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens",
                                               "Number of prefill tokens processed.", LABELS, buckets=tokens)  # fmt: skip
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Number of generation tokens processed.", LABELS,
                                                   buckets=tokens)  # fmt: skip
        self.request_params_n = Histogram(PREFIX + "request_params_n", "Histogram of the n request parameter.",
                                          LABELS, buckets=N_BUCKETS)  # fmt: skip

    def timer(self, model_name: str, prompt_tokens: int, n: int) -> RequestTimer:
        """A new request's timer (call at its arrival)."""
        return RequestTimer(self, (model_name, "0"), prompt_tokens, n)


_metrics: ServingMetrics | None = None
_lock = threading.Lock()


def serving_metrics(max_model_len: int) -> ServingMetrics:
    """This process's :class:`ServingMetrics` (built on first use; the token buckets follow the
    first caller's ``max_model_len``)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = ServingMetrics(max_model_len)
        return _metrics


class RequestTimer:
    """One engine request seen from the API worker: the core's outputs as they arrive, then its end."""

    def __init__(self, metrics: ServingMetrics, labels: tuple[str, str], prompt_tokens: int, n: int) -> None:
        self.metrics = metrics
        self.labels = labels
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.arrival = time.monotonic()
        self.last_token: float | None = None
        self.queue_time: float | None = None
        self.done = False

    def output(self, item: RequestOutput) -> None:
        """A core output (token-id deltas) reached the worker."""
        if self.done:
            return
        m, labels, now = self.metrics, self.labels, time.monotonic()
        if item.queue_time is not None:
            self.queue_time = item.queue_time
        generated = sum(len(choice.token_ids) for choice in item.outputs)
        if generated:
            m.generation_tokens.labels(*labels).inc(generated)
        new = max((len(choice.token_ids) for choice in item.outputs), default=0)
        if not new:
            return
        if self.last_token is None:
            m.ttft.labels(*labels).observe(now - self.arrival)
            new -= 1
        else:
            # several tokens in one output (a reader that lagged): the gap is theirs together
            gap = (now - self.last_token) / new
            for _ in range(new):
                m.inter_token.labels(*labels).observe(gap)
        self.last_token = now

    def finish(self, finish_reasons: list[str | None], generated_tokens: int) -> None:
        """Every choice has ended (in the core, or here at a stop string)."""
        if self.done:
            return
        self.done = True
        m, labels = self.metrics, self.labels
        m.prompt_tokens.labels(*labels).inc(self.prompt_tokens)
        m.e2e.labels(*labels).observe(time.monotonic() - self.arrival)
        if self.queue_time is not None:
            m.queue_time.labels(*labels).observe(self.queue_time)
        m.request_prompt_tokens.labels(*labels).observe(self.prompt_tokens)
        m.request_generation_tokens.labels(*labels).observe(generated_tokens)
        m.request_params_n.labels(*labels).observe(self.n)
        for reason in finish_reasons:
            if reason is not None:
                m.request_success.labels(*labels, reason).inc()

    def failed(self) -> None:
        """The request ended with an error: not a success of any reason."""
        self.done = True

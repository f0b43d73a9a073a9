"""Prometheus metrics of one simulated engine, under vLLM V1's names.

Everything lives on the app's own :class:`~prometheus_client.CollectorRegistry`,
never the process-wide one, so several engines can share a process. vLLM's series
carry the labels ``model_name`` and ``engine="0"``; bucket lists are vLLM's.

Times are model seconds: with ``--time-scale 1`` they are wall seconds, with a
larger scale they are what the modelled engine would have measured.

``vllm:num_requests_waiting_by_reason``: walking the waiting queue in order, the
requests that the free sequence slots and free KV blocks (prefix hits ignored)
could take are ``deferred`` (waiting for the token budget of a coming step); the
first one that does not fit and every one behind it are ``capacity``.

The simulator's own health is under ``whoseturn_sim_``: the driver's lag behind its
clock, so that a slow simulator can be told from a slow scheduler.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadtests.sim.request import SimRequest
from loadtests.sim.step_loop import SimEngine, StepResult, TokenEvent
from loadtests.sim.step_scheduler import SchedulerConfig

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort")
LABELS = ("model_name", "engine")


def buckets_1_2_5(maximum: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``maximum`` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return out
            out.append(value)
        exponent += 1


def waiting_by_reason(engine: SimEngine) -> tuple[int, int]:
    """``(capacity, deferred)`` counts of the waiting queue (see the module docstring)."""
    scheduler = engine.scheduler
    seats = scheduler.config.max_num_seqs - len(scheduler.running)
    free_blocks = scheduler.kv.num_free_blocks
    block_size = scheduler.config.block_size
    deferred = 0
    for request in scheduler.waiting:
        need = -(-request.num_tokens // block_size)
        if seats < 1 or need > free_blocks:
            break
        seats -= 1
        free_blocks -= need
        deferred += 1
    return len(scheduler.waiting) - deferred, deferred


class SimMetrics:
    """The metrics of one engine; fed by the driver, read by ``GET /metrics``."""

    def __init__(self, model_name: str, config: SchedulerConfig) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "engine": "0"}
        self._preemptions_seen = 0
        self._gauges()
        self._counters()
        self._histograms(config)
        self._sim_health()
        self._cache_info(config)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        h = Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets)
        return h.labels(**self._labels)

    def _gauges(self) -> None:
        self.running = self._gauge("vllm:num_requests_running", "Requests in model execution.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Requests waiting to be run.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by why they wait: capacity (sequence slots or KV blocks) "
            "or deferred (the token budget of a coming step).",
            (*LABELS, "reason"),
            registry=self.registry,
        )
        self.waiting_capacity = by_reason.labels(**self._labels, reason="capacity")
        self.waiting_deferred = by_reason.labels(**self._labels, reason="deferred")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100%.")

    def _counters(self) -> None:
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Generation tokens processed."
        )
        self.preemptions = self._counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            (*LABELS, "finished_reason"),
            registry=self.registry,
        )
        self.success = {
            reason: success.labels(**self._labels, finished_reason=reason)
            for reason in FINISH_REASONS
        }

    def _histograms(self, config: SchedulerConfig) -> None:
        lat = REQUEST_LATENCY_BUCKETS
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS
        )
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Request latency.", lat)
        self.queue = self._histogram(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", lat
        )
        self.prefill = self._histogram(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.", lat
        )
        self.decode = self._histogram(
            "vllm:request_decode_time_seconds", "First token to last token.", lat
        )
        self.inference = self._histogram(
            "vllm:request_inference_time_seconds", "First scheduled to last token.", lat
        )
        self.iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.",
            [float(b) for b in ITERATION_TOKEN_BUCKETS],
        )  # fmt: skip
        length = buckets_1_2_5(config.max_model_len)
        self.request_prompt = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", length
        )
        self.request_generation = self._histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request.", length
        )

    def _sim_health(self) -> None:
        self.lag = Gauge(
            "whoseturn_sim_lag_seconds",
            "Model seconds the step loop was behind its clock when the last step ended "
            "(0 when on time or idle).",
            registry=self.registry,
        )
        self.lag_total = Counter(
            "whoseturn_sim_lag_accumulated_seconds",
            "Sum of the step loop's lag over all steps, in model seconds.",
            registry=self.registry,
        )
        self.steps = Counter(
            "whoseturn_sim_steps", "Engine steps the loop has run.", registry=self.registry
        )
        self.prefill_tokens = Gauge(
            "whoseturn_sim_prefill_prompt_tokens",
            "Prompt tokens of the requests in the engine with no first token yet, by "
            "request priority (with the proxy and --scheduling-policy priority: 0 batch, "
            "-10 interactive).",
            ["priority"],
            registry=self.registry,
        )
        self.prefill_tokens_peak = Gauge(
            "whoseturn_sim_prefill_prompt_tokens_peak",
            "The most whoseturn_sim_prefill_prompt_tokens has been since start.",
            ["priority"],
            registry=self.registry,
        )
        self._prefill_peak: dict[int, int] = {}

    def _cache_info(self, config: SchedulerConfig) -> None:
        info = {
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching),
        }
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache config.",
            ("engine", *info),
            registry=self.registry,
        )
        gauge.labels(engine="0", **info).set(1)

    # -- feeding ---------------------------------------------------------------

    def update_gauges(self, engine: SimEngine) -> None:
        """Queue lengths and KV-cache usage as they are now."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        capacity, deferred = waiting_by_reason(engine)
        self.waiting_capacity.set(capacity)
        self.waiting_deferred.set(deferred)
        self.kv_usage.set(engine.kv_cache_usage)
        self._update_prefill(engine)

    def _update_prefill(self, engine: SimEngine) -> None:
        now: dict[int, int] = dict.fromkeys(self._prefill_peak, 0)
        scheduler = engine.scheduler
        for request in [*scheduler.waiting, *scheduler.running]:
            if request.first_token_time is None:
                now[request.priority] = now.get(request.priority, 0) + request.num_prompt_tokens
        for priority, tokens in now.items():
            peak = max(tokens, self._prefill_peak.get(priority, 0))
            self._prefill_peak[priority] = peak
            self.prefill_tokens.labels(str(priority)).set(tokens)
            self.prefill_tokens_peak.labels(str(priority)).set(peak)

    def on_step(self, result: StepResult, engine: SimEngine, lag: float) -> None:
        """Everything one finished step changed."""
        self.steps.inc()
        self.lag.set(lag)
        self.lag_total.inc(lag)
        self.iteration_tokens.observe(result.plan.output.num_tokens)
        for request in result.newly_scheduled:
            self.prefix_queries.inc(request.num_prompt_tokens)
            self.prefix_hits.inc(max(request.num_cached_tokens, 0))
        for event in result.tokens:
            self._on_token(event)
        preemptions = engine.scheduler.num_preemptions
        self.preemptions.inc(preemptions - self._preemptions_seen)
        self._preemptions_seen = preemptions
        self.update_gauges(engine)

    def on_idle(self) -> None:
        self.lag.set(0.0)

    def on_abort(self, engine: SimEngine) -> None:
        self.success["abort"].inc()
        self.update_gauges(engine)

    def _on_token(self, event: TokenEvent) -> None:
        request = event.request
        self.generation_tokens.inc()
        if event.is_first:
            self.prompt_tokens.inc(request.num_prompt_tokens)
            self.ttft.observe(event.time - request.arrival_time)
        elif event.gap is not None:
            self.itl.observe(event.gap)
        if event.finished:
            self._on_finished(request)

    def _on_finished(self, request: SimRequest) -> None:
        self.success.get(request.finish_reason or "length", self.success["length"]).inc()
        arrival = request.arrival_time
        scheduled = request.first_scheduled_time or arrival
        first = request.first_token_time or scheduled
        last = request.last_token_time or first
        self.e2e.observe((request.finished_time or last) - arrival)
        self.queue.observe(scheduled - arrival)
        self.prefill.observe(first - scheduled)
        self.decode.observe(last - first)
        self.inference.observe(last - scheduled)
        self.request_prompt.observe(request.num_prompt_tokens)
        self.request_generation.observe(len(request.output_token_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics of one app, in its own CollectorRegistry (no global state).

Engine gauges (lanes, pages, queue) are read from `engine.stats()` at scrape time, so
they are never stale; request counters and latency histograms are fed by the handlers
through one `RequestTracker` per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..api_types import Usage
from ..errors import BadInputError, QueueFullError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, engine.stats() key, help)
_ENGINE_GAUGES = (
    ("tf_lanes_in_use", "lanes_in_use", "Lanes open (streams holding a lane)."),
    ("tf_lanes_total", "lanes_total", "Lanes of the engine (--parallel)."),
    ("tf_kv_pages_in_use", "pages_in_use", "KV pages held by open lanes."),
    ("tf_kv_pages_total", "pages_total", "KV pages in the arena."),
    ("tf_queue_depth", "queued", "Requests waiting for a lane."),
    ("tf_requests_running", "running", "Requests running in the engine."),
    ("tf_draft_areas_in_use", "draft_areas_in_use", "Drafter areas held by open lanes' runs."),
    ("tf_draft_area_bytes_in_use", "draft_area_bytes_in_use", "Bytes of drafter areas in use."),
    ("tf_prefix_cache_pages", "cached_pages",
     "KV pages in the prefix cache (held by runs or idle); not lane pages."),
    ("tf_prefix_cache_pages_idle", "cached_pages_idle",
     "Cached KV pages no run holds (evicted, least recently used first, when pages run short)."),
    ("tf_prefix_state_slots", "prefix_state_slots",
     "Hybrid models: recurrent states the prefix cache can keep."),
)
# (metric name without _total, engine.stats() key, help): counters the engine keeps
_ENGINE_COUNTERS = (
    ("tf_preemptions", "preemptions",
     "Streams preempted out of KV pages (lane given back, KV recomputed on re-admission)."),
    ("tf_draft_paused_rounds", "draft_paused_rounds",
     "Decode rows of a stream that skipped drafting after rejected drafts (--draft-backoff)."),
    ("tf_prefix_cache_hit_pages", "prefix_cache_hit_pages",
     "Prompt pages taken from the prefix cache instead of computed."),
    ("tf_prefix_cache_missed_pages", "prefix_cache_missed_pages",
     "Full pages computed and published to the prefix cache (no cached copy was found)."),
    ("tf_prefix_cache_evictions", "prefix_cache_evictions",
     "Idle cached pages given back to the pool."),
    ("tf_prefix_cache_copied_rows", "prefix_cache_copied_rows",
     "KV rows copied from a cached partial last page into a stream's own page."),
    ("tf_prefix_states_kept", "prefix_states_kept",
     "Hybrid models: recurrent states kept at page boundaries for resumed streams."),
    ("tf_prefix_states_resumed", "prefix_states_resumed",
     "Hybrid models: streams that started from a kept recurrent state."),
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)

OUTCOMES = ("stop", "length", "cancelled", "error", "bad_input", "queue_full")


class EngineCollector:
    """Reads the engine's gauges when /metrics is scraped."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # skip the registration-time collect()

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, key, doc in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for name, key, doc in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))


class ServerMetrics:
    """All metrics of one app; `render()` gives the Prometheus text."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(stats))
        reg = self.registry
        self.requests = Counter("tf_requests", "Finished requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=reg)
        self.prompt_tokens = Counter("tf_prompt_tokens", "Prompt tokens processed.", registry=reg)
        self.generation_tokens = Counter("tf_generation_tokens", "Tokens generated.", registry=reg)
        self.drafted_tokens = Counter("tf_drafted_tokens", "Tokens proposed by drafters.",
                                      registry=reg)
        self.accepted_tokens = Counter("tf_accepted_tokens", "Drafted tokens accepted.",
                                       registry=reg)
        self.ttft = Histogram("tf_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("tf_inter_token_latency_seconds", "Time between streamed tokens.",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.duration = Histogram("tf_request_duration_seconds", "Request duration.",
                                  buckets=_LATENCY_BUCKETS, registry=reg)
        self.in_flight = Gauge("tf_requests_in_flight", "Requests being answered (not yet "
                               "counted in tf_requests).", registry=reg)
        self._num_in_flight = 0
        self._none_in_flight = asyncio.Event()
        self._none_in_flight.set()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    async def wait_none_in_flight(self) -> None:
        """Return once every request begun has been counted with its outcome."""
        while self._num_in_flight:
            self._none_in_flight.clear()
            await self._none_in_flight.wait()

    def _begin(self) -> None:
        self._num_in_flight += 1
        self.in_flight.inc()

    def _end(self) -> None:
        self._num_in_flight -= 1
        self.in_flight.dec()
        if not self._num_in_flight:
            self._none_in_flight.set()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, endpoint: str) -> RequestTracker:
        return RequestTracker(self, endpoint)


class RequestTracker:
    """Timing and outcome of one request; `finish` counts it exactly once."""

    def __init__(self, metrics: ServerMetrics, endpoint: str):
        self._metrics = metrics
        self._endpoint = endpoint
        self._start_s = time.perf_counter()
        self._last_token_s: float | None = None
        self.num_tokens = 0
        self.finished = False
        metrics._begin()

    def on_tokens(self, num_tokens: int) -> None:
        """Record `num_tokens` tokens arriving now (first one: TTFT; later: ITL)."""
        if num_tokens <= 0:
            return
        now_s = time.perf_counter()
        if self._last_token_s is None:
            self._metrics.ttft.observe(now_s - self._start_s)
        else:
            gap_s = (now_s - self._last_token_s) / num_tokens
            for _ in range(num_tokens):
                self._metrics.itl.observe(gap_s)
        self._last_token_s = now_s
        self.num_tokens += num_tokens

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Count the request with the outcome of an exception that leaves the block."""
        try:
            yield
        except BadInputError:
            self.finish("bad_input")
            raise
        except QueueFullError:
            self.finish("queue_full")
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            self.finish("cancelled")
            raise
        except Exception as exc:  # aiohttp's HTTPException 4xx (e.g. 413) is bad input too
            status = getattr(exc, "status", 500)
            self.finish("bad_input" if isinstance(status, int) and status < 500 else "error")
            raise

    def finish(self, outcome: str, usage: Usage | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        metrics = self._metrics
        metrics._end()
        metrics.requests.labels(self._endpoint, outcome).inc()
        metrics.duration.observe(time.perf_counter() - self._start_s)
        if usage is not None:
            metrics.prompt_tokens.inc(usage.prompt_tokens)
            metrics.generation_tokens.inc(usage.completion_tokens)
            metrics.drafted_tokens.inc(usage.drafted_tokens)
            metrics.accepted_tokens.inc(usage.accepted_tokens)
        else:
            metrics.generation_tokens.inc(self.num_tokens)

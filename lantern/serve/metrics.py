"""The service's Prometheus metrics, in a registry of its own (no process-global state), named like vLLM's.

Requests by outcome, queue depth, slots and slots busy per engine and width, images per second, latency histograms
(queue wait and decode per image, total per request), and the speculative-decoding counters vLLM exports
(`spec_decode_num_drafts`, `num_draft_tokens`, `num_accepted_tokens`, accepted tokens per draft position), all under
the `lantern:` prefix.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "bad_request", "rejected", "timeout", "cancelled", "unavailable", "error")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)
RATE_WINDOW_S = 30.0  # images per second: over the last this many seconds


class ServeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("lantern:requests", "HTTP generation requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome shows from the start, at 0
        self.images = Counter("lantern:images", "Images generated", ["method"], registry=r)
        self.in_flight = Gauge("lantern:requests_in_flight", "HTTP generation requests being handled", registry=r)
        self.queue_depth = Gauge("lantern:queue_depth", "Images waiting for a slot", registry=r)
        self.slots_busy = Gauge("lantern:slots_busy", "Slots decoding an image, per engine (method and sampling) "
                                "and static width", ["engine", "width"], registry=r)
        self.slots = Gauge("lantern:slots", "Slots (the static width) of each engine built, per engine and width",
                           ["engine", "width"], registry=r)
        self.images_per_second = Gauge("lantern:images_per_second",
                                       f"Images finished per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self.images_per_second.set_function(self.recent_rate)
        self.queue_wait = Histogram("lantern:queue_wait_seconds", "Per image: submitted to first step",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("lantern:decode_seconds", "Per image: first step to last", buckets=LATENCY_BUCKETS,
                                registry=r)
        self.total = Histogram("lantern:request_seconds", "Per request: received to answered",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.drafts = Counter("lantern:spec_decode_num_drafts", "Verify steps that checked drafts, per image",
                              ["method"], registry=r)
        self.draft_tokens = Counter("lantern:spec_decode_num_draft_tokens", "Draft tokens proposed", ["method"],
                                    registry=r)
        self.accepted_tokens = Counter("lantern:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       ["method"], registry=r)
        self.accepted_per_position = Counter("lantern:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position (0 = first)",
                                             ["method", "position"], registry=r)
        self._finished = collections.deque()  # perf_counter stamps of finished images within the window
        self._lock = threading.Lock()

    def observe_step(self, method: str, report) -> None:
        """One engine step's StepReport: the speculative counters and slot occupancy."""
        self.drafts.labels(method).inc(report.drafts)
        self.draft_tokens.labels(method).inc(report.draft_tokens)
        self.accepted_tokens.labels(method).inc(report.accepted_tokens)
        for position, count in enumerate(report.accepted_per_position):
            if count:
                self.accepted_per_position.labels(method, str(position)).inc(count)

    def observe_image(self, method: str, queue_wait_s: float, decode_s: float) -> None:
        self.images.labels(method).inc()
        self.queue_wait.observe(queue_wait_s)
        self.decode.observe(decode_s)
        with self._lock:
            self._finished.append(time.perf_counter())

    def recent_rate(self) -> float:
        """Images finished per second over the last RATE_WINDOW_S."""
        now = time.perf_counter()
        with self._lock:
            while self._finished and self._finished[0] < now - RATE_WINDOW_S:
                self._finished.popleft()
            return len(self._finished) / RATE_WINDOW_S

    def observe_request(self, outcome: str, seconds: float) -> None:
        self.requests.labels(outcome).inc()
        self.total.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The service's Prometheus metrics, in a registry of its own (no process-global state), named like vLLM's.

Requests by outcome, queue depth, slots and slots busy per engine and width, images per second, latency histograms
(queue wait and decode per image, total per request), and the speculative-decoding counters vLLM exports
(`spec_decode_num_drafts`, `num_draft_tokens`, `num_accepted_tokens`, accepted tokens per draft position); beside
them, in vLLM-Omni's names, images by outcome (`image_count`), each stage's time (`stage_gen_time_s{stage}`: queue,
encode, decode, pixels), a request's queue wait (`request_queue_wait_s`) and the peak device memory
(`peak_memory_mb`); and which plan auto serves and whether its calibration still runs. All under the `lantern:`
prefix.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "bad_request", "rejected", "timeout", "cancelled", "unavailable", "error")
STAGES = ("queue", "encode", "decode", "pixels")  # submitted to first step; the prompt's encoding (t2i); first step
# to last; tokens to PNGs (the VQ decoder and the PNG encoding)
MIB = 1 << 20
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
        self.image_count = Counter("lantern:image_count", "Images requested, by their request's outcome",
                                   ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.image_count.labels(outcome)
        self.stage_time = Histogram("lantern:stage_gen_time_s", "Seconds per stage: queue and decode per image; "
                                    "encode (prompts) and pixels (VQ decode and PNG) per request", ["stage"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        for stage in STAGES:
            self.stage_time.labels(stage)
        self.request_queue_wait = Histogram("lantern:request_queue_wait_s", "Per request: submitted until its last "
                                            "image's first step", buckets=LATENCY_BUCKETS, registry=r)
        self.peak_memory_mb = Gauge("lantern:peak_memory_mb", "Peak memory of the engines' runners, MiB (device "
                                    "memory; the process RSS on CPU)", registry=r)
        self.plan = Gauge("lantern:plan_info", "1 for the plan auto serves now (engine, plan, backend)",
                          ["engine", "plan", "backend"], registry=r)
        self.calibrating = Gauge("lantern:calibration_running", "1 while auto's background calibration runs",
                                 registry=r)
        self.plan_switches = Counter("lantern:plan_switches", "Switches to a newly calibrated plan", registry=r)
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
        self.stage_time.labels("queue").observe(queue_wait_s)
        self.stage_time.labels("decode").observe(decode_s)
        with self._lock:
            self._finished.append(time.perf_counter())

    def recent_rate(self) -> float:
        """Images finished per second over the last RATE_WINDOW_S."""
        now = time.perf_counter()
        with self._lock:
            while self._finished and self._finished[0] < now - RATE_WINDOW_S:
                self._finished.popleft()
            return len(self._finished) / RATE_WINDOW_S

    def observe_request(self, outcome: str, seconds: float, images: int = 0) -> None:
        """A request answered: its outcome, seconds, and the images it asked for (0 when it was unreadable)."""
        self.requests.labels(outcome).inc()
        self.total.observe(seconds)
        if images:
            self.image_count.labels(outcome).inc(images)

    def watch_peak_memory(self, peak_bytes) -> None:
        """peak_bytes(): the peak in bytes, read at each scrape."""
        self.peak_memory_mb.set_function(lambda: peak_bytes() / MIB)

    def serving(self, plans: dict, calibrating: bool) -> None:
        """plans: engine -> (plan, backend) auto serves now; calibrating: its background calibration runs."""
        self.plan.clear()
        for engine, (plan, backend) in plans.items():
            self.plan.labels(engine, plan, backend).set(1)
        self.calibrating.set(1 if calibrating else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

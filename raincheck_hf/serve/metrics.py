"""Prometheus text exposition (format 0.0.4) of the server's counters and histograms, by hand: a
few counters do not need a client library."""

from __future__ import annotations

import bisect
import threading

# seconds; TTFT spans a tiny model on a CPU to a long video on a GPU, TPOT a few ms to a few hundred
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Counters of finished requests; held-conversation figures come from the store at scrape time."""

    COUNTERS = {
        "prompt_tokens": "Prompt tokens of answered requests.",
        "cached_tokens": "Prompt tokens served from a held conversation's cache (not prefilled again).",
        "completion_tokens": "Generated tokens.",
        "restored_during_answer": "Deferred visual tokens prefilled fused into decode steps.",
        "restored_at_prefill": "Deferred tokens of earlier turns prefilled in a follow-up's first forward.",
        "cancelled": "Generations stopped because the client disconnected.",
    }

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def add(self, **counts) -> None:
        with self._lock:
            for name, n in counts.items():
                self.counters[name] += int(n)

    def turn(self, ttft: float, token_times: list[float]) -> None:
        with self._lock:
            if ttft == ttft:  # not NaN (no token)
                self.ttft.observe(ttft)
            for t in token_times:
                self.tpot.observe(t)

    def render(self, store: dict) -> str:
        with self._lock:
            lines = ["# HELP raincheck_requests_total HTTP requests by endpoint and status.",
                     "# TYPE raincheck_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'raincheck_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            for name, help_ in self.COUNTERS.items():
                lines += [f"# HELP raincheck_{name}_total {help_}", f"# TYPE raincheck_{name}_total counter",
                          f"raincheck_{name}_total {self.counters[name]}"]
            lines += ["# HELP raincheck_ttft_seconds Time to first token.", "# TYPE raincheck_ttft_seconds histogram",
                      *self.ttft.lines("raincheck_ttft_seconds"),
                      "# HELP raincheck_tpot_seconds Time between consecutive generated tokens.",
                      "# TYPE raincheck_tpot_seconds histogram", *self.tpot.lines("raincheck_tpot_seconds")]
        lines += [
            "# HELP raincheck_restored_after_answer_total Deferred tokens prefilled in idle time after answers.",
            "# TYPE raincheck_restored_after_answer_total counter",
            f"raincheck_restored_after_answer_total {store['restored_after_answer']}",
            "# HELP raincheck_evictions_total Conversations evicted to fit --max-cache-gb.",
            "# TYPE raincheck_evictions_total counter", f"raincheck_evictions_total {store['evictions']}",
            "# HELP raincheck_conversations Conversations held (busy: answering now).",
            "# TYPE raincheck_conversations gauge", f'raincheck_conversations{{state="held"}} {store["conversations"]}',
            f'raincheck_conversations{{state="busy"}} {store["busy"]}',
            "# HELP raincheck_cache_bytes Bytes of the held conversations' caches.",
            "# TYPE raincheck_cache_bytes gauge", f"raincheck_cache_bytes {store['cache_bytes']}",
            "# HELP raincheck_pending_tokens Deferred tokens not yet restored, all held conversations.",
            "# TYPE raincheck_pending_tokens gauge", f"raincheck_pending_tokens {store['pending']}",
        ]
        return "\n".join(lines) + "\n"

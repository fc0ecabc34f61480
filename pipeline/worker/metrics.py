"""The worker's Prometheus metrics (``/metrics``) and its resident memory."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.records = Counter("fleetmedic_records_total", "records consumed", ["topic", "result"], registry=self.registry)
        self.anomalies = Counter("fleetmedic_anomalies_total", "anomalies emitted", ["kind"], registry=self.registry)
        self.verdicts = Counter("fleetmedic_verdicts_total", "verdicts emitted", ["scope", "fault_class"], registry=self.registry)
        self.actions = Counter("fleetmedic_actions_total", "actions recorded", ["action", "outcome"], registry=self.registry)
        self.breaker_used = Gauge("fleetmedic_breaker_isolations", "isolations counted in the breaker window", registry=self.registry)
        self.breaker_budget = Gauge("fleetmedic_breaker_budget", "isolations the breaker allows per window now",
                                    registry=self.registry)
        self.detect_seconds = Histogram(
            "fleetmedic_detect_seconds", "time to decode and run the detectors on one batch", ["detector"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=self.registry)
        self.batch_size = Histogram("fleetmedic_detect_batch_records", "records per detection batch", ["detector"],
                                    buckets=(1, 10, 50, 100, 500, 1000, 5000, 20000), registry=self.registry)
        self.lag = Gauge("fleetmedic_event_lag_seconds",
                         "wall time minus the event time of the newest record processed", ["topic"], registry=self.registry)


def rss_bytes() -> int:
    """Resident memory of this process (Linux), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

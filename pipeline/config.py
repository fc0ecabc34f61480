"""Configuration: one validated object, from a TOML file and ``FLEETMEDIC_*`` variables.

Precedence: defaults < TOML file (``--config`` or ``FLEETMEDIC_CONFIG``) < environment.
Environment keys are ``FLEETMEDIC_<SECTION>__<KEY>`` (for example
``FLEETMEDIC_KAFKA__BOOTSTRAP=127.0.0.1:9092``, ``FLEETMEDIC_SAFETY__MAX_FRACTION=0.05``).
A bad value fails at start with a message that names the field.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schemas import FaultClass


def state_dir(default: str) -> Path:
    """The directory a command keeps its services' state in: ``$FLEETMEDIC_STATE``, else
    ``~/.cache/fleetmedic/<default>`` (deploy/*.sh use the same variable)."""
    return Path(os.environ.get("FLEETMEDIC_STATE") or Path.home() / ".cache" / "fleetmedic" / default)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KafkaSettings(_Section):
    bootstrap: str = Field("127.0.0.1:9092", description="host:port[,host:port] of the Kafka brokers")
    topic_prefix: str = Field("fleetmedic.", description="prefix of every topic name")
    partitions: int = Field(8, ge=1, le=1024, description="partitions of telemetry, anomaly and internal topics")
    decision_partitions: int = Field(
        1, ge=1, le=64, description="partitions of verdicts/actions: 1 keeps one global circuit breaker"
    )
    replication: int = Field(1, ge=1, le=7)
    app_id: str = Field("fleetmedic", description="consumer group / Faust application id")


class WorkerSettings(_Section):
    web_port: int = Field(6066, ge=0, le=65535, description="Faust web server port (0: pick a free one)")
    web_host: str = Field("127.0.0.1", description="the worker's host name in its own URLs (Faust's canonical URL)")
    web_bind: str = Field(
        "127.0.0.1", description="the address the web server listens on (0.0.0.0: every interface; turn sign-in "
                                 "on first)")
    allowed_hosts: list[str] = Field(
        default_factory=list, description="names the Host header may carry besides loopback, web_host and web_bind "
                                          "(a Service name, an ingress host); '*' allows any; in the environment, "
                                          "comma-separated")

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _hosts_from_text(cls, v: Any) -> Any:
        return [h.strip() for h in v.split(",") if h.strip()] if isinstance(v, str) else v
    data_dir: str = Field(
        "", description="Faust's data directory (empty: $FLEETMEDIC_STATE/faust, else ~/.cache/fleetmedic/worker/faust)")
    hold_telemetry: bool = Field(
        False, description="batch telemetry consumer: join the group but read nothing until POST "
                           "/fleetmedic/release (make bench starts several workers this way so that they begin on the backlog together)")
    telemetry_consumer: Literal["batch", "faust"] = Field(
        "batch", description="telemetry path: 'batch' (consumer batches, fast) or 'faust' (a Faust agent per topic)"
    )
    batch_size: int = Field(
        200, ge=1, le=100000,
        description="telemetry records per detector batch; small enough that a batch's decoded records stay in "
                    "the CPU cache (docs/decisions/0005)")
    batch_within_s: float = Field(0.2, gt=0, le=60, description="longest wait for the first record of a batch")
    batch_linger_s: float = Field(0.02, ge=0, le=10, description="after the first record, how long a batch may wait for more")
    commit_interval_s: float = Field(1.0, gt=0, le=60, description="telemetry offsets are committed this often (after their anomalies are sent)")
    ready_max_lag: int = Field(
        10000, ge=0, description="/readyz: records a worker may have left to read on its partitions (input and "
                                 "internal topics) and still be ready (caught up)")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    stream_buffer_maxsize: int = Field(16384, ge=1, description="Faust: events buffered per stream before the fetcher pauses")
    max_poll_records: int = Field(5000, ge=1, description="Faust: records returned by one poll of the consumer")
    max_fetch_bytes: int = Field(8 * 1024 * 1024, ge=1024,
                                 description="Faust agents' consumer: bytes fetched per partition request (smaller "
                                             "fetches delay the hops between agents)")
    telemetry_fetch_bytes: int = Field(
        1024 * 1024, ge=1024,
        description="batch telemetry consumer: bytes fetched per partition request (Kafka's own default, 1 MiB: "
                    "larger fetches buy no throughput here and cost every worker memory that does not shrink as "
                    "partitions are shared out)")
    session_timeout_s: float = Field(
        20.0, ge=6, le=300,
        description="Kafka consumer session timeout: how long a dead worker holds its partitions before the group "
                    "rebalances without it")
    gc_threshold: int = Field(50000, ge=700, description="allocations between young-generation garbage collections")


class DetectorSettings(_Section):
    window_s: float = Field(
        3600.0, ge=60, le=7 * 86400, description="event-time seconds of history a rate test (ECC, NVLink, PCIe "
                                                 "replay, symbol errors) compares the recent part with")
    recent_s: float = Field(
        300.0, gt=0, description="the recent part of the rate tests' window, event-time seconds: a rise shows "
                                 "within about this long")
    bucket_s: float = Field(
        30.0, ge=1, le=3600, description="time resolution of the windows: events are counted per bucket of this "
                                         "many seconds (memory per node grows with window_s / bucket_s)")
    throttle_window_s: float = Field(
        300.0, gt=0, description="event-time seconds over which the share of thermally throttled samples counts")
    alpha: float = Field(1e-6, gt=0, lt=1, description="significance level of rate-change tests")
    min_events: int = Field(5, ge=1)
    throttle_fraction: float = Field(0.5, gt=0, le=1)
    peer_threshold: float = Field(5.0, gt=0, description="robust z-score beyond which a node departs from its job peers (calibrated on Alibaba PAI traces)")
    anomaly_cooldown_s: float = Field(15.0, ge=0, description="re-emit the same finding at most this often")
    univariate: bool = Field(
        True, description="streaming baselines (detectors.UnivariateDetector) of each GPU's temperature and power "
                          "while it is busy, and of each node's step time in each job; their anomalies "
                          "(temp_drift, power_drift, step_time_drift) are info: evidence in the node's history, "
                          "never a reason to isolate")
    univariate_threshold: float = Field(
        0.1, gt=0, le=1, description="univariate score from which an anomaly is reported: 0.1 is a two-sided "
                                     "Gaussian tail p = 1e-5 (about 4.4 baseline standard deviations), 1 is p = 1e-50")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old in ("window", "recent"):
                if old in data:
                    raise ValueError(f"{old} (samples) is now {old}_s (event-time seconds): windows count time, "
                                     "whatever the sampling interval")
        return data

    @model_validator(mode="after")
    def _windows_fit(self) -> "DetectorSettings":
        if 2 * self.recent_s > self.window_s:
            raise ValueError(f"recent_s ({self.recent_s:g}) must be at most half of window_s ({self.window_s:g}), "
                             "so the baseline is at least as long as the recent part")
        for name in ("recent_s", "throttle_window_s"):
            if getattr(self, name) < self.bucket_s:
                raise ValueError(f"{name} ({getattr(self, name):g}) must be at least bucket_s ({self.bucket_s:g})")
        if self.window_s / self.bucket_s > 2000:
            raise ValueError(f"window_s / bucket_s is {self.window_s / self.bucket_s:.0f} buckets; at most 2000 "
                             "(raise bucket_s)")
        return self

    def buckets(self, seconds: float) -> int:
        """Whole buckets in ``seconds`` (at least 1)."""
        return max(1, int(round(seconds / self.bucket_s)))


class PolicySettings(_Section):
    correlation_grace_s: float = Field(
        3.0, ge=0, le=600, description="event-time seconds after a job failure whose node evidence counts for it: "
                                       "the failure is judged once telemetry of every partition has passed its "
                                       "time plus this (or after correlation_wait_max_s of wall time)"
    )
    correlation_lag_s: float = Field(
        2.0, ge=0, le=60, description="wall seconds a failure's judgement waits after the telemetry watermark passed "
                                      "its grace, for node evidence sent by another worker (anomalies this worker "
                                      "sent are waited for until its node track has correlated them)")
    correlation_wait_max_s: float = Field(
        30.0, ge=0, le=3600, description="wall-clock seconds a job failure waits at most for telemetry to reach the "
                                         "end of its grace; past it (telemetry stalled or absent) it is judged on "
                                         "the evidence at hand; also the longest a tick waits for one anomaly still "
                                         "on its way through the node track"
    )
    degrade_confirmations: int = Field(3, ge=1, description="degradation findings that make a node isolated")
    degrade_window_s: float = Field(600.0, gt=0, description="event-time window for degradation findings")
    repeat_failure_jobs: int = Field(3, ge=2, description="distinct failed jobs that make a node suspect")
    repeat_failure_share: float = Field(
        1.0, gt=0, description="blame, summed over those jobs (1/nodes of each job), that isolates the node: a "
                               "failure of a 2-node job puts 0.5 on each node, one of a 512-node job almost none")
    repeat_failure_window_s: float = Field(6 * 3600.0, gt=0)
    repeat_origin_failures: int = Field(
        3, ge=2, description="distinct jobs whose unattributed failures began on one node (the scheduler's first "
                             "failed worker) within repeat_origin_window_s that make it suspect, whatever the "
                             "jobs' sizes; the attempts of one job count once")
    repeat_origin_window_s: float = Field(24 * 3600.0, gt=0)
    xid_window_s: float = Field(24 * 3600.0, gt=0, description="event-time window of the Xid repeat rules")
    xid_repeat_escalate: int = Field(
        5, ge=2, description="times one Xid code seen on one GPU within xid_window_s that escalate it to a person")
    xid_app_repeat_jobs: int = Field(
        2, ge=2, description="distinct jobs in which an application-side Xid (13, 31, 43) repeats on one GPU within "
                             "xid_window_s before the GPU, not the code, is suspect (isolate and diagnose)")
    user_error_retries: int = Field(
        1, ge=0, description="retries of a failure whose output names the user's code, inputs or environment, "
                             "before the job is stopped")
    unknown_repeats: int = Field(
        3, ge=2, description="failures of one job the same way on the same nodes, with no cause found, after which "
                             "it is stopped for a person (the same failure on other nodes stops it at once)")
    transient_retries: int = Field(3, ge=0, description="retries of a transient fault before requeue")
    checkpoint_deadline_s: float = Field(
        600.0, gt=0, description="event-time seconds a degraded job may run on to reach its next checkpoint"
    )
    checkpoint_now: bool = Field(
        True, description="when a node under a running job degrades, ask the job to save its state now (a "
                          "checkpoint action: annotation, signal, checkpoint_requested record) instead of waiting "
                          "for its next scheduled checkpoint; either way it moves at checkpoint_deadline_s at the latest")
    lemon_returns: int = Field(3, ge=1, description="returns to service within lemon_window_s that make a lemon")
    lemon_window_s: float = Field(7 * 86400.0, gt=0)


class NetworkSettings(_Section):
    """The network track (beta): learned fabric-port model and switch attribution."""

    enforce: bool = Field(
        False, description="act on network verdicts (isolate a node with a bad port); off: alert only (beta)")
    model: Literal["hbos", "ecod", "copod", "iforest"] = Field(
        "ecod", description="PyOD model scoring port features (make eval-network compares them)")
    feature_samples: int = Field(6, ge=2, le=100, description="network samples per feature window")
    confirm: int = Field(2, ge=1, le=20, description="consecutive flagged windows before a port is anomalous")
    min_train_rows: int = Field(2000, ge=100, description="healthy port windows needed before the model is fitted")
    refit_s: float = Field(900.0, gt=0, description="event-time seconds between refits (in a worker thread)")
    switch_min_nodes: int = Field(3, ge=2, description="nodes with port anomalies under one switch that blame the switch")
    rated_gbps: dict[str, Annotated[float, Field(gt=0, le=100000)]] = Field(
        default_factory=dict,
        description="the rate fabric ports should train to, Gb/s, by port ('mlx5_0/1'), device ('mlx5_0') or '*'; "
                    "a port below it is link_degraded (without it: below its alike peers on the node, or its past)")
    hold_s: float = Field(60.0, ge=0, description="how long a lone node's port anomaly waits for others under its switch")
    window_s: float = Field(600.0, gt=0, description="how long a port anomaly counts towards its switch")
    tick_lag_s: float = Field(
        5.0, ge=0, le=60, description="wall seconds a lone node's hold waits after the fabric's watermark passed it, "
                                      "for neighbours' anomalies sent by another worker (those this worker sent are "
                                      "waited for until its node track has correlated them)")


class SafetySettings(_Section):
    max_fraction: float = Field(0.1, gt=0, le=1, description="largest share of the fleet isolated per window")
    max_absolute: int = Field(50, ge=0, description="largest number of nodes isolated per window")
    window_s: float = Field(3600.0, gt=0, description="circuit-breaker window, event-time seconds")
    fleet_size: int = Field(0, ge=0, description="nodes in the fleet (0: count the nodes seen)")
    dry_run: bool = Field(False, description="decide and record, but never act")


BackendName = Literal["sim", "kubernetes", "slurm", "dryrun"]


class PoolSettings(_Section):
    """A node pool and the scheduler backend that acts on it."""

    name: str = Field(min_length=1)
    nodes: list[str] = Field(min_length=1, description="node name patterns (shell globs, e.g. 'gpu-a*')")
    backend: BackendName


class ActuatorSettings(_Section):
    backend: BackendName = Field("sim", description="default backend for nodes in no pool and jobs of unknown scheduler")
    pools: list[PoolSettings] = Field(
        default_factory=list,
        description="node pools mapped to backends; job actions go to the backend of the job's scheduler",
    )
    slurm_conf: str | None = Field(None, description="SLURM_CONF for scontrol/sbatch (default: the environment's)")
    slurm_diag_command: str = Field("dcgmi diag -r 2", description="command of Slurm diagnostics jobs")
    slurm_diag_start_wait_s: float = Field(
        15.0, ge=0.0, le=300.0,
        description="how long a Slurm diagnostics action waits for its job to start (then it drains the node "
                    "again around the running job); a job still pending is left to the maintenance reservation",
    )
    sim_url: str = Field("http://127.0.0.1:7070", description="simulated cluster API")
    kubeconfig: str | None = Field(None, description="kubeconfig file (default: in-cluster service account, else ~/.kube/config)")
    kube_context: str | None = None
    kube_as: str | None = Field(
        None, description="act as this user, e.g. system:serviceaccount:fleetmedic:fleetmedic (Impersonate-User)"
    )
    kube_diag_namespace: str = Field("fleetmedic-diag", min_length=1, description="namespace of diagnostics Jobs")
    kube_job_namespace: str = Field("default", min_length=1, description="namespace of workloads named without one")
    kube_diag_image: str = Field(
        "nvcr.io/nvidia/cloud-native/dcgm:3.3.5-1-ubuntu22.04", min_length=1, description="image of diagnostics Jobs"
    )
    kube_diag_command: list[str] = Field(["dcgmi", "diag", "-r", "2"], min_length=1)
    kube_taint_key: str = Field("fleetmedic.dev/quarantine", min_length=1, description="key of the quarantine taint")
    kube_max_requests: int = Field(32, ge=1, le=512, description="Kubernetes API calls in flight at once (and "
                                   "connections kept to the API server)")
    kube_node_cache: bool = Field(True, description="keep the Nodes from a watch (list and watch on nodes), so an "
                                  "isolation writes without reading its node first (decision 0032)")
    webhook_url: str | None = Field(None, description="alerts (escalations, held isolations) go here")

    @field_validator("webhook_url", "sim_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v)
    webhook_secret: str | None = None
    max_attempts: int = Field(6, ge=1, le=100)
    base_delay_s: float = Field(0.2, ge=0)
    max_delay_s: float = Field(10.0, ge=0)
    drain_wait_s: float = Field(1800.0, ge=0, description="a drain refused for now (a PodDisruptionBudget) is "
                                "tried again for this long (wall seconds) before it is reported failed")
    max_in_flight: int = Field(64, ge=1, le=4096, description="targets acted on at once (each in its own order)")
    contain_quiet_s: float = Field(
        1.0, ge=0.0, le=60.0,
        description="drains, diagnostics and other work less urgent than containment wait until no isolation has "
                    "run or been due for this long: a burst's isolations go first even when they arrive over seconds")
    drain_mode: Literal["Immediate", "AllowCompletion", "DeleteAfterTimeout"] = Field(
        "Immediate", description="how pods that declare no fleetmedic.dev/drain-mode are drained (Kubernetes)")
    drain_timeout_s: float = Field(600.0, ge=0, description="DeleteAfterTimeout: wall seconds a drain waits before "
                                   "it evicts (a pod's fleetmedic.dev/drain-timeout-s overrides it)")


class WebhookSettings(_Section):
    """One alert receiver (``[[alerts.webhooks]]``)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="names the receiver on action records")
    url: str = Field(pattern=r"^https?://", description="where verdicts are POSTed")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return _check_url(v)
    format: Literal["alertmanager", "cloudevents", "alertmanager-api"] = Field(
        "alertmanager", description="alertmanager: Alertmanager's webhook JSON; cloudevents: CloudEvents 1.0 JSON; "
                                    "alertmanager-api: alerts posted to an Alertmanager (url: its base URL; "
                                    "POST <url>/api/v2/alerts), a node's alert firing until it is returned")
    secret: str | None = Field(None, description="HMAC-SHA256 key of the X-Fleetmedic-Signature header")
    timeout_s: float = Field(10.0, gt=0, le=300)
    hold_s: float = Field(7 * 86400.0, gt=0, description="alertmanager-api: how long a node's out-of-service alert "
                                                         "fires without a return (Alertmanager resolves it then)")
    event_s: float = Field(3600.0, gt=0, description="alertmanager-api: how long the alert of any other verdict "
                                                     "fires")


class AlertSettings(_Section):
    """Alert webhooks: every verdict (except the excluded classes) to every receiver, once."""

    webhooks: list[WebhookSettings] = Field(default_factory=list)
    exclude_classes: list[FaultClass] = Field(
        [FaultClass.transient_software], description="fault classes that do not alert (a retried crash is not news)")
    external_url: str = Field("", description="this worker's URL as receivers reach it (links in alerts)")
    max_attempts: int = Field(8, ge=1, le=100, description="deliveries tried per verdict and receiver")
    base_delay_s: float = Field(0.5, ge=0)
    max_delay_s: float = Field(60.0, ge=0)
    queue_size: int = Field(10000, ge=1, description="verdicts waiting per receiver before new ones are refused (and reported)")

    @field_validator("webhooks")
    @classmethod
    def _unique_names(cls, v: list[WebhookSettings]) -> list[WebhookSettings]:
        names = [w.name for w in v]
        if len(set(names)) != len(names):
            raise ValueError(f"webhook names must be unique, got {names}")
        return v


class AuthSettings(_Section):
    """Sign-in for the operator API and the dashboard: OIDC bearer tokens (e.g. Keycloak)."""

    enabled: bool = Field(False, description="off: anyone who reaches the web port can read and act (the page says so)")
    issuer: str = Field("", description="the token issuer, e.g. https://keycloak.example/realms/gpu")
    audience: str = Field("", description="the audience tokens must name (Keycloak: an audience mapper on the client)")
    jwks_url: str | None = Field(None, description="signing keys (default: Keycloak's <issuer>/protocol/openid-connect/certs)")
    roles_claim: str = Field("realm_access.roles", description="dotted path of the roles list in the token")
    viewer_role: str = Field("viewer", min_length=1, description="role that may read")
    operator_role: str = Field("operator", min_length=1, description="role that may read and change")
    leeway_s: float = Field(30.0, ge=0, le=600, description="clock skew allowed on exp/nbf/iat")
    metrics_public: bool = Field(False, description="serve /metrics without a token (for a Prometheus scrape)")
    client_id: str | None = Field(None, description="when set, a token's azp (the client it was issued to) must be it")
    jwks_cache_s: float = Field(300.0, ge=30, le=600, description=(
        "longest a key set is kept before it is refetched (less when the issuer's Cache-Control says so); "
        "a key removed at the issuer is refused at most this long after"))
    max_stale_s: float = Field(3600.0, ge=0, le=86400, description=(
        "while the issuer cannot be reached, keys already held keep checking tokens this long past their "
        "freshness; after that every request is refused (503) until the issuer answers"))
    dashboard_client: str | None = Field(None, description=(
        "the public OIDC client the dashboard signs in with (authorization code with PKCE, S256); "
        "unset: the dashboard asks for a pasted token"))
    authorization_url: str | None = Field(None, description=(
        "the issuer's authorization endpoint (default: Keycloak's <issuer>/protocol/openid-connect/auth)"))
    token_url: str | None = Field(None, description=(
        "the issuer's token endpoint (default: Keycloak's <issuer>/protocol/openid-connect/token)"))
    logout_url: str | None = Field(None, description=(
        "the issuer's end-session endpoint (default: Keycloak's <issuer>/protocol/openid-connect/logout)"))

    @model_validator(mode="after")
    def _needs_issuer(self) -> AuthSettings:
        if self.enabled and not (self.issuer and self.audience):
            raise ValueError("auth.enabled needs auth.issuer and auth.audience")
        return self


class CollectSettings(_Section):
    """The node agent (``fleetmedic collect``)."""

    node: str | None = Field(None, description="node name on the records (default: $NODE_NAME, else the host name)")
    interval_s: float = Field(10.0, gt=0, le=3600, description="seconds between samples")
    nvml: Literal["auto", "on", "off"] = Field(
        "auto", description="GPU telemetry through NVML: auto (when the library loads), on (required), off")
    dcgm_urls: list[str] = Field(
        default_factory=list, description="dcgm-exporter endpoints to scrape (http://host:9400/metrics)")
    infiniband_root: str = Field("/sys/class/infiniband", description="sysfs directory of the RDMA devices")
    switches: dict[str, str] = Field(
        default_factory=dict, description="port ('mlx5_0/1') or device ('mlx5_0') -> switch id it is cabled to")
    lldp_dir: str | None = Field(None, description="directory of LLDP-style neighbour labels per port")
    node_exporter_url: str | None = Field(
        None, description="read this node's fabric ports from node_exporter's node_infiniband_* metrics "
                          "(http://127.0.0.1:9100/metrics) instead of sysfs")

    @field_validator("node_exporter_url")
    @classmethod
    def _exporter_url(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v)
    kernel_log: str = Field(
        "auto", description="the driver's Xid/SXid lines from the kernel log: auto (journald, else /dev/kmsg, "
                            "else off), off, journald, journald:FILE (journal JSON lines), kmsg, kmsg:FILE, "
                            "file:PATH (a syslog file)")
    kernel_log_backlog: bool = Field(
        False, description="also read what the kernel-log source holds already (default: new lines only)")
    xid_merge_s: float = Field(
        10.0, gt=0, le=600, description="one GPU's Xid seen by NVML and the kernel log (or repeated) within this "
                                        "many seconds is one event")

    @field_validator("kernel_log")
    @classmethod
    def _kernel_source(cls, v: str) -> str:
        kind, _, arg = v.partition(":")
        if kind not in ("auto", "off", "journald", "kmsg", "file") or (kind == "file" and not arg) or (
                kind in ("auto", "off") and arg):
            raise ValueError("expected auto, off, journald, journald:FILE, kmsg, kmsg:FILE or file:PATH")
        return v


class Settings(_Section):
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    detectors: DetectorSettings = Field(default_factory=DetectorSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    safety: SafetySettings = Field(default_factory=SafetySettings)
    actuators: ActuatorSettings = Field(default_factory=ActuatorSettings)
    collect: CollectSettings = Field(default_factory=CollectSettings)
    network: NetworkSettings = Field(default_factory=NetworkSettings)
    alerts: AlertSettings = Field(default_factory=AlertSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)

    def topic(self, name: str) -> str:
        return f"{self.kafka.topic_prefix}{name}"


def _check_url(v: str) -> str:
    """An http(s) URL with a host, no credentials in it, no spaces."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(v)
        u.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        raise ValueError(f"not a URL: {exc}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError("expected an http:// or https:// URL with a host")
    if u.username or u.password:
        raise ValueError("credentials do not belong in the URL (use the secret)")
    if any(c.isspace() for c in v):
        raise ValueError("a URL has no spaces")
    return v


class ConfigError(SystemExit):
    """Raised (and exits the process with status 2) when the configuration is invalid."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith("FLEETMEDIC_") or "__" not in key:
            continue
        section, _, field = key[len("FLEETMEDIC_") :].lower().partition("__")
        out.setdefault(section, {})[field] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_settings(
    path: str | os.PathLike | None = None,
    *,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Settings:
    """Build the settings; raise :class:`ConfigError` naming the bad field."""
    env = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    path = path or env.get("FLEETMEDIC_CONFIG")
    if path:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        if p.suffix == ".json":  # the Helm chart writes JSON: its numbers keep their type
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"config file {p} is not valid JSON: {exc}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"config file {p} must hold a JSON object of sections")
        else:
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    data = _merge(data, _env_overrides(env))
    if overrides:
        data = _merge(data, overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"]) or "<config>"
            lines.append(f"  {loc}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None

"""What the worker is built from, read from its settings: the Faust app's options, the
actuator backends, the escalation notifier, sign-in and the alert dispatcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actuators.dryrun import DryRunBackend

from pipeline.actuate.core import BackendRouter
from pipeline.config import Settings, state_dir


def _backend(name: str, s: Settings):
    a = s.actuators
    if name == "sim":
        from actuators.sim import SimBackend

        return SimBackend(a.sim_url)
    if name == "kubernetes":
        from actuators.kubernetes import KubernetesBackend

        return KubernetesBackend.from_config(
            a.kubeconfig, context=a.kube_context, impersonate=a.kube_as,
            namespace=a.kube_diag_namespace, job_namespace=a.kube_job_namespace,
            diag_image=a.kube_diag_image, diag_command=a.kube_diag_command, taint_key=a.kube_taint_key,
            drain_mode=a.drain_mode, drain_timeout_s=a.drain_timeout_s, max_requests=a.kube_max_requests,
            node_cache=a.kube_node_cache,
        )
    if name == "slurm":
        from actuators.slurm import SlurmBackend

        return SlurmBackend(slurm_conf=a.slurm_conf, diag_command=a.slurm_diag_command,
                            diag_start_wait_s=a.slurm_diag_start_wait_s)
    return DryRunBackend()


def build_router(s: Settings) -> "BackendRouter":
    """Backends by name, built once.  Dry-run (``safety.dry_run`` at start, then the operator
    API's switch) wraps them per action in :meth:`Actuation.backend_for`."""
    names = {s.actuators.backend, *(p.backend for p in s.actuators.pools)}
    backends = {n: _backend(n, s) for n in names}
    pools = [(p.nodes, p.backend) for p in s.actuators.pools]
    return BackendRouter(backends, default=s.actuators.backend, pools=pools)


def build_notifier(s: Settings):
    if not s.actuators.webhook_url:
        return None
    from actuators.webhook import WebhookNotifier

    return WebhookNotifier(s.actuators.webhook_url, secret=s.actuators.webhook_secret)


def build_auth(s: Settings) -> Any:
    from pipeline.api.auth import NoAuth, OidcAuth

    a = s.auth
    if not a.enabled:
        return NoAuth()
    return OidcAuth(issuer=a.issuer, audience=a.audience, jwks_url=a.jwks_url, roles_claim=a.roles_claim,
                    viewer_role=a.viewer_role, operator_role=a.operator_role, leeway_s=a.leeway_s,
                    client_id=a.client_id, jwks_cache_s=a.jwks_cache_s, max_stale_s=a.max_stale_s,
                    dashboard_client=a.dashboard_client, authorization_url=a.authorization_url,
                    token_url=a.token_url, logout_url=a.logout_url)


def build_alerts(s: Settings, on_outcome: Any) -> Any:
    """The alert dispatcher of ``s.alerts`` (None without webhooks)."""
    if not s.alerts.webhooks:
        return None
    from actuators.alerts import AlertDispatcher, Receiver
    from actuators.retry import RetryPolicy
    from schemas import ActionName

    a = s.alerts
    skip = set(a.exclude_classes)
    return AlertDispatcher(
        [Receiver(w.name, w.url, format=w.format, secret=w.secret, timeout_s=w.timeout_s, hold_s=w.hold_s,
                  event_s=w.event_s) for w in a.webhooks],
        on_outcome=on_outcome, retry=RetryPolicy(max_attempts=a.max_attempts, base_delay=a.base_delay_s,
                                                 max_delay=a.max_delay_s),
        source=s.kafka.app_id, external_url=a.external_url, queue_size=a.queue_size,
        # a node's return to service always goes out: it resolves the alert of its isolation
        want=lambda v: v.fault_class not in skip or any(x.action is ActionName.return_ for x in v.actions),
    )


def data_dir(s: Settings) -> Path:
    """Where Faust keeps its files: ``worker.data_dir``, else ``faust`` in the state dir
    (never the working directory)."""
    if s.worker.data_dir:
        return Path(s.worker.data_dir).expanduser()
    return state_dir("worker") / "faust"


def app_options(s: Settings, middlewares: list[Any], **faust_options: Any) -> dict[str, Any]:
    """The Faust app's options for ``s`` (``faust_options`` override them)."""
    datadir = data_dir(s)
    datadir.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    options = dict(
        broker=f"kafka://{s.kafka.bootstrap}",
        datadir=str(datadir / f"{s.kafka.app_id}-data"),
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=s.kafka.partitions,
        topic_replication_factor=s.kafka.replication,
        web_host=s.worker.web_host,
        web_port=s.worker.web_port,
        web_bind=s.worker.web_bind,
        web_enabled=True,
        # Faust's own views show tables, partitions and the graph to anyone: off; every
        # route passes the gate (pipeline.api.gate)
        web_tables_enabled=False,
        web_router_enabled=False,
        web_graph_enabled=False,
        web_application_options={"middlewares": middlewares, "client_max_size": 256 * 1024},
        autodiscover=False,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        # every topic, Faust's own included, is created by pipeline.worker.topics.ensure_topics
        # with retries; Faust's declaration has none and fails while one broker is down
        topic_allow_declare=False,
        stream_buffer_maxsize=s.worker.stream_buffer_maxsize,
        broker_max_poll_records=s.worker.max_poll_records,
        consumer_max_fetch_size=s.worker.max_fetch_bytes,
        broker_session_timeout=s.worker.session_timeout_s,
        broker_heartbeat_interval=min(3.0, s.worker.session_timeout_s / 4),
    )
    options.update(faust_options)
    return options

"""Backends that carry verdicts out: simulated cluster, dry-run, Kubernetes, webhooks.

Actuators are libraries the pipeline wires; they import ``schemas`` only, never the
pipeline and never each other.
"""

from .base import (ActionRequest, ActionResult, ActuatorError, Backend, PermanentError, TemporaryError, Waiting,
                   idempotency_key)
from .guard import BreakerDecision, CircuitBreaker
from .retry import RetriesExhausted, RetryPolicy, call_with_retry

__all__ = [
    "ActionRequest", "ActionResult", "ActuatorError", "Backend", "BreakerDecision", "CircuitBreaker",
    "PermanentError", "RetriesExhausted", "RetryPolicy", "TemporaryError", "Waiting", "call_with_retry",
    "idempotency_key",
]

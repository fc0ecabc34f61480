"""The worker's log level holds for the libraries under it too."""

from __future__ import annotations

import logging

import pytest

from pipeline.config import load_settings
from pipeline.worker.app import create_app, faust_worker


@pytest.fixture
def root_logger():
    """The root logger's level and handlers, restored after the test."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    root.setLevel(level)
    root.handlers[:] = handlers


@pytest.mark.parametrize("level", ["warning", "error"])
def test_a_quiet_worker_builds_no_debug_records(root_logger, level):
    """Faust's own worker sets the root logger to DEBUG at these levels (for its spinner),
    so every debug call in aiokafka and Faust built a record that was then dropped."""
    app = create_app(load_settings(environ={}, overrides={"kafka": {"app_id": "fm-log-test"}}))
    worker = faust_worker(app, level)
    worker._setup_logging()
    assert root_logger.level == getattr(logging, level.upper())
    for name in ("aiokafka.producer.producer", "faust.topics", "mode"):
        assert not logging.getLogger(name).isEnabledFor(logging.DEBUG), name
    assert logging.getLogger("fleetmedic").isEnabledFor(getattr(logging, level.upper()))

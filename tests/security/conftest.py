"""The security suite runs real workers on the real broker, like the integration tests."""

from tests.integration.conftest import kafka_bootstrap  # noqa: F401 (the session fixture)

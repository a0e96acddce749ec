"""The connector tests' fixtures. Their shared code is in halves.py, imported here only where a
test asks for a fixture (it imports vLLM, which the CPU suite does not have)."""

import pytest


@pytest.fixture
def producer():
    """A producer instance's two halves, (scheduler, worker): halves.producer_halves."""
    from tests.connector.halves import producer_halves

    with producer_halves() as halves:
        yield halves

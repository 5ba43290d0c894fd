"""Fixtures of the fault suite."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.support.postgres import fresh_schema


@pytest.fixture
def pg_url() -> Iterator[tuple[str, str]]:
    """(URL of an empty schema on the test PostgreSQL, the application_name its
    connections carry: what pg_terminate_backend picks them by)."""
    app = f"pdc_fault_{secrets.token_hex(4)}"
    with fresh_schema(f"application_name={app}") as url:
        yield url, app

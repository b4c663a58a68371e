"""Fixtures of the SQL task's tests."""

from __future__ import annotations

import pytest

from builders.sql import write_shop


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """The hand-made shop database (``builders.sql.ROWS``), written once per module."""
    path = tmp_path_factory.mktemp("sql") / "shop.sqlite"
    write_shop(path)
    return path

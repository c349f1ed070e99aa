"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest
from synthetic import DP_PINS

from hapnb import zoo
from hapnb.plan import Plan
from hapnb.synthesis import synthesize


@pytest.fixture(scope="module")
def dp_plan() -> Plan:
    """Data parallel on uneven ratios (batch 6/2): every weight replicated, so every gradient syncs."""
    return synthesize(
        "mlp", "2xV100", ratios=[0.75, 0.25], pins=DP_PINS, options={"sfb": False}, **zoo.TINY["mlp"]
    )

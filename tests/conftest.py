"""Fixtures shared by test modules."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from synthetic import DP_PINS

from hapnb import zoo
from hapnb.plans.plan import Plan
from hapnb.plans.synthesis import synthesize

# the trace cache (hapnb.tracing.cache) of this test session: a fresh folder, not the user's, so tests
# never read graphs cached by another checkout or run; subprocesses (CLI, notebooks) inherit it
_CACHE = os.environ.setdefault("HAPNB_CACHE_DIR", tempfile.mkdtemp(prefix="hapnb-test-cache-"))


@pytest.fixture(scope="session", autouse=True)
def _trace_cache_folder():
    yield
    if _CACHE.startswith(tempfile.gettempdir()) and "hapnb-test-cache-" in _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def dp_plan() -> Plan:
    """Data parallel on uneven ratios (batch 6/2): every weight replicated, so every gradient syncs."""
    return synthesize(
        "mlp", "2xV100", ratios=[0.75, 0.25], pins=DP_PINS, options={"sfb": False}, **zoo.TINY["mlp"]
    )

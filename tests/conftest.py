"""Session-wide pools of gloo CPU ranks: spawning costs seconds, so each size starts once."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from funcshard.testing import RankPool, scaled_timeout  # noqa: E402


def _pool(n: int):
    # 240 s a call with a core per rank, more where ranks share cores (4 ranks on CI's 2
    # cores: 480 s); FUNCSHARD_POOL_TIMEOUT=seconds sets it outright on a slow machine
    with RankPool(n, timeout=scaled_timeout(240.0, n)) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool1():
    yield from _pool(1)


@pytest.fixture(scope="session")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="session")
def pool3():
    yield from _pool(3)


@pytest.fixture(scope="session")
def pool4():
    yield from _pool(4)


@pytest.fixture(scope="session")
def pool6():
    yield from _pool(6)


@pytest.fixture
def pool_of(request):
    """``pool_of(n)``: the session pool of ``n`` ranks, for tests parametrized over meshes."""
    return lambda n: request.getfixturevalue(f"pool{n}")

"""Shared by every test: an in-process tmd (tmd.daemon.Daemon) exports its key directory as ``TM_KEYS`` for the
processes it starts; a test must not leave that to the next one."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _restore_tm_keys():
    before = os.environ.pop("TM_KEYS", None)
    yield
    os.environ.pop("TM_KEYS", None)
    if before is not None:
        os.environ["TM_KEYS"] = before

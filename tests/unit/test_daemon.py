"""tmd's daemon on its own (in-process, no worker processes): what it does when the job ends."""
import pytest

from tmd import protocol as p
from tmd.daemon import Daemon
from tmd.registry import Worker

pytestmark = pytest.mark.timeout(30)


def test_job_end_aborts_a_migration_in_flight_and_releases_the_standbys(tmp_path):
    d = Daemon("t", str(tmp_path), ["n1", "n2"], 1, ["s1"], record_steps=1, echo=False)
    sent: list[tuple[str, p.Message]] = []
    d.send = lambda w, msg: sent.append((w.identity.decode(), msg))  # observe, no sockets
    try:
        for node in ("n1", "n2", "s1"):
            d.registry.add_worker(Worker(f"{node}/0".encode(), node, 0, 1, "h"))
        for w in d.registry.rank_owner.values():
            w.step = 5
        m = d.migrations.request("n2", "s1")
        for w in d.registry.rank_owner.values():
            w.done = True
        d._check_finished()
        assert m.state == "aborted" and m.reason == "the job finished before the migration committed"
        assert ("s1/0", p.Release(reason="job finished", exit_code=0)) in sent
        assert d.exit_code == 0  # no launcher: nothing left to wait for
    finally:
        d.sock.close()

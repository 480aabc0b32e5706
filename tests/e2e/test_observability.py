"""Observability end to end: one real local job (2 nodes x 2 ranks, tiny GPT, standbys s1 and s2) with a planned
migration (``tmctl migrate --from n2 --to s1``, the CLI itself) and then a kill -9 of n1 (the script's ``--fault``),
recovered onto s2.

While the job runs, tmd's metrics endpoint is scraped with the job's token and its counters and histograms are
asserted to have moved by exactly what happened; the status page is loaded in a real headless Chromium (the DOM
it renders is asserted: the node table and the timeline's shaded spans; a screenshot is kept in
``$TM_TEST_ARTIFACTS`` or ``test-artifacts/``). After the job, ``tmctl timeline --png`` draws the journal and the
number of shaded events counted in the picture's pixels equals the journal's.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tmctl.localjob import Job, events, final_hashes, scrape, wait_until, web_of
from tmd import protocol as p

STEPS = 170
FAULT_STEP = 90  # n1 is killed at the start of this step's forward, well after the migration committed
PAD = ("--min-step-time-s", "0.15")
ARTIFACTS = os.environ.get("TM_TEST_ARTIFACTS") or os.path.join(os.path.dirname(__file__), "..", "..",
                                                                 "test-artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class ObservedJob(Job):
    """The module's job (standbys s1 and s2; n1 killed at FAULT_STEP), with its status page's address and token."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(run_dir, 2, STEPS, *PAD, "--fault", f"n1:{FAULT_STEP}:forward")
        self.url, self.token = web_of(run_dir)
        with open(p.layout.RunDir(run_dir).tmd_json) as f:
            self.token_file = json.load(f)["web"]["token_file"]

    def get(self, path: str, token: str | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.url.rstrip("/") + path)
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: (name, sorted labels without ``job``) -> value."""
        out = {}
        for (name, labels), v in scrape(self.run_dir).items():
            assert dict(labels).get("job") == self.job_name(), (name, labels)
            out[(name, tuple((k, x) for k, x in labels if k != "job"))] = v
        return out

    def job_name(self) -> str:
        return self.events(p.Event.TMD_STARTED)[0]["job"]


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chromium_dom(url: str, profile: str, screenshot: str | None = None) -> str:
    """The DOM Chromium renders for ``url`` after its scripts ran (a few seconds of virtual time), with a profile
    of its own in directory ``profile`` (cookies are per profile)."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
            "--virtual-time-budget=4000"]
    if screenshot:
        subprocess.run(args + ["--window-size=1280,1000", f"--screenshot={screenshot}", url], check=True,
                       capture_output=True, timeout=60)
    return subprocess.run(args + ["--dump-dom", url], check=True, capture_output=True, text=True, timeout=60).stdout


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with ObservedJob(str(tmp_path_factory.mktemp("observability") / "job")) as j:
        yield j


def test_metrics_need_the_token_and_count_steps(job):
    assert job.url.startswith("http://127.0.0.1:"), job.url  # the job's address, never all interfaces
    assert job.get("/metrics")[0] == 401
    assert job.get("/metrics", "not-the-token")[0] == 401
    wait_until(lambda: value(job.metrics(), "trainmover_steps_total") >= 5, 120, "5 steps counted")
    before = job.metrics()
    assert value(before, "trainmover_migrations_total", state="committed") == 0
    assert value(before, "trainmover_node_healthy", node="n1") == 1
    assert value(before, "trainmover_node_role", node="s1", role="standby") == 1
    assert value(before, "trainmover_step_time_seconds_count") >= 5


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (scripts/setup.sh installs it as root)")
def test_status_page_renders_in_a_real_browser(job, tmp_path):
    wait_until(lambda: any(n["warm"] for n in job.client.request(p.StatusRequest()).nodes if n["name"] == "s2"), 120,
               "s2 warm")
    tmctl = [sys.executable, "-m", "tmctl.cli", "--run-dir", job.run_dir]
    shown = subprocess.run(tmctl + ["page"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == f"{job.url}?token={job.token}", shown
    scrape = subprocess.run(tmctl + ["page", "--prometheus"], capture_output=True, text=True, timeout=60).stdout
    assert f"credentials_file: {os.path.abspath(job.token_file)}" in scrape and job.token not in scrape, scrape
    assert f"page: {job.url}" in subprocess.run(tmctl + ["status"], capture_output=True, text=True, timeout=60).stdout
    dom = chromium_dom(shown.stdout.strip(), str(tmp_path / "profile"))
    for node in ("n1", "n2", "s1", "s2"):
        assert re.search(rf'<tr[^>]*data-node="{node}"', dom), (node, dom[:2000])
    assert 'id="timeline"' in dom
    assert chromium_dom(job.url, str(tmp_path / "fresh")).count('data-node="') == 0  # no token: nothing shown


def test_migration_with_the_cli_waits_and_moves_the_metrics(job):
    r = subprocess.run([sys.executable, "-m", "tmctl.cli", "--run-dir", job.run_dir, "migrate", "--from", "n2",
                        "--to", "s1", "--wait", "--wait-standby-s", "60"], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for state in (p.MigrationState.WARMING, p.MigrationState.PREPARED, p.MigrationState.SWITCHING,
                  p.MigrationState.COMMITTED):
        assert state in r.stdout, r.stdout
    job.wait_event(p.Event.MIGRATION_DOWNTIME)
    m = wait_until(lambda: (lambda s: s if value(s, "trainmover_migration_downtime_seconds_count") == 1 else None)(
        job.metrics()), 30, "the downtime observed")
    committed = next(e for e in events(job.run_dir) if e["event"] == p.Event.MIGRATION_COMMITTED)
    assert value(m, "trainmover_migrations_total", state="committed") == 1
    assert value(m, "trainmover_migrations_total", state="aborted") == 0
    assert value(m, "trainmover_moved_bytes_total", kind="migration") == committed["bytes_moved"] > 0
    assert value(m, "trainmover_migration_stayer_pause_seconds_count") == 1
    for phase in committed["phases_s"]:
        assert value(m, "trainmover_migration_phase_seconds_count", phase=phase) == 1, phase


def test_kill_9_is_counted_and_the_page_shows_both_spans(job, tmp_path):
    done = job.wait_event(p.Event.RECOVERY_DONE, 180)
    failed = next(e for e in events(job.run_dir) if e["event"] == p.Event.NODE_FAILED)
    assert failed["node"] == "n1" and failed["silent_s"] is not None
    m = wait_until(lambda: (lambda s: s if value(s, "trainmover_recoveries_total", state="recovered") == 1
                            else None)(job.metrics()), 30, "the incident counted")
    assert value(m, "trainmover_node_failures_total", node="n1", signal=failed["signal"]) == 1
    assert value(m, "trainmover_detection_latency_seconds_count") == 1
    assert value(m, "trainmover_detection_latency_seconds_sum") == pytest.approx(failed["silent_s"], abs=1e-6)
    assert value(m, "trainmover_moved_bytes_total", kind="recovery") == done["bytes_moved"]
    if CHROMIUM is not None:
        os.makedirs(ARTIFACTS, exist_ok=True)
        shot = os.path.join(ARTIFACTS, "status_page.png")
        dom = chromium_dom(f"{job.url}?token={job.token}", str(tmp_path / "profile"), screenshot=shot)
        assert len(re.findall(r'<rect[^>]*class="span migration', dom)) == 1, dom[-3000:]
        assert len(re.findall(r'<rect[^>]*class="span incident', dom)) == 1, dom[-3000:]
        assert os.path.getsize(shot) > 10_000


def test_job_ends_and_timeline_png_shades_every_event(job, tmp_path):
    job.end_padding()  # the migration and the kill are over: the rest at the job's own speed
    assert job.proc.wait(timeout=240) == 0
    assert len(final_hashes(job.run_dir)) == 4
    journal = events(job.run_dir)
    migrations = {e["migration_id"] for e in journal if e["event"] == p.Event.MIGRATION_REQUESTED}
    incidents = {e["incident_id"] for e in journal if e["event"] == p.Event.RECOVERY_STARTED}
    assert (len(migrations), len(incidents)) == (1, 1)
    png = str(tmp_path / "timeline.png")
    r = subprocess.run([sys.executable, "-m", "tmctl.cli", "--run-dir", job.run_dir, "timeline", "--png", png],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    import matplotlib.image

    from tmctl.timeline_plot import count_bands

    assert matplotlib.image.imread(png).shape[:2] == (500, 1200)  # tmctl's default picture, in pixels
    assert count_bands(png) == {"migration": len(migrations), "incident": len(incidents)}
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(png, os.path.join(ARTIFACTS, "timeline.png"))
    r = subprocess.run([sys.executable, "-m", "tmctl.cli", "--run-dir", job.run_dir, "timeline"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "migration 1" in r.stdout and "incident 1" in r.stdout, r.stdout

"""tmd's Prometheus metrics: counters and histograms from the journal, gauges from the latest status.

:class:`Metrics` owns its own ``CollectorRegistry`` (never prometheus_client's global one). tmd feeds it each journal
entry (:meth:`Metrics.observe`, in tmd's loop thread; :meth:`Metrics.replay` the journal of a resumed job, so the
counters go on from it) and the latest ``StatusReply`` as a dict (:meth:`Metrics.set_live`); the web server
(tmd.web) asks for :meth:`Metrics.exposition` from its own threads. A journal entry may carry anything: a field of
the wrong type, a negative or non-finite number, or none at all skips that one metric, never raises.

Every metric carries the label ``job``; per-node metrics also ``node``. Units are seconds and bytes.

From the journal (event -> metric):

=================================================  =========  ========================================================
metric (labels besides ``job``)                    type       source and meaning
=================================================  =========  ========================================================
``trainmover_steps_total``                         counter    ``step_times``: steps completed by every active rank (a
                                                              step redone after a rollback counts again)
``trainmover_step_time_seconds``                   histogram  ``step_times``: the slowest rank's time of each step
``trainmover_migrations_total{state}``             counter    ``migration_committed`` / ``migration_aborted``:
                                                              finished migrations, ``state`` committed or aborted
``trainmover_migration_phase_seconds{phase}``      histogram  ``migration_committed``'s ``phases_s``: warm_up, prepare,
                                                              switch_wait, transfer, commit, total
``trainmover_migration_downtime_seconds``          histogram  ``migration_downtime``'s ``downtime_s``: the time the
                                                              job lost to a committed migration
``trainmover_migration_stayer_pause_seconds``      histogram  ``migration_downtime``'s ``pause_s``: the longest time a
                                                              stayer stood at the switch step
``trainmover_migration_joiner_lag_seconds``        histogram  ``migration_downtime``'s ``joiner_lag_s``: how much later
                                                              than the last stayer the last joiner was ready to run
                                                              the switch step
``trainmover_recoveries_total{state}``             counter    ``recovery_done`` / ``recovery_failed`` /
                                                              ``recovery_superseded``: finished incidents, ``state``
                                                              recovered, failed or superseded
``trainmover_recovery_phase_seconds{phase}``       histogram  ``recovery_done``'s ``phases_s``: halt, warm_up, plan,
                                                              transfer_and_regroup, after_warm_up, total
``trainmover_node_failures_total{node,signal}``    counter    ``node_failed``: nodes declared failed, ``signal``
                                                              process_exit, stopped or silent
``trainmover_detection_latency_seconds``           histogram  ``node_failed``'s ``silent_s``: the node's last
                                                              heartbeat to tmd declaring it failed
``trainmover_moved_bytes_total{kind}``             counter    ``migration_committed`` / ``recovery_done``'s
                                                              ``bytes_moved``: training state sent, ``kind``
                                                              migration or recovery
``trainmover_stragglers_total{node}``              counter    ``straggler_detected``: ranks flagged as stragglers
``trainmover_checkpoints_total{state}``            counter    ``checkpoint_committed`` / ``checkpoint_failed``:
                                                              checkpoints written, ``state`` committed or failed
``trainmover_restarts_total{tier}``                counter    ``job_restarting``: restarts of every process from a
                                                              lower tier (``tier`` checkpoint)
``trainmover_restart_work_lost_seconds``           histogram  ``job_restarting``'s ``work_lost_s``: the training time
                                                              between the checkpoint and the failure
=================================================  =========  ========================================================

From the latest status (computed at scrape time):

=================================================  =========  ========================================================
``trainmover_world_size``                          gauge      ranks in the job
``trainmover_step``                                gauge      the job's current step
``trainmover_generation``                          gauge      the job's process-group generation
``trainmover_node_heartbeat_age_seconds{node}``    gauge      age of the node's oldest live heartbeat (grows between
                                                              status updates; absent when no live process)
``trainmover_node_healthy{node}``                  gauge      1 when tmd judges the node healthy, else 0
``trainmover_node_role{node,role}``                gauge      state set: 1 for the node's role (active, standby,
                                                              joining, left, failed), 0 for the others
``trainmover_node_step{node}``                     gauge      the highest step the node's processes reported
``trainmover_node_step_time_seconds{node}``        gauge      the node's slowest recent step time
``trainmover_standbys{state}``                     gauge      standby nodes, ``state`` warm or cold
``trainmover_migration_in_progress``               gauge      1 while a migration runs
``trainmover_recovery_in_progress``                gauge      1 while a failure recovery runs
``trainmover_job_failed``                          gauge      1 once tmd declared the job failed
=================================================  =========  ========================================================
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Iterable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tmd.migration import Migration
from tmd.protocol.vocab import Event, FailureSignal, Health, IncidentState, MigrationState, NodeRole
from tmd.recovery import Incident

PREFIX = "trainmover"
MAX_LABEL_CHARS = 128  # a label value longer than this is cut (names come from the journal)
MAX_NODES = 4096  # distinct node label values a metric takes at most (further ones are skipped)

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DOWNTIME_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
DETECTION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)

MIGRATION_FINAL = {Event.MIGRATION_COMMITTED: MigrationState.COMMITTED, Event.MIGRATION_ABORTED: MigrationState.ABORTED}
RECOVERY_FINAL = {Event.RECOVERY_DONE: IncidentState.RECOVERED, Event.RECOVERY_FAILED: IncidentState.FAILED,
                  Event.RECOVERY_SUPERSEDED: IncidentState.SUPERSEDED}
MIGRATION_PHASES = tuple(Migration.SPANS)
RECOVERY_PHASES = tuple(Incident.SPANS)
MOVED_MIGRATION, MOVED_RECOVERY = "migration", "recovery"


def seconds(value: Any) -> Optional[float]:
    """``value`` as a finite, non-negative number of seconds (or bytes), else None (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def label(value: Any) -> Optional[str]:
    """``value`` as a label value: a non-empty string cut to MAX_LABEL_CHARS, else None."""
    if not isinstance(value, str) or not value:
        return None
    return str.__str__(value)[:MAX_LABEL_CHARS]


class LiveCollector(Collector):
    """The gauges of the latest status dict, computed at each scrape (heartbeat ages grow by the time since the
    dict was published)."""

    def __init__(self, job: str):
        self.job = job
        self._lock = threading.Lock()
        self._status: Optional[dict] = None
        self._published = 0.0  # time.monotonic() of the last set()

    def set(self, status: dict) -> None:
        with self._lock:
            self._status, self._published = status, time.monotonic()

    def describe(self):
        return []  # unchecked collector: its families depend on the status

    def collect(self):
        with self._lock:
            status, published = self._status, self._published
        if not isinstance(status, dict):
            return
        job, since = self.job, max(0.0, time.monotonic() - published)

        def gauge(name: str, doc: str, labels: tuple = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["job", *labels])

        for name, key, doc in (("world_size", "world_size", "Ranks in the job."),
                               ("step", "step", "The job's current step."),
                               ("generation", "generation", "The job's process-group generation.")):
            g = gauge(name, doc)
            value = seconds(status.get(key))
            if value is not None:
                g.add_metric([job], value)
                yield g

        age = gauge("node_heartbeat_age_seconds", "Age of the node's oldest live heartbeat (seconds).", ("node",))
        healthy = gauge("node_healthy", "1 when tmd judges the node healthy, else 0.", ("node",))
        role = gauge("node_role", "The node's role (state set: 1 for its role).", ("node", "role"))
        step = gauge("node_step", "The highest step the node's processes reported.", ("node",))
        step_time = gauge("node_step_time_seconds", "The node's slowest recent step time (seconds).", ("node",))
        standbys = {"warm": 0, "cold": 0, "guarding": 0}
        nodes = status.get("nodes")
        for n in (nodes if isinstance(nodes, list) else [])[:MAX_NODES]:
            name = label(n.get("name")) if isinstance(n, dict) else None
            if name is None:
                continue
            value = seconds(n.get("heartbeat_age_s"))
            if value is not None:
                age.add_metric([job, name], value + since)
            if isinstance(n.get("health"), str):
                healthy.add_metric([job, name], 1.0 if n["health"] == Health.HEALTHY else 0.0)
            if n.get("role") in tuple(NodeRole):
                for r in NodeRole:
                    role.add_metric([job, name, r.value], 1.0 if n["role"] == r else 0.0)
                if n["role"] == NodeRole.STANDBY:
                    standbys["warm" if n.get("warm") is True else "cold"] += 1
                elif n["role"] == NodeRole.GUARDING:
                    standbys["guarding"] += 1
            for family, key in ((step, "step"), (step_time, "step_time_s")):
                value = seconds(n.get(key))
                if value is not None:
                    family.add_metric([job, name], value)
        yield from (age, healthy, role, step, step_time)
        g = gauge("standbys", "Standby nodes: warm (ready to take ranks over), cold, or guarding (warm as one "
                              "node's ranks, tmd.guards).", ("state",))
        for state, count in standbys.items():
            g.add_metric([job, state], count)
        yield g

        for name, key, kind in (("migration_in_progress", "migration", MigrationState),
                                ("recovery_in_progress", "recovery", IncidentState)):
            episode = status.get(key)
            running = 0.0
            if isinstance(episode, dict) and episode.get("state") in tuple(kind):
                running = 0.0 if kind(episode["state"]).finished else 1.0
            g = gauge(name, f"1 while a {key} runs.")
            g.add_metric([job], running)
            yield g
        g = gauge("job_failed", "1 once tmd declared the job failed.")
        g.add_metric([job], 1.0 if status.get("failure") else 0.0)
        yield g


class Metrics:
    """The metrics of job ``job`` (see the module docstring for each one). ``observe`` and ``set_live`` may run in
    one thread while ``exposition`` runs in others."""

    def __init__(self, job: str):
        self.job = job
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()  # observe() calls from several threads stay consistent
        self._nodes: set[str] = set()
        r, j = self.registry, ("job",)

        def counter(name, doc, labels=()):
            return Counter(f"{PREFIX}_{name}", doc, [*j, *labels], registry=r)

        def histogram(name, doc, buckets, labels=()):
            return Histogram(f"{PREFIX}_{name}", doc, [*j, *labels], buckets=buckets, registry=r)

        self.steps = counter("steps", "Steps completed by every active rank (a redone step counts again).")
        self.step_time = histogram("step_time_seconds", "The slowest rank's time of each step (seconds).",
                                   STEP_BUCKETS_S)
        self.migrations = counter("migrations", "Finished migrations by final state.", ("state",))
        self.migration_phase = histogram("migration_phase_seconds", "Durations of committed migrations' phases "
                                         "(seconds).", PHASE_BUCKETS_S, ("phase",))
        self.downtime = histogram("migration_downtime_seconds", "Time the job lost to a committed migration "
                                  "(seconds).", DOWNTIME_BUCKETS_S)
        self.pause = histogram("migration_stayer_pause_seconds", "Longest time a stayer stood at a migration's "
                               "switch step (seconds).", DOWNTIME_BUCKETS_S)
        self.joiner_lag = histogram("migration_joiner_lag_seconds", "How much later than the last stayer the last "
                                    "joiner was ready to run a migration's switch step (seconds).", DOWNTIME_BUCKETS_S)
        self.recoveries = counter("recoveries", "Finished failure recoveries (incidents) by final state.", ("state",))
        self.recovery_phase = histogram("recovery_phase_seconds", "Durations of recovered incidents' phases "
                                        "(seconds).", PHASE_BUCKETS_S, ("phase",))
        self.failures = counter("node_failures", "Nodes declared failed, by how tmd noticed.", ("node", "signal"))
        self.detection = histogram("detection_latency_seconds", "A failed node's last heartbeat to tmd declaring "
                                   "it failed (seconds).", DETECTION_BUCKETS_S)
        self.moved = counter("moved_bytes", "Training state sent by migrations and recoveries (bytes).", ("kind",))
        self.stragglers = counter("stragglers", "Ranks flagged as stragglers, by node.", ("node",))
        self.checkpoints = counter("checkpoints", "Checkpoints the ranks wrote, by state (committed or failed).",
                                   ("state",))
        self.restarts = counter("restarts", "Restarts of every process from a lower tier, by tier.", ("tier",))
        self.work_lost = histogram("restart_work_lost_seconds", "Training time between the checkpoint a restart "
                                   "went back to and the failure (seconds).", DOWNTIME_BUCKETS_S)
        # label sets known up front start at 0 (so rate() and increase() see the first one)
        self.steps.labels(job)
        for state in MIGRATION_FINAL.values():
            self.migrations.labels(job, state.value)
        for state in RECOVERY_FINAL.values():
            self.recoveries.labels(job, state.value)
        for kind in (MOVED_MIGRATION, MOVED_RECOVERY):
            self.moved.labels(job, kind)
        for state in ("committed", "failed"):
            self.checkpoints.labels(job, state)
        self.restarts.labels(job, "checkpoint")
        self.live = LiveCollector(job)
        self.registry.register(self.live)

    # --- from the journal ---------------------------------------------------------------------------------------
    def observe(self, entry: dict) -> None:
        """Count one journal entry ``{"seq", "ts", "event", ...fields}``; never raises (a malformed field skips
        its metric)."""
        try:
            with self._lock:
                self._observe(entry)
        except Exception:  # noqa: BLE001 - a metric must never take tmd's loop down
            pass

    def replay(self, entries: Iterable[dict]) -> None:
        """Observe each of ``entries`` in order (the journal of a resumed job)."""
        for entry in entries:
            self.observe(entry)

    def _observe(self, e: dict) -> None:
        if not isinstance(e, dict) or not isinstance(e.get("event"), str):
            return
        ev, job = e["event"], self.job
        if ev == Event.STEP_TIMES:
            steps = e.get("steps")
            for item in steps if isinstance(steps, list) else []:
                if isinstance(item, (list, tuple)) and len(item) == 3:
                    value = seconds(item[2])
                    if value is not None:
                        self.steps.labels(job).inc()
                        self.step_time.labels(job).observe(value)
        elif ev in MIGRATION_FINAL:
            self.migrations.labels(job, MIGRATION_FINAL[ev].value).inc()
            if ev == Event.MIGRATION_COMMITTED:
                self._phases(self.migration_phase, MIGRATION_PHASES, e.get("phases_s"))
                self._moved(MOVED_MIGRATION, e.get("bytes_moved"))
        elif ev == Event.MIGRATION_DOWNTIME:
            for histogram, key in ((self.downtime, "downtime_s"), (self.pause, "pause_s"),
                                   (self.joiner_lag, "joiner_lag_s")):
                value = seconds(e.get(key))
                if value is not None:
                    histogram.labels(job).observe(value)
        elif ev in RECOVERY_FINAL:
            self.recoveries.labels(job, RECOVERY_FINAL[ev].value).inc()
            if ev == Event.RECOVERY_DONE:
                self._phases(self.recovery_phase, RECOVERY_PHASES, e.get("phases_s"))
                self._moved(MOVED_RECOVERY, e.get("bytes_moved"))
        elif ev == Event.WORKER_REGISTERED:  # a node's label sets start at 0 once it runs a process
            node = self._node(e.get("node"))
            if node is not None:
                self.stragglers.labels(job, node)
                for signal in FailureSignal:
                    self.failures.labels(job, node, signal.value)
        elif ev == Event.NODE_FAILED:
            node, signal = self._node(e.get("node")), e.get("signal")
            if node is not None and signal in tuple(FailureSignal):
                self.failures.labels(job, node, FailureSignal(signal).value).inc()
            value = seconds(e.get("silent_s"))
            if value is not None:
                self.detection.labels(job).observe(value)
        elif ev == Event.STRAGGLER_DETECTED:
            node = self._node(e.get("node"))
            if node is not None:
                self.stragglers.labels(job, node).inc()
        elif ev in (Event.CHECKPOINT_COMMITTED, Event.CHECKPOINT_FAILED):
            self.checkpoints.labels(job, "committed" if ev == Event.CHECKPOINT_COMMITTED else "failed").inc()
        elif ev == Event.JOB_RESTARTING and e.get("tier") == "checkpoint":
            self.restarts.labels(job, "checkpoint").inc()
            value = seconds(e.get("work_lost_s"))
            if value is not None:
                self.work_lost.labels(job).observe(value)

    def _phases(self, histogram: Histogram, names: tuple, phases_s: Any) -> None:
        if not isinstance(phases_s, dict):
            return
        for name in names:
            value = seconds(phases_s.get(name))
            if value is not None:
                histogram.labels(self.job, name).observe(value)

    def _moved(self, kind: str, value: Any) -> None:
        value = seconds(value)
        if value is not None:
            self.moved.labels(self.job, kind).inc(value)

    def _node(self, value: Any) -> Optional[str]:
        """A node label value, or None (not a string, or MAX_NODES other nodes were seen already)."""
        name = label(value)
        if name is None or (name not in self._nodes and len(self._nodes) >= MAX_NODES):
            return None
        self._nodes.add(name)
        return name

    # --- live ---------------------------------------------------------------------------------------------------
    def set_live(self, status: dict) -> None:
        """Publish the latest status (``dataclasses.asdict`` of a ``StatusReply``); the gauges read it at each
        scrape. The dict is kept as given: do not change it afterwards."""
        self.live.set(status)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format: (body, content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

"""tmd.config: one JobConfig, its defaults defined once, checked as it is built, journalled whole at each start,
restored by ``tmd resume`` with the options given to it as journalled overrides."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import typing

import pytest
import typer

from tmd import cli
from tmd.config import (
    DEFAULTS, SECTION_OF, ConfigError, DetectionConfig, JobConfig, changed, field_help, flag,
)
from tmd.daemon import Daemon
from tmd.journal import read_events
from tmd.protocol.layout import RunDir
from tmd.protocol.vocab import Event, ExitCode
from tmd.resume import ResumeError, load

pytestmark = pytest.mark.timeout(30)

# a job started with settings other than the defaults: detection, straggler evacuation, snapshots, the page off
NON_DEFAULT = DEFAULTS.with_options(heartbeat_timeout_s=12.0, suspect_after_s=1.5, blocked_after_s=0.5,
                                    migrate_stragglers=True, snapshot_every=4, metrics_port=-1)


# --- defaults ----------------------------------------------------------------------------------------------------
def test_every_field_has_one_default_help_and_option_and_the_cli_restates_none():
    assert DEFAULTS == JobConfig() and DEFAULTS.detection == DetectionConfig()
    hints = typing.get_type_hints(JobConfig)
    names = [f.name for s in dataclasses.fields(JobConfig) for f in dataclasses.fields(hints[s.name])]
    assert len(names) == len(set(names)) == len(SECTION_OF)  # a field's name is its option's: unique
    for name in names:
        assert field_help(name).strip() and flag(name) == "--" + name.replace("_", "-")
    # Every option of tmd local, slurm and resume named after a field is not given unless typed (None): the
    # default lives in tmd.config only, and its help is the field's.
    commands = typer.main.get_command(cli.app).commands
    seen = set()
    for command in ("local", "slurm", "resume"):
        for param in commands[command].params:
            if param.name in SECTION_OF and not param.hidden:  # (resume's hidden --record-steps: ignored)
                seen.add(param.name)
                assert param.default is None, (command, param.name)
                assert param.help == field_help(param.name, resumed=command == "resume"), (command, param.name)
    assert seen == set(SECTION_OF) - {"auth"}  # auth: off with tmd local --no-auth only


def test_the_detector_and_the_daemon_take_their_thresholds_from_the_config(tmp_path):
    from tmd.detection import Detector
    from tmd.registry import Registry

    assert Detector(Registry(["n1"], 1, [])).config == DEFAULTS.detection
    d = Daemon("t", str(tmp_path), ["n1", "n2"], 1, ["s1"], NON_DEFAULT, echo=False)
    try:
        assert d.detector.config == NON_DEFAULT.detection and d.evacuation.migrate_stragglers
        assert d.incidents.snapshot_every == 4 and d.web is None
        assert d.status().config == NON_DEFAULT.to_dict()
    finally:
        d.close()


# --- validation ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,message", [
    ({"blocked_after_s": 0.8}, "the detection thresholds must rise, --blocked-after-s < --suspect-after-s < "
                               "--heartbeat-timeout-s: not 0.8, 0.8, 5 (seconds)"),
    ({"suspect_after_s": 6.0}, "the detection thresholds must rise"),
    ({"heartbeat_timeout_s": 0.5}, "the detection thresholds must rise"),
    ({"blocked_after_s": 0.0}, "--blocked-after-s must be a positive number of seconds, not 0"),
    ({"heartbeat_timeout_s": float("inf")}, "--heartbeat-timeout-s must be a finite number, not inf"),
    ({"heartbeat_timeout_s": "5"}, "--heartbeat-timeout-s must be a number, not '5'"),
    ({"record_steps": 1}, "--record-steps must be at least 2, not 1"),
    ({"record_steps": True}, "--record-steps must be of type int, not True"),
    ({"record_steps": 101}, "--record-steps must be at most 100, not 101: every rank keeps the output"),
    ({"record_steps": 99999999999999999999}, "--record-steps must fit in 64 bits, not a 67-bit integer"),
    ({"guards": 2 ** 63}, "--guards must fit in 64 bits, not a 64-bit integer"),
    ({"guards": -1}, "--guards must be at least 0, not -1"),
    ({"snapshot_every": -1}, "--snapshot-every must be at least 0, not -1"),
    ({"metrics_port": -2}, "--metrics-port must be at least -1, not -2"),
    ({"port": 70000}, "--port must be at most 65535, not 70000"),
    ({"poll_s": 0.01}, "--poll-s must be at least 0.1 s, not 0.01"),
    ({"migrate_stragglers": 1}, "--migrate-stragglers must be of type bool, not 1"),
    ({"iface": "eth0/x"}, "--iface: 'eth0/x' is not a network interface name (1 to 15 characters"),
    ({"iface": "a" * 16}, "--iface: 'aaaaaaaaaaaaaaaa' is not a network interface name"),
    ({"checkpoint_every": -1}, "--checkpoint-every must be at least 0, not -1"),
    ({"checkpoint_keep": 0}, "--checkpoint-keep must be at least 1, not 0"),
    ({"standby_wait_s": -1.0}, "--standby-wait-s must be at least 0 s, not -1"),
    ({"keep_standbys": -1}, "--keep-standbys must be at least 0, not -1"),
])
def test_a_bad_setting_is_refused_at_construction_in_one_line(options, message):
    with pytest.raises(ConfigError) as e:
        DEFAULTS.with_options(**options)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_tmd_refuses_bad_thresholds_in_one_error_line_before_anything_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        cli.main(["local", "--suspect-after-s", "0.2", "--run-dir", str(run_dir), "--", "true"])
    assert e.value.code == ExitCode.REFUSED
    assert capsys.readouterr().err.splitlines() == [
        "error: the detection thresholds must rise, --blocked-after-s < --suspect-after-s < --heartbeat-timeout-s: "
        "not 0.3, 0.2, 5 (seconds)"]
    assert not run_dir.exists()


# --- the journal and tmd resume -----------------------------------------------------------------------------------
def test_a_config_survives_its_journal_line_and_an_older_one_lacks_fields():
    line = json.dumps(NON_DEFAULT.to_dict())
    assert JobConfig.from_dict(json.loads(line)) == NON_DEFAULT
    assert JobConfig.from_dict({"detection": {"heartbeat_timeout_s": 9}}) == \
        DEFAULTS.with_options(heartbeat_timeout_s=9.0)  # a section or field it lacks: the default
    for bad, why in (({"detection": {"heartbeat_s": 1.0}}, "unknown setting(s) in config section 'detection'"),
                     ({"nope": {}}, "unknown config section(s): nope"),
                     ({"replay": 3}, "config section 'replay' is not an object"),
                     ({"replay": {"record_steps": 1}}, "--record-steps must be at least 2")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            JobConfig.from_dict(bad)
    assert changed(NON_DEFAULT.to_dict()) == {"heartbeat_timeout_s": 12.0, "suspect_after_s": 1.5,
                                              "blocked_after_s": 0.5, "snapshot_every": 4,
                                              "migrate_stragglers": True, "metrics_port": -1}
    assert changed(DEFAULTS.to_dict()) == {} and changed(None) == {}


def configs(run_dir: str) -> list[dict]:
    return [e for e in read_events(RunDir(run_dir).events) if e["event"] == Event.JOB_CONFIG]


def test_the_config_is_journalled_whole_restored_by_resume_and_an_override_is_journalled(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    first = Daemon("t", run_dir, ["n1", "n2"], 1, ["s1"], NON_DEFAULT, echo=False)
    first.close()  # as if killed: no tmd_stopped
    assert [c["config"] for c in configs(run_dir)] == [NON_DEFAULT.to_dict()] and "overrides" not in configs(run_dir)[0]

    state = load(run_dir)
    assert state.config == NON_DEFAULT  # restored whole: migrate_stragglers and the thresholds too
    # tmd resume --heartbeat-timeout-s 9 --no-migrate-stragglers: two fields overridden, the rest the job's
    resumed_config = state.config.with_options({"heartbeat_timeout_s": 9.0, "migrate_stragglers": False,
                                                "suspect_after_s": None, "run_dir": run_dir})
    second = Daemon("t", run_dir, state.nodes, state.ranks_per_node, state.standbys, resumed_config, echo=False,
                    resume=state)
    try:
        assert second.detector.config == DetectionConfig(heartbeat_timeout_s=9.0, suspect_after_s=1.5,
                                                         blocked_after_s=0.5)
        assert not second.evacuation.migrate_stragglers and second.status().config == resumed_config.to_dict()
        assert second.resumed.rejoin_grace_s == 18.0  # twice the job's heartbeat timeout
    finally:
        second.close()
    last = configs(run_dir)[-1]
    assert last["config"] == resumed_config.to_dict()
    assert last["overrides"] == {"heartbeat_timeout_s": {"was": 12.0, "now": 9.0},
                                 "migrate_stragglers": {"was": True, "now": False}}
    assert load(run_dir).config == resumed_config  # a second restart keeps the override


def test_resume_of_an_older_journal_and_of_a_broken_config(tmp_path):
    run_dir = str(tmp_path)
    with open(os.path.join(run_dir, "tmd.json"), "w") as f:
        json.dump({"address": "tcp://127.0.0.1:5555", "pid": 999_999_999, "job": "j", "run_dir": run_dir}, f)
    start = {"seq": 1, "ts": 1.0, "event": Event.TMD_STARTED, "job": "j", "world_size": 2, "nodes": ["n1", "n2"],
             "standbys": [], "record_steps": 4, "snapshot_every": 0, "guards": 1}
    with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
        f.write(json.dumps(start) + "\n")
    # a tmd without job_config: its tmd_started's settings, the page off as tmd.json says, defaults elsewhere
    assert load(run_dir).config == DEFAULTS.with_options(record_steps=4, snapshot_every=0, guards=1,
                                                         metrics_port=-1)
    with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps({"seq": 2, "ts": 1.0, "event": Event.JOB_CONFIG,
                            "config": {"detection": {"suspect_after_s": 9.0}}}) + "\n")
    with pytest.raises(ResumeError, match="configuration in its journal does not read: the detection thresholds"):
        load(run_dir)


def test_resume_option_out_of_range_exits_2_in_one_line(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    Daemon("t", run_dir, ["n1"], 1, [], NON_DEFAULT, echo=False).close()
    with pytest.raises(SystemExit) as e:  # below the job's own --suspect-after-s 1.5
        cli.main(["resume", "--run-dir", run_dir, "--heartbeat-timeout-s", "1.0"])
    assert e.value.code == ExitCode.REFUSED
    assert capsys.readouterr().err.splitlines() == [
        "error: the detection thresholds must rise, --blocked-after-s < --suspect-after-s < --heartbeat-timeout-s: "
        "not 0.5, 1.5, 1 (seconds)"]
    assert len(configs(run_dir)) == 1  # nothing restarted


# --- the interface, the checkpoint tier and the standby pool: sections like the others -------------------------
OPERATIONS = DEFAULTS.with_options(iface="tm0", checkpoint_dir="/ckpt/job", checkpoint_every=50, checkpoint_keep=3,
                                   standby_wait_s=30.0, keep_standbys=2)


def test_the_interface_checkpoint_and_pool_settings_are_journalled_restored_by_resume_and_shown(tmp_path):
    from tmctl.render import config_line

    assert (DEFAULTS.network.iface, DEFAULTS.slurm.keep_standbys) == (None, 0)
    assert (DEFAULTS.checkpoint.checkpoint_dir, DEFAULTS.checkpoint.checkpoint_every,
            DEFAULTS.checkpoint.checkpoint_keep, DEFAULTS.checkpoint.standby_wait_s) == (None, 0, 2, 0.0)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir, mode=0o700)
    Daemon("t", run_dir, ["n1"], 1, [], OPERATIONS, echo=False).close()
    assert configs(run_dir)[0]["config"]["network"] == {"iface": "tm0"}
    assert configs(run_dir)[0]["config"]["checkpoint"] == {"checkpoint_dir": "/ckpt/job", "checkpoint_every": 50,
                                                           "checkpoint_keep": 3, "standby_wait_s": 30.0}
    assert configs(run_dir)[0]["config"]["slurm"]["keep_standbys"] == 2
    assert load(run_dir).config == OPERATIONS  # tmd resume restores them (none is a resume option)
    assert config_line(OPERATIONS.to_dict()) == ("config: iface=tm0 checkpoint_dir=/ckpt/job checkpoint_every=50 "
                                                 "checkpoint_keep=3 standby_wait_s=30.0 keep_standbys=2")


def test_a_command_line_sets_them_through_the_config_and_tm_ifname_is_the_interface_option(monkeypatch):
    seen, config = {}, cli._config

    def build(base, given, **more):  # the config the command would run with, and stop there
        seen["config"] = config(base, given, **more)
        raise typer.Exit(0)
    monkeypatch.setattr(cli, "_config", build)
    monkeypatch.setenv("TM_IFNAME", "ib0")
    with pytest.raises(SystemExit):
        cli.main(["slurm", "--keep-standbys", "2", "--checkpoint-dir", "/ckpt/job", "--checkpoint-every", "50",
                  "--checkpoint-keep", "3", "--standby-wait-s", "30", "--", "true"])
    assert seen["config"] == OPERATIONS.with_options(iface="ib0")  # from TM_IFNAME
    monkeypatch.delenv("TM_IFNAME")
    with pytest.raises(SystemExit):
        cli.main(["local", "--iface", "tm0", "--", "true"])
    assert seen["config"] == DEFAULTS.with_options(iface="tm0")


def test_checkpoint_settings_without_a_checkpoint_dir_exit_2_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for argv, line in ((["--checkpoint-every", "5"], "error: --checkpoint-every and --standby-wait-s need "
                                                     "--checkpoint-dir"),
                       (["--checkpoint-keep", "0"], "error: --checkpoint-keep must be at least 1, not 0")):
        with pytest.raises(SystemExit) as e:
            cli.main(["local", *argv, "--run-dir", str(run_dir), "--", "true"])
        assert e.value.code == ExitCode.REFUSED and capsys.readouterr().err.splitlines() == [line]
    assert not run_dir.exists()


def test_click_sees_a_bool_setting_as_a_switch_pair():
    params = {p.name: p for p in typer.main.get_command(cli.app).commands["resume"].params}
    option = params["migrate_stragglers"]
    assert option.opts == ["--migrate-stragglers"] and option.secondary_opts == ["--no-migrate-stragglers"]

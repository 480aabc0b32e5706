"""Every ``TM_*`` environment variable the project reads, in one table: its name, its default, who sets it and
what it means.

The reading sites keep their own ``os.environ`` calls; this module is the list a user reads (the user guide's
table, ``docs/user-guide.md``, is generated from it) and the list a unit test holds the code to: every
``TM_[A-Z_]+`` name read in ``tmd/``, ``worker/``, ``tmctl/``, ``slurm/``, ``examples/``, ``benchmarks/`` and
``scripts/`` must be here (``tests/unit/test_env.py``).

    python -m tmd.protocol.env                          # print the table (Markdown)
    python -m tmd.protocol.env --write docs/user-guide.md   # splice it between the guide's markers
    python -m tmd.protocol.env --check docs/user-guide.md   # exit 1 if the guide's table is not current
"""
from __future__ import annotations

import argparse
import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``name`` (``TM_...``), ``default`` (in words, as the reader sees it: ``unset``,
    a value, or what is used instead), ``scope`` (who sets or reads it) and ``meaning`` (one sentence)."""

    name: str
    default: str
    scope: str
    meaning: str


RANKS = "ranks (set by the user)"
BY_TMD = "ranks (set by tmd)"
CLI = "tmd / tmctl"
SLURM = "SLURM scripts"

VARIABLES: tuple[EnvVar, ...] = (
    # what a user may set in the ranks' environment
    EnvVar("TM_PRECOPY", "1", RANKS,
           "`0`: a leaver sends its whole state at the switch step (no pre-copy, no optimizer replay)."),
    EnvVar("TM_EARLY_COMMIT", "1", RANKS,
           "`0`: joiners report `transferred` only after loading the tail at the switch step, so tmd decides the "
           "commit then (a window of tens of ms instead of about a step)."),
    EnvVar("TM_STOP_VOID_PASSES", "1", RANKS,
           "`0`: after a peer failure a survivor's DDP forward and backward passes run to their end instead of "
           "raising `StepAborted` early."),
    EnvVar("TM_ABORT_IN_FORWARD", "unset", RANKS,
           "The earlier name of `TM_STOP_VOID_PASSES` (forward passes only then), still read when that is unset."),
    EnvVar("TM_TRANSFER_SHM", "1", RANKS,
           "`0`: state transfers never use the same-host shared-memory ring (the bytes always go over the group)."),
    EnvVar("TM_INNER_BACKEND", "`nccl` where CUDA is available, else `gloo`", RANKS,
           "The inner backend the mover Backend wraps: `gloo` or `nccl`; anything else is refused."),
    EnvVar("TM_EXIT_DRAIN_S", "5", RANKS,
           "Seconds a rank waits at exit for retired groups still being destroyed on C++ threads (finalizing the "
           "interpreter under them would abort the process)."),
    EnvVar("TM_FORK_SERVER", "1", CLI + " (tmd local)",
           "`0`: tmd local starts every rank with a fresh interpreter instead of forking it from a fork server that "
           "imported torch once (worker/fork_server.py; only `python script.py` and `python -m module` commands "
           "without CPU sets or namespaces are forked)."),
    EnvVar("TM_FORK_PRELOAD", "unset", CLI + " (tmd local)",
           "Modules (comma-separated) the fork server imports after torch and the worker package, before it forks "
           "the ranks: what they import anyway, e.g. `worker.integrations.torchtitan_image` for torchtitan "
           "(docs/torchtitan.md). A module that fails to import or leaves a thread running makes tmd start every "
           "process with a fresh interpreter."),
    EnvVar("TM_GLOO_HOST", "the address routing to tmd's store", RANKS + "; tmd local sets it",
           "The address gloo binds and advertises (local mode: 127.0.0.1, or the node's namespace address)."),
    EnvVar("TM_IFNAME", "unset (the interface routing to tmd)", "tmd local / tmd slurm (`--iface`); ranks",
           "The network interface the ranks' data plane uses on every node: each rank sets `TM_GLOO_HOST` to its "
           "address and `GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME` to the name; a node without it fails its ranks "
           "at start."),
    # what tmd sets for the processes it starts
    EnvVar("TM_COORDINATOR", "none", BY_TMD + "; tmctl",
           "tmd's ZeroMQ address: `worker.init()` registers there; tmctl uses it before `--job`/`--run-dir`."),
    EnvVar("TM_NODE", "`SLURMD_NODENAME`, else the host name", BY_TMD, "The node name this process registers as."),
    EnvVar("TM_LOCAL_RANK", "`SLURM_LOCALID`, else 0", BY_TMD,
           "The process's index on its node (also picks its CUDA device)."),
    EnvVar("TM_STANDBY", "0", BY_TMD, "`1`: this process is a standby and waits in `worker.init()` for a rank."),
    EnvVar("TM_KEYS", "none", BY_TMD + "; tmctl",
           "A key directory: tmd sets it for the ranks to `<keys>/worker` (the worker key pair, tmd's public key and "
           "the job secret, nothing else); tmctl reads the client key from a full keys directory named here."),
    EnvVar("TM_RUN_DIR", "`tmrun` (tmd, tmctl); the working directory (ranks)", BY_TMD + "; " + CLI,
           "The run directory: events, logs, recordings and `tmd.json`."),
    EnvVar("TM_CHECKPOINT_DIR", "unset (no checkpoints)", BY_TMD,
           "`--checkpoint-dir`: where the ranks write their checkpoints (worker.checkpointing)."),
    EnvVar("TM_CHECKPOINT_EVERY", "0 (none)", BY_TMD, "`--checkpoint-every`: steps between checkpoints."),
    EnvVar("TM_CHECKPOINT_KEEP", "2", BY_TMD, "`--checkpoint-keep`: checkpoints kept (the newest)."),
    EnvVar("TM_CHECKPOINT_JOB", "`local`", BY_TMD,
           "The job id that owns the checkpoint directory (`<dir>/JOB`; tmd.tiers derives it from the job's name)."),
    EnvVar("TM_CHECKPOINT_RESTART", "unset", BY_TMD,
           "`1`: tmd relaunched the job from its checkpoint tier; the ranks keep the run directory's recording of the "
           "job's first steps instead of recording again."),
    EnvVar("TM_RESUME_FROM", "unset", BY_TMD,
           "The checkpoint every rank loads before its first step: `--resume-from`'s, or the one tmd restarts the "
           "job from when in-memory recovery is impossible."),
    # the CLI and state on disk
    EnvVar("TM_STATE_DIR", "`~/.trainmover`", CLI + "; SLURM hooks",
           "The per-user state directory: SLURM jobs' `jobs/<JOBID>/tmd.json`, keys and hook reports."),
    EnvVar("TM_HOST", "the address this host's name resolves to", "tmd slurm; " + SLURM,
           "The address tmd binds and advertises, with its rendezvous store (never all interfaces)."),
    EnvVar("TM_RESERVATION", "`standby`", "tmd slurm; " + SLURM, "The SLURM reservation holding the standby jobs."),
    EnvVar("TM_PYTHON", "`python3`", SLURM,
           "The interpreter `slurm/train.sbatch` and `slurm/standby.sbatch` run tmd with."),
    EnvVar("TM_TMD_ARGS", "empty", SLURM, "More `tmd slurm` options for `slurm/train.sbatch` (e.g. `--guards 1`)."),
    EnvVar("TM_SLURM_NODES", "5", "slurm/local-cluster.sh", "How many slurmd nodes the throw-away cluster runs."),
    EnvVar("TM_SLURM_CTLD_PORT", "16817", "slurm/local-cluster.sh", "The throw-away cluster's slurmctld port."),
    EnvVar("TM_SLURM_UP_TIMEOUT_S", "60", "slurm/local-cluster.sh",
           "Seconds to wait for the throw-away cluster's nodes to come up."),
    # examples, setup and tests
    EnvVar("TM_PLAIN", "unset", "examples/train_llama.py",
           "`1`: run without the runtime (a plain gloo world, as `--plain`)."),
    EnvVar("TM_SKIP_SLURM", "0", "scripts/setup.sh", "`1`: do not install the SLURM packages for the SLURM tests."),
    EnvVar("TM_SKIP_BROWSER", "0", "scripts/setup.sh",
           "`1`: do not install Chromium for the status page's browser test."),
    EnvVar("TM_GPU_CHECK_BUDGET_S", "290", "scripts/gpu-check.sh",
           "Seconds the whole GPU check may take, set-up included (it always prints its JSON line)."),
    EnvVar("TM_GPU_CHECK_ONLY", "unset (every check)", "scripts/gpu-check.sh",
           "A comma-separated subset of the GPU check's checks to run (e.g. `rng,transfer`)."),
    EnvVar("TM_GPU_CHECK_SETUP", "unset", "benchmarks/gpu_check.py (set by scripts/gpu-check.sh)",
           "What the script's set-up did, copied into the JSON line's `setup`."),
    EnvVar("TM_TEST_ARTIFACTS", "`test-artifacts/`", "tests",
           "Where the observability test saves the status page's screenshot and the timeline picture."),
    EnvVar("TM_TEST_TORCHTITAN", "unset (both layouts' jobs)", "tests/e2e/test_torchtitan.py",
           "`all` also runs the torchtitan test left out of the default suite for time: the runtime's "
           "uninterrupted run against torchrun's."),
)

BY_NAME: dict[str, EnvVar] = {v.name: v for v in VARIABLES}

TABLE_BEGIN = "<!-- env-table: generated by `python -m tmd.protocol.env --write docs/user-guide.md` -->"
TABLE_END = "<!-- env-table: end -->"


def markdown_table() -> str:
    """The table as Markdown: one row per variable, in :data:`VARIABLES`' order."""
    rows = ["| variable | default | set or read by | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.default} | {v.scope} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"


def spliced(text: str) -> str:
    """``text`` with the table between :data:`TABLE_BEGIN` and :data:`TABLE_END` replaced by the current one.
    Raises ValueError when either marker is missing or they are out of order."""
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the markers {TABLE_BEGIN!r} and {TABLE_END!r} are missing or out of order")
    return text[:begin + len(TABLE_BEGIN)] + "\n" + markdown_table() + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tmd.protocol.env", description=__doc__.split("\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help="splice the table into PATH between its markers")
    group.add_argument("--check", metavar="PATH", help="exit 1 if PATH's table is not the current one")
    args = ap.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(markdown_table())
        return 0
    path = args.write or args.check
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        new = spliced(text)
    except ValueError as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"{path}: the TM_* table is not current; run python -m tmd.protocol.env --write {path}",
                  file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())

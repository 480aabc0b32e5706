"""A PROJECTION (not a measurement) of TrainMover's downtime to 32, 256 and 1,024 H100 GPUs. Prints one JSON object.

    python -m benchmarks.project [--results benchmarks/results] [--gpus 32,256,1024]

Each projected figure is a sum of named terms; each term is tagged ``measured`` (a figure of this implementation,
read from ``benchmarks/results/<file>.json``, with the file and key it came from), ``sourced`` (a published bound,
cited below) or ``assumed`` (a stated assumption). The measured terms were measured on a 2-core CPU host with gloo;
the projection uses them only where they do not depend on the hardware (counts, per-tensor CPU costs, tmd's own
round trips), and takes every bandwidth and every NCCL cost from the sources.

Layouts (``assumed``; Llama-3 sizes ``sourced`` [L3]): TP 8 inside each 8-GPU node, always.

- **Llama-3 8B** (8.03 B parameters, 32 layers): TP 8 x FSDP over the N / 8 nodes. No rank's shard has a copy on
  another node, so buddy snapshots (worker/snapshot.py) are on and a lost rank comes back from its keeper's host copy.
- **Llama-3 70B** (70.6 B parameters, 80 layers): TP 8 x PP 4 x HSDP over D = N / 32 data-parallel ranks, sharded
  over min(D, 8) and replicated over the rest. At 32 and 256 GPUs nothing is replicated (snapshots on); at 1,024 each
  shard has 4 copies on other nodes (recovery from a replica, no snapshots).

State per rank (``assumed``, mixed precision as FSDP2 keeps it): 12 bytes per parameter (fp32 master weights, fp32
Adam moments) and 4 bytes per parameter of fp32 gradients, divided over TP x PP x the FSDP shard group.

**Planned downtime** (a node migrated to a warm standby with pre-copy; the critical path at the switch step):

- ``swap``: phase 2 of the group change, switching every group to the generation built in phase 1, measured as the
  stayers' pause at the switch step in the least loaded run (scale.json, 8 ranks): local work, independent of N;
- ``switch_barrier``: the switch step's agreement, one collective across the job: log2(N) latency stages of
  ``ib_latency_s`` each (``assumed``, sourced [IB] order of magnitude);
- ``tail``: the state_dict digests of the tail (worker/precopy.py), per state tensor, on both ends (tail.json's CPU
  time per tensor, measured) times the tensors per rank (3 per parameter tensor: weight, exp_avg, exp_avg_sq);
- ``last_gradients``: the last step's gradients, streamed to the joiner in place before its update: gradient bytes
  per rank / InfiniBand bandwidth per GPU (sourced [IB]);
- ``first_collectives``: 0, ``assumed``: phase 1 connects every new communicator (worker/backend.py's eager
  connect) and the cluster sets NCCL_RUNTIME_CONNECT=0, so no connection is made lazily at the switch step
  ([NCCL222]: lazy connection is NCCL's default since 2.22; left on, the first collectives pay it).

Prepared beforehand, off the critical path (reported as ``preparation_s``, to be shorter than the time between a
migration's request and its switch step): NCCL init of the joiners' groups (phase 1), the pre-copy of the full state
(bytes / IB) and the joiners' shadow iterations (measured count x the assumed step time).

**Unplanned downtime** (a node lost, a warm general standby replaces it):

- ``detection``: a node silent while a peer is blocked in a collective is failed after ``suspect_after_s`` (0.8 s;
  tmd/detection.py's default; a process exit is seen in ~10 ms, recovery.json);
- ``halt`` and ``plan``: tmd's decision and the survivors' halt (recovery.json, measured round trips);
- ``nccl_init``: the groups containing the replacement's ranks, built after the failure, one after another: NCCL
  init per communicator of n ranks (sourced [NCCLX], [NCCL222]; see ``nccl_init_s``);
- ``state``: the lost rank's state from a replica (bytes / IB) or from its keeper's host copy (bytes /
  min(IB, PCIe), sourced [IB], [PCIE]);
- ``redo``: the interrupted step redone, on average half a step (``assumed`` step time);
- ``replay``: the replacement's shadow iterations (measured count for a recovery, hybrid.json: 0 for FSDP, 1 for
  pipeline x data parallel) x the step time.

**Buddy snapshots**: host memory per rank = ``copies_at_peak`` (measured: own + buddy, twice while a round
completes; hybrid.json) x the rank's state; checkpoint stall per rank = the device-to-host copy of its state over
PCIe (sourced [PCIE], x ``pcie_efficiency`` assumed); the send to the keeper runs in the background.

Sources:

- [L3] Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783 (2024): 8B has 32 layers, 70B 80 layers; parameter
  counts from the released model cards (8.03 B, 70.6 B).
- [NVL] NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s per GPU (both directions together), so 450 GB/s
  each way.
- [IB] NVIDIA DGX H100 datasheet / ConnectX-7: 8 x 400 Gb/s InfiniBand NDR ports per 8-GPU node, one per GPU:
  50 GB/s per GPU each way; NDR port-to-port latency is in the low microseconds (we assume 5 us per stage,
  switch hops included).
- [PCIE] PCI-SIG, PCI Express 5.0: 32 GT/s x 16 lanes, 128b/130b: 63 GB/s each way.
- [NCCLX] M. Si et al. (Meta), "Collective Communication for 100k+ GPUs", arXiv:2510.20171 (2025): stock NCCL's
  initialisation takes ~265 s at 96k GPUs and grows super-linearly with the number of ranks; a per-rank linear
  scale-down from that point is therefore an upper bound below 96k.
- [NCCL222] NVIDIA Technical Blog, "Memory Efficiency, Faster Initialization, and Cost Estimation with NVIDIA
  Collective Communications Library 2.22" (2024): lazy connection establishment on by default
  (NCCL_RUNTIME_CONNECT), ncclCommInitRank up to 90 % faster when several communicators are created.
- [TM] C. Lao et al., "TrainMover", arXiv:2412.12636: the paper's figures beside which this projection is printed
  (11.5 s planned and 19.6 s unplanned at 32 GPUs; 16.6 s and 21.1 s at 1,024).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GPUS = (32, 256, 1024)
GPUS_PER_NODE = 8

PAPER = {32: {"planned_s": 11.5, "unplanned_s": 19.6}, 1024: {"planned_s": 16.6, "unplanned_s": 21.1}}

SOURCED = {  # name: (value, unit, source)
    "nvlink_Bps": (450e9, "bytes/s per GPU each way", "[NVL]"),
    "ib_Bps": (50e9, "bytes/s per GPU each way", "[IB]"),
    "pcie_Bps": (63e9, "bytes/s each way", "[PCIE]"),
    "nccl_init_ref_s": (265.0, "s at nccl_init_ref_ranks", "[NCCLX]"),
    "nccl_init_ref_ranks": (96_000, "ranks", "[NCCLX]"),
}
ASSUMED = {  # name: (value, unit, why)
    "ib_latency_s": (5e-6, "s per collective stage", "NDR latency order of magnitude [IB], switch hops included"),
    "nccl_init_floor_s": (0.5, "s per communicator",
                          "topology detection and bootstrap of a small communicator, after [NCCL222]'s speed-up"),
    "pcie_efficiency": (0.8, "fraction of [PCIE]", "achieved device-to-host copy rate"),
    "state_bytes_per_param": (12, "bytes", "fp32 master weights + Adam exp_avg + exp_avg_sq"),
    "grad_bytes_per_param": (4, "bytes", "fp32 sharded gradients"),
}


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    step_s: float  # assumed step time (s)

    @property
    def param_tensors(self) -> int:
        """Parameter tensors of a Llama block stack: 9 per layer (4 attention, 3 MLP, 2 norms) + embedding, final
        norm, output."""
        return 9 * self.layers + 3


MODELS = {"llama3-8b": Model("llama3-8b", 8.03e9, 32, 4.0), "llama3-70b": Model("llama3-70b", 70.6e9, 80, 8.0)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout over ``gpus`` ranks: ``tp`` x ``pp`` x ``shard`` x ``replicate`` = gpus."""

    gpus: int
    tp: int
    pp: int
    shard: int
    replicate: int

    @property
    def replicated(self) -> bool:
        """Whether every rank's state has a copy on another node (else buddy snapshots are on)."""
        return self.replicate > 1

    def groups(self) -> dict[str, int]:
        """The size of each group a rank belongs to (a dimension of size 1 has none)."""
        sizes = {"tp": self.tp, "pp": self.pp, "dp_shard": self.shard, "dp_replicate": self.replicate}
        return {k: v for k, v in sizes.items() if v > 1}


def layout(model: str, gpus: int) -> Layout:
    """The assumed layout of ``model`` on ``gpus`` GPUs (see the module docstring). Raises ValueError when ``gpus`` is
    not a multiple of the layout's fixed part (8 for 8B, 32 for 70B)."""
    fixed = GPUS_PER_NODE * (4 if model == "llama3-70b" else 1)
    if gpus % fixed or gpus < fixed:
        raise ValueError(f"{model} needs a multiple of {fixed} GPUs, not {gpus}")
    if model == "llama3-8b":
        return Layout(gpus, 8, 1, gpus // 8, 1)
    dp = gpus // 32
    shard = min(dp, 8)
    return Layout(gpus, 8, 4, shard, dp // shard)


def nccl_init_s(ranks: int) -> float:
    """NCCL init time (s) of one communicator of ``ranks`` ranks: the assumed floor plus [NCCLX]'s 265 s at 96k ranks
    scaled down linearly per rank (an upper bound below 96k: the growth is super-linear)."""
    per_rank = SOURCED["nccl_init_ref_s"][0] / SOURCED["nccl_init_ref_ranks"][0]
    return ASSUMED["nccl_init_floor_s"][0] + per_rank * ranks


def fit_power(xs: list[float], ys: list[float]) -> float:
    """The exponent b of y = a x^b fitted by least squares in log-log space. Raises ValueError on fewer than two
    points or a non-positive value."""
    if len(xs) < 2 or any(v <= 0 for v in (*xs, *ys)):
        raise ValueError("a power fit needs two or more positive points")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# --- measured inputs -----------------------------------------------------------------------------------------------
def _load(results: str, name: str) -> dict:
    path = os.path.join(results, f"{name}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the measured inputs in {path}: {e}") from None


def measured_inputs(results: str = RESULTS) -> dict[str, dict]:
    """Every measured term: ``{name: {"value", "unit", "from": "<file>.json: <key>"}}``. Raises ValueError naming
    the file when one is missing or lacks a key."""
    def term(value: float, unit: str, where: str) -> dict:
        return {"value": value, "unit": unit, "from": where}

    try:
        scale, tail, recovery = _load(results, "scale"), _load(results, "tail"), _load(results, "recovery")
        hybrid, ettr, rendezvous = _load(results, "hybrid"), _load(results, "ettr"), _load(results, "rendezvous")
        smallest = min(scale["sizes"], key=lambda s: s["world"])
        sizes = sorted(rendezvous["sizes"], key=lambda s: s["world"])
        kill = recovery["faults"]["kill"]
        per_tensor = [v[k]["us_per_tensor"] for v in tail["sizes"].values() for k in ("same", "lr")]
        fsdp = hybrid["layouts"]["fsdp"]["snapshots"]
        migrations = [e for e in ettr["runs"]["migrate"]["events"] if e.get("shadow_steps")]
        recoveries = {name: max(hybrid["layouts"][name]["recovery"]["shadow_steps"].values())
                      for name in ("fsdp", "pp_dp")}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the measured inputs lack {e}") from None
    return {
        "swap_s": term(smallest["stayer_pause_s"], "s", f"scale.json: sizes[world={smallest['world']}].stayer_pause_s"),
        "group_build_s_by_world": term({s["world"]: s["job_store_s"] for s in sizes}, "s",
                                       "rendezvous.json: sizes[].job_store_s (one gloo group of every rank through "
                                       "the job store, median of 10 rounds, 2 cores)"),
        "group_build_exponent": term(round(fit_power([s["world"] for s in sizes], [s["job_store_s"] for s in sizes]),
                                           3), "", "fitted to rendezvous.json: sizes[].job_store_s"),
        "tail_s_per_tensor": term(max(per_tensor) * 1e-6, "s", "tail.json: sizes.*.{same,lr}.us_per_tensor (max)"),
        "detection_exit_s": term(kill["detection_latency_s"], "s", "recovery.json: faults.kill.detection_latency_s"),
        "halt_s": term(kill["phases_s"]["halt"], "s", "recovery.json: faults.kill.phases_s.halt"),
        "plan_s": term(kill["phases_s"]["plan"], "s", "recovery.json: faults.kill.phases_s.plan"),
        "migration_shadow_steps": term(max(max(e["shadow_steps"].values()) for e in migrations), "steps",
                                       "ettr.json: runs.migrate.events[].shadow_steps (max per joiner)"),
        "recovery_shadow_steps": term(recoveries, "steps by layout",
                                      "hybrid.json: layouts.{fsdp,pp_dp}.recovery.shadow_steps (max)"),
        "snapshot_copies_at_peak": term(round(fsdp["memory_per_rank_peak_bytes"] / fsdp["bytes_per_copy_max"], 2),
                                        "copies", "hybrid.json: layouts.fsdp.snapshots (peak / one copy)"),
    }


# --- the projection -----------------------------------------------------------------------------------------------
def _t(value: float, kind: str, basis: str) -> dict:
    return {"s": round(value, 4), "kind": kind, "basis": basis}


def project(model: str, gpus: int, m: dict[str, dict]) -> dict[str, Any]:
    """The projection of ``model`` on ``gpus`` GPUs from the measured inputs ``m`` (:func:`measured_inputs`):
    layout, state per rank, planned and unplanned downtime (their terms), preparation, buddy snapshots."""
    spec, lay = MODELS[model], layout(model, gpus)
    ib, pcie = SOURCED["ib_Bps"][0], SOURCED["pcie_Bps"][0] * ASSUMED["pcie_efficiency"][0]
    split = lay.tp * lay.pp * lay.shard
    state_bytes = spec.params * ASSUMED["state_bytes_per_param"][0] / split
    grad_bytes = spec.params * ASSUMED["grad_bytes_per_param"][0] / split
    tensors = 3 * math.ceil(spec.param_tensors / lay.pp)
    v = {k: t["value"] for k, t in m.items()}

    planned = {
        "swap": _t(v["swap_s"], "measured", m["swap_s"]["from"]),
        "switch_barrier": _t(math.log2(gpus) * ASSUMED["ib_latency_s"][0], "assumed", "log2(N) x ib_latency_s"),
        "tail": _t(2 * tensors * v["tail_s_per_tensor"], "measured",
                   f"2 ends x {tensors} tensors x {m['tail_s_per_tensor']['from']}"),
        "last_gradients": _t(grad_bytes / ib, "sourced", f"{grad_bytes:.3g} B / ib_Bps [IB]"),
        "first_collectives": _t(0.0, "assumed", "every connection made in phase 1 (eager connect, "
                                                "NCCL_RUNTIME_CONNECT=0), none at the switch step"),
    }
    new_groups = lay.groups()
    preparation = {
        "nccl_init_phase1": _t(sum(nccl_init_s(n) for n in new_groups.values()), "sourced",
                               f"groups {new_groups}, nccl_init_s per group [NCCLX], [NCCL222]"),
        "precopy": _t(state_bytes / ib, "sourced", f"{state_bytes:.3g} B / ib_Bps [IB]"),
        "shadow_iterations": _t(v["migration_shadow_steps"] * spec.step_s, "measured",
                                f"{m['migration_shadow_steps']['from']} x assumed step {spec.step_s} s"),
    }
    from_buddy = not lay.replicated
    like = "pp_dp" if lay.pp > 1 else "fsdp"  # the measured layout whose replacement replays like this one's
    unplanned = {
        "detection": _t(0.8, "assumed", "tmd/detection.py suspect_after_s (a lost node; a process exit: "
                                        f"{v['detection_exit_s']} s measured)"),
        "halt": _t(v["halt_s"], "measured", m["halt_s"]["from"]),
        "plan": _t(v["plan_s"], "measured", m["plan_s"]["from"]),
        "nccl_init": _t(sum(nccl_init_s(n) for n in new_groups.values()), "sourced",
                        f"groups {new_groups} built after the failure, one after another [NCCLX], [NCCL222]"),
        "state": _t(state_bytes / (min(ib, pcie) if from_buddy else ib), "sourced",
                    f"{state_bytes:.3g} B from " + ("the keeper's host copy / min(IB, PCIe)" if from_buddy
                                                     else "a replica / IB")),
        "redo": _t(0.5 * spec.step_s, "assumed", f"half of the assumed step {spec.step_s} s"),
        "replay": _t(v["recovery_shadow_steps"][like] * spec.step_s, "measured",
                     f"{v['recovery_shadow_steps'][like]} steps ({like}: {m['recovery_shadow_steps']['from']}) "
                     f"x assumed step {spec.step_s} s"),
    }
    snapshots = {"on": from_buddy,
                 "host_bytes_per_rank": round(v["snapshot_copies_at_peak"] * state_bytes) if from_buddy else 0,
                 "stall_s_per_rank": round(state_bytes / pcie, 4) if from_buddy else 0.0,
                 "basis": f"{m['snapshot_copies_at_peak']['value']} copies at peak (measured) x state; "
                          "stall = state / (PCIe x pcie_efficiency) [PCIE]"}
    out = {"model": model, "gpus": gpus, "layout": dataclasses.asdict(lay), "replicated": lay.replicated,
           "state_bytes_per_rank": round(state_bytes), "tensors_per_rank": tensors,
           "planned_s": round(sum(t["s"] for t in planned.values()), 3), "planned_terms": planned,
           "preparation_s": round(sum(t["s"] for t in preparation.values()), 3), "preparation_terms": preparation,
           "unplanned_s": round(sum(t["s"] for t in unplanned.values()), 3), "unplanned_terms": unplanned,
           "buddy_snapshots": snapshots}
    if gpus in PAPER:
        out["paper"] = {**PAPER[gpus], "source": "[TM]"}
    return out


def projection(gpus: tuple[int, ...] = GPUS, results: str = RESULTS) -> dict[str, Any]:
    """The whole projection: every model at every GPU count, with the inputs, sources and assumptions."""
    m = measured_inputs(results)
    return {"benchmark": "project", "kind": "PROJECTION, not a measurement: measured component costs (2-core CPU "
                                            "host, gloo) + published hardware bounds + stated assumptions",
            "gpus": list(gpus), "measured": m,
            "sourced": {k: {"value": v, "unit": u, "source": s} for k, (v, u, s) in SOURCED.items()},
            "assumed": {k: {"value": v, "unit": u, "why": w} for k, (v, u, w) in ASSUMED.items()},
            "assumed_step_s": {k: s.step_s for k, s in MODELS.items()},
            "rows": [project(model, n, m) for model in MODELS for n in gpus]}


def table(p: dict[str, Any]) -> str:
    """The projection as a text table, the paper's figures beside."""
    lines = [f"{'model':11} {'GPUs':>5} {'planned s':>10} {'paper':>6} {'unplanned s':>12} {'paper':>6} "
             f"{'state/rank GB':>14} {'snapshot GB':>12} {'stall s':>8}"]
    for r in p["rows"]:
        paper = r.get("paper", {})
        lines.append(f"{r['model']:11} {r['gpus']:5d} {r['planned_s']:10.3f} {paper.get('planned_s', '-'):>6} "
                     f"{r['unplanned_s']:12.2f} {paper.get('unplanned_s', '-'):>6} "
                     f"{r['state_bytes_per_rank'] / 1e9:14.2f} {r['buddy_snapshots']['host_bytes_per_rank'] / 1e9:12.2f} "
                     f"{r['buddy_snapshots']['stall_s_per_rank']:8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=RESULTS, help="where the measured inputs' JSON files are")
    ap.add_argument("--gpus", default=",".join(map(str, GPUS)), help="comma-separated GPU counts (multiples of 32)")
    args = ap.parse_args(argv)
    try:
        gpus = tuple(int(g) for g in args.gpus.split(","))
        p = projection(gpus, args.results)
    except ValueError as e:
        print(f"project: {e}", file=sys.stderr)
        return 2
    print(table(p), file=sys.stderr)
    print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())

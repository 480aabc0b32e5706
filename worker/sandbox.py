"""Record at job start, replay in a joiner's shadow iterations (TrainMover, arXiv 2412.12636, section 5).

Active ranks run their first ``record_steps`` steps with the mover in ``record`` mode: each collective's outputs are
kept in call order. At the boundary after those steps each group's recording is written to
``tmd.protocol.layout.recording_path(record_dir, r, group)`` (``<record_dir>/rank<r>.<group>.pt``, on a background
thread; the file appears atomically). A joiner that takes rank r loads that file and runs the same
script with the mover in ``replay`` mode: every collective is filled with the real recorded values (zeros could
produce NaNs), barriers and sends complete at once, and nothing touches the network. Those shadow iterations warm
up the allocator, DDP's buckets (DDP regroups them after the first step) and the optimizer state.

Each recording also keeps where every recorded step began (``step_starts``: the number of ops the group had
recorded at the boundary before that step; the ops before the first step are the script's set-up). With them a
joiner can tell, after its first shadow iteration, whether the rest of the job's second step issued exactly the
collectives of its third (:func:`unsteady_after_first`): then a process's second iteration does what every later
one does, and the joiner may run it live. A script whose second step differs (DDP's one-time regrouping of its
buckets, which worker.ddp_regroup ``regroup_ddp_buckets`` replays without an iteration's compute; a collective of
the script's own at step 1 only; a group created after the first step) keeps running shadow iterations. A
failure's replacement runs one more than its limit while the next recorded step issues collectives its previous
step did not (:func:`new_ops_at`: DDP with ``static_graph=True`` regroups its buckets in its third iteration).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import Optional

import torch

from tmd import protocol as p
from tmd.protocol.layout import recording_path

FORMAT_VERSION = 1
# An op's signature: (op name, ((dtype, shape), ...) of its recorded outputs)
Signature = tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]


@dataclasses.dataclass
class Recording:
    """What a joiner loaded of one group's recording: ``ops`` recorded ops; ``step_starts[k]``: the index of the
    first op of recorded step k (empty for a recording written without them); ``signatures``: each op's
    :data:`Signature`, in call order."""

    ops: int
    step_starts: list[int]
    signatures: list[Signature]
    # ops at the start of recorded step 0 that regroup the group's DDP model (a job resumed from a checkpoint
    # regrouped it before its first step, worker.checkpointing): a joiner replays them before its first iteration
    regrouped_first: int = 0


def signature(op: str, outputs: list[torch.Tensor]) -> Signature:
    """An op's name with the dtype and shape of each of its outputs: two steps whose ops have the same signatures,
    in the same order, issue the same collectives."""
    return op, tuple((str(t.dtype), tuple(t.shape)) for t in outputs)


def save_recordings_async(movers: dict, record_dir: str, rank: int,
                          ranks: Optional[dict[str, list[int]]] = None,
                          step_starts: Optional[dict[str, list[int]]] = None,
                          inserted: Optional[dict[str, list]] = None) -> threading.Thread:
    """Stop recording on every group's mover (``{name: mover}``; mode becomes ``live``) and write what each
    recorded, on a background thread, with each group's global ``ranks`` (``{name: ranks}``) so that a joiner
    that creates its groups in another order is told so, and where each recorded step began (``{name: [op index
    at each step's boundary]}``, the mover's ``recorded_ops`` there). The recorded tensors are freed once
    written: stayers keep no extra memory.

    ``inserted`` (``{name: [(op, [tensors]), ...]}``): ops written at the start of the group's recorded step 0 as
    if recorded there (the later step starts move by their count; the file's ``regrouped_first`` counts them): the
    regrouping broadcasts of a DDP model that a job resumed from a checkpoint made before its first step
    (worker.checkpointing ``regroup_to``, answered without the network, so not recorded). Its recorded steps ran
    on the regrouped buckets, so a joiner replays them before its first iteration (worker.session): without them
    a replacement kept DDP's first bucket layout and made the regrouping's broadcasts live while the stayers
    all-reduced gradients (a wrong model, or a hang until gloo's timeout)."""
    taken = {}
    step_starts = {name: list(starts) for name, starts in (step_starts or {}).items()}
    for name, mover in movers.items():
        mover.set_mode(p.MoverMode.LIVE.value)
        taken[name] = mover.take_recording()
    regrouped_first = {}
    for name, ops in (inserted or {}).items():
        starts = step_starts.get(name, [])
        if name not in taken or not starts or not ops:
            continue
        at = starts[0]
        taken[name][at:at] = [(op, list(tensors)) for op, tensors in ops]
        step_starts[name] = starts[:1] + [k + len(ops) for k in starts[1:]]
        regrouped_first[name] = len(ops)

    def write() -> None:
        for name, entries in taken.items():
            path = recording_path(record_dir, rank, name)
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save({"version": FORMAT_VERSION, "rank": rank, "group": name, "entries": entries,
                        "ranks": list((ranks or {}).get(name, [])),
                        "step_starts": list(step_starts.get(name, [])),
                        "regrouped_first": regrouped_first.get(name, 0)}, tmp)
            os.replace(tmp, path)
        taken.clear()

    t = threading.Thread(target=write, daemon=True, name="tm-record-writer")
    t.start()
    return t


def start_replay(mover, record_dir: str, rank: int, group: str = p.layout.WORLD_GROUP, wait_s: float = 60.0,
                 ranks: Optional[list[int]] = None) -> Recording:
    """Load rank ``rank``'s recording of ``group`` into ``mover`` and switch it to ``replay``. Returns what was
    loaded (:class:`Recording`). The recording is written by another process, so a missing file is awaited up to
    ``wait_s`` seconds; raises FileNotFoundError after that, ValueError on a foreign format, on step starts that
    do not fit its ops, or when ``ranks`` (this process's group's global ranks) differ from the recorded group's
    (the script created its groups in another order than the job did)."""
    path = recording_path(record_dir, rank, group)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)  # written by another process: no event to wait on
    # Mapped, not read: the replay copies each recorded output as its op comes (copy-on-write pages, the file
    # untouched). Reading the demo GPT's 53 MB recording into fresh memory took 0.15 s of a replacement's warm-up,
    # on a failure's critical path; mapping it takes ~5 ms.
    data = torch.load(path, weights_only=True, mmap=True)
    if data.get("version") != FORMAT_VERSION or data.get("rank") != rank or data.get("group") != group:
        raise ValueError(f"{path} is not a v{FORMAT_VERSION} recording of rank {rank}, group {group}")
    recorded = data.get("ranks") or []
    if ranks is not None and recorded and list(ranks) != list(recorded):
        raise ValueError(f"process group {group} was created over ranks {recorded} by the job but over {list(ranks)} "
                         "here: every process must create its groups in the same order")
    entries = [(op, list(tensors)) for op, tensors in data["entries"]]
    starts = [int(n) for n in data.get("step_starts") or []]
    if starts != sorted(starts) or (starts and not 0 <= starts[0] <= starts[-1] <= len(entries)):
        raise ValueError(f"{path}: step starts {starts} do not fit its {len(entries)} ops")
    regrouped_first = int(data.get("regrouped_first") or 0)
    step_0_end = starts[1] if len(starts) > 1 else len(entries)
    if regrouped_first and (not starts or starts[0] + regrouped_first > step_0_end):
        raise ValueError(f"{path}: {regrouped_first} regrouping ops do not fit its first recorded step")
    loaded = Recording(len(entries), starts, [signature(op, outputs) for op, outputs in entries], regrouped_first)
    mover.load_recording(entries)
    mover.set_mode(p.MoverMode.REPLAY.value)
    return loaded


def _not_comparable(recordings: dict[str, Optional[Recording]], recorded: set[str], when: str) -> str:
    """Why the recorded steps of this rank's groups cannot be compared (a group recorded by the job but not
    created here ``when``, one not replayed, fewer than 3 recorded steps), or ""."""
    missing = sorted(recorded - set(recordings))
    if missing:
        return f"group(s) {', '.join(missing)} recorded but not created {when}"
    for name, rec in sorted(recordings.items()):
        if rec is None:
            return f"group {name} is not replayed"
        if len(rec.step_starts) < 3:
            return f"group {name}: {len(rec.step_starts)} recorded step(s), 3 needed to compare steps"
    return ""


def _bucket_runs_merged(signatures: list[Signature]) -> list[Signature]:
    """``signatures`` with every run of consecutive all-reduces of one flat tensor of one dtype merged into one
    entry (op ``allreduce*``) of their summed length: DDP's gradient buckets, whatever the layout."""
    out: list[Signature] = []
    for op, outputs in signatures:
        flat = op == "allreduce" and len(outputs) == 1 and len(outputs[0][1]) == 1
        last = out[-1] if out else None
        if flat and last is not None and last[0] == "allreduce*" and last[1][0][0] == outputs[0][0]:
            out[-1] = (last[0], ((outputs[0][0], (last[1][0][1][0] + outputs[0][1][0],)),))
        else:
            out.append(("allreduce*", outputs) if flat else (op, outputs))
    return out


def unsteady_from_start(recordings: dict[str, Optional[Recording]], positions: dict[str, int],
                        recorded: set[str], regroup: Optional[str] = None, regroup_ops: int = 0) -> str:
    """Why a failure's replacement must run a shadow iteration at all, or "" when its first live step may be the
    redone step itself: then its process's first iteration must do what the job's later steps do. Arguments as
    for :func:`unsteady_after_first`; ``regroup``: the group of the one DDP model whose buckets are regrouped
    before that step (worker.ddp_regroup ``regroup_ddp_buckets``), whose recorded step 1 then begins with
    ``regroup_ops`` broadcasts.

    "" only when every recorded group exists here, each group's replay stands where the job's step 0 began (the
    script's set-up issued what the job's did), and in each the ops of the job's step 0, and of its step 1 past
    the regrouping, have the signatures of the ops of its step 2. Needs 3 recorded steps."""
    why = _not_comparable(recordings, recorded, "before the first step")
    if why:
        return why
    if regroup is not None and regroup not in recordings:
        return f"the DDP model's group {regroup} is not one of this rank's groups"
    for name, rec in sorted(recordings.items()):
        starts = rec.step_starts
        # (a recording whose step 0 begins with DDP's regrouping: the joiner replayed it before this check)
        first, second, third = starts[0] + rec.regrouped_first, starts[1], starts[2]
        end = starts[3] if len(starts) > 3 else rec.ops
        steady = rec.signatures[third:end]
        if positions[name] != first:
            return f"group {name}: replay at op {positions[name]} after the set-up, the job's step 0 began at {first}"
        # DDP's step 0 reduces its gradients in the buckets of its first layout, its later steps in the regrouped
        # ones: the same gradients in runs of all-reduces of other sizes, compared by what they reduce
        same = _bucket_runs_merged if name == regroup else list
        if same(rec.signatures[first:second]) != same(steady):
            return f"group {name}: step 0 issued other collectives ({second - first} ops) than step 2 ({end - third})"
        skip = regroup_ops if name == regroup else 0
        if any(op != "broadcast" for op, _ in rec.signatures[second:second + skip]) or \
                rec.signatures[second + skip:third] != steady:
            return (f"group {name}: step 1 issued other collectives ({third - second} ops"
                    f"{f', {skip} of them regrouping DDP' if skip else ''}) than step 2 ({end - third})")
    return ""


def new_ops_at(recordings: dict[str, Optional[Recording]], step: int) -> str:
    """Why a joiner that ran ``step`` shadow iterations (``step`` >= 1) must run another, or "": in some group, the
    job's recorded step ``step`` (what the joiner's next iteration would issue live) made collectives its recorded
    step ``step - 1`` did not (compared as multisets of signatures, DDP's gradient buckets merged: a regrouped
    layout reduces the same gradients). A DDP model with ``static_graph=True`` regroups its buckets in a process's
    third iteration with two broadcasts from rank 0: a replacement that ran two shadow iterations made them live
    while the survivors made none, and the redone step hung until gloo's timeout. "" where no group recorded that
    step, or a group is not replayed (nothing to compare)."""
    for name, rec in sorted(recordings.items()):
        if rec is None or step < 1 or len(rec.step_starts) <= step:
            continue
        starts = rec.step_starts
        end = starts[step + 1] if len(starts) > step + 1 else rec.ops
        before = collections.Counter(_bucket_runs_merged(rec.signatures[starts[step - 1]:starts[step]]))
        now = collections.Counter(_bucket_runs_merged(rec.signatures[starts[step]:end]))
        new = now - before
        if new:
            shown = ", ".join(sorted({op for op, _ in new}))
            return (f"group {name}: the job's step {step} issued {sum(new.values())} collective(s) ({shown}) that "
                    f"its step {step - 1} did not")
    return ""


def unsteady_after_first(recordings: dict[str, Optional[Recording]], positions: dict[str, int],
                         recorded: set[str]) -> str:
    """Why a joiner that ran one shadow iteration must run another, or "" when it need not. ``recordings``: the
    joiner's groups by name (None: not replayed); ``positions``: each group's replay position (the mover's
    ``replay_position``); ``recorded``: every group its rank recorded (tmd.protocol.layout ``recorded_groups``).

    "" only when every recorded group exists here (one the script creates later would be created live, where the
    job created it long ago) and, in each, the recorded ops from the replay position to the end of the job's
    second step (step 1) have the signatures of the ops of its third (step 2), the position lying within step 1
    (not before it: the joiner's first iteration did less than the job's). Needs 3 recorded steps."""
    why = _not_comparable(recordings, recorded, "in one iteration")
    if why:
        return why
    for name, rec in sorted(recordings.items()):
        starts = rec.step_starts
        at, second, third = positions[name], starts[1], starts[2]
        end = starts[3] if len(starts) > 3 else rec.ops
        if not second <= at <= third:
            return f"group {name}: replay at op {at}, step 1 is ops {second}..{third - 1}"
        if rec.signatures[at:third] != rec.signatures[third:end]:
            return (f"group {name}: step 1 issued other collectives ({third - at} ops from op {at}) "
                    f"than step 2 ({end - third})")
    return ""

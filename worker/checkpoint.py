"""Checkpoints the runtime writes itself: every managed object, each rank's rank-local state and RNG, and the step,
in ``torch.distributed.checkpoint`` (DCP) format, saved asynchronously and committed by a checksummed manifest.

**Layout on disk** (``root`` is ``--checkpoint-dir``)::

    root/JOB                      the job id that owns root (one line); another job's id refuses root
    root/step-000000050/          one checkpoint, named by the step it was taken after (9 digits)
        .metadata                 DCP's metadata (written by rank 0 once every rank's data is written)
        __<rank>_<k>.distcp       DCP's data files: the replicated objects, DTensor shards as shards
        rank00001.pt              rank 1's rank state (worker.rank_state.capture: CPU/CUDA RNG, rank-local
                                  state_dicts) and, under ``objects``, the replicated objects that are neither
                                  a module nor an optimizer (`plain_states`: an LR scheduler),
                                  ``torch.save``; load with ``torch.load(weights_only=True)``
        rank00001.sums.json       the sizes and sha256 of the files rank 1 wrote (read only by rank 0)
        manifest.json             written LAST, by rank 0: format, job id, step, world size, layout, and every
                                  file's size and sha256; fsynced and renamed into place

A checkpoint is valid only when its ``manifest.json`` exists and every file it lists has its size and sha256.
A directory without a manifest is a torn save (a crash, a full disk) and is never loaded.

**The DCP state dict** (what plain torch or torchtitan loads): ``{name: state}`` for each replicated managed
object: an ``nn.Module`` as ``get_model_state_dict`` gives it (fully qualified names, a DDP wrapper's ``module.``
dropped, FSDP2/TP parameters as DTensors), an optimizer as ``get_optimizer_state_dict`` gives it (keyed by
parameter names) when a managed module holds its parameters. Any other object (an LR scheduler) is in each
rank's ``rankNNNNN.pt`` instead (`plain_states`: DCP's flattening into string paths breaks plain data).
See docs/checkpoints.md.

**Saving** (:meth:`Checkpointer.save`, at a step boundary, on every rank): the training thread waits for the
previous save (if any is still writing), copies the state into host-memory staging buffers kept between saves
(pinned where CUDA is used; the only stall) and returns. A background thread then runs ``dcp.save`` on a
dedicated gloo process group, writes the rank state, checksums what this rank wrote, agrees with every rank
that all succeeded (one all-reduce), and rank 0 writes the manifest and prunes to the newest ``keep``. A failed
save (full disk, unwritable directory) is reported (:attr:`SaveResult.error`, ``on_error``) and deletes nothing;
training goes on.

**Loading** (:meth:`Checkpointer.load`, every rank): the newest checkpoint whose manifest verifies is used; one
that does not (a torn save, a truncated or corrupted file, a manifest of another job) is refused by name and the
previous is tried. A checkpoint written under another world size or layout raises :class:`LayoutMismatch`
naming what differs. Everything comes back bit-identically: the managed objects, each rank's rank state (RNG
included) and the step.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from worker import rank_state

FORMAT = "trainmover-checkpoint/1"
MANIFEST = "manifest.json"
JOB_FILE = "JOB"
OBJECTS = "objects"  # the rank file's key for the replicated objects kept out of DCP (plain_states)
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_FAILED, _WRITE, _SKIP = 0, 1, 2  # rank 0's decision on a save, agreed by an all-reduce (MIN)


class CheckpointError(Exception):
    """A checkpoint directory or checkpoint that cannot be used; the message is one line naming why."""


class LayoutMismatch(CheckpointError):
    """A checkpoint written under another world size or layout (the message names the first difference)."""


@dataclasses.dataclass
class SaveResult:
    """One save as this rank saw it: ``stall_s`` the training thread's time in :meth:`Checkpointer.save` (waiting
    for the previous save + staging), ``write_s`` the background time to the commit (or the failure), ``error``
    None when the checkpoint was committed, else one line."""

    step: int
    path: str
    stall_s: float = 0.0
    write_s: float = 0.0
    error: Optional[str] = None
    skipped: bool = False  # a valid checkpoint of this step existed already (kept as it was)
    done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)


def step_dir(root: str, step: int) -> str:
    """The directory of the checkpoint taken after ``step`` (``root/step-%09d``)."""
    return os.path.join(root, f"step-{step:09d}")


def job_identity(job: str) -> str:
    """A job id for ``root/JOB`` derived from ``job`` (tmd.tiers passes the job's name: the same across a restart
    and a SLURM requeue; anything secret passed here stays off the disk): 16 hex digits of sha256."""
    return hashlib.sha256(f"trainmover/checkpoint/{job}".encode()).hexdigest()[:16]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through ``path.tmp``: written, fsynced, renamed into place, directory fsynced."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _file_sum(path: str) -> dict:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": os.path.getsize(path), "sha256": digest}


def _one_line(exc: BaseException) -> str:
    """``exc`` in one line of at most 300 characters; DCP's gathered CheckpointException as its first rank's
    error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = sorted(exc.failures.items())[0]
        if isinstance(failure, tuple):  # DCP keeps each rank's (exception, stack)
            failure = failure[0]
        return f"rank {rank}: {_one_line(failure)}"
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


# --- the state, as DCP sees it -----------------------------------------------------------------------------------
def _owner(optimizer: torch.optim.Optimizer, modules: dict[str, torch.nn.Module]) -> Optional[torch.nn.Module]:
    """The managed module holding every parameter of ``optimizer`` (None when none does)."""
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    return None


def _holds_dtensor(node: Any) -> bool:
    if isinstance(node, DTensor):
        return True
    if isinstance(node, dict):
        return any(_holds_dtensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_dtensor(v) for v in node)
    return False


def plain_states(replicated: dict[str, Any]) -> dict[str, Any]:
    """The state_dicts, by name, of the replicated managed objects whose state goes into each rank's file rather
    than DCP's: those that are neither a module nor an optimizer (an LR scheduler, a counter), unless their state
    holds a DTensor. DCP
    flattens a state dict into string paths, which breaks plain data: MultiStepLR's ``milestones`` (a Counter
    with int keys) came back with each key twice (``2`` and ``"2"``), and a list that grew since the fresh
    object's could not be loaded at all ("Missing key"). The rank file keeps them as they are (``torch.save``,
    loaded with ``weights_only=True``)."""
    states = {name: obj.state_dict() for name, obj in replicated.items()
              if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))}
    return {name: state for name, state in states.items() if not _holds_dtensor(state)}


def app_state(replicated: dict[str, Any]) -> dict[str, Any]:
    """The DCP state dict of the replicated managed objects (see the module docstring): ``{name: state}``."""
    modules = {n: o for n, o in replicated.items() if isinstance(o, torch.nn.Module)}
    out: dict[str, Any] = {}
    for name, obj in replicated.items():
        if isinstance(obj, torch.nn.Module):
            out[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer) and _owner(obj, modules) is not None:
            out[name] = get_optimizer_state_dict(_owner(obj, modules), obj)
        else:
            out[name] = obj.state_dict()
    return out


def _load_app_state(replicated: dict[str, Any], state: dict[str, Any]) -> None:
    modules = {n: o for n, o in replicated.items() if isinstance(o, torch.nn.Module)}
    for name, obj in replicated.items():
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, state[name], options=StateDictOptions(strict=True))
        elif isinstance(obj, torch.optim.Optimizer) and _owner(obj, modules) is not None:
            set_optimizer_state_dict(_owner(obj, modules), obj, state[name])
        else:
            obj.load_state_dict(state[name])


def layout(state: dict[str, Any], world_size: int) -> dict[str, Any]:
    """What a checkpoint must match to be loaded: the world size and, for every tensor of ``state`` (a DCP
    state dict), its global shape and dtype, and for a DTensor its placements and mesh shape."""
    tensors: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, DTensor):
            tensors[path] = (f"{tuple(node.shape)} {node.dtype} {tuple(str(p) for p in node.placements)} "
                             f"mesh {tuple(node.device_mesh.shape)}")
        elif isinstance(node, torch.Tensor):
            tensors[path] = f"{tuple(node.shape)} {node.dtype}"
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}")

    walk(state, "")
    return {"world_size": world_size, "tensors": tensors}


def layout_difference(saved: dict[str, Any], current: dict[str, Any]) -> Optional[str]:
    """The first difference between two :func:`layout` values, in words, or None when they match."""
    if saved["world_size"] != current["world_size"]:
        return f"world size {saved['world_size']}, this job has {current['world_size']}"
    a, b = saved["tensors"], current["tensors"]
    for key in sorted(set(a) | set(b)):
        if key not in b:
            return f"tensor {key} is not in this job's state"
        if key not in a:
            return f"tensor {key} of this job's state is missing"
        if a[key] != b[key]:
            return f"tensor {key} is {a[key]}, this job has {b[key]}"
    return None


class _Staging:
    """Host-memory copies of a state dict, the buffers kept between saves (allocated at the first save and when a
    tensor's shape or dtype changes): tensors are copied into them, DTensors as their local shard (re-wrapped
    with the same spec, so DCP writes them as shards), everything else deep-copied."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, path: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin and t.is_cuda)
            self.buffers[path] = buf
        buf.copy_(t.detach(), non_blocking=self.pin and t.is_cuda)
        return buf

    def copy(self, node: Any, path: str = "") -> Any:
        if isinstance(node, DTensor):
            local = self._buffer(path, node._local_tensor)
            return DTensor(local, node._spec, requires_grad=False)
        if isinstance(node, torch.Tensor):
            return self._buffer(path, node)
        if isinstance(node, dict):
            return {k: self.copy(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, list):
            return [self.copy(v, f"{path}/{i}") for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(self.copy(v, f"{path}/{i}") for i, v in enumerate(node))
        return copy.deepcopy(node)


class Checkpointer:
    """Saves and loads this job's checkpoints under ``root`` (see the module docstring). Construct it on every
    rank (it creates its process group: a collective).

    ``job_id``: the owner written to ``root/JOB`` (e.g. :func:`job_identity`); a root owned by another job
    raises :class:`CheckpointError`. ``keep``: checkpoints kept (the newest; at least 1). ``process_group``: a
    gloo group of every rank used only by the background saves (default: a new one). ``on_error(step,
    message)``: called from the background thread when a save fails. ``claim`` false: only to load (any job's
    ``root``, ``root/JOB`` neither checked nor written).
    Raises CheckpointError for a root owned by another job, ValueError for ``keep < 1``."""

    def __init__(self, root: str, job_id: str, *, keep: int = 2, process_group: Optional[dist.ProcessGroup] = None,
                 on_error: Optional[Callable[[int, str], None]] = None, claim: bool = True) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint keep must be at least 1, not {keep}")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", job_id):
            raise ValueError(f"checkpoint job id must be 1-64 of [A-Za-z0-9._-], not {job_id!r}")
        self.root = os.path.abspath(root)
        self.job_id = job_id
        self.keep = keep
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = process_group if process_group is not None else dist.new_group(backend="gloo")
        self.on_error = on_error
        self.refused: list[str] = []  # one line per checkpoint refused by the last load
        self._staging = _Staging(pin=torch.cuda.is_available())
        self._pending: Optional[SaveResult] = None
        self._thread: Optional[threading.Thread] = None
        if claim:
            self._claim()

    def _claim(self) -> None:
        """Refuse a root owned by another job (:func:`check_owner`); rank 0 writes ``root/JOB`` when it is
        absent. A root that cannot be created is left to the first save to report (training goes on)."""
        if check_owner(self.root, self.job_id) is None and self.rank == 0:
            try:
                os.makedirs(self.root, exist_ok=True)
                _write_durably(os.path.join(self.root, JOB_FILE), f"{self.job_id}\n".encode())
            except OSError:
                pass

    # --- saving -------------------------------------------------------------------------------------------------
    def save(self, step: int, replicated: dict[str, Any], local: dict[str, Any]) -> SaveResult:
        """Checkpoint the state after ``step`` (every rank, at the same step boundary): ``replicated`` and
        ``local`` are the managed objects by name (``Session.manage``'s ``rank_local=False`` and ``True``).
        Returns once the state is staged in host memory; the write goes on in the background (:meth:`wait`).
        Never raises for storage errors: they end up in the result's ``error``."""
        start = time.perf_counter()
        self.wait()
        plain = plain_states(replicated)
        state = self._staging.copy(app_state({n: o for n, o in replicated.items() if n not in plain}))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory are done
        rank = rank_state.capture(local)
        rank[OBJECTS] = copy.deepcopy(plain)
        result = SaveResult(step=step, path=step_dir(self.root, step))
        result.stall_s = time.perf_counter() - start
        self._pending = result
        self._thread = threading.Thread(target=self._write, args=(result, state, rank),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        return result

    def wait(self) -> Optional[SaveResult]:
        """Wait for the save in flight (if any) and return its result (None when there was none)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        pending, self._pending = self._pending, None
        return pending

    def _lowest(self, value: int) -> int:
        """The lowest ``value`` of every rank (an all-reduce on the checkpoint group: also a barrier)."""
        flag = torch.tensor([value], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return int(flag.item())

    def _agree(self, ok: bool) -> bool:
        """Whether every rank is ``ok``."""
        return bool(self._lowest(1 if ok else 0))

    def _write(self, result: SaveResult, state: dict[str, Any], rank: dict[str, Any]) -> None:
        start = time.perf_counter()
        path = result.path
        try:
            error, decision = None, _SKIP  # rank 0 decides; the others agree with anything
            if self.rank == 0:
                try:
                    decision = _SKIP if self._prepare(path) else _WRITE
                except OSError as e:
                    error, decision = _one_line(e), _FAILED
            decision = self._lowest(decision)
            if decision == _FAILED:
                raise CheckpointError(error or "rank 0 could not prepare the checkpoint directory")
            if decision == _SKIP:  # a redone step: its valid checkpoint is kept, never replaced
                result.skipped = True
                return
            dcp.save(state, checkpoint_id=path, process_group=self.group)
            try:
                self._write_rank_files(path, rank)
            except OSError as e:
                error = _one_line(e)
            if not self._agree(error is None):
                raise CheckpointError(error or "another rank could not write its rank files")
            if self.rank == 0:
                self._commit(path, result.step, state)
                self._prune(result.step)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported; training goes on (DCP's
            # CheckpointException, every rank's failures gathered, is a BaseException)
            result.error = f"checkpoint at step {result.step} not saved ({path}): {_one_line(e)}"
            if self.on_error is not None:
                self.on_error(result.step, result.error)
        finally:
            result.write_s = time.perf_counter() - start
            result.done.set()

    def _prepare(self, path: str) -> bool:
        """Rank 0: True when a valid checkpoint of this step (of this job) exists already (a step redone after a
        recovery: it is kept); else a fresh, empty directory for the checkpoint (a torn or corrupted one of the
        same step is removed) and False."""
        os.makedirs(self.root, exist_ok=True)
        if verify(path, self.job_id)[0] is None:
            return True
        if os.path.exists(path):
            if os.path.exists(os.path.join(path, MANIFEST)):
                os.remove(os.path.join(path, MANIFEST))  # no longer valid from here on
            shutil.rmtree(path)
        os.makedirs(path)
        return False

    def _write_rank_files(self, path: str, rank: dict[str, Any]) -> None:
        """This rank's rank state, then the sizes and sums of every file this rank wrote (fsynced)."""
        name = f"rank{self.rank:05d}.pt"
        _write_durably(os.path.join(path, name), rank_state.encode(rank))
        mine = [f for f in os.listdir(path) if f.startswith(f"__{self.rank}_") and f.endswith(".distcp")]
        sums = {f: _file_sum(os.path.join(path, f)) for f in sorted(mine + [name])}
        _write_durably(os.path.join(path, f"rank{self.rank:05d}.sums.json"), json.dumps(sums).encode())

    def _commit(self, path: str, step: int, state: dict[str, Any]) -> None:
        """Rank 0: the manifest (every rank's sums, DCP's metadata), written last, fsynced, renamed into place."""
        files = {".metadata": _file_sum(os.path.join(path, ".metadata"))}
        for r in range(self.world_size):
            sums_name = f"rank{r:05d}.sums.json"
            with open(os.path.join(path, sums_name)) as f:
                files.update(json.load(f))
            files[sums_name] = _file_sum(os.path.join(path, sums_name))
        manifest = {"format": FORMAT, "job_id": self.job_id, "step": step, "time": time.time(),
                    "layout": layout(state, self.world_size), "files": files}
        _write_durably(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1).encode())

    def _prune(self, step: int) -> None:
        """Rank 0, after committing ``step``: delete the valid checkpoints beyond the newest ``keep`` and the
        torn ones older than ``step``."""
        valid = 0
        for s, path in checkpoints(self.root):
            if s > step:
                continue
            if os.path.exists(os.path.join(path, MANIFEST)):
                valid += 1
                if valid <= self.keep:
                    continue
            shutil.rmtree(path, ignore_errors=True)

    # --- loading ------------------------------------------------------------------------------------------------
    def load(self, replicated: dict[str, Any], local: dict[str, Any], source: Optional[str] = None) -> Optional[int]:
        """Load the newest valid checkpoint into the managed objects, every rank; returns its step, or None when
        there is no valid checkpoint. ``source``: another directory to resume from (``--resume-from``: a root
        of checkpoints or one ``step-*`` directory, any job's); default this job's root. Checkpoints refused on
        the way are in :attr:`refused`, one line each. Raises LayoutMismatch for a checkpoint of another world
        size or layout (nothing is loaded then)."""
        self.wait()
        root = os.path.abspath(source) if source is not None else self.root
        job = None if source is not None else self.job_id
        candidates = [(None, root)] if _STEP_DIR.match(os.path.basename(root)) else checkpoints(root)
        self.refused = []
        for _, path in candidates:
            why, manifest = verify(path, job)
            if why is not None:
                self.refused.append(f"checkpoint {path} refused: {why}")
                continue
            with open(os.path.join(path, f"rank{self.rank:05d}.pt"), "rb") as f:
                mine = rank_state.deserialize(f.read())
            plain = mine.get(OBJECTS, {})  # (a checkpoint written before they moved out of DCP has none)
            in_dcp = {n: o for n, o in replicated.items() if n not in plain}
            target = app_state(in_dcp)
            diff = layout_difference(manifest["layout"], layout(target, self.world_size))
            if diff is None and set(plain) - set(replicated):
                diff = f"objects {sorted(set(plain) - set(replicated))} that this job does not manage"
            if diff is not None:
                raise LayoutMismatch(f"checkpoint {path} was written under {diff}")
            dcp.load(target, checkpoint_id=path, process_group=self.group)
            _load_app_state(in_dcp, target)
            for name, state in plain.items():
                replicated[name].load_state_dict(state)
            rank_state.restore(mine, local)
            return int(manifest["step"])
        return None

    def close(self) -> Optional[SaveResult]:
        """Wait for the save in flight; returns its result."""
        return self.wait()


def check_owner(root: str, job_id: str) -> Optional[str]:
    """The job id in ``root/JOB`` (None when there is none yet). Raises CheckpointError when it is another
    job's."""
    try:
        with open(os.path.join(root, JOB_FILE)) as f:
            owner = f.read().strip()
    except FileNotFoundError:
        return None
    if owner != job_id:
        raise CheckpointError(f"checkpoint dir {root} holds the checkpoints of job {owner}, not of this job ({job_id})")
    return owner


def checkpoints(root: str) -> list[tuple[int, str]]:
    """The ``step-*`` directories under ``root`` as (step, path), newest first ([] when root does not exist)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := _STEP_DIR.match(n))]
    return sorted(found, reverse=True)


def verify(path: str, job_id: Optional[str] = None) -> tuple[Optional[str], Optional[dict]]:
    """Check one checkpoint directory against its manifest: ``(None, manifest)`` when it is valid, else
    ``(why, None)`` with ``why`` one line naming the first problem (no manifest: a torn save; a file missing,
    of another size or sha256; another job's manifest when ``job_id`` is given)."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        return "no manifest (a torn or unfinished save)", None
    except (OSError, ValueError) as e:
        return f"manifest unreadable ({_one_line(e)})", None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"manifest is not {FORMAT}", None
    if job_id is not None and manifest.get("job_id") != job_id:
        return f"manifest of job {manifest.get('job_id')}, not of this job ({job_id})", None
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(w, dict) and isinstance(w.get("size"), int) and isinstance(w.get("sha256"), str)
            and "/" not in n and n not in ("", ".", "..") for n, w in files.items()):
        return "manifest lists its files wrongly", None
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("layout"), dict):
        return "manifest has no step or layout", None
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing", None
        size = os.path.getsize(file)
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']}", None
        if _file_sum(file)["sha256"] != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest", None
    return None, manifest

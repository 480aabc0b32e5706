"""Thin Python helpers around the mover Backend (``worker._C``, built from csrc/).

The mover is a c10d backend named ``tmover`` that wraps a swappable inner backend (gloo here, NCCL on GPU
clusters). :func:`init_mover_world` installs it as the default process group, so DDP, FSDP2, DeviceMesh and
functional collectives all run through it; :func:`build_gloo` builds inner backends to stage on it.

Every group's store keys live below the job's secret namespace (:func:`store_prefix`: ``<namespace>/<prefix>``,
the namespace derived from the job secret, worker.job_keys), whatever store a group is built over.

A group built over the job's store (worker.store.JobStore) is a :class:`Setup` there until this rank releases it:
:func:`release_in_background`, a swap that retires it (worker.groups: :func:`setup_of` hands its Setup over), or
the process's end (worker.exit). Once every member released it, the store drops its keys (tmd.protocol.store's
``done``), so finished setups do not pile up against the store's key cap.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import threading
import urllib.parse
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tmd import netif
from tmd.protocol.vocab import MoverMode
from worker import _C, job_keys
from worker.exit import before_exit

log = logging.getLogger("worker.backend")

CBackend = torch._C._distributed_c10d.Backend  # the c10d Backend type (dist.Backend is the name enum)
MoverBackend = _C.MoverBackend

BACKEND_NAME = "tmover"

# At exit, wait this long (seconds, env TM_EXIT_DRAIN_S) for retired groups still being destroyed on C++ threads
# and for ops abandoned by abort(): those threads can drop the last reference to a tensor Python created, which
# takes the GIL, and doing that while the interpreter finalizes aborts the process.
EXIT_DRAIN_S = float(os.environ.get("TM_EXIT_DRAIN_S", "5"))

wait_for_background = _C.wait_for_background

__all__ = ["new_mover_group", "set_group_factory", "GroupFactory", "build_inner", "inner_kind", "store_prefix",
           "gloo_host", "data_plane", "BACKEND_NAME", "MoverBackend", "build_gloo", "init_mover_world", "mover_of",
           "release_in_background", "wait_for_background", "Setup", "setup_of", "release_all_setups"]

# The registered creator is called by torch (init_process_group, new_group, and so init_device_mesh) with the
# group's rank, size, global ranks and torch group name, never with an inner backend. For the default group (and
# new_mover_group) the inner backend and mode (a MoverMode's string value: the C++ backend parses it) travel
# through this module-level slot, set and cleared around the call (not meant to be called concurrently). Every
# other group is made by the group factory the rank's session installed (worker.groups.GroupManager.create_group).
_pending_config: Optional[tuple[Optional[CBackend], str]] = None
_registered = False
# (torch group name, global ranks, group rank, group size) -> MoverBackend
GroupFactory = Callable[[str, list[int], int, int], "MoverBackend"]
_group_factory: Optional[GroupFactory] = None


def store_prefix(prefix: str) -> str:
    """Where a group built under ``prefix`` (tmd.protocol.layout) keeps its store keys: ``<namespace>/<prefix>``
    with the job's secret namespace (JobKeys.store_namespace), or ``prefix`` itself without ``TM_KEYS``. Raises
    KeysUnavailable when ``TM_KEYS`` names keys this process cannot read."""
    namespace = job_keys.store_namespace()
    return f"{namespace}/{prefix}" if namespace else prefix


def gloo_host(store_host: str) -> Optional[str]:
    """The address gloo binds and advertises on this host: env ``TM_GLOO_HOST`` (local mode sets it), else this
    host's address on the interface that routes to the job's store (tmd's host: under SLURM the rank's own
    network address, found with a UDP ``connect``, which sends nothing), never all interfaces. None when neither
    can be found (gloo then binds the address this host's name resolves to)."""
    host = os.environ.get("TM_GLOO_HOST")
    if host:
        return host
    try:
        family, _, _, _, address = socket.getaddrinfo(store_host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def data_plane(node: str, coordinator: str) -> tuple[str, str]:
    """Where this process's data plane goes: ``(interface, address)``. With env ``TM_IFNAME`` (``--iface``) it
    resolves that interface on this node and sets ``TM_GLOO_HOST``, ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` in this process's environment (tmd.netif.data_plane_env), before any group exists;
    otherwise the address is :func:`gloo_host` of tmd's host (``coordinator``: ``tcp://host:port``; the job's
    store is there too) and the interface the one holding it ("" when neither is known). Raises
    tmd.netif.InterfaceError (one line naming ``node`` and the interface) when this node has no such interface
    or it has no IPv4 address."""
    name = os.environ.get(netif.ENV)
    if name:
        os.environ.update(netif.data_plane_env(name, node))
    host = gloo_host(urllib.parse.urlsplit(coordinator).hostname or "") or ""
    return name or (netif.interface_of(host) if host else None) or "", host


def build_gloo(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float = 60.0,
               host: Optional[str] = None) -> dist.ProcessGroupGloo:
    """A gloo backend over ``PrefixStore(store_prefix(prefix), store)``; it does not touch the default group.

    Blocks until all ``size`` ranks built theirs with the same ``prefix`` (never reuse a prefix: the store keys
    of an earlier group would be picked up). ``timeout_s`` (seconds) bounds every op of the group. ``host``
    (or env ``TM_GLOO_HOST``) pins the address gloo binds to and advertises.
    """
    prefixed = dist.PrefixStore(store_prefix(prefix), store)
    timeout = datetime.timedelta(seconds=timeout_s)
    host = host or os.environ.get("TM_GLOO_HOST")
    if not host:
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


def inner_kind() -> str:
    """The inner backend rank groups use: env ``TM_INNER_BACKEND`` (``gloo`` or ``nccl``), else ``nccl`` where
    CUDA is available and ``gloo`` elsewhere. Raises ValueError on another value."""
    kind = os.environ.get("TM_INNER_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if kind not in ("gloo", "nccl"):
        raise ValueError(f"TM_INNER_BACKEND must be gloo or nccl, not {kind!r}")
    return kind


def build_inner(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float = 60.0,
                host: Optional[str] = None) -> CBackend:
    """An inner backend of :func:`inner_kind` over ``PrefixStore(store_prefix(prefix), store)`` (see
    :func:`build_gloo`); over the job's store it is a :class:`Setup` until released (see the module docstring).
    NCCL groups bind to ``cuda:<LOCAL_RANK>`` (env ``TM_LOCAL_RANK``, the device the script should use); their
    collectives and the state transfer then move CUDA tensors over NVLink/RDMA."""
    if inner_kind() == "gloo":
        return _note_setup(build_gloo(store, prefix, rank, size, timeout_s, host), store, prefix, size)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cuda", int(os.environ.get("TM_LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    pg = dist.ProcessGroupNCCL(dist.PrefixStore(store_prefix(prefix), store), rank, size, opts)
    pg.eager_connect_single_device(device)  # connect now (phase 1), not in the first collective (the switch step)
    return _note_setup(pg, store, prefix, size)


class Setup:
    """A group this rank set up in the job's store under ``prefix`` (full: namespace included) with ``members``
    ranks, until :meth:`release`."""

    def __init__(self, store, prefix: str, members: int) -> None:
        self.store, self.prefix, self.members = store, prefix, members
        with _setups_lock:
            _unreleased.add(self)

    def release(self, wait: bool = False) -> None:
        """Tell the store this rank will not use the setup's keys again (once; ``wait``: for its answer, which
        is how a process about to end makes sure it was sent). Errors are logged, never raised."""
        with _setups_lock:
            if self not in _unreleased:
                return
            _unreleased.discard(self)
        try:
            self.store.release(self.prefix, self.members, wait=wait)
        except Exception as e:  # noqa: BLE001 - the keys stay (the store's caps still hold)
            log.debug("store keys of %s not released: %s", self.prefix, e)


_setups_lock = threading.Lock()
_unreleased: set[Setup] = set()
_setup_of_inner: dict[int, Setup] = {}  # id(inner) -> its Setup, while Python code holds the inner


def _note_setup(inner: CBackend, store: dist.Store, prefix: str, size: int) -> CBackend:
    if callable(getattr(store, "release", None)):
        setup = Setup(store, store_prefix(prefix), size)
        with _setups_lock:
            _setup_of_inner[id(inner)] = setup
    return inner


def setup_of(inner: CBackend) -> Optional[Setup]:
    """The Setup of ``inner`` (built by :func:`build_inner` over the job's store; None otherwise), handed over to
    the caller, who releases it when it retires the group (a mover swapping ``inner`` out)."""
    with _setups_lock:
        return _setup_of_inner.pop(id(inner), None)


def release_in_background(inner: CBackend) -> None:
    """Drop ``inner`` (destroyed on a C++ thread: a gloo group costs ~10 ms per peer) and release its setup in
    the job's store."""
    setup = setup_of(inner)
    if setup is not None:
        setup.release()
    _C.release_in_background(inner)


def release_all_setups(timeout_s: float = 1.0) -> None:
    """Release every setup this process still holds, waiting (``timeout_s`` in all, at most) for the store to
    take each: the process is about to end (worker.exit)."""
    with _setups_lock:
        pending = list(_unreleased)
    done = threading.Thread(target=lambda: [s.release(wait=True) for s in pending], daemon=True)
    done.start()
    done.join(timeout_s)


before_exit(release_all_setups)


def set_group_factory(factory: Optional[GroupFactory]) -> None:
    """Install (None: remove) what builds the mover of every group torch creates after the default group:
    ``factory(torch_group_name, global_ranks, group_rank, group_size) -> MoverBackend``."""
    global _group_factory
    _group_factory = factory


def _create_mover(opts, backend_options) -> MoverBackend:
    """Creator registered for ``tmover`` (torch's extended API: ``opts`` is a ``_DistributedBackendOptions``).
    The default group and new_mover_group get the inner/mode left in ``_pending_config``; every other group (a
    ``dist.new_group``, ``new_subgroups``, a DeviceMesh dimension) is built by the group factory. Raises
    RuntimeError when neither is set (no session: call ``worker.init()`` first)."""
    if _pending_config is not None:
        inner, mode = _pending_config
        mover = MoverBackend(opts.group_rank, opts.group_size, inner)
        mover.set_mode(mode)
        return mover
    if _group_factory is None:
        raise RuntimeError("a tmover process group is created after worker.init() (or worker.backend."
                           "init_mover_world); no session is running in this process")
    return _group_factory(str(opts.group_id), list(opts.global_ranks_in_group), opts.group_rank, opts.group_size)


def _register() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND_NAME, _create_mover, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def init_mover_world(store: dist.Store, rank: int, size: int, inner: Optional[CBackend] = None,
                     mode: MoverMode = MoverMode.LIVE) -> MoverBackend:
    """Make a mover-backed group the default process group and return its MoverBackend.

    ``inner`` is the initial inner backend (None: no network, e.g. a joiner replaying); ``mode`` is a
    :class:`MoverMode` (or its string value: live, record, replay, bypass). Raises ValueError on a bad mode, an
    inner of another rank/size, or if a default group already exists.
    """
    global _pending_config
    _register()
    _pending_config = (inner, MoverMode(mode).value)
    try:
        dist.init_process_group(backend=BACKEND_NAME, store=store, rank=rank, world_size=size)
    finally:
        _pending_config = None
    return mover_of()


def new_mover_group(ranks: list[int], inner: Optional[CBackend] = None,
                    mode: MoverMode = MoverMode.LIVE) -> Optional[dist.ProcessGroup]:
    """A mover-backed subgroup of the default group over global ``ranks`` (``dist.new_group``: every process
    calls it, in the same order). Returns the ProcessGroup on members and None elsewhere. ``inner`` must be
    built over the group's ranks (group rank = index in ``ranks``), or None for a replaying joiner. ``mode``: a
    :class:`MoverMode` or its string value; raises ValueError otherwise."""
    global _pending_config
    _pending_config = (inner, MoverMode(mode).value)
    try:
        pg = dist.new_group(ranks, backend=BACKEND_NAME)
    finally:
        _pending_config = None
    return pg if dist.get_rank() in ranks else None


def mover_of(group: Optional[dist.ProcessGroup] = None) -> MoverBackend:
    """The MoverBackend behind ``group`` (default: the default group). Raises TypeError if it has none."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, MoverBackend):
        raise TypeError(f"process group backend is {type(backend).__name__}, not a MoverBackend")
    return backend


@atexit.register
def _drain_at_exit() -> None:
    wait_for_background(EXIT_DRAIN_S)

"""GPU health probe through NVML (``pynvml``, package ``nvidia-ml-py``), run on the worker side.

Each rank probes the GPU it trains on and puts :meth:`GpuProbe.sample` into its heartbeats; tmd judges the
samples with :class:`tmd.health.GpuHealthPolicy`. Where there is no GPU (no driver, no NVML library, no device,
pynvml not installed) the probe is simply unavailable and samples are ``{}``: it never raises. Each field NVML
cannot report on this GPU (``NVMLError_NotSupported``, no permission, ...) is ``None``.
"""
from __future__ import annotations

import os
from typing import Any, Optional

# Clock event ("throttle") reason bits that matter, from nvml.h (nvmlClocksEventReason*, formerly
# nvmlClocksThrottleReason*: same values). Idle, application clocks, SW power cap and sync boost are normal.
THROTTLE_BITS = {
    "hw_slowdown": 0x08,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
}
MAX_EVENTS_PER_SAMPLE = 16  # bounds the XID drain in one sample() (an event storm must not stall heartbeats)
MAX_XIDS = 16


def _visible_devices() -> Optional[list[str]]:
    """``CUDA_VISIBLE_DEVICES`` as a list (indices or UUIDs), None when unset. NVML ignores this variable: its
    device indices are physical, while ``cuda:N`` is the N-th visible device."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    devices = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):  # CUDA stops at the first invalid entry ("-1" hides every GPU)
            break
        devices.append(entry)
    return devices


class GpuProbe:
    """Health readings of one GPU. ``device_index`` is the CUDA index the rank uses (``cuda:N``; default env
    ``TM_LOCAL_RANK``, as :func:`worker.backend.build_inner` binds NCCL), taken modulo the visible device count
    and mapped through ``CUDA_VISIBLE_DEVICES`` to the NVML device. ``nvml``: a module-like object, default
    ``pynvml`` (injectable for tests). XID errors are seen from construction on (NVML events)."""

    def __init__(self, device_index: Optional[int] = None, nvml: Any = None) -> None:
        self.available = False
        self.index: Optional[int] = None  # NVML (nvidia-smi) index of the probed GPU
        self.uuid: Optional[str] = None
        self._xids: list[int] = []  # distinct XIDs seen, in order of their last occurrence
        self._last_xid: Optional[int] = None
        self._events = None
        self._lost = False
        try:
            if nvml is None:
                import pynvml as nvml
            self._nvml = nvml
            nvml.nvmlInit()
        except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            return
        try:
            self._handle = self._open(device_index)
        except Exception:
            self._shutdown()
            return
        if self._handle is None:
            self._shutdown()
            return
        self.available = True
        self.index = self._read(lambda h: int(nvml.nvmlDeviceGetIndex(h)))
        uuid = self._read(nvml.nvmlDeviceGetUUID)
        self.uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        try:
            events = nvml.nvmlEventSetCreate()
        except Exception:
            return
        try:
            nvml.nvmlDeviceRegisterEvents(self._handle, self._const("nvmlEventTypeXidCriticalError", 0x8), events)
            self._events = events
        except Exception:  # not supported on this GPU (or in this container): xid stays None
            self._call(nvml.nvmlEventSetFree, events)

    def _open(self, device_index: Optional[int]):
        """The NVML handle of the rank's GPU, or None where no GPU is visible."""
        nvml = self._nvml
        if device_index is None:
            device_index = int(os.environ.get("TM_LOCAL_RANK") or "0")
        visible = _visible_devices()
        count = len(visible) if visible is not None else int(nvml.nvmlDeviceGetCount())
        if count <= 0:
            return None
        device_index %= count
        if visible is None:
            return nvml.nvmlDeviceGetHandleByIndex(device_index)
        entry = visible[device_index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)  # "GPU-..." or "MIG-..."

    def _const(self, name: str, default: int) -> int:
        return getattr(self._nvml, name, default)

    def _is(self, exc: BaseException, name: str) -> bool:
        cls = getattr(self._nvml, name, None)
        return isinstance(cls, type) and isinstance(exc, cls)

    def _call(self, fn, *args):
        """``fn(*args)``, or None on any error (noting a lost GPU)."""
        try:
            return fn(*args)
        except Exception as exc:
            if self._is(exc, "NVMLError_GpuIsLost"):
                self._lost = True
            return None

    def _read(self, fn, *args):
        return self._call(fn, self._handle, *args)

    def _throttle(self) -> Optional[list[str]]:
        nvml = self._nvml
        fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        reasons = self._read(fn) if fn is not None else None
        if reasons is None:
            return None
        return [name for name, bit in THROTTLE_BITS.items() if int(reasons) & bit]

    def _pending_memory_repair(self) -> Optional[bool]:
        """Retired pages pending a GPU reset (pre-Ampere page retirement), else rows pending remapping
        (Ampere and later replaced page retirement by row remapping)."""
        nvml = self._nvml
        pending = self._read(nvml.nvmlDeviceGetRetiredPagesPendingStatus)
        if pending is not None:
            return bool(pending)
        remap_fn = getattr(nvml, "nvmlDeviceGetRemappedRows", None)
        rows = self._read(remap_fn) if remap_fn is not None else None  # (corrected, uncorrected, pending, failed)
        return bool(rows[2]) if rows is not None else None

    def _drain_xids(self) -> None:
        """Take the XID events NVML queued since the last sample, without waiting."""
        if self._events is None:
            return
        nvml, xid_type = self._nvml, self._const("nvmlEventTypeXidCriticalError", 0x8)
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception as exc:
                if self._is(exc, "NVMLError_GpuIsLost"):
                    self._lost = True
                return  # NVMLError_Timeout: nothing (more) queued
            if int(data.eventType) & xid_type:
                xid = int(data.eventData)
                self._last_xid = xid
                if xid in self._xids:
                    self._xids.remove(xid)
                self._xids = (self._xids + [xid])[-MAX_XIDS:]

    def sample(self) -> dict:
        """The GPU's state now, JSON-able; ``{}`` when unavailable. A handful of NVML queries (microseconds),
        cheap enough for every heartbeat. Keys:

        - ``index`` (int): NVML / nvidia-smi index of the GPU; ``uuid`` (str or None)
        - ``temperature_c`` (int, degrees Celsius, core sensor)
        - ``ecc_uncorrected`` (int): volatile uncorrected ECC errors (count since the driver loaded)
        - ``xid`` (int): last XID error seen since the probe started; ``xids``: the distinct ones (up to 16,
          most recent last), so a benign XID after a critical one does not hide it
        - ``throttle`` (list of str): active reasons among hw_slowdown, hw_thermal_slowdown,
          hw_power_brake_slowdown, sw_thermal_slowdown
        - ``retired_pages_pending`` (bool): memory pages/rows waiting for a GPU reset to be retired/remapped
        - ``gpu_lost`` (bool): NVML answered "GPU is lost" (fallen off the bus) to a query

        Any field NVML cannot report is None."""
        if not self.available:
            return {}
        nvml = self._nvml
        self._drain_xids()
        sample = {
            "index": self.index,
            "uuid": self.uuid,
            "temperature_c": self._read(nvml.nvmlDeviceGetTemperature, self._const("NVML_TEMPERATURE_GPU", 0)),
            "ecc_uncorrected": self._read(nvml.nvmlDeviceGetTotalEccErrors,
                                          self._const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                                          self._const("NVML_VOLATILE_ECC", 0)),
            "xid": self._last_xid,
            "xids": list(self._xids),
            "throttle": self._throttle(),
            "retired_pages_pending": self._pending_memory_repair(),
        }
        for key in ("temperature_c", "ecc_uncorrected"):
            if sample[key] is not None:
                sample[key] = int(sample[key])
        sample["gpu_lost"] = self._lost
        return sample

    def _shutdown(self) -> None:
        self._call(self._nvml.nvmlShutdown)

    def close(self) -> None:
        """Free the event set and release NVML (idempotent)."""
        if not self.available:
            return
        self.available = False
        if self._events is not None:
            self._call(self._nvml.nvmlEventSetFree, self._events)
            self._events = None
        self._shutdown()


def probe_from_env() -> GpuProbe:
    """A probe of this rank's GPU: ``cuda:<TM_LOCAL_RANK>`` (modulo the device count), the device NCCL binds."""
    return GpuProbe()

"""GPU health: the worker's NVML probe against a fake NVML (and the real one, which finds no GPU here), and
tmd's policy on synthetic samples."""
import json
from types import SimpleNamespace

import pynvml
import pytest

from tmd.health import GpuHealthPolicy
from worker.gpu_health import GpuProbe, probe_from_env

pytestmark = pytest.mark.timeout(10)


class FakeNvml:
    """The pynvml functions the probe uses, over ``devices`` (dicts of readings; an exception class as a
    reading raises it). Errors are pynvml's own classes."""

    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self, devices, init_error=None, events=True):
        self.devices = devices
        self.init_error = init_error
        self.events_supported = events
        self.queue = []  # (device index, xid) events not yet taken
        self.registered = {}
        self.calls = []

    def _get(self, handle, key):
        value = self.devices[handle][key]
        if isinstance(value, type) and issubclass(value, Exception):
            raise value()
        return value

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error()

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return next(i for i, d in enumerate(self.devices) if d["uuid"] == uuid)

    def nvmlDeviceGetIndex(self, handle):
        return handle

    def nvmlDeviceGetUUID(self, handle):
        return self._get(handle, "uuid")

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._get(handle, "temperature")

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        assert (error_type, counter_type) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return self._get(handle, "ecc")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._get(handle, "reasons")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        return self._get(handle, "retired_pending")

    def nvmlDeviceGetRemappedRows(self, handle):
        return self._get(handle, "remapped_rows")

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle, types, event_set):
        if not self.events_supported:
            raise pynvml.NVMLError_NotSupported()
        self.registered[handle] = types

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        assert timeout_ms == 0  # never blocks the heartbeat
        mine = [e for e in self.queue if e[0] in self.registered]
        if not mine:
            raise pynvml.NVMLError_Timeout()
        self.queue.remove(mine[0])
        return SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=mine[0][1])

    def nvmlEventSetFree(self, event_set):
        self.calls.append("free")


def gpu(uuid="GPU-0", temperature=60, ecc=0, reasons=0, retired_pending=0, remapped_rows=(0, 0, 0, 0)):
    return dict(uuid=uuid, temperature=temperature, ecc=ecc, reasons=reasons, retired_pending=retired_pending,
                remapped_rows=remapped_rows)


@pytest.fixture(autouse=True)
def no_cuda_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TM_LOCAL_RANK", raising=False)


def test_sample_reads_every_field():
    nvml = FakeNvml([gpu("GPU-a"), gpu("GPU-b", temperature=71, ecc=2, reasons=0x08 | 0x20 | 0x04 | 0x01,
                                        retired_pending=pynvml.NVML_FEATURE_ENABLED)])
    probe = GpuProbe(1, nvml=nvml)
    assert probe.available
    sample = probe.sample()
    assert sample == {"index": 1, "uuid": "GPU-b", "temperature_c": 71, "ecc_uncorrected": 2, "xid": None,
                      "xids": [], "throttle": ["hw_slowdown", "sw_thermal_slowdown"], "retired_pages_pending": True,
                      "gpu_lost": False}
    json.dumps(sample)
    probe.close()
    assert nvml.calls == ["free", "shutdown"] and probe.sample() == {}


def test_unsupported_fields_are_none():
    ns = pynvml.NVMLError_NotSupported
    nvml = FakeNvml([gpu(temperature=ns, ecc=ns, reasons=pynvml.NVMLError_NoPermission, retired_pending=ns,
                         remapped_rows=ns)], events=False)
    sample = GpuProbe(0, nvml=nvml).sample()
    assert sample["index"] == 0 and sample["gpu_lost"] is False
    assert all(sample[k] is None for k in ("temperature_c", "ecc_uncorrected", "xid", "throttle",
                                           "retired_pages_pending"))


def test_row_remapping_stands_in_for_page_retirement():
    nvml = FakeNvml([gpu(retired_pending=pynvml.NVMLError_NotSupported, remapped_rows=(0, 1, 1, 0))])
    assert GpuProbe(0, nvml=nvml).sample()["retired_pages_pending"] is True


def test_throttle_reasons_fall_back_to_the_old_call():
    nvml = FakeNvml([gpu()])
    nvml.nvmlDeviceGetCurrentClocksEventReasons = None
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: pynvml.nvmlClocksThrottleReasonHwThermalSlowdown
    assert GpuProbe(0, nvml=nvml).sample()["throttle"] == ["hw_thermal_slowdown"]


def test_xid_events_are_drained_without_blocking_and_remembered():
    nvml = FakeNvml([gpu("GPU-a"), gpu("GPU-b")])
    probe = GpuProbe(0, nvml=nvml)
    assert nvml.registered == {0: pynvml.nvmlEventTypeXidCriticalError}
    assert probe.sample()["xid"] is None
    nvml.queue += [(1, 79), (0, 79), (0, 13)]  # GPU 1's event is not this probe's
    sample = probe.sample()
    assert (sample["xid"], sample["xids"]) == (13, [79, 13])
    assert probe.sample()["xid"] == 13  # remembered after the queue is empty
    assert nvml.queue == [(1, 79)]


def test_gpu_lost_is_reported():
    lost = pynvml.NVMLError_GpuIsLost
    sample = GpuProbe(0, nvml=FakeNvml([gpu(temperature=lost, ecc=lost)])).sample()
    assert sample["gpu_lost"] is True and sample["temperature_c"] is None


@pytest.mark.parametrize("error", [pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded])
def test_no_driver_means_unavailable(error):
    probe = GpuProbe(nvml=FakeNvml([gpu()], init_error=error))
    assert not probe.available and probe.sample() == {}
    probe.close()


def test_no_device_means_unavailable():
    nvml = FakeNvml([])
    probe = GpuProbe(nvml=nvml)
    assert not probe.available and probe.sample() == {} and nvml.calls == ["shutdown"]


def test_device_from_local_rank_and_visible_devices(monkeypatch):
    nvml = FakeNvml([gpu("GPU-a"), gpu("GPU-b"), gpu("GPU-c"), gpu("GPU-d")])
    monkeypatch.setenv("TM_LOCAL_RANK", "5")
    assert GpuProbe(nvml=nvml).index == 1  # 5 % 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    assert GpuProbe(nvml=nvml).index == 2  # cuda:1 of 2 visible is physical GPU 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-d,GPU-a")
    assert GpuProbe(nvml=nvml).uuid == "GPU-a"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not GpuProbe(nvml=nvml).available


def test_real_nvml_without_gpu_is_unavailable():
    probe = probe_from_env()
    if probe.available:
        pytest.skip("this machine has a GPU")
    assert probe.sample() == {}


def sample(**fields):
    return {"index": 0, "uuid": "GPU-a", "temperature_c": 60, "ecc_uncorrected": 0, "xid": None, "xids": [],
            "throttle": [], "retired_pages_pending": False, "gpu_lost": False} | fields


def test_policy_healthy_and_empty_samples():
    policy = GpuHealthPolicy()
    assert policy.evaluate(0, {}) is None
    assert policy.evaluate(0, sample()) is None


def test_policy_uncorrected_ecc_increase_is_unhealthy():
    policy = GpuHealthPolicy()
    assert policy.evaluate(3, sample(ecc_uncorrected=2)) is None  # already there when the rank started
    state, reason = policy.evaluate(3, sample(ecc_uncorrected=3))
    assert state == "unhealthy" and "rank 3" in reason and "1 new uncorrected ECC" in reason
    assert policy.evaluate(3, sample(ecc_uncorrected=3))[0] == "unhealthy"  # stays so on this GPU
    assert policy.evaluate(3, sample(uuid="GPU-b", ecc_uncorrected=5)) is None  # the rank moved: new baseline
    assert policy.evaluate(3, sample(uuid="GPU-b", ecc_uncorrected=None)) is None


def test_policy_critical_xid_is_unhealthy():
    policy = GpuHealthPolicy()
    state, reason = policy.evaluate(1, sample(xid=79, xids=[79]))
    assert state == "unhealthy" and "rank 1" in reason and "79" in reason
    state, reason = policy.evaluate(1, sample(xid=13, xids=[48, 13]))  # a benign XID after a critical one
    assert state == "unhealthy" and "48" in reason
    assert policy.evaluate(2, {"index": 0, "xid": 74})[0] == "unhealthy"  # the last XID alone also counts


def test_policy_non_critical_xid_is_fine():
    assert GpuHealthPolicy().evaluate(0, sample(xid=13, xids=[13])) is None


def test_policy_gpu_lost_is_unhealthy():
    assert GpuHealthPolicy().evaluate(0, sample(gpu_lost=True))[0] == "unhealthy"


def test_policy_temperature_above_max_is_degraded():
    policy = GpuHealthPolicy(max_temperature_c=85)
    assert policy.evaluate(0, sample(temperature_c=85)) is None
    state, reason = policy.evaluate(0, sample(temperature_c=88))
    assert state == "degraded" and "rank 0" in reason and "88" in reason
    assert GpuHealthPolicy().evaluate(0, sample(temperature_c=88)) is None  # default limit: 90 C


def test_policy_throttle_needs_patience():
    policy = GpuHealthPolicy(throttle_patience=3)
    throttled = sample(throttle=["hw_power_brake_slowdown"])
    assert policy.evaluate(0, throttled) is None
    assert policy.evaluate(0, throttled) is None
    assert policy.evaluate(0, sample()) is None  # the streak breaks
    assert policy.evaluate(0, throttled) is None
    assert policy.evaluate(0, throttled) is None
    state, reason = policy.evaluate(0, throttled)
    assert state == "degraded" and "hw_power_brake_slowdown" in reason and "3 samples" in reason
    sw_only = sample(throttle=["sw_thermal_slowdown"])
    assert all(policy.evaluate(1, sw_only) is None for _ in range(5))


def test_policy_unhealthy_wins_over_degraded():
    state, reason = GpuHealthPolicy().evaluate(0, sample(temperature_c=95, xids=[95], xid=95))
    assert state == "unhealthy" and "XID 95" in reason

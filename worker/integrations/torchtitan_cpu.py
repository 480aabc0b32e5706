"""The shims that let torchtitan run on a CPU-only host with gloo (and under this runtime's mover backend).

:func:`apply` installs them; it must run BEFORE anything imports torchtitan (it imports ``torchtitan.tools.utils``
itself, under the device shim). Each shim names the torchtitan and torch versions it was written for and is
installed only where it applies; none of them edits torchtitan's files or changes the numbers a GPU run computes.

============================  ===================  =============  =================================================
shim                          torchtitan           torch          why
============================  ===================  =============  =================================================
``cpu_device``                0.3.0                2.13.0         ``tools/utils.py`` falls back to ``"cuda"`` when
                                                                  no accelerator is found; the device becomes
                                                                  ``"cpu"`` with a module answering the
                                                                  ``torch.cuda``-style calls torchtitan makes
``no_triton_kernels``         0.3.0                any            ``distributed/minimal_async_ep/kernels.py`` (MoE
                                                                  expert parallel only) does ``import triton``
``dense_flex_attention``      0.3.0                2.13.0         flex attention has no backward on CPU; a dense
                                                                  eager equivalent with the same ``mask_mod``
``eager_block_mask``          0.3.0                2.13.0         ``create_attention_mask`` builds the BlockMask
                                                                  with ``torch.compile(create_block_mask)``: an
                                                                  Inductor compile of 10-20 s of CPU in every
                                                                  process's first step, for a mask of which
                                                                  ``dense_flex_attention`` reads only the
                                                                  ``mask_mod``; built eagerly instead (the same
                                                                  BlockMask)
``fsdp_sum_reduction``        0.3.0                2.13.0         ``gradient_divide_factor=1.0`` becomes
                                                                  ``ReduceOp.PREMUL_SUM``, which gloo rejects;
                                                                  ``set_force_sum_reduction_for_comms(True)``
                                                                  reduces with SUM: the same numbers
``set_timeout``               0.3.0                2.13.0         ``torch.distributed.set_timeout`` (called by
                                                                  torchtitan 0.3.0) is missing from torch 2.13.0,
                                                                  which has the private ``_set_pg_timeout``
============================  ===================  =============  =================================================
"""
from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, Callable, Optional

import torch

#: shim name -> (torchtitan version, torch version) it was written for
SHIM_VERSIONS = {
    "cpu_device": ("0.3.0", "2.13.0"),
    "no_triton_kernels": ("0.3.0", "any"),
    "dense_flex_attention": ("0.3.0", "2.13.0"),
    "eager_block_mask": ("0.3.0", "2.13.0"),
    "fsdp_sum_reduction": ("0.3.0", "2.13.0"),
    "set_timeout": ("0.3.0", "2.13.0"),
}

_applied: Optional[list[str]] = None


def on_cpu() -> bool:
    """Whether this host has no accelerator torch can use (the shims' condition)."""
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


class CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style calls torchtitan 0.3.0 makes on its device module (device name
    and properties, memory statistics, cache and peak resets): answered with CPU values or zeros."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import psutil

        return types.SimpleNamespace(name="cpu", total_memory=psutil.virtual_memory().total)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


def _cpu_device() -> None:
    """Import ``torchtitan.tools.utils`` while torch reports a "cpu" device with :class:`CpuDeviceModule`: its
    module-level ``device_type, device_module`` (which every other torchtitan module imports) are then CPU's."""
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError("torchtitan was imported before worker.integrations.torchtitan_cpu.apply()")
    import torch._utils as tu

    saved = tu._get_available_device_type, tu._get_device_module
    module = CpuDeviceModule()
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda device_type=None: module if device_type == "cpu" else saved[1](device_type)
    try:
        importlib.import_module("torchtitan.tools.utils")
    finally:
        tu._get_available_device_type, tu._get_device_module = saved


def _no_triton_kernels() -> None:
    """Stand-in for ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels of MoE expert parallel):
    importable, and every kernel raises if it is ever launched."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("MoE minimal_async_ep kernels need triton, which this host does not have")

    def kernel(attr: str) -> Callable:
        if attr.startswith("__"):  # __file__, __spec__...: what a module without them answers
            raise AttributeError(attr)
        return unavailable

    stub = types.ModuleType(name, "stand-in for torchtitan's Triton kernels (worker.integrations.torchtitan_cpu)")
    stub.__getattr__ = kernel  # type: ignore[attr-defined]
    sys.modules[name] = stub


def dense_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Optional[Callable],
                         block_mask: Any, scale: Optional[float], enable_gqa: bool, return_aux: Any,
                         kernel_options: Optional[dict] = None, **_: Any) -> tuple[torch.Tensor, Any]:
    """``flex_attention(q, k, v, block_mask=...)`` computed densely in eager mode (with a backward on CPU): the
    boolean mask ``block_mask.mask_mod(b, h, q_idx, kv_idx)`` over every (query, key) pair, then
    ``scaled_dot_product_attention``. q: [B, Hq, L, E], k/v: [B, Hkv, S, E]; returns (out [B, Hq, L, E],
    ``AuxOutput`` with the log-sum-exp [B, Hq, L] when ``return_aux.lse``). Raises NotImplementedError for a
    ``score_mod``."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("dense_flex_attention: score_mod is not supported on CPU")
    B, L, S = q.size(0), q.size(-2), k.size(-2)
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, B, 1, L, S, device=q.device)  # [B, 1, L, S] bool
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa)
    lse = None
    if return_aux is not None and getattr(return_aux, "lse", False):
        kk = k.repeat_interleave(q.size(1) // k.size(1), dim=1) if enable_gqa else k
        scores = (q @ kk.transpose(-2, -1)) * (scale if scale is not None else q.size(-1) ** -0.5)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
    return out, AuxOutput(lse=lse)


def _dense_flex_attention() -> None:
    from torchtitan.models.common.attention import FlexAttention

    # compiled_flex_attn, not _compiled_flex_attn: set_determinism (--debug.deterministic) reassigns the latter
    FlexAttention.compiled_flex_attn = staticmethod(dense_flex_attention)


def _eager_block_mask() -> None:
    """``torchtitan.models.common.attention.create_attention_mask`` (which the decoder's ``get_attention_masks``
    calls every step) runs ``_compiled_create_block_mask = torch.compile(create_block_mask)``. On a CPU its first
    call compiles through Dynamo and Inductor: 21 s here in one process, 10-20 s of CPU in every rank and joiner
    at its first step (on a failure's critical path for a replacement). The eager ``create_block_mask`` builds
    the same BlockMask (checked equal field by field, sequence 64, batch 2) in about 16 ms, and
    :func:`dense_flex_attention` reads only its ``mask_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention._compiled_create_block_mask = create_block_mask


def _fsdp_sum_reduction() -> None:
    """After torchtitan disables FSDP's gradient division (divide factor 1.0, reduced with PREMUL_SUM), force a
    plain SUM reduction: gloo has no PREMUL_SUM, and a factor of 1.0 makes both the same numbers."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    original = tt_fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _set_timeout() -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_timeout(timeout: Any, group: Any = None) -> None:
        _set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout  # type: ignore[attr-defined]


def apply() -> list[str]:
    """Install the shims that apply here (once per process; later calls return the same list) and return their
    names. On a host with an accelerator only ``set_timeout`` can apply (where torch lacks it). Raises
    RuntimeError when torchtitan was already imported (its device would already be fixed)."""
    global _applied
    if _applied is not None:
        return _applied
    import torch.distributed as dist

    applied = []
    if on_cpu():
        _cpu_device()
        applied.append("cpu_device")
        if importlib.util.find_spec("triton") is None:
            _no_triton_kernels()
            applied.append("no_triton_kernels")
        _dense_flex_attention()
        _eager_block_mask()
        _fsdp_sum_reduction()
        applied += ["dense_flex_attention", "eager_block_mask", "fsdp_sum_reduction"]
    if not hasattr(dist, "set_timeout"):
        _set_timeout()
        applied.append("set_timeout")
    _applied = applied
    return applied

"""The name `sgl_kernel` for sglang 0.5.23 on a CPU without its kernel build (setup.sh installs it).

With SGLANG_USE_CPU_ENGINE=1, sglang imports CPU ops from sgl_kernel when its modules load, e.g.
`from sgl_kernel import copy_all_layer_kv_cache_cpu` (sglang/kernels/ops/kvcache/cache_move.py:10
@ 0.5.23) and `assign_req_to_token_pool_cpu` (srt/mem_cache/allocation.py:46 @ 0.5.23). PyPI has
no CPU build of sgl_kernel (sglang-kernel ships CUDA ops only), and on a CPU without AMX sglang runs
a dense Llama with torch-native code, so what must exist is the names. The one op reached on the
PD path, the KV copy of cache_move.py:191, is implemented below; any other raises when *called*,
naming itself, so a new code path fails loudly instead of computing garbage.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NoReturn

__version__ = "0.0.0+watchdog-cpu-shim"


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """For each KV buffer (one per layer and K/V: base address, row stride in bytes), copy row
    src_loc[j] to row tgt_loc[j] (the contract of cache_move.py:181-196 @ 0.5.23)."""
    sources = src_loc.tolist()
    targets = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for src, tgt in zip(sources, targets, strict=True):
            if src != tgt:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel CPU shim: {name} is not available on this host")

    missing.__name__ = name
    return missing

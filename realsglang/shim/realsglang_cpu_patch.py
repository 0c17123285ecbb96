"""One flag cleared in sglang 0.5.23 on a CPU: prefill's KV send takes its device-neutral branch.

Loaded at interpreter start by realsglang_cpu_patch.pth (setup.sh), in every sglang process (the
scheduler runs in a spawned subprocess), and only with SGLANG_USE_CPU_ENGINE=1.

Why: srt/disaggregation/prefill.py:1746-1761 @ 0.5.23 copies the page indices through pinned host
memory and records a torch.cuda.Event whenever the KV sender declares
`supports_host_tensor_indices`, which MooncakeKVSender does (srt/disaggregation/mooncake/
conn.py:3312 @ 0.5.23). On a host without CUDA that kills the prefill scheduler at its first send
("Found no NVIDIA driver"). With the flag False, prefill takes the `else` branch every other
transfer backend takes (kv_to_page_indices, numpy). The installed files stay untouched: the class
attribute is set when the module is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_TARGET = "sglang.srt.disaggregation.mooncake.conn"


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        sender = getattr(module, "MooncakeKVSender", None)
        if sender is not None:
            sender.supports_host_tensor_indices = False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _Finder())

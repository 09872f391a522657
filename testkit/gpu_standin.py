"""torch as kvlc's GPU copy (:class:`kvlc.runtime.ipc.copy.GpuCopy`) uses it, on a CPU: ``torch.cuda``'s streams
and events stood in for by objects of a device whose work is done when launched (every event has completed),
tensors real CPU ones ("pinned" and "cuda" ones plain). The tests run the GPU copy's own logic on them with
Triton's interpreter as the kernel; a benchmark probe times kvlc's host work with the kernel stubbed."""

from __future__ import annotations

import contextlib


class CudaStandIn:
    """What GpuCopy uses of ``torch.cuda``."""

    class Stream:
        def __init__(self, device=0):
            self.cuda_stream = 0

        def wait_event(self, event):
            pass

    class Event:
        def record(self, stream=None):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

    def __init__(self):
        self.launches = 0

    def current_stream(self, device=None):
        return self.Stream()

    def current_device(self):
        return 0

    def device(self, device):
        return contextlib.nullcontext()

    stream = device


class TorchStandIn:
    """torch with ``cuda`` replaced by :class:`CudaStandIn`."""

    def __init__(self):
        import torch

        self._torch, self.cuda = torch, CudaStandIn()

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *shape, dtype=None, pin_memory=False, device=None):
        return self._torch.empty(*shape, dtype=dtype)

    def zeros(self, *shape, dtype=None, device=None):
        return self._torch.zeros(*shape, dtype=dtype)

    def arange(self, *args, dtype=None, device=None):
        return self._torch.arange(*args, dtype=dtype)

"""What the GPU tests share: how many CUDA devices this machine shows, and the skip below a count."""

from __future__ import annotations

import pytest


def cuda_devices() -> int:
    """CUDA devices this process sees, counted through NVML (CUDA stays unstarted: vLLM may fork)."""
    import torch

    return torch.cuda.device_count()


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """`gpu` and a skip on a machine with fewer than `n` CUDA devices (none: every test here skips)."""
    return pytest.mark.skipif(
        cuda_devices() < n, reason=f"needs {n} CUDA device(s); this machine shows {cuda_devices()}"
    )

"""Process-group setup for the trainer: env defaults for a single process, device choice.

DeepSpeed reads MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK (its launcher or
torchrun set them). A plain `python` process (tests, `rft warmstart`, the in-process loop) has
none, so `ensure_dist_env` fills them in for a world of one, on a free loopback port.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OWNER = "RFT_DIST_ENV_OWNER"  # pid of the process that filled in the variables below for itself


def ensure_dist_env() -> None:
    """Set the rendezvous variables for a one-process world unless a launcher already did.

    Values this function set in another process (our parent, say a test or a `serve` process
    that ran a trainer before starting a Prefect worker) are not a launcher's: children inherit
    them, and reusing the parent's MASTER_PORT, which the parent still holds, fails with
    EADDRINUSE. Those are replaced.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return  # an earlier trainer in this process already joined; DeepSpeed reuses the group
    inherited = os.environ.get(OWNER) not in (None, str(os.getpid()))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not inherited:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", **{OWNER: str(os.getpid())})


def accelerator_device() -> str:
    """Device of this rank: 'cuda:<LOCAL_RANK>' (or another accelerator's name) or 'cpu'.
    DeepSpeed picks the matching backend itself (nccl / gloo)."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return name if name == "cpu" else f"{name}:{int(os.environ.get('LOCAL_RANK', '0'))}"

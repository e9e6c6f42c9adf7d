"""Wire format of the collective weight sync: parameters broadcast in buckets over one process group.

Pure torch (no vLLM import at module level), used by the trainer side
(`rl_engine.sync.collective`) and by the inference workers (`rl_engine.rollout.worker_ext`).

The root (trainer rank 0) broadcasts a stream of messages; every other rank receives the same
stream, so receivers need no prior knowledge of the model:

    S_0 = int64[3] (version, header bytes, data bytes) of bucket 0   ((version, 0, 0): nothing to send)
    for bucket i:  H_i = uint8[header bytes]  JSON {"version", "params": [[name, dtype, shape, offset, nbytes], ...]}
                   D_i = uint8[data bytes]    the parameters' bytes, each at its 64-byte aligned offset
                   S_i+1 = int64[3]           sizes of bucket i+1; (version, 0, 0) ends the stream

Sizes of bucket i+1 travel with bucket i, so a receiver posts the receives of bucket i+1
before it loads bucket i (loading overlaps the transfer), and the root packs bucket i+1
while D_i is on the wire. A parameter bigger than a bucket is sent alone, without a copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

ALIGN = 64  # byte alignment of every parameter inside a bucket (any dtype view stays aligned)


def resolve_backend(backend: str) -> str:
    """'auto' -> 'nccl' with CUDA, else 'gloo'."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def group_device(backend: str) -> torch.device:
    """Where the group's tensors must live: the current CUDA device for NCCL, else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def init_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """Join the weight-sync process group (blocks until all world_size ranks joined); rank 0 hosts the store."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend=backend, timeout=timedelta(seconds=timeout_s)
    )


def destroy_group(pg: Any) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    stateless_destroy_torch_distributed_process_group(pg)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Bucket:
    params: list[list[Any]]  # [name, dtype name, shape, offset, nbytes] per parameter
    data: torch.Tensor  # uint8 [nbytes of the bucket]


def _as_bytes(t: torch.Tensor, wire_dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A tensor as a flat uint8 view [numel * itemsize], in the wire dtype, on the group device."""
    t = t.detach()
    if wire_dtype is not None and t.is_floating_point() and t.dtype != wire_dtype:
        t = t.to(wire_dtype)
    t = t.to(device).contiguous().view(-1)
    return t.view(torch.uint8)


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, wire_dtype: torch.dtype | None, device: torch.device) -> Iterator[Bucket]:
    """Group parameters, in iteration order, into buckets of at most `bucket_bytes` (bigger ones alone)."""
    pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, original, bytes view)
    size = 0

    def flush() -> Bucket:
        data = torch.empty(size, dtype=torch.uint8, device=device)  # [bucket bytes]
        params, off = [], 0
        for name, orig, b in pending:
            data[off : off + b.numel()].copy_(b)
            params.append([name, _dtype_name(wire_dtype_of(orig, wire_dtype)), list(orig.shape), off, b.numel()])
            off = _aligned(off + b.numel())
        return Bucket(params, data)

    for name, tensor in named_tensors:
        b = _as_bytes(tensor, wire_dtype, device)
        if b.numel() >= bucket_bytes:
            if pending:
                yield flush()
                pending, size = [], 0
            yield Bucket([[name, _dtype_name(wire_dtype_of(tensor, wire_dtype)), list(tensor.shape), 0, b.numel()]], b)
            continue
        if pending and _aligned(size) + b.numel() > bucket_bytes:
            yield flush()
            pending, size = [], 0
        size = _aligned(size) + b.numel()
        pending.append((name, tensor, b))
    if pending:
        yield flush()


def wire_dtype_of(t: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor travels in: the wire dtype for floating tensors, else its own."""
    return wire_dtype if wire_dtype is not None and t.is_floating_point() else t.dtype


def unpack_bucket(header: dict[str, Any], data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket's bytes (no copy)."""
    out = []
    for name, dtype, shape, off, nbytes in header["params"]:
        t = data[off : off + nbytes].view(getattr(torch, dtype)).view(shape)
        out.append((name, t))
    return out


def _sizes(version: int, bucket: Bucket | None, header: bytes | None, device: torch.device) -> torch.Tensor:
    vals = [version, 0, 0] if bucket is None else [version, len(header or b""), bucket.data.numel()]
    return torch.tensor(vals, dtype=torch.int64, device=device)  # [3]


def _encode(version: int, bucket: Bucket) -> bytes:
    return json.dumps({"version": version, "params": bucket.params}, separators=(",", ":")).encode()


def _bytes_tensor(b: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device)  # [len(b)]


def broadcast_send(pg: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int, wire_dtype: torch.dtype | None, device: torch.device) -> tuple[int, int]:
    """Root side: stream all parameters; returns (parameters sent, bytes sent). Blocks until sent."""
    buckets = pack_buckets(named_tensors, bucket_bytes, wire_dtype, device)
    cur = next(buckets, None)
    header = _encode(version, cur) if cur is not None else None
    pg.broadcast(_sizes(version, cur, header, device), 0).wait()
    n_params = n_bytes = 0
    while cur is not None:
        works = [pg.broadcast(_bytes_tensor(header, device), 0), pg.broadcast(cur.data, 0)]
        nxt = next(buckets, None)  # pack the next bucket while this one is on the wire
        nxt_header = _encode(version, nxt) if nxt is not None else None
        works.append(pg.broadcast(_sizes(version, nxt, nxt_header, device), 0))
        for w in works:
            w.wait()
        n_params += len(cur.params)
        n_bytes += cur.data.numel()
        cur, header = nxt, nxt_header
    return n_params, n_bytes


def broadcast_recv(pg: Any, device: torch.device, load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> tuple[int, int]:
    """Receiver side: receive the stream and `load` each bucket's (name, tensor) list; returns (version, parameters)."""
    sizes = torch.empty(3, dtype=torch.int64, device=device)  # (version, header bytes, data bytes)
    pg.broadcast(sizes, 0).wait()
    version, hlen, dlen = sizes.tolist()

    def post(hlen: int, dlen: int):
        h = torch.empty(hlen, dtype=torch.uint8, device=device)
        d = torch.empty(dlen, dtype=torch.uint8, device=device)  # fresh: loaders may keep views of it
        s = torch.empty(3, dtype=torch.int64, device=device)
        return h, d, s, [pg.broadcast(h, 0), pg.broadcast(d, 0), pg.broadcast(s, 0)]

    pending = post(hlen, dlen) if hlen else None
    n_params = 0
    while pending is not None:
        h, d, s, works = pending
        for w in works:
            w.wait()
        version, hlen, dlen = s.tolist()
        pending = post(hlen, dlen) if hlen else None  # next bucket arrives while this one loads
        header = json.loads(bytes(h.cpu().numpy()))
        params = unpack_bucket(header, d)
        load(params)
        n_params += len(params)
    return version, n_params


def raw_broadcast(pg: Any, sizes: list[int], device: torch.device) -> None:
    """Benchmark baseline: broadcast uint8 buffers of these sizes, nothing else (same group, same bytes)."""
    bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    for b in bufs:
        pg.broadcast(b, 0).wait()

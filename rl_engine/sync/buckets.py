"""Wire format of the collective weight sync: parameters broadcast in buckets over one process group.

Pure torch (vLLM only for creating the group), used by the trainer side
(`rl_engine.sync.collective`) and by the inference workers (`rl_engine.sync.worker_ext`).

The root (trainer rank 0) broadcasts a stream of messages; every other rank receives the same
stream, so receivers need no prior knowledge of the model:

    L_0 = int64[2] (version, header bytes of bucket 0)
    for bucket i:  H_i = uint8[header bytes]  JSON {"version", "segs": [bytes, ...],
                                                     "params": [[name, dtype, shape, seg, offset, nbytes], ...]}
                   the bucket's segments, in order: one uint8 segment per large parameter, sent
                   straight from the parameter's memory (no copy), and at most one segment that
                   packs the small ones (norms, biases) at 64-byte aligned offsets
                   L_i+1 = int64[2]; (version, 0) ends the stream

A receiver learns H_i+1 before it loads bucket i, posts the receives of bucket i+1, then
loads bucket i while bucket i+1 is on the wire. The root keeps at most two buckets in flight.

Same host, gloo (`shm.py`): a group whose members all mapped the trainer's shared-memory file when
it formed (`join_group`) moves no segment over the wire. The root copies bucket i into the file
before it sends H_i, whose `"at": [offset, ...]` says where each segment is; receivers load views
of their mapping. A bucket the file cannot hold has no `at` and is streamed as above.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from rl_engine.sync.shm import SharedRegion

ALIGN = 64  # byte alignment of every parameter inside a bucket (any dtype view stays aligned)
SMALL_BYTES = 1 << 20  # parameters under this many bytes are packed together; bigger ones go as they are


def resolve_backend(backend: str) -> str:
    """'auto' -> 'nccl' with CUDA, else 'gloo'."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def group_device(backend: str, device: str | None = None) -> torch.device:
    """Where the group's tensors must live: for NCCL `device` (this member's GPU, e.g. 'cuda:1'),
    else the calling thread's current CUDA device; CPU for gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    return torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())


def init_group(
    host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float, listen_socket: Any = None
) -> Any:
    """Join the weight-sync process group (blocks until all world_size ranks joined); rank 0 hosts
    the store, on `listen_socket` if given (bound and listening already: no race for the port)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend=backend, timeout=timedelta(seconds=timeout_s), listen_socket=listen_socket
    )


def join_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    listen_socket: Any = None,
    region: SharedRegion | None = None,
) -> tuple[Any, SharedRegion | None]:
    """`init_group`, then (gloo) the members agree on the transport: `region` (this member's
    mapping of the trainer's shared-memory file, None where it has none) is kept only if every
    member has one; otherwise it is closed and the group streams. Returns (group, region or None)."""
    agreed = False
    try:
        pg = init_group(host, port, rank, world_size, backend, timeout_s, listen_socket)
        if backend == "gloo":
            flag = torch.tensor([int(region is not None)], dtype=torch.int64)  # [1]
            pg.allreduce([flag], _min_op()).wait()
            agreed = flag.item() == 1
    finally:
        if region is not None and not agreed:  # a failed join, or a member without the file
            region.close()
    return pg, region if agreed else None


def _min_op() -> Any:
    from torch.distributed import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MIN
    return opts


def destroy_group(pg: Any) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    stateless_destroy_torch_distributed_process_group(pg)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Bucket:
    params: list[list[Any]]  # [name, dtype name, shape, segment, offset, nbytes] per parameter
    segs: list[torch.Tensor]  # uint8 [bytes] each: a large parameter's own bytes, or packed small ones

    def header(self, version: int, at: list[int] | None = None) -> bytes:
        h = {"version": version, "segs": [s.numel() for s in self.segs], "params": self.params}
        if at is not None:
            h["at"] = at
        return json.dumps(h, separators=(",", ":")).encode()


def wire_dtype_of(t: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor travels in: the wire dtype for floating tensors, else its own."""
    return wire_dtype if wire_dtype is not None and t.is_floating_point() else t.dtype


def _as_bytes(t: torch.Tensor, wire_dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A tensor as a flat uint8 view [numel * itemsize] in the wire dtype on the group device (no copy if it already is)."""
    t = t.detach()
    if t.dtype != wire_dtype_of(t, wire_dtype):
        t = t.to(wire_dtype)
    return t.to(device).contiguous().view(-1).view(torch.uint8)


def _bucket(
    items: list[tuple[str, torch.Tensor, torch.Tensor]],
    small_bytes: int,
    device: torch.device,
    wire_dtype: torch.dtype | None,
) -> Bucket:
    """One bucket from (name, original, bytes view) items; only parameters under small_bytes are copied (packed)."""
    small = [it for it in items if it[2].numel() < small_bytes]
    packed_size, offsets = 0, {}
    for name, _, b in small:
        offsets[name] = packed_size
        packed_size = _aligned(packed_size + b.numel())
    segs: list[torch.Tensor] = []
    if small:
        packed = torch.empty(packed_size, dtype=torch.uint8, device=device)  # [packed bytes]
        for name, _, b in small:
            packed[offsets[name] : offsets[name] + b.numel()].copy_(b)
        segs.append(packed)
    params = []
    for name, orig, b in items:
        if name in offsets:
            seg, off = 0, offsets[name]
        else:
            seg, off = len(segs), 0
            segs.append(b)
        params.append(
            [name, str(wire_dtype_of(orig, wire_dtype)).removeprefix("torch."), list(orig.shape), seg, off, b.numel()]
        )
    return Bucket(params, segs)


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    wire_dtype: torch.dtype | None,
    device: torch.device,
) -> Iterator[Bucket]:
    """Group parameters, in iteration order, into buckets of about `bucket_bytes` (a bigger one alone)."""
    small_bytes = min(bucket_bytes, SMALL_BYTES)
    pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        b = _as_bytes(tensor, wire_dtype, device)
        if pending and size + b.numel() > bucket_bytes:
            yield _bucket(pending, small_bytes, device, wire_dtype)
            pending, size = [], 0
        pending.append((name, tensor, b))
        size += _aligned(b.numel())
    if pending:
        yield _bucket(pending, small_bytes, device, wire_dtype)


def unpack_bucket(header: dict[str, Any], segs: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket's segments (no copy)."""
    out = []
    for name, dtype, shape, seg, off, nbytes in header["params"]:
        out.append((name, segs[seg][off : off + nbytes].view(getattr(torch, dtype)).view(shape)))
    return out


def _len_msg(version: int, header: bytes | None, device: torch.device) -> torch.Tensor:
    return torch.tensor([version, len(header or b"")], dtype=torch.int64, device=device)  # [2]


def _bytes_tensor(b: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device)  # [len(b)]


def broadcast_send(
    pg: Any,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    bucket_bytes: int,
    wire_dtype: torch.dtype | None,
    device: torch.device,
    region: SharedRegion | None = None,
) -> tuple[int, int]:
    """Root side: stream all parameters (through `region` where the group agreed on it); returns
    (parameters sent, bytes sent) once every rank has them."""
    buckets = pack_buckets(named_tensors, bucket_bytes, wire_dtype, device)
    offset = 0

    def announce(b: Bucket | None) -> tuple[list[Any], bool]:
        """L and H of bucket `b` (None: the end) on the wire, `b`'s bytes in the region first if they fit there."""
        nonlocal offset
        placed = region.put(b.segs, offset, ALIGN) if region is not None and b is not None else None
        at = None
        if placed is not None:
            at, offset = placed
        header = b.header(version, at) if b is not None else None
        works = [pg.broadcast(_len_msg(version, header, device), 0)]
        if header:
            works.append(pg.broadcast(_bytes_tensor(header, device), 0))
        return works, at is not None

    cur = next(buckets, None)
    in_flight, shared = announce(cur)
    n_params = n_bytes = 0
    while cur is not None:
        works = [] if shared else [pg.broadcast(s, 0) for s in cur.segs]
        nxt = next(buckets, None)  # materialize/convert the next bucket while this one is on the wire
        more, nxt_shared = announce(nxt)
        works += more
        for w in in_flight:  # bucket i-1 done: at most two buckets' tensors are held
            w.wait()
        in_flight = works
        n_params += len(cur.params)
        n_bytes += sum(s.numel() for s in cur.segs)
        cur, shared = nxt, nxt_shared
    for w in in_flight:
        w.wait()
    if region is not None:
        region.settle()
    return n_params, n_bytes


def broadcast_recv(
    pg: Any,
    device: torch.device,
    load: Callable[[list[tuple[str, torch.Tensor]]], Any],
    buffers: ReceiveBuffers | None = None,
    region: SharedRegion | None = None,
) -> tuple[int, int]:
    """Receiver side: receive the stream and `load` each bucket's (name, tensor) list; returns (version, parameters).

    `buffers` reuses receive memory across syncs (see ReceiveBuffers); by default every
    segment gets fresh memory. A bucket whose header places it in the shared-memory file is
    loaded from `region` (the group agreed on it in `join_group`).
    """
    buffers = buffers or ReceiveBuffers(device, reuse=False)
    index = 0

    def recv_header() -> tuple[int, dict[str, Any] | None]:
        msg = torch.empty(2, dtype=torch.int64, device=device)  # (version, header bytes)
        pg.broadcast(msg, 0).wait()
        version, hlen = msg.tolist()
        if not hlen:
            return version, None
        h = torch.empty(hlen, dtype=torch.uint8, device=device)
        pg.broadcast(h, 0).wait()
        return version, json.loads(bytes(h.cpu().numpy()))

    def post(header: dict[str, Any]) -> tuple[list[torch.Tensor], list[Any]]:
        nonlocal index
        if "at" in header:
            if region is None:
                raise RuntimeError("the trainer placed a bucket in shared memory this worker did not map")
            return region.views(header["at"], header["segs"]), []
        segs = [buffers.get(index, j, n) for j, n in enumerate(header["segs"])]
        index += 1
        return segs, [pg.broadcast(s, 0) for s in segs]

    version, header = recv_header()
    pending = post(header) if header else None
    n_params = 0
    while header is not None and pending is not None:
        segs, works = pending
        for w in works:
            w.wait()
        version, nxt = recv_header()
        pending = post(nxt) if nxt else None  # bucket i+1 arrives while bucket i loads
        params = unpack_bucket(header, segs)
        load(params)
        n_params += len(params)
        header = nxt
    if region is not None:
        region.settle()
    return version, n_params


class ReceiveBuffers:
    """Receive memory of a worker, optionally kept from one sync to the next.

    A loader may keep views of received bytes until its layer is complete (vLLM's layerwise
    reload does), so within one sync every segment needs its own memory. Across syncs the
    same model sends the same segments, and on CPU fresh memory costs page faults on every
    byte (about as much as the transfer itself), so `reuse=True` keeps each segment's memory
    for the next sync: one extra copy of the weights in host RAM, which is why GPU workers
    (whose caching allocator already reuses device memory) do not ask for it.
    """

    def __init__(self, device: torch.device, reuse: bool):
        self.device, self.reuse = device, reuse
        self._kept: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, bucket: int, seg: int, nbytes: int) -> torch.Tensor:
        t = self._kept.get((bucket, seg))
        if t is None or t.numel() != nbytes:
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)  # [nbytes]
            if self.reuse:
                self._kept[(bucket, seg)] = t
        return t


def raw_broadcast(pg: Any, bufs: list[torch.Tensor]) -> None:
    """Benchmark floor: broadcast these preallocated buffers, all posted at once; nothing else."""
    for w in [pg.broadcast(b, 0) for b in bufs]:
        w.wait()

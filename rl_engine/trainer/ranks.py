"""The trainer on several data-parallel ranks: rank 0 leads, the other ranks follow.

Rank 0 is the trainer everyone else sees (the trainer role, its buffer reader, the board, the
weight-sync group). Every DeepSpeed operation is collective, though: a step's gradient
all-reduce, and under ZeRO-3 every gather of a parameter. So `LeaderTrainer` (rank 0's `Trainer`)
broadcasts each operation to the other ranks before doing its own part, and `follow` (ranks
1..N-1) carries them out in the same order until the leader says `end`:

    train / sft    the whole batch; each rank trains on its rows (`share`): rows sorted by GRPO
                   group and cut into equal parts, so groups stay whole when a rank's part is a
                   multiple of the group size. Advantages are computed on the whole batch first.
    logprobs       the whole batch on every rank (under ZeRO-3 a forward pass is collective)
    weights        every rank walks named_weights (ZeRO-3 gathers); rank 0 sends them on
    save_hf / save_state / load_state   with the URL; rank 0 writes, every rank reads

An operation travels as a JSON header (op, args, tensor names, dtypes and shapes) and then its
tensors, broadcast on the ranks' default group (gloo on CPU, NCCL on GPU). Storage options are
not sent: each rank opens the run's storage itself.

Ranks are started by torchrun (`rl_engine.trainer.launch`); each runs `python -m
rl_engine.roles.trainer_rank RUN_URL`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl_engine.algorithms import prepare_batch_rows, row_metrics

Batch = dict[str, Tensor]


def share(batch: Batch, rank: int, world: int) -> Batch:
    """Rank `rank`'s rows of `batch` ([B, ...] tensors -> [B / world, ...]): sorted by group, cut evenly."""
    n = batch["input_ids"].shape[0]
    if n % world:
        raise ValueError(f"a batch of {n} rows does not split over {world} trainer ranks")
    order = torch.argsort(batch["group_index"].cpu(), stable=True) if "group_index" in batch else torch.arange(n)  # [B]
    rows = order[rank * n // world : (rank + 1) * n // world]  # [B / world]
    return {k: v[rows.to(v.device)] for k, v in batch.items()}


def broadcast_op(
    op: str, args: dict[str, Any] | None = None, tensors: Batch | None = None, device: str = "cpu"
) -> None:
    """Rank 0: send one operation to the other ranks."""
    tensors = tensors or {}
    names = sorted(tensors)
    head = json.dumps(
        {
            "op": op,
            "args": args or {},
            "tensors": [[k, str(tensors[k].dtype).removeprefix("torch."), list(tensors[k].shape)] for k in names],
        }
    ).encode()
    dist.broadcast(torch.tensor([len(head)], dtype=torch.int64, device=device), src=0)
    dist.broadcast(torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device), src=0)
    for k in names:
        dist.broadcast(tensors[k].contiguous().to(device), src=0)


def receive_op(device: str = "cpu") -> tuple[str, dict[str, Any], Batch]:
    """Ranks 1..N-1: the next operation rank 0 sent (op, args, tensors)."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(raw, src=0)
    head = json.loads(raw.cpu().numpy().tobytes())
    tensors = {}
    for name, dtype, shape in head["tensors"]:
        tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensors[name], src=0)
    return head["op"], head["args"], tensors


class LeaderTrainer:
    """Rank 0's `Trainer`: the local DeepSpeed trainer, with every operation sent to the other ranks first."""

    def __init__(self, local: Any):
        self.local = local
        self.rank, self.world, self.pad_token_id, self.device = (
            local.rank,
            local.world,
            local.pad_token_id,
            local.device,
        )
        # An operation that raised may have left the other ranks inside a collective: no `end`
        # then; rank 0's failure makes torchrun stop them.
        self._broken = False

    @property
    def version(self) -> int:
        return self.local.version

    def _send(self, op: str, args: dict[str, Any] | None = None, tensors: Batch | None = None) -> None:
        if self._broken:
            raise RuntimeError(f"trainer ranks out of step after a failed operation; cannot send {op!r}")
        self._broken = True  # until the operation returns
        broadcast_op(op, args, tensors, self.local.device)

    def _done(self, out: Any = None) -> Any:
        self._broken = False
        return out

    def train_step(self, batch: Batch) -> dict[str, float]:
        extra: dict[str, float] = {}
        if "advantages" not in batch:  # on the whole batch: batch baselines and stds see every row
            prep = prepare_batch_rows(batch, self.local.algo, self.local.max_response_tokens)
            batch = {**batch, "advantages": prep.advantages, "trained_rows": prep.trained_rows}
            extra = row_metrics(prep, self.local.algo)
        self._send("train", tensors=batch)
        return {**self._done(self.local.train_step(share(batch, 0, self.world))), **extra}

    def sft_step(self, batch: Batch) -> dict[str, float]:
        self._send("sft", tensors=batch)
        return self._done(self.local.sft_step(share(batch, 0, self.world)))

    def compute_logprobs(self, batch: Batch) -> Tensor:
        self._send("logprobs", tensors=batch)
        return self._done(self.local.compute_logprobs(batch))

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        self._send("weights")
        yield from self.local.named_weights()
        self._done()  # not reached when the caller stops early: under ZeRO-3 the others wait in a gather

    def save_hf(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self._send("save_hf", {"url": url})
        self._done(self.local.save_hf(url, storage_options))

    def save_state(
        self, url: str, storage_options: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        self._send("save_state", {"url": url})
        self._done(self.local.save_state(url, storage_options, extra))

    def load_state(self, url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        self._send("load_state", {"url": url})
        return self._done(self.local.load_state(url, storage_options))

    def close(self) -> None:
        """Let the other ranks exit (once, at the end of the role), unless they are out of step."""
        if not self._broken:
            self._send("end")
            self._broken = True  # nobody is listening any more


def follow(local: Any, storage_options: dict[str, Any] | None = None) -> None:
    """Ranks 1..N-1: carry out rank 0's operations on `local` until `end`."""
    while True:
        op, args, batch = receive_op(local.device)
        if op == "end":
            return
        if op == "train":
            local.train_step(share(batch, local.rank, local.world))
        elif op == "sft":
            local.sft_step(share(batch, local.rank, local.world))
        elif op == "logprobs":
            local.compute_logprobs(batch)
        elif op == "weights":
            for _ in local.named_weights():
                pass
        elif op == "save_hf":
            local.save_hf(args["url"], storage_options)
        elif op == "save_state":
            local.save_state(args["url"], storage_options)
        elif op == "load_state":
            local.load_state(args["url"], storage_options)
        else:
            raise RuntimeError(
                f"trainer rank {local.rank}: unknown operation {op!r} from rank 0 (ranks of different versions?)"
            )

"""What the rest of the engine may ask of a trainer (the trainer role, weight sync, warm start, loop)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torch import Tensor


class Trainer(Protocol):
    """A policy being trained. Batches are `ExperienceBatch.to_tensors(pad_token_id)` dicts."""

    version: int  # completed trainer steps; 0 = the initial weights
    rank: int  # data-parallel rank of this process (0 writes files and broadcasts weights)
    device: str  # where this rank's tensors live: 'cuda:<i>' or 'cpu'
    pad_token_id: int

    def train_step(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """One RL update (GRPO advantages from rewards/group_index unless batch has `advantages`)."""
        ...

    def sft_step(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """One supervised update on the `loss_mask` tokens (warm start)."""
        ...

    def compute_logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, L] logprobs of input_ids under the current policy (temperature-scaled)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(Hugging Face name, full tensor) pairs, for weight sync."""
        ...

    def save_hf(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        """Write a Hugging Face model directory (transformers and vLLM load it)."""
        ...

    def save_state(
        self, url: str, storage_options: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        """Write resumable state plus the caller's JSON `extra`; commit marker last."""
        ...

    def load_state(self, url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restore state written by save_state; returns its `extra`."""
        ...

    def close(self) -> None:
        """Done with the trainer: with several ranks, the other ranks exit."""
        ...

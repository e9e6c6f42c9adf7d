"""A COST MODEL standing in for vLLM and DeepSpeed in `bench.modes --synthetic` only.

Rollout sleeps R seconds and returns random tokens, a train step sleeps T, a weight load S.
It measures what the real orchestration (Prefect flows and tasks, buffer, checkpoints, control
board) adds on top of known costs. Never used by the product or the tests.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from rl_engine.rollout.engine import Rollout
from rl_engine.storage import join, open_storage, read_json, write_json


class CostModelEngine:
    """The `rl_engine.rollout.engine.RolloutEngine` protocol at a known cost per call."""

    def __init__(self, cfg: Any, explorer_id: int, rollout_s: float, sync_s: float):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self._version, self.rollout_s, self.sync_s = 0, rollout_s, sync_s

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def generate(
        self, prompts: list[list[int]], n: int, sampling: Any, seed: int, max_tokens: Any = None, repeat: Any = None
    ) -> list[list[Rollout]]:
        time.sleep(self.rollout_s)
        rng = random.Random(seed)
        out = []
        for i, p in enumerate(prompts):
            group = []
            for _ in range(n):
                ids = [
                    rng.randrange(3, 200) for _ in range(sampling.max_tokens if max_tokens is None else max_tokens[i])
                ]
                group.append(
                    Rollout(
                        prompt_ids=p,
                        response_ids=ids,
                        logprobs=[-1.0] * len(ids),
                        finish_reason="length",
                        version=self._version,
                        text="",
                    )
                )
            out.append(group)
        return out

    def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        if method == "rft_load_checkpoint":
            time.sleep(self.sync_s)
            return [(args[1], 1)]
        return [None]

    def mark_synced(self, version: int) -> None:
        self._version = version

    def close(self) -> None:
        pass


class CostModelTrainer:
    """The `rl_engine.trainer.Trainer` protocol, one rank, at a known cost per step."""

    def __init__(self, settings: Any, train_s: float):
        from transformers import AutoTokenizer

        self.pad_token_id = AutoTokenizer.from_pretrained(settings.model_path).pad_token_id
        self.version, self.rank, self.device, self.train_s, self.w = 0, 0, "cpu", train_s, torch.zeros(8)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        time.sleep(self.train_s)
        self.version += 1
        return {"loss": 0.0, "version": float(self.version)}

    def sft_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        time.sleep(self.train_s)
        return {"loss": 0.0}

    def compute_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.full(batch["input_ids"].shape, -1.0)  # [B, L]

    def named_weights(self):
        yield "cost_model.weight", self.w

    def save_state(self, url: str, storage_options: dict | None = None, extra: dict | None = None) -> None:
        fs, root = open_storage(url, storage_options)
        write_json(fs, join(root, "state.json"), {"version": self.version, "extra": extra or {}})
        write_json(fs, join(root, "COMMITTED"), {"version": self.version})

    def save_hf(self, url: str, storage_options: dict | None = None) -> None:
        fs, root = open_storage(url, storage_options)
        write_json(fs, join(root, "cost_model.json"), {"version": self.version})

    def load_state(self, url: str, storage_options: dict | None = None) -> dict:
        fs, root = open_storage(url, storage_options)
        meta = read_json(fs, join(root, "state.json"))
        self.version = meta["version"]
        return meta["extra"]

    def close(self) -> None:
        pass


def install(rollout_s: float, train_s: float, sync_s: float) -> None:
    """Swap the engine and trainer factories of this process for the cost model (refused if the
    cost model no longer implements the protocols the roles call)."""
    import rl_engine.roles.explorer
    import rl_engine.roles.trainer
    from rl_engine.api import RolloutEngine, Trainer
    from rl_engine.conformance import mismatches

    if problems := mismatches(CostModelEngine, RolloutEngine) + mismatches(CostModelTrainer, Trainer):
        raise TypeError("bench.cost_model is behind the protocols: " + "; ".join(problems))

    rl_engine.roles.explorer.build_rollout_engine = lambda cfg, i=0, **_: CostModelEngine(cfg, i, rollout_s, sync_s)
    rl_engine.roles.trainer.build_trainer = lambda settings: CostModelTrainer(settings, train_s)

"""Every implementation of an engine Protocol implements it: members and call signatures
(rl_engine/conformance.py), so a protocol change cannot leave one behind unseen, the bench's cost
model included (issue 29: `bench.modes --synthetic` died on `trainer.close()`).

    .venv/bin/python -m pytest tests/rl_engine/test_conformance.py -q
"""

from __future__ import annotations

from typing import Any, Protocol

import pytest

from bench.cost_model import CostModelEngine, CostModelTrainer
from rl_engine.api import RolloutEngine, Trainer, WeightReceiver, WeightSender
from rl_engine.conformance import mismatches
from rl_engine.rollout.engine import VLLMRolloutEngine
from rl_engine.sync.checkpoint import CheckpointReceiver, CheckpointSender
from rl_engine.sync.collective import CollectiveReceiver, CollectiveSender
from rl_engine.trainer.deepspeed_trainer import DeepSpeedTrainer
from rl_engine.trainer.ranks import LeaderTrainer


@pytest.mark.parametrize(
    "cls, proto",
    [
        (DeepSpeedTrainer, Trainer),
        (LeaderTrainer, Trainer),
        (CostModelTrainer, Trainer),
        (VLLMRolloutEngine, RolloutEngine),
        (CostModelEngine, RolloutEngine),
        (CollectiveSender, WeightSender),
        (CheckpointSender, WeightSender),
        (CollectiveReceiver, WeightReceiver),
        (CheckpointReceiver, WeightReceiver),
    ],
    ids=lambda x: x.__name__,
)
def test_implementation_conforms(cls, proto):
    assert mismatches(cls, proto) == []


class Proto(Protocol):
    version: int

    @property
    def name(self) -> str: ...

    def step(self, batch: dict, scale: float = 1.0) -> dict: ...

    def close(self) -> None: ...


class Good:
    def __init__(self):
        self.version, self.name = 0, "x"  # an attribute where the protocol has a property is fine

    def step(self, batch: dict, scale: float = 1.0, extra: Any = None) -> dict:  # extra optional parameters are fine
        return batch

    def close(self) -> None:
        pass


class Bad:
    def step(self, batch: dict, scale: float, needed: int) -> dict:
        return batch

    close = None


def test_the_check_names_every_kind_of_gap():
    assert mismatches(Good, Proto) == []
    assert mismatches(Bad, Proto) == [
        "Bad: no attribute 'version' (Proto)",
        "Bad: 'close' is not a method (Proto)",
        "Bad: no property 'name' (Proto)",
        "Bad: step() parameter 'scale' needs a default, as in the protocol (Proto)",
        "Bad: step() requires 'needed', which the protocol does not pass (Proto)",
    ]


def test_the_cost_model_refuses_to_install_when_behind(monkeypatch):
    from bench import cost_model

    monkeypatch.delattr(cost_model.CostModelTrainer, "close")
    with pytest.raises(TypeError, match="CostModelTrainer: no method 'close'"):
        cost_model.install(0.1, 0.1, 0.0)

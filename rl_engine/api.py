"""The public contracts of rft, and the decorators that register an extension: the one module a
plugin imports.

Extension points (each a registry in rl_engine.registry; a config selects one by `type`):

    estimator  algorithm.advantage   AdvantageEstimator: (rewards [B], group_index [B], **kw) -> [B]
    loss       algorithm.loss        PolicyLoss: (logprobs, proximal, advantages, mask, **kw) -> [B, L]
    reward     taskset.reward        Reward (per sample) or BatchReward (a step's samples at once)
    workflow   taskset.workflow      Workflow: (task, episode, **kw) -> reward | None
    task       rft make-tasks --task TaskMaker: (n, seed, **kw) -> rows

A plugin is a module that registers with the decorators below; a config names it in `plugins:`
and selects its entries by name:

    # mylosses.py
    from rl_engine.api import register_loss

    @register_loss("clipped_reinforce")
    def clipped_reinforce(logprobs, proximal, advantages, mask, clip=5.0):
        return -(advantages[:, None].clamp(-clip, clip) * logprobs)    # [B, L]

    # run.yaml
    plugins: [mylosses]
    algorithm: {loss: {type: clipped_reinforce, kwargs: {clip: 2.0}}}

A function that is not registered is named by import path instead:
`{type: python, function: mylosses:clipped_reinforce, kwargs: {...}}`. User rewards and the code
of user workflows run in the explorer's user-code pool (worker processes with timeouts); losses
and estimators run in the trainer's process.

The engine-side contracts (`Trainer`, `RolloutEngine`, `WeightSender`, `WeightReceiver`) are what
the roles ask of a trainer, an inference engine and a weight sync; tests/rl_engine/test_conformance.py
checks every implementation against them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from rl_engine.registry import ESTIMATORS, LOSSES, REWARDS, TASKS, WORKFLOWS

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from rl_engine.board import StopSignal
    from rl_engine.config import SamplingConfig
    from rl_engine.rewards.tasks import Task
    from rl_engine.rollout.engine import Rollout

T = TypeVar("T")

__all__ = [
    "AdvantageEstimator",
    "BatchReward",
    "PolicyLoss",
    "Reward",
    "RewardSample",
    "RolloutEngine",
    "TaskMaker",
    "Trainer",
    "WeightReceiver",
    "WeightSender",
    "Workflow",
    "register_estimator",
    "register_loss",
    "register_reward",
    "register_task",
    "register_workflow",
]


def register_estimator(name: str) -> Callable[[T], T]:
    """Register an `AdvantageEstimator` as `algorithm.advantage.type: <name>`."""
    return ESTIMATORS.register(name)


def register_loss(name: str) -> Callable[[T], T]:
    """Register a `PolicyLoss` as `algorithm.loss.type: <name>`."""
    return LOSSES.register(name)


def register_reward(name: str) -> Callable[[T], T]:
    """Register a `Reward` or `BatchReward` function as `taskset.reward.type: <name>` (with
    `batch: true` for a BatchReward)."""
    return REWARDS.register(name)


def register_workflow(name: str) -> Callable[[T], T]:
    """Register a `Workflow` (a function, or a class built with the kwargs) as `taskset.workflow.type: <name>`."""
    return WORKFLOWS.register(name)


def register_task(name: str) -> Callable[[T], T]:
    """Register a `TaskMaker` as `rft make-tasks OUT --task <name>`."""
    return TASKS.register(name)


# ---------------------------------------------------------------------------- algorithm


class AdvantageEstimator(Protocol):
    """One advantage per experience from its reward and its group (the rollouts of one task).

    rewards [B] float, group_index [B] long (any integers; equal means same group); returns
    advantages [B] float. The trainer broadcasts each to every response token of its experience.
    Keyword arguments are the config's `kwargs` (a built-in's: its fields, e.g. `std`).
    """

    def __call__(self, rewards: Tensor, group_index: Tensor, **kwargs: Any) -> Tensor: ...


class PolicyLoss(Protocol):
    """The per-token policy loss of one (micro-)batch, before aggregation.

    logprobs [B, L] (the policy's, with grad), proximal [B, L] (the ratio's denominator: vLLM's
    behavior logprobs, or the trainer's recomputed ones), advantages [B], mask [B, L] float (1 on
    trained tokens). Returns the loss [B, L], or (loss [B, L], clipped [B, L] bool) to report which
    tokens the loss's own clip touched. The trainer applies the off-policy weights, aggregates over
    the mask as `algorithm.aggregation` says and adds the KL term.
    """

    def __call__(
        self, logprobs: Tensor, proximal: Tensor, advantages: Tensor, mask: Tensor, **kwargs: Any
    ) -> Tensor | tuple[Tensor, Tensor]: ...


# ---------------------------------------------------------------------------- tasks, rewards, workflows


class RewardSample(NamedTuple):
    """What a reward sees of one rollout."""

    prompt: str
    response: str
    task: Task  # .task_id, .prompt, .answer and the task row's other columns in .extra
    finish_reason: str  # stop | length | repeat | truncated


class Reward(Protocol):
    """The reward of one response: a float, or a dict of named components (their sum is the
    reward). Raising leaves the sample out (counted); `finish_reason` may be left out of the
    signature. Keyword arguments are the config's `kwargs`."""

    def __call__(self, prompt: str, response: str, task: Task, finish_reason: str) -> float | dict[str, float]: ...


class BatchReward(Protocol):
    """The rewards of a whole step's samples in one call (`taskset.reward.batch: true`): one
    float, dict of components, or None (this sample cannot be scored: left out, counted) per sample,
    in order. For rewards that are cheaper together (a judge model, a sandbox pool, a web API)."""

    def __call__(self, samples: list[RewardSample]) -> Sequence[float | dict[str, float] | None]: ...


class Workflow(Protocol):
    """One episode of one task against the explorer's engine (rl_engine.rollout.workflow): ask
    for model turns with `episode.generate`, append what the environment says, return the reward
    (a float or dict of components) or None to have `taskset.reward` score the last turn. Keyword
    arguments are the config's `kwargs`; a class is built with them and its `run` (or `__call__`)
    plays each episode."""

    def __call__(self, task: Task, episode: Any) -> float | dict[str, float] | None: ...


class TaskMaker(Protocol):
    """Rows of a task set ({id, question, answer, ...}: what `taskset.path` holds), `n` of them
    (None: the maker's natural size), the same rows for the same arguments."""

    def __call__(self, n: int | None, seed: int, **kwargs: Any) -> list[dict[str, Any]]: ...


# ---------------------------------------------------------------------------- engines and sync


class Trainer(Protocol):
    """A policy being trained. Batches are `ExperienceBatch.to_tensors(pad_token_id)` dicts."""

    version: int  # completed trainer steps; 0 = the initial weights
    rank: int  # data-parallel rank of this process (0 writes files and broadcasts weights)
    device: str  # where this rank's tensors live: 'cuda:<i>' or 'cpu'
    pad_token_id: int

    def train_step(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """One RL update (advantages from rewards/group_index unless batch has `advantages`)."""
        ...

    def sft_step(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """One supervised update on the `loss_mask` tokens (warm start)."""
        ...

    def compute_logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, L] logprobs of input_ids under the current policy (temperature-scaled)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """What a weight sync sends: (Hugging Face name, full tensor) pairs, or under `model.lora`
        the adapter's tensors only (peft's file names; rl_engine.adapter)."""
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


class RolloutEngine(Protocol):
    """What explorers and weight syncs need from an inference engine."""

    @property
    def version(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        seed: int,
        max_tokens: Sequence[int] | None = None,
        repeat: tuple[int, int] | None = None,
    ) -> list[list[Rollout]]: ...

    def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call `method` of the worker extension on every inference worker; one result per worker."""
        ...

    def mark_synced(self, version: int) -> None:
        """Record that the workers now hold weights of `version` (called by rl_engine.sync)."""
        ...

    def close(self) -> None: ...


class WeightSender(Protocol):
    """Trainer side of a weight sync. Each sync is `prepare(v)` (wait until the receivers can take
    it; nothing for checkpoints), `send(weights, v)`, and at a rendezvous `wait_loaded(v)`."""

    method: str

    def connect(self, stop: StopSignal | None = None) -> None:
        """Join whatever the method needs (the process group); blocks until the receivers joined."""
        ...

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Block until every receiver is ready to take `version` (collective: all joined the broadcast)."""
        ...

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish (HF parameter name, full tensor) pairs as weight version `version`; a method
        that keeps versions on storage (checkpoint) prunes them here (synchronizer.keep_last_checkpoints)."""
        ...

    def wait_loaded(self, version: int, stop: StopSignal | None = None) -> None:
        """Block until every explorer acknowledged loading `version` (or newer)."""
        ...

    def close(self) -> None:
        """Release the method's resources; receivers still waiting for a send are released too."""
        ...


class WeightReceiver(Protocol):
    """Explorer side of a weight sync: installs weights into a live rollout engine.
    Each sync is `prepare(v)` (collective: join the broadcast) then `receive(engine, v)`."""

    method: str
    joins_every_version: bool  # a send waits for every explorer (a broadcast), so none may skip a version

    def connect(self, engine: Any, stop: StopSignal | None = None) -> None:
        """Join from the engine's inference workers (collective) or nothing (checkpoint)."""
        ...

    def prepare(self, version: int, stop: StopSignal | None = None) -> None:
        """Block until the trainer is ready to hand over `version`; raises Stopped if it gave up."""
        ...

    def receive(self, engine: Any, version: int | None = None) -> int:
        """Install the trainer's weights into `engine`, acknowledge them on the board, and
        return the installed version (engine.version too)."""
        ...

    def close(self) -> None: ...

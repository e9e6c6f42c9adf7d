"""What one episode of a task is (a workflow) and where user code runs (the user-code pool).

A workflow turns one task into one episode against the explorer's engine: `single_turn` (the
default: prompt -> one response, scored by `taskset.reward`), the built-in `calculator` and
`guess_number` multi-turn examples, or a user's `python` function. `user_code` bounds what user
code may cost: Python rewards and workflows' tool and environment calls run in a pool of worker
processes with a per-call timeout and a hard kill (`rl_engine.rewards.isolation`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rl_engine.config.base import Kwargs, _Model, check_registered, variants
from rl_engine.registry import IMPORT_PATH, WORKFLOWS


class SingleTurnWorkflow(_Model):
    """Prompt -> one response, scored by `taskset.reward` (no environment tokens)."""

    type: Literal["single_turn"] = Field(description="Workflow variant selector.")


class CalculatorWorkflow(_Model):
    """The calculator tool: the model may write `<calc>EXPR</calc>`; the environment appends the
    value and the model continues to its answer, which `taskset.reward` scores."""

    type: Literal["calculator"] = Field(description="Workflow variant selector.")
    max_calls: int = Field(
        default=2, ge=1, le=16, description="Tool calls an episode may make; the turn after the last one must answer."
    )


class GuessNumberWorkflow(_Model):
    """A game with feedback: the model guesses the task's number, the environment answers `+`
    (higher), `-` (lower) or `?` (not a number in range); reward 1 for a hit within `max_turns`
    guesses, plus 0.1 when every guess was well formed (`rl_engine.demos.guess_number`)."""

    type: Literal["guess_number"] = Field(description="Workflow variant selector.")
    max_turns: int = Field(default=4, ge=1, le=32, description="Guesses an episode may make.")


class PythonWorkflow(_Model):
    """A user workflow `package.module:function(task, episode, **kwargs) -> reward | None`, or a
    class built with the kwargs whose `run(task, episode)` (or `__call__`) runs one episode
    (`rl_engine.api.Workflow`; see `rl_engine.rollout.workflow`)."""

    type: Literal["python"] = Field(description="Workflow variant selector.")
    function: str = Field(
        description="Import path `package.module:name` of the workflow function or class.", pattern=IMPORT_PATH
    )
    kwargs: Kwargs = Field(
        default_factory=dict, description="Extra keyword arguments passed to the function (or the class)."
    )


class RegisteredWorkflow(_Model):
    """A workflow a plugin registered (`@register_workflow(name)` in a module of `plugins:`)."""

    type: str = Field(description="The registered name.")
    kwargs: Kwargs = Field(
        default_factory=dict, description="Extra keyword arguments passed to the function (or the class)."
    )

    @field_validator("type")
    @classmethod
    def _registered(cls, v: str) -> str:
        return check_registered(WORKFLOWS, v)


WorkflowConfig = variants(
    SingleTurnWorkflow, CalculatorWorkflow, GuessNumberWorkflow, PythonWorkflow, registered=RegisteredWorkflow
)


class UserCodeConfig(_Model):
    """Limits on user code: Python rewards and workflows' tool calls run in worker processes."""

    workers: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Worker processes of each explorer's pool; calls beyond them wait for a free worker.",
    )
    tool_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="Longest one tool or environment call of a workflow (`episode.call`) may take; its worker is then killed and replaced.",
    )
    failed_reward: float | None = Field(
        default=None,
        description="Reward of a sample whose reward call timed out or whose worker died; null leaves the sample out of training. Counted either way (reward/timeouts, reward/crashes).",
    )
    episode_timeout_s: float = Field(
        default=300.0,
        gt=0.0,
        description="Longest one episode's own code may run between model calls; the episode then fails (see on_episode_error).",
    )
    on_episode_error: Literal["drop", "score", "fail"] = Field(
        default="drop",
        description="An episode whose workflow raised or timed out (counted as workflow_errors, its task named in the log): `drop` leaves it out, "
        "`score` trains on it as far as it got with reward `failed_reward`, `fail` fails the run.",
    )

    @model_validator(mode="after")
    def _score_needs_a_reward(self) -> UserCodeConfig:
        if self.on_episode_error == "score" and self.failed_reward is None:
            raise ValueError(
                "taskset.user_code.on_episode_error = score needs taskset.user_code.failed_reward: the reward a failed episode is trained with"
            )
        return self

"""Multi-turn episodes: a workflow runs one episode of one task on the explorer's engine, token in / token out.

A workflow is a plain function `(task, episode, **kwargs) -> reward | None`. It asks the model
for turns (`episode.generate`: the ids so far in, the new ids and their behavior logprobs out),
and appends what the environment or a tool says (`append_text`, `append_ids`, or a chat message
rendered by the template, `append_message`). The ids are the truth: nothing is re-tokenised, so
the trainer sees exactly the ids the policy sampled plus the environment's, and the loss mask is
1 on the policy's tokens and 0 on the environment's.

    def guess(task, episode, max_turns=4):
        for _ in range(max_turns):
            turn = episode.generate(max_tokens=3, stop=["\\n"])
            if turn.text.strip() == task.answer:
                return 1.0
            episode.append_text(" higher\\n" if ... else " lower\\n")
        return 0.0

It returns the reward (a float, or a dict of named components summed), or None to have
`taskset.reward` score the last turn's text. Tool and environment code that may hang or crash
goes through `episode.call(fn, *args)`, which runs it in the explorer's user-code pool with
`taskset.user_code.tool_timeout_s` (`rl_engine.rewards.isolation`). An episode that runs out of
context ends there (finish reason `truncated`); the workflow does not need to check.

`run_episodes` runs all episodes of an explorer step at once, one thread each. Their model calls
are batched: the engine is called when every running episode waits for the model (or has ended,
or has spent `episode_timeout_s` in its own code since the model last answered: it fails). Every
turn has its own seed, from the step's seed, the episode and the turn number, so an episode's
samples do not depend on which others shared a call. A workflow that raises fails its episode
only (returned as the error, the task named); an engine that dies fails the step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_engine.errors import UserError
from rl_engine.registry import WORKFLOWS, load_object

log = logging.getLogger(__name__)
_WAIT_S = 1.0  # how often a waiting episode thread wakes to see whether the step gave up on it


class ContextFull(Exception):
    """The episode has no room left in model.max_model_len; it ends as `truncated`."""


class EpisodeAbandoned(Exception):
    """The step stopped waiting for this episode (it timed out, or the engine failed)."""


@dataclass
class Turn:
    """One model turn: the sampled ids, their behavior logprobs, the text, how it ended."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # stop | length | repeat


@dataclass
class EpisodeResult:
    """One finished episode (or its error): what becomes one experience row."""

    index: int  # position in run_episodes' jobs
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # policy and environment tokens, in order
    logprobs: list[float] = field(default_factory=list)  # behavior logprob per token; 0.0 on environment tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 = the policy sampled it (trained), 0 = the environment's
    versions: list[int] = field(
        default_factory=list
    )  # weight version per token (the environment's: the version it answered)
    turns: int = 0  # model turns
    finish_reason: str = "stop"
    last_text: str = ""  # text of the last model turn (what taskset.reward scores when the workflow returns None)
    reward: Any = None  # the workflow's return value
    error: str | None = None  # why it failed (the workflow raised, or timed out)


class _Batcher:
    """Collects the episodes' model calls and makes one engine call when every running episode waits."""

    def __init__(
        self, engine: Any, keys: Sequence[int], timeout_s: float, on_timeout: Callable[[int], None] | None = None
    ):
        self.engine, self.timeout_s, self.on_timeout = engine, timeout_s, on_timeout
        self._cv = threading.Condition()
        self._running: dict[int, float] = {k: time.monotonic() for k in keys}  # key -> when its own code got control
        self._pending: dict[int, tuple[list[int], Any, int]] = {}
        self._answers: dict[int, Any] = {}
        self.timed_out: set[int] = set()
        self._failed: BaseException | None = None

    def ask(self, key: int, ids: list[int], sampling: Any, seed: int) -> Any:
        """From an episode's thread: one sample of `ids`; waits until the step's next engine call."""
        with self._cv:
            if key not in self._running:
                raise EpisodeAbandoned(f"episode {key} timed out or the step failed")
            self._pending[key] = (ids, sampling, seed)
            self._cv.notify_all()
            while key not in self._answers:
                if self._failed is not None or key not in self._running:
                    raise EpisodeAbandoned(f"episode {key}: the step stopped waiting for it")
                self._cv.wait(_WAIT_S)
            return self._answers.pop(key)

    def done(self, key: int) -> None:
        with self._cv:
            self._running.pop(key, None)
            self._cv.notify_all()

    def serve(self) -> None:
        """From the step's thread: engine calls until every episode has ended or timed out."""
        while True:
            with self._cv:
                while self._running and set(self._running) != set(self._pending):
                    now = time.monotonic()
                    busy = {k: t for k, t in self._running.items() if k not in self._pending}
                    late = [k for k, t in busy.items() if now - t > self.timeout_s]
                    for k in late:  # its own code ran too long: stop waiting for it
                        self._running.pop(k)
                        self.timed_out.add(k)
                        if self.on_timeout is not None:
                            self.on_timeout(k)
                    if not late:
                        self._cv.wait(min(_WAIT_S, max(0.01, min(busy.values()) + self.timeout_s - now)))
                if not self._running:
                    return
                batch, self._pending = self._pending, {}
            keys = sorted(batch)
            try:
                outs = self.engine.generate_each([batch[k] for k in keys])
            except BaseException as e:
                with self._cv:
                    self._failed = e
                    self._cv.notify_all()
                raise
            with self._cv:
                self._answers.update(zip(keys, outs))
                now = time.monotonic()
                for k in keys:  # their own code has control again from now on
                    self._running[k] = now
                self._cv.notify_all()


class Episode:
    """The handle a workflow drives: one episode's token sequence, grown turn by turn."""

    def __init__(
        self,
        result: EpisodeResult,
        job: EpisodeJob,
        batcher: _Batcher,
        sampling: Any,
        max_model_len: int,
        tokenizer: Any,
        pool: Any,
        tool_timeout_s: float,
        model: str,
    ):
        self._r, self._batcher, self._sampling, self._seed = result, batcher, sampling, job.seed
        self.prompt_text, self.tokenizer, self.model = job.prompt_text, tokenizer, model
        self._max_model_len, self._pool, self._tool_timeout_s = max_model_len, pool, tool_timeout_s
        self._version = batcher.engine.version  # what environment tokens before the first turn carry
        # The chat so far as the template sees it (model turns as their sampled text); None when no
        # chat template rendered the prompt.
        self.messages: list[dict[str, str]] | None = None if job.messages is None else [dict(m) for m in job.messages]

    # ---- what the workflow reads

    @property
    def prompt_ids(self) -> list[int]:
        return list(self._r.prompt_ids)

    @property
    def ids(self) -> list[int]:
        """Prompt and response ids so far."""
        return self._r.prompt_ids + self._r.response_ids

    @property
    def turns(self) -> int:
        return self._r.turns

    @property
    def last_text(self) -> str:
        return self._r.last_text

    @property
    def room(self) -> int:
        """Tokens left in model.max_model_len."""
        return self._max_model_len - len(self._r.prompt_ids) - len(self._r.response_ids)

    # ---- model turns

    def generate(self, max_tokens: int | None = None, stop: Sequence[str] | None = None) -> Turn:
        """One model turn from the ids so far; its tokens are trained (mask 1). `max_tokens` and
        `stop` override explorer.sampling's for this turn; the turn is capped by the room left."""
        if self.room < 1:
            raise ContextFull()
        budget = min(max_tokens or self._sampling.max_tokens, self.room)
        sampling = self._sampling.model_copy(
            update={"max_tokens": budget, **({"stop": list(stop)} if stop is not None else {})}
        )
        seed = derived_seed(self._seed, self._r.turns)
        out = self._batcher.ask(self._r.index, self.ids, sampling, seed)
        r = self._r
        r.response_ids += out.response_ids
        r.logprobs += out.logprobs
        r.loss_mask += [1] * len(out.response_ids)
        r.versions += [out.version] * len(out.response_ids)
        r.turns += 1
        r.finish_reason, r.last_text, self._version = out.finish_reason, out.text, out.version
        if self.messages is not None:
            self.messages.append(
                {"role": "assistant", "content": self.tokenizer.decode(out.response_ids, skip_special_tokens=True)}
            )
        if out.finish_reason == "length" and self.room < 1:
            raise ContextFull()
        return Turn(list(out.response_ids), list(out.logprobs), out.text, out.finish_reason)

    # ---- the environment's tokens (masked)

    def append_ids(self, ids: Sequence[int]) -> None:
        """Append environment token ids (not trained: mask 0). Past the context, the episode ends
        there as `truncated`, with what fitted."""
        ids = [int(i) for i in ids]
        fits = ids[: max(self.room, 0)]
        r = self._r
        r.response_ids += fits
        r.logprobs += [0.0] * len(fits)
        r.loss_mask += [0] * len(fits)
        r.versions += [self._version] * len(fits)
        if len(fits) < len(ids):
            raise ContextFull()

    def append_text(self, text: str) -> list[int]:
        """Append what the environment says as plain text (tokenised alone, no special tokens added)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.append_ids(ids)
        return ids

    def append_message(self, role: str, content: str) -> list[int]:
        """Append a chat message (e.g. the tool's or the user's reply) rendered by the model's chat
        template, only what is new; the template must be append-only (`rl_engine.rollout.chat`).
        The model's turns join `messages` as they are sampled."""
        from rl_engine.rollout.chat import chat_turn_ids

        if self.messages is None:
            raise UserError(
                f"episode.append_message: the prompt was not rendered by a chat template (taskset.template is set, or model {self.model!r} has none); "
                "append the environment's text with episode.append_text instead"
            )
        new = {"role": role, "content": content}
        ids = chat_turn_ids(self.tokenizer, self.messages, self.ids, [new], self.model, self._r.turns)
        self.append_ids(ids)
        self.messages.append(new)
        return ids

    # ---- tools

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a worker process of the user-code pool, bounded by
        taskset.user_code.tool_timeout_s (fn must be importable: a module-level function)."""
        if self._pool is None:
            return fn(*args, **kwargs)
        return self._pool.call(fn, *args, timeout_s=self._tool_timeout_s, **kwargs)


def derived_seed(*parts: int) -> int:
    """A sampling seed from `parts` (hashed: nearby parts give unrelated seeds), below 2**40."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 40)


@dataclass
class EpisodeJob:
    """One episode to run: the task, its rendered prompt, its seed."""

    task: Any
    prompt_text: str
    prompt_ids: list[int]
    seed: int
    messages: list[dict[str, str]] | None = None  # the chat the prompt renders, when a chat template rendered it


def run_episodes(
    engine: Any,
    workflow: Callable[..., Any],
    jobs: Sequence[EpisodeJob],
    sampling: Any,
    max_model_len: int,
    episode_timeout_s: float,
    pool: Any = None,
    tool_timeout_s: float = 30.0,
    model: str = "",
) -> list[EpisodeResult]:
    """Run every job's episode concurrently (model calls batched); results in job order.

    A failed episode has `error` set (the workflow raised, or its own code ran past
    `episode_timeout_s` between model calls); an engine failure raises."""
    results = [EpisodeResult(i, list(j.prompt_ids)) for i, j in enumerate(jobs)]

    def abandoned(i: int) -> None:  # said as it happens: the step may still wait on the others
        log.warning(
            "episode %d (task %s) abandoned: its workflow's own code ran past taskset.user_code.episode_timeout_s = %g s "
            "since the model last answered",
            i,
            jobs[i].task.task_id,
            episode_timeout_s,
        )

    batcher = _Batcher(engine, range(len(jobs)), episode_timeout_s, abandoned)

    def play(i: int) -> None:
        r, job = results[i], jobs[i]
        episode = Episode(r, job, batcher, sampling, max_model_len, engine.tokenizer, pool, tool_timeout_s, model)
        try:
            r.reward = workflow(job.task, episode)
        except ContextFull:
            r.finish_reason = "truncated"
        except EpisodeAbandoned:
            pass  # the step records why
        except Exception as e:  # noqa: BLE001 - a workflow's failure is its episode's, not the step's
            r.error = f"{type(e).__name__}: {e}"
        finally:
            batcher.done(i)

    threads = [threading.Thread(target=play, args=(i,), name=f"episode-{i}", daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    batcher.serve()
    for i in batcher.timed_out:
        # A copy: the abandoned thread may still append to the episode it holds.
        r = results[i]
        results[i] = dataclasses.replace(
            r,
            response_ids=list(r.response_ids),
            logprobs=list(r.logprobs),
            loss_mask=list(r.loss_mask),
            versions=list(r.versions),
        )
        results[
            i
        ].error = f"TimeoutError: the workflow's own code ran longer than taskset.user_code.episode_timeout_s = {episode_timeout_s:g} s between model calls"
    deadline = time.monotonic() + _WAIT_S  # one wait for them all: 64 stuck episodes must not cost 64 waits
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))  # ended or abandoned; a stuck one is left behind (daemon)
    return results


def import_workflow(spec: str, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """The workflow `package.module:name` as `fn(task, episode)`: a function (called with `kwargs`
    too), or a class, built once with `kwargs`, whose instances run an episode with
    `run(task, episode)` or `__call__(task, episode)`."""
    import functools
    import inspect

    obj = load_object(spec, "taskset.workflow.function")
    if inspect.isclass(obj):
        try:
            instance = obj(**kwargs)
        except TypeError as e:
            raise UserError(
                f"taskset.workflow.function = {spec!r}: cannot build the class with taskset.workflow.kwargs {sorted(kwargs)} ({e})"
            ) from None
        run = getattr(instance, "run", None) or (instance if callable(instance) else None)
        if run is None:
            raise UserError(
                f"taskset.workflow.function = {spec!r}: the class has neither run(task, episode) nor __call__(task, episode)"
            )
        return run
    if not callable(obj):
        raise UserError(f"taskset.workflow.function = {spec!r}: {spec.partition(':')[2]!r} is not a function or class")
    return functools.partial(obj, **kwargs)


def build_workflow(cfg: Any) -> Callable[..., Any] | None:
    """The workflow of a WorkflowConfig as `fn(task, episode)`; None for single_turn (the explorer's
    plain batched path). A built-in's parameters are its variant's fields; a user's (`type: python`,
    or a plugin's registered name) its `kwargs`."""
    if cfg.type == "single_turn":
        return None
    if WORKFLOWS.builtin(cfg.type):
        return import_workflow(WORKFLOWS.path(cfg.type), cfg.model_dump(exclude={"type"}))
    return import_workflow(cfg.function if cfg.type == "python" else WORKFLOWS.path(cfg.type), cfg.kwargs)

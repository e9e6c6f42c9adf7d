"""`reward: {type: judge}`: a generative model judges each response, asked through an
OpenAI-compatible endpoint (a vLLM server: `rft engine serve`, `vllm serve`; or a hosted API), or
served by the run itself on a vLLM engine of its own (`path`).

    reward: {type: judge, base_url: http://127.0.0.1:8100/v1, model: runs/models/judge,
             template: "Question: {prompt}\\nAnswer: {response}\\nReference: {answer}\\nCorrect (yes or no)?",
             parser: yes_no, api_key_env: null, concurrency: 8, timeout_s: 60}
    reward: {type: judge, path: runs/models/judge, max_model_len: 1024, kv_cache_space_gib: 1}

With `path`, the first step starts vLLM's OpenAI-compatible server for that model directory on a
free loopback port (`python -m rl_engine.rollout.server`: an explorer engine's settings, greedy
replies need no more), as a reward service (rl_engine.rewards.services): one per process and
setting, shared by the process's explorers, stopped by the last to close, at exit, or by itself
when this process dies. An engine that does not start fails the step's samples as a dead
endpoint does (below), and the next step tries again.

Each sample's `template` is filled with its `{prompt}`, `{response}` and `{answer}` (the task's
answer column; empty when it has none) and sent as one request: `/completions` with the text as
the prompt, or with `chat: true` `/chat/completions` with it as the one user message; greedy
(temperature 0), at most `max_tokens` tokens. The reply's text goes to the parser:

- `yes_no`: the first `yes` or `no` (a word, any case) is 1 or 0;
- `number`: the first number (`-3`, `0.75`) is the reward;
- `package.module:function`: `function(text) -> float | None`, imported and called in the
  explorer's process (a parser is trusted code, like a built-in: it is not run in the user-code
  pool), one that raises leaves that sample out (reward/errors);

`pattern`, when set, is a regular expression whose first group (or whole match) is what
yes_no or number read instead. A reply the parser finds nothing in (or a function returning None)
leaves its sample out, counted as reward/errors and reward/judge/unparsed.

The key, when the endpoint needs one, comes from the environment variable `api_key_env` names
(read when the reward is built; a missing variable fails preflight naming it) and is sent as a
bearer token; it is never in the config, a log line or an error message.

A step's samples are sent `concurrency` at a time (the server batches what arrives together);
each request must be answered within `timeout_s`. Once one times out, or the endpoint cannot be
reached or answers with an error, the requests not yet sent fail at once, so a step waits about
`timeout_s` for a broken judge, not once per sample. Failed samples follow `on_failure` as the
model reward's (rl_engine.rewards.reward_model): `failed_reward` hands them to
`taskset.user_code.failed_reward` (counted as reward/timeouts or reward/crashes), `fail` fails
the step naming the endpoint. Each step reports `reward/judge/...`: latency_ms (mean per
request), samples_per_s, failures, timeouts and unparsed.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl_engine.config.model import template_fields
from rl_engine.errors import UserError
from rl_engine.model_dir import require_model_dir
from rl_engine.proc.ports import free_port
from rl_engine.registry import load_object
from rl_engine.rewards.isolation import UserCodeCrashed, UserCodeTimeout
from rl_engine.rewards.remote import ServiceCalls, score_one
from rl_engine.rewards.services import SERVICES, Service, acquire_service, start_service

_PATTERNS = {"yes_no": r"\b(yes|no)\b", "number": r"-?\d+(?:\.\d+)?"}


def build_parser(parser: str, pattern: str | None) -> Callable[[str], float | None]:
    """The function from a reply's text to a reward (None: nothing found)."""
    if parser in _PATTERNS:
        regex = re.compile(pattern or _PATTERNS[parser], re.IGNORECASE)

        def parse(text: str) -> float | None:
            m = regex.search(text)
            if m is None:
                return None
            found = (m.group(1) if m.groups() else m.group(0)).strip().lower()
            if parser == "yes_no":
                return {"yes": 1.0, "no": 0.0}.get(found)
            try:
                return float(found)
            except ValueError:
                return None

        return parse
    fn = load_object(parser, "taskset.reward.parser")
    if not callable(fn):
        raise UserError(f"taskset.reward.parser = {parser!r}: it is a {type(fn).__name__}, not a function")
    return fn


class JudgeRewardFn:
    """The `judge` reward (see the module docstring); built from its config variant's fields."""

    def __init__(
        self,
        template: str,
        base_url: str | None = None,
        model: str | None = None,
        path: str | None = None,
        max_model_len: int = 1024,
        kv_cache_space_gib: float = 1.0,
        parser: str = "yes_no",
        pattern: str | None = None,
        chat: bool = False,
        max_tokens: int = 16,
        api_key_env: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 60.0,
        on_failure: str = "failed_reward",
    ):
        try:
            template_fields(template)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.parse = build_parser(parser, pattern)
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise UserError(
                f"taskset.reward.api_key_env = {api_key_env!r}: that environment variable is not set (or empty) in this process; "
                "export it where the run's explorers start, or set api_key_env: null for an endpoint without a key"
            )
        self.engine = None  # with path: the settings of its own engine (rl_engine.rollout.server's main)
        if path is not None:
            path = require_model_dir(path, "taskset.reward.path")
            self.engine = {"path": path, "max_model_len": max_model_len, "kv_cache_space_gib": kv_cache_space_gib}
            base_url, model = "", path  # vLLM serves the model under the name of its --model
        self.base_url, self.model, self.template, self.chat = str(base_url).rstrip("/"), model, template, chat
        self.max_tokens, self.concurrency, self.timeout_s = max_tokens, max(1, concurrency), float(timeout_s)
        self.api_key_env = api_key_env
        where = f"taskset.reward.base_url = {self.base_url!r}" if path is None else f"taskset.reward.path = {path!r}"
        self.calls = ServiceCalls(f"the judge at {where}", on_failure, timeout_s)
        self._service: Service | None = None
        self.describe = self.calls.describe  # how scoring's messages name this reward

    def __call__(self, prompt: str, response: str, task: Any, finish_reason: str = "stop") -> float:
        return score_one(self, prompt, response, task, finish_reason)

    def render(self, prompt: str, response: str, answer: Any) -> str:
        return self.template.format(prompt=prompt, response=response, answer="" if answer is None else answer)

    def score_samples(
        self, samples: Sequence[Any]
    ) -> tuple[list[tuple[float, dict[str, float]] | Exception], dict[str, Any]]:
        """(reward, components) or the exception of each (prompt, response, task, finish_reason)
        sample, in order, and the step's `reward/judge/...` metrics."""
        import httpx

        started = time.monotonic()
        texts = [self.render(s[0], s[1], getattr(s[2], "answer", None)) for s in samples]
        broken = threading.Event()
        first: list[Exception] = []
        latencies: list[float] = []
        headers = {"Authorization": f"Bearer {os.environ[self.api_key_env]}"} if self.api_key_env else {}

        def ask(client: httpx.Client, text: str) -> str | Exception:
            if broken.is_set():  # the judge already failed this step: do not wait on it again
                return first[0]
            sent = time.monotonic()
            try:
                reply = self._request(client, text)
            except (UserCodeTimeout, UserCodeCrashed) as e:
                if not broken.is_set():
                    first.append(e)
                    broken.set()
                return e
            latencies.append(1000 * (time.monotonic() - sent))
            return reply

        try:
            base = self._base_url()
        except UserCodeCrashed as e:  # its engine did not start: every sample fails with it
            base = ""
            first.append(e)
            broken.set()
        with (
            httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(self.timeout_s, connect=10.0)) as client,
            ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(texts))), thread_name_prefix="judge") as ex,
        ):
            replies = list(ex.map(lambda t: ask(client, t), texts))
        self.calls.check_failure(first[0] if first else None)
        outcomes: list[Any] = []
        unparsed = 0
        for reply in replies:
            if isinstance(reply, Exception):
                outcomes.append(reply)
                continue
            try:
                value = self.parse(reply)
                verdict = None if value is None else float(value)
            except Exception as e:  # noqa: BLE001 - a parser failing on one reply leaves that sample out
                outcomes.append(
                    ValueError(f"the parser failed on the judge's reply {reply[:200]!r}: {type(e).__name__}: {e}")
                )
                continue
            if verdict is None or not math.isfinite(verdict):
                unparsed += 1
                outcomes.append(ValueError(f"the judge's reply has no verdict the parser reads: {reply[:200]!r}"))
            else:
                outcomes.append((verdict, {}))
        wall = time.monotonic() - started
        failed = [r for r in replies if isinstance(r, Exception)]
        metrics = {
            "reward/judge/latency_ms": sum(latencies) / len(latencies) if latencies else float("nan"),
            "reward/judge/samples_per_s": (len(replies) - len(failed)) / wall if wall > 0 else float("nan"),
            "reward/judge/failures": sum(isinstance(r, UserCodeCrashed) for r in failed),
            "reward/judge/timeouts": sum(isinstance(r, UserCodeTimeout) for r in failed),
            "reward/judge/unparsed": unparsed,
        }
        return outcomes, metrics

    def _request(self, client: Any, text: str) -> str:
        """The reply's text; UserCodeTimeout past timeout_s, UserCodeCrashed when the endpoint
        cannot be reached or answers with an error."""

        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.chat:
            path, body["messages"] = "/chat/completions", [{"role": "user", "content": text}]
        else:
            path, body["prompt"] = "/completions", text
        r = self.calls.post(client, path, body)
        if r.status_code != 200:
            raise UserCodeCrashed(f"{self.calls.describe} answered HTTP {r.status_code}: {r.text[:300]}")
        try:
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if self.chat else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise UserCodeCrashed(
                f"{self.calls.describe} answered what is not a completion ({type(e).__name__}: {e})"
            ) from None

    def _base_url(self) -> str:
        """The endpoint's API root: base_url, or that of this process's engine of `path` (started
        if there is none); UserCodeCrashed when the engine cannot start."""
        if self.engine is None:
            return self.base_url
        self._service = acquire_service(self.engine, self._start_engine, self._service)
        return self._service.url + "/v1"

    def _start_engine(self) -> Service:
        # A process of its own that becomes vLLM's server (rl_engine.rollout.server's main: an
        # explorer engine's settings for the model), so stopping it stops the server.
        port = free_port()
        argv = [sys.executable, "-m", "rl_engine.rollout.server", json.dumps(self.engine), str(port)]
        return start_service(argv, self.calls.describe, port=port)

    def close(self) -> None:
        """Done with the judge: the last client of its own engine stops it."""
        if self._service is not None:
            svc, self._service = self._service, None
            SERVICES.release(svc)

    def __repr__(self) -> str:
        return f"JudgeRewardFn(base_url={self.base_url!r}, model={self.model!r})"

"""A scripted stand-in for `rl_engine.rollout.workflow.Episode`: the workflow tests drive the
built-in workflows with it, no engine.

Each scripted turn is what the model samples, as text: a turn that ends with one of the turn's
stop strings stops there (its ids keep the stop string, its text leaves it out, as vLLM does), one
that ends with "<EOS>" stops at EOS, any other is cut by the budget ("length"). The fake records
every generate (its max_tokens and stop), every environment append and every tool call, and
keeps the token mask an Episode would build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_engine.rollout.workflow import Turn
from rl_engine.tiny_model import build_tokenizer

EOS_MARK = "<EOS>"
_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = build_tokenizer()
    return _TOKENIZER


@dataclass
class FakeTask:
    task_id: str
    prompt: str
    answer: str
    row: dict


class FakeEpisode:
    def __init__(self, prompt: str, script: list[str]):
        self.tokenizer = tokenizer()
        self.script = list(script)
        self.prompt_text = prompt
        self.ids = list(self.tokenizer(prompt)["input_ids"])
        self.mask = [0] * len(self.ids)  # 1 = sampled (trained), 0 = prompt / environment
        self.events: list[
            tuple[str, Any]
        ] = []  # ("generate", (max_tokens, stop)), ("env", text), ("call", (fn name, args))
        self.last_text = ""
        self.turns = 0

    def generate(self, max_tokens=None, stop=None) -> Turn:
        self.events.append(("generate", (max_tokens, None if stop is None else list(stop))))
        if not self.script:
            raise AssertionError("the workflow asked for more turns than scripted")
        sampled = self.script.pop(0)
        eos = sampled.endswith(EOS_MARK)
        body = sampled.removesuffix(EOS_MARK)
        ids = list(self.tokenizer(body, add_special_tokens=False)["input_ids"]) + (
            [self.tokenizer.eos_token_id] if eos else []
        )
        hit = next((s for s in (stop or []) if body.endswith(s)), None)
        text = body[: len(body) - len(hit)] if hit else body
        finish = "stop" if eos or hit else "length"
        self.ids += ids
        self.mask += [1] * len(ids)
        self.last_text, self.turns = text, self.turns + 1
        return Turn(ids, [-1.0] * len(ids), text, finish)

    def append_text(self, text: str) -> list[int]:
        self.events.append(("env", text))
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.ids += ids
        self.mask += [0] * len(ids)
        return ids

    def call(self, fn, *args, **kwargs):
        self.events.append(("call", (fn.__name__, args)))
        return fn(*args, **kwargs)

    # ---- what the tests read

    def env_texts(self) -> list[str]:
        return [v for k, v in self.events if k == "env"]

    def stops(self) -> list:
        return [v[1] for k, v in self.events if k == "generate"]

    def trained_text(self) -> str:
        return self.tokenizer.decode([i for i, m in zip(self.ids, self.mask) if m])

    def masked_text(self) -> str:
        n = len(self.tokenizer(self.prompt_text)["input_ids"])
        return self.tokenizer.decode([i for i, m in zip(self.ids[n:], self.mask[n:]) if not m])

    def text(self) -> str:
        return self.tokenizer.decode(self.ids)

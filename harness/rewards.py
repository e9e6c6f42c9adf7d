"""Reward functions for tests whose model is too small to earn the task's own reward.

`response_length_parity` pays 1 for a response of an odd number of characters: a random tiny
model gets it about half the time, so groups of two differ about half the time (the mix a test of
dynamic sampling needs: some groups with signal, some without).

    taskset: {reward: {type: python, function: harness.rewards:response_length_parity}}
"""

from __future__ import annotations


def response_length_parity(prompt: str, response: str, task: dict) -> float:
    """1.0 when len(response) is odd, else 0.0."""
    return float(len(response) % 2)


def reply_length(text: str) -> float:
    """A judge parser (`taskset.reward.parser: harness.rewards:reply_length`) that always finds a
    verdict: the reply's length in characters (a random tiny model never says yes or no)."""
    return float(len(text))


def strict_verdict(text: str) -> float:
    """A judge parser that raises on anything but a bare yes or no (a parser's own failure)."""
    return {"yes": 1.0, "no": 0.0}[text.strip().strip(".").lower()]

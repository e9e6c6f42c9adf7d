"""Workflows the tests name by import path (taskset.workflow: {type: python, function: ...})."""

from __future__ import annotations


def tool_then_answer(task, episode, reply="=3\n"):
    """A turn, the environment's reply, the answer turn; taskset.reward scores the answer."""
    episode.generate(max_tokens=3)
    episode.append_text(reply)
    episode.generate(max_tokens=2)


def breaks_on_odd_tasks(task, episode):
    episode.generate(max_tokens=3)
    if int(task.task_id.rsplit("-", 1)[-1]) % 2:
        raise ValueError(f"the environment cannot handle {task.task_id}")
    return 1.0


class Game:
    """A class workflow: built once with the kwargs, `run` plays one episode."""

    def __init__(self, turns: int = 2):
        self.turns = turns

    def run(self, task, episode):
        for _ in range(self.turns):
            episode.generate(max_tokens=2)
            episode.append_message("user", "again")
        return {"played": float(self.turns)}

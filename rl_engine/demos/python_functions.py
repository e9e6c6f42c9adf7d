"""The `code` demo's task: write a small Python function, scored by running it against tests
(`reward: {type: code_tests}`, rl_engine.rewards.code_tests, in the sandbox).

Each problem is a family and a constant: "Write a Python function `add_7(x)` that returns x plus
7." Its row holds the prompt, the reference solution (`answer`), the tests (`tests`: four assert
statements, their inputs fixed per problem, their expected values the reference's) and the
function's name (`entry_point`):

    {"id": "pyfn-train-s0-000000", "question": "Write a Python function `add_7(x)` ...",
     "answer": "def add_7(x):\\n    return x + 7\\n", "tests": ["assert add_7(3) == 10", ...],
     "entry_point": "add_7"}

Held out: the problems (family, constant) are split by a fixed hash into a train part and a
held-out fifth; `split="heldout"` writes the held-out problems (each once, in a seeded order) and
no train task asks one of them.

    rft make-tasks runs/data/code-train.jsonl --task python-functions --n 2000
    rft make-tasks runs/data/code-heldout.jsonl --task python-functions --split heldout
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

from rl_engine.errors import UserError

PROMPT = "Write a Python function `{signature}` that {does}. Reply with only the code, in a ```python block."
TESTS_PER_TASK = 4
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class Family(NamedTuple):
    """One kind of problem: `name` and `does` are formatted with the constant `k`; `body` is the
    reference's return expression; `inputs(rng, k)` draws one call's arguments."""

    name: str
    params: str
    does: str
    body: str
    constants: tuple[Any, ...]
    inputs: Callable[[random.Random, Any], tuple[Any, ...]]


def _ints(rng: random.Random, _k: Any) -> tuple[Any, ...]:
    return (rng.randint(-20, 50),)


def _naturals(rng: random.Random, _k: Any) -> tuple[Any, ...]:
    return (rng.randint(0, 60),)


def _words(rng: random.Random, _k: Any) -> tuple[Any, ...]:
    return ("".join(rng.choice(_LETTERS[:8]) for _ in range(rng.randint(0, 7))),)


def _lists(rng: random.Random, _k: Any) -> tuple[Any, ...]:
    return ([rng.randint(-5, 30) for _ in range(rng.randint(0, 7))],)


FAMILIES = (
    Family("add_{k}", "x", "returns x plus {k}", "x + {k}", tuple(range(1, 31)), _ints),
    Family("times_{k}", "x", "returns x multiplied by {k}", "x * {k}", tuple(range(2, 21)), _ints),
    Family("mod_{k}", "x", "returns the remainder of x divided by {k}", "x % {k}", tuple(range(2, 21)), _naturals),
    Family(
        "is_multiple_of_{k}",
        "n",
        "returns True if n is divisible by {k}, else False",
        "n % {k} == 0",
        tuple(range(2, 21)),
        _naturals,
    ),
    Family("power_{k}", "x", "returns x raised to the power {k}", "x ** {k}", (2, 3, 4, 5), _ints),
    Family("at_most_{k}", "x", "returns the smaller of x and {k}", "min(x, {k})", tuple(range(21)), _ints),
    Family("repeat_{k}", "s", "returns the string s repeated {k} times", "s * {k}", tuple(range(2, 8)), _words),
    Family(
        "count_{k}",
        "s",
        "returns how many times the letter '{k}' occurs in the string s",
        "s.count({k!r})",
        tuple(_LETTERS[:8]),
        _words,
    ),
    Family(
        "remove_{k}",
        "s",
        "returns the string s with every letter '{k}' removed",
        "s.replace({k!r}, '')",
        tuple(_LETTERS[:8]),
        _words,
    ),
    Family(
        "ends_with_{k}",
        "s",
        "returns True if the string s ends with the letter '{k}', else False",
        "s.endswith({k!r})",
        tuple(_LETTERS[:8]),
        _words,
    ),
    Family(
        "first_{k}",
        "xs",
        "returns a list of the first {k} elements of the list xs",
        "xs[:{k}]",
        tuple(range(1, 6)),
        _lists,
    ),
    Family(
        "sum_above_{k}",
        "xs",
        "returns the sum of the numbers in the list xs that are greater than {k}",
        "sum(v for v in xs if v > {k})",
        tuple(range(16)),
        _lists,
    ),
    Family(
        "count_above_{k}",
        "xs",
        "returns how many numbers in the list xs are greater than {k}",
        "sum(1 for v in xs if v > {k})",
        tuple(range(16)),
        _lists,
    ),
)


class Problem(NamedTuple):
    family: Family
    k: Any

    @property
    def key(self) -> str:
        return f"{self.family.name.format(k='K')}:{self.k}"

    @property
    def name(self) -> str:
        return self.family.name.format(k=self.k)

    def reference(self) -> str:
        return f"def {self.name}({self.family.params}):\n    return {self.family.body.format(k=self.k)}\n"

    def row(self, task_id: str) -> dict[str, Any]:
        """The task row: prompt, reference, tests (expected values computed by the reference)."""
        source = self.reference()
        scope: dict[str, Any] = {}
        exec(compile(source, self.name, "exec"), scope)  # noqa: S102 - our own reference solution
        fn = scope[self.name]
        rng = random.Random(zlib.crc32(self.key.encode()))  # the same tests for the same problem, whatever the seed
        tests, seen = [], set()
        for _ in range(50):
            args = self.family.inputs(rng, self.k)
            if repr(args) in seen:
                continue
            seen.add(repr(args))
            tests.append(f"assert {self.name}({', '.join(map(repr, args))}) == {fn(*args)!r}")
            if len(tests) == TESTS_PER_TASK:
                break
        signature = f"{self.name}({self.family.params})"
        return {
            "id": task_id,
            "question": PROMPT.format(signature=signature, does=self.family.does.format(k=self.k)),
            "answer": source,
            "tests": tests,
            "entry_point": self.name,
        }


def is_heldout(problem: Problem) -> bool:
    """The fixed train / held-out split of the problems (a fifth held out)."""
    return zlib.crc32(problem.key.encode()) % 5 == 0


def problems(split: str) -> list[Problem]:
    want = split == "heldout"
    return [Problem(f, k) for f in FAMILIES for k in f.constants if is_heldout(Problem(f, k)) == want]


def make_python_functions_tasks(n: int | None = None, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """Rows {id, question, answer (the reference solution), tests, entry_point}: `n` train
    problems drawn with replacement (seeded; None: each train problem once, in a seeded order), or
    with `split="heldout"` the held-out problems, each once, in a seeded order (`n` caps how many)."""
    if split not in ("train", "heldout"):
        raise UserError(f"make-tasks: --split {split!r}: use train or heldout")
    if n is not None and n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    pool, rng = problems(split), random.Random(seed)
    if split == "heldout" or n is None:
        rng.shuffle(pool)
        picked = pool[:n] if n is not None else pool
    else:
        picked = [rng.choice(pool) for _ in range(n)]
    return [p.row(f"pyfn-{split}-s{seed}-{i:06d}") for i, p in enumerate(picked)]

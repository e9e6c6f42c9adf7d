"""The calculator workflow (issue 23): two-digit multiplications the model may hand to a tool.

The tiny byte-level model cannot multiply "37*58=" in its head, but it can copy: the tool call
is the question's expression between tags, and the answer is the tool's result copied back.
So a policy that calls the tool more often scores more, which is what RL should find.

Tasks are rows like the arithmetic ones (`question` / `answer`, TasksetConfig's default keys):

    {"id": "calc-train-s0-000000", "question": "37*58=", "answer": "2146"}

with a, b in MIN_OPERAND..MAX_OPERAND (10..99 by default: 8100 problems, products of 3 or 4
digits). Held out: the problems are split by a fixed hash of the unordered pair {a, b} (so
"37*58" and "58*37" fall on the same side) into a train part and a held-out tenth
(`is_heldout`); no train task ever asks a held-out problem, whatever the seed.

One episode (`calculator_workflow`), one character per token for the tiny model:

    37*58=<calc>37*58</calc>=2146\\n2146<EOS>
          |---- model ------||-env-||-model-|

Each model turn is generated with stop=["</calc>"] while tool calls are left. A turn that ended
at "</calc>" (its sampled ids end with those characters; vLLM leaves the stop string out of the
text but keeps its tokens) is a tool call: the expression is the text after the turn's last
"<calc>" (none: the tool says "error"), `calc` evaluates it in the user-code pool
(`episode.call`) and the environment appends "=" + result + "\\n" (masked from the loss). Any
other turn (EOS, or the token budget) is the answer. After `max_calls` tool calls the next turn
is generated without the stop string: it answers, whatever it writes. The workflow returns
None, so `taskset.reward` (type arithmetic: exact answer, plus the format bonus for only digits
ended by EOS) scores `episode.last_text`, which is then the answer turn's text only.

`calc(expr)` is the tool: integers, + - * and parentheses, parsed with `ast` (nothing is
evaluated as Python); anything else, or a result beyond 10^12, gives "error". It never raises.

    rft make-tasks runs/data/calc-train.jsonl --task calculator --n 4000 --seed 0
    rft make-tasks runs/data/calc-heldout.jsonl --task calculator --split heldout
    rft warmstart runs/models/tiny-calc-sft --task calculator
"""

from __future__ import annotations

import ast
import hashlib
import random
from typing import Any

from rl_engine.errors import UserError

MIN_OPERAND, MAX_OPERAND = 10, 99
CALL_START, CALL_END = "<calc>", "</calc>"
ERROR = "error"
MAX_EXPR_CHARS = 64  # longer expressions are refused before parsing
MAX_ABS = 10**12  # results (and intermediate values) beyond this are refused
HELDOUT_EVERY = 10  # one problem pair in ten is held out


# --------------------------------------------------------------------------- the tool


def calc(expr: str) -> str:
    """The value of an integer expression of + - * (unary +/- and parentheses too) as text, or
    "error" for anything else: names, calls, division, powers, floats, too long, too large.
    Runs in a worker process (`episode.call`); it never raises on the model's text."""
    try:
        if not isinstance(expr, str) or len(expr) > MAX_EXPR_CHARS:
            return ERROR
        tree = ast.parse(expr.strip(), mode="eval")
        return str(_value(tree.body))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError):
        return ERROR


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        v = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand)
        v = -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _value(node.left), _value(node.right)
        v = (
            left + right
            if isinstance(node.op, ast.Add)
            else left - right
            if isinstance(node.op, ast.Sub)
            else left * right
        )
    else:
        raise ValueError(f"not allowed: {type(node).__name__}")
    if abs(v) > MAX_ABS:
        raise ValueError("too large")
    return v


def tool_reply(result: str) -> str:
    """What the environment appends after a tool call's "</calc>"."""
    return f"={result}\n"


# --------------------------------------------------------------------------- the workflow


def ended_at(episode: Any, turn: Any, stop: str) -> bool:
    """The turn stopped at the stop string `stop`: its sampled ids (which keep the stop string's
    tokens, unlike its text) end with it."""
    if turn.finish_reason != "stop" or not turn.ids:
        return False
    sampled = episode.tokenizer.decode(turn.ids)
    return sampled.endswith(stop) or stop in sampled[len(turn.text) :]


def call_expression(text: str) -> str | None:
    """The expression of a tool-call turn: its text after the last "<calc>" (None without one)."""
    _, tag, expr = text.rpartition(CALL_START)
    return expr if tag else None


def calculator_workflow(task: Any, episode: Any, max_calls: int = 2) -> None:
    """One calculator episode (module doc): up to `max_calls` tool calls, then the answer turn;
    returns None (taskset.reward scores `episode.last_text`, the answer turn's text)."""
    calls = 0
    while True:
        can_call = calls < max_calls
        turn = episode.generate(stop=[CALL_END] if can_call else None)
        if not (can_call and ended_at(episode, turn, CALL_END)):
            return  # the answer turn
        expr = call_expression(turn.text)
        result = ERROR if expr is None else episode.call(calc, expr)
        calls += 1
        episode.append_text(tool_reply(result))


def calculator_transcript(a: int, b: int, use_tool: bool) -> list[tuple[str, bool]]:
    """The response of a good episode as (text, trained) segments, EOS not included: with the
    tool "<calc>a*b</calc>" (trained), "=ab\\n" (the environment's, masked), "ab" (trained); without
    it the bare product (trained). The warm start's SFT examples and its evaluation."""
    answer = str(a * b)
    if not use_tool:
        return [(answer, True)]
    return [(f"{CALL_START}{a}*{b}{CALL_END}", True), (tool_reply(answer), False), (answer, True)]


# --------------------------------------------------------------------------- tasks


def is_heldout(a: int, b: int) -> bool:
    """The fixed train / held-out split: a hash of the unordered pair, one pair in HELDOUT_EVERY."""
    lo, hi = sorted((a, b))
    digest = hashlib.blake2b(f"{lo}*{hi}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % HELDOUT_EVERY == 0


def calculator_problem(a: int, b: int) -> dict[str, str]:
    return {"question": f"{a}*{b}=", "answer": str(a * b)}


def calculator_problems(
    split: str = "train", min_operand: int = MIN_OPERAND, max_operand: int = MAX_OPERAND
) -> list[tuple[int, int]]:
    """Every (a, b) of `split` ("train", "heldout" or "all"), in a fixed order."""
    if split not in ("train", "heldout", "all"):
        raise UserError(f"make-tasks: --split {split!r}: use train or heldout")
    if not 0 <= min_operand <= max_operand:
        raise UserError(f"make-tasks: operands {min_operand}..{max_operand}: need 0 <= min <= max")
    pairs = [(a, b) for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)]
    return pairs if split == "all" else [p for p in pairs if is_heldout(*p) == (split == "heldout")]


def make_calculator_tasks(
    n: int | None = None,
    seed: int = 0,
    split: str = "train",
    min_operand: int = MIN_OPERAND,
    max_operand: int = MAX_OPERAND,
) -> list[dict[str, str]]:
    """Rows {id, question, answer}: `n` train problems drawn uniformly with replacement (seeded),
    or with `split="heldout"` the held-out problems, each once, in a seeded order (`n` caps how
    many). Same arguments, same rows."""
    if n is not None and n < 1:
        raise UserError(f"make-tasks: --n must be >= 1, got {n}")
    pool, rng = calculator_problems(split, min_operand, max_operand), random.Random(seed)
    if not pool:
        raise UserError(f"make-tasks: no {split} problems with operands {min_operand}..{max_operand}")
    if split == "heldout":
        rng.shuffle(pool)
        picked = pool[:n] if n is not None else pool
    else:
        picked = [rng.choice(pool) for _ in range(n if n is not None else 4000)]
    return [{"id": f"calc-{split}-s{seed}-{i:06d}", **calculator_problem(a, b)} for i, (a, b) in enumerate(picked)]


def write_calculator_taskset(
    path_or_url: str,
    n: int | None,
    seed: int = 0,
    split: str = "train",
    min_operand: int = MIN_OPERAND,
    max_operand: int = MAX_OPERAND,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Write `make_calculator_tasks(...)` as JSONL to a local path or fsspec URL; returns the row count."""
    from rl_engine.rewards.tasks import write_taskset

    rows = make_calculator_tasks(n, seed, split, min_operand, max_operand)
    write_taskset(path_or_url, rows, storage_options)
    return len(rows)

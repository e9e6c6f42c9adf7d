"""Features tested together: a seeded all-pairs covering array over the run's feature dimensions,
and each row as the `set` overrides that make its config (issue 42, item 6).

`covering_rows(DIMENSIONS, FORBIDDEN, SEED)` draws rows greedily (AETG-style: per row, a few
seeded candidates, each grown from an uncovered pair one dimension at a time by the value that
covers the most uncovered pairs; the best candidate is kept) until every pair of values of two
dimensions is in some row, except the `FORBIDDEN` pairs, which the config refuses; `invalid_rows`
adds one row per forbidden pair, which validation must refuse, naming the field.
`tests/flows/pairwise_rows.json` holds `matrix()`'s result (regenerate with
`python -m harness.pairwise > tests/flows/pairwise_rows.json`); a unit test compares the two.

`row_overrides(row, ctx)` turns a row into `set` overrides (`KEY=VALUE`, YAML values) applied on top
of a validated base config, as a flow run's `set` parameter and `rft run --set` apply them.
The `resume` dimension is no config field: it says what the test does with the run.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from harness.kill_resume import LORA
from harness.runs import PARTIAL

SEED = 42

DIMENSIONS: dict[str, list[str]] = {
    "mode": ["synchronous", "one_step_off_policy", "fully_async", "multi_explorer"],
    "sync": ["collective", "checkpoint", "checkpoint+delta"],
    "partial": ["off", "on"],
    "workflow": ["single_turn", "calculator", "python"],
    "preset": ["grpo", "gspo", "rloo"],
    "eval": ["off", "on"],
    "trackers": ["none", "all"],
    "placement": ["local", "deployments"],
    "storage": ["local", "s3"],
    "resume": ["none", "kill"],
    "lora": ["off", "on"],
}

# Pairs the config refuses, and the field its error must name.
FORBIDDEN: list[tuple[tuple[str, str], tuple[str, str], str]] = [
    (("partial", "on"), ("workflow", "calculator"), "explorer.partial.enabled"),
    (("partial", "on"), ("workflow", "python"), "explorer.partial.enabled"),
]

Pair = tuple[tuple[str, str], tuple[str, str]]


def _pair(a: tuple[str, str], b: tuple[str, str], order: list[str]) -> Pair:
    return (a, b) if order.index(a[0]) < order.index(b[0]) else (b, a)


def all_pairs(dims: dict[str, list[str]]) -> set[Pair]:
    """Every pair of values of two different dimensions."""
    names = list(dims)
    return {((x, u), (y, v)) for x, y in itertools.combinations(names, 2) for u in dims[x] for v in dims[y]}


def row_pairs(row: dict[str, str], dims: dict[str, list[str]]) -> set[Pair]:
    names = [n for n in dims if n in row]
    return {((x, row[x]), (y, row[y])) for x, y in itertools.combinations(names, 2)}


def covering_rows(
    dims: dict[str, list[str]], forbidden: list[Pair], seed: int, candidates: int = 20
) -> list[dict[str, str]]:
    """Rows (one value per dimension) holding every pair of `all_pairs(dims)` but the forbidden
    ones, none holding a forbidden pair; the same rows for the same arguments."""
    order = list(dims)
    banned = {_pair(a, b, order) for a, b in forbidden}
    uncovered = sorted(all_pairs(dims) - banned)
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while uncovered:
        left = set(uncovered)
        best, best_gain = None, -1
        for _ in range(candidates):
            (x, u), (y, v) = rng.choice(uncovered)
            row = {x: u, y: v}
            rest = [n for n in order if n not in row]
            rng.shuffle(rest)
            for name in rest:
                scored = []
                for value in dims[name]:
                    if any(_pair((name, value), (n, row[n]), order) in banned for n in row):
                        continue
                    gain = sum(_pair((name, value), (n, row[n]), order) in left for n in row)
                    scored.append((gain, rng.random(), value))
                row[name] = max(scored)[2]
            gain = len(row_pairs(row, dims) & left)
            if gain > best_gain:
                best, best_gain = row, gain
        assert best is not None
        best = {n: best[n] for n in order}
        rows.append(best)
        uncovered = [p for p in uncovered if p not in row_pairs(best, dims)]
    return rows


def invalid_rows(
    rows: list[dict[str, str]], forbidden: list[tuple[tuple[str, str], tuple[str, str], str]]
) -> list[dict[str, Any]]:
    """For each forbidden pair: the first row holding its first value, with the second put in; and the field its error names."""
    out = []
    for (x, u), (y, v), field in forbidden:
        base = next(r for r in rows if r[x] == u)
        out.append({"row": {**base, y: v}, "field": field})
    return out


def matrix() -> dict[str, Any]:
    """What tests/flows/pairwise_rows.json holds."""
    rows = covering_rows(DIMENSIONS, [(a, b) for a, b, _ in FORBIDDEN], SEED)
    return {"seed": SEED, "dimensions": DIMENSIONS, "rows": rows, "invalid": invalid_rows(rows, FORBIDDEN)}


# ---- a row as `set` overrides


# A user workflow (taskset.workflow type python): a turn, the environment's reply, the answer turn,
# which the task set's reward scores.
def tool_then_answer(task: Any, episode: Any) -> None:
    episode.generate(max_tokens=2)
    episode.append_text("=3\n")
    episode.generate(max_tokens=2)


def _y(value: Any) -> str:
    return json.dumps(value)  # JSON is YAML: what `--set key=VALUE` parses


def row_overrides(row: dict[str, str], ctx: dict[str, Any]) -> list[str]:
    """The `set` overrides of `row`. `ctx`: `tasks` (the task file, also the held-out set),
    `storage` (local root), `s3` ((url, storage options) or None), `mlflow_uri`."""
    sync = {
        "synchronous": ["synchronizer.mode=synchronous"],
        "one_step_off_policy": ["synchronizer.mode=one_step_off_policy", "synchronizer.sync_offset=1"],
        "fully_async": ["synchronizer.mode=fully_async", "synchronizer.max_staleness=1"],
        "multi_explorer": ["synchronizer.mode=multi_explorer", "synchronizer.max_staleness=3", "explorer.count=2"],
    }[row["mode"]]
    sync += {
        "collective": ["synchronizer.sync_method=collective"],
        "checkpoint": ["synchronizer.sync_method=checkpoint"],
        "checkpoint+delta": [
            "synchronizer.sync_method=checkpoint",
            "synchronizer.delta.enabled=true",
            "synchronizer.delta.full_every=2",
        ],
    }[row["sync"]]
    out = sync + [f"explorer.partial={_y(PARTIAL)}" if row["partial"] == "on" else "explorer.partial.enabled=false"]
    out += {
        "single_turn": ["taskset.workflow.type=single_turn"],
        "calculator": ["taskset.workflow.type=calculator", "explorer.sampling.max_tokens=3"],
        "python": [f"taskset.workflow={_y({'type': 'python', 'function': 'harness.pairwise:tool_then_answer'})}"],
    }[row["workflow"]]
    out.append(f"algorithm.preset={row['preset']}")
    if row["eval"] == "on":
        sets = [{"name": "heldout", "path": ctx["tasks"], "n": 2, "max_tasks": 4}]
        out += [f"eval.tasksets={_y(sets)}", f"eval.keep_best={_y({'metric': 'heldout/pass@1'})}"]
    else:
        out.append("eval.tasksets=[]")
    if row["trackers"] == "all":
        trackers = [
            "tensorboard",
            {"type": "mlflow", "tracking_uri": ctx["mlflow_uri"], "experiment": "pairwise"},
            {"type": "wandb", "mode": "offline", "project": "pairwise"},
        ]
        out.append(f"monitor.trackers={_y(trackers)}")
    else:
        out.append("monitor.trackers=[]")
    out.append(f"model.lora={_y(LORA)}" if row["lora"] == "on" else "model.lora=null")
    out.append(f"placement.type={row['placement']}")  # the discriminator alone, as a user changes it
    if row["storage"] == "s3":
        url, options = ctx["s3"]
        out += [f"buffer.storage.url={url}", f"buffer.storage.options={_y(options)}"]
    else:
        out.append(f"buffer.storage.url={ctx['storage']}")
    return out


if __name__ == "__main__":
    print(json.dumps(matrix(), indent=1))

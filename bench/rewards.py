"""Benchmark of the rewards beyond rules (issue 47): the code sandbox, the reward model service
and the judge.

    python -m bench.rewards [--quick] [--runs N] [--steps N] [--judge-pairs N] [--code-demo | --code-run DIR]

`sandbox_overhead_ms`: what the sandbox adds to one execution (rl_engine.rewards.sandbox: its own
PID, network, mount, IPC and UTS namespaces, a root of its own, no rights, rlimits, a clean
environment) over a bare `subprocess.run` of the same program with the same interpreter and flags
(`python -I -S main.py`, in a directory holding the same files): the median of each over --runs
executions, taken in turns, and their difference. The program is a code_tests run (the harness,
a 2-line solution, 4 asserts). The goal is <= 50 ms.

`sandbox_contained_fraction`: the hostile programs of harness/hostile_code.py (fork bomb,
infinite loop, memory bomb, a 10 GB file, filling the disk, reading a fake ~/.aws and a run's
config holding a fake secret (and the environment), a socket to a listener on 127.0.0.1, killing
this process, printing 1 GB), each scored by the code_tests reward (2 s timeout) and run alone in
its sandbox: contained when it scored 0, counted, within its bound, leaked nothing, connected
nowhere and this process lived. The goal is 1.0.

`rm_samples_per_s`: the model reward's service (rl_engine.rewards.reward_model) scoring the
(prompt, response) pairs of SmolLM2's word-arithmetic steps (configs/smollm2.yaml: 4 tasks x 8
samples = 32 pairs a step, responses of a sentence with the answer) with a 135M classifier: SmolLM2-135M
(runs/models/smollm2-135m) under AutoModelForSequenceClassification with a fresh random
one-score head (no trained reward model is on disk; the head does not change the cost), float32
on CPU, batch_size 16, rendered with its chat template. Service start-up is left out (a warm
step first). One explorer scores `--steps` steps in turn; then two explorers (threads of one
process, as under placement local) score theirs at once through the one shared service:
`rm_samples_per_s` and `rm_samples_per_s_2` are scored pairs per second of wall time,
`rm_step_s_1` and `rm_step_s_2` the median seconds one explorer step's scoring took, and
`rm_step_share_1`/`_2` that time's share of a step if added to bench.real's 18.7 s SmolLM2 step
(`REAL_STEP_S`, measured there, not here: an estimate, not a run); `rm_failed_1`/`_2` count
pairs not scored within the bench's 900 s timeout (0 unless the machine is far too busy). No goal
on CPU.

`judge_agreement`: SmolLM2-135M-Instruct as a judge (rl_engine.rewards.judge, `chat: true`, the
default yes/no template and parser) of its own greedy answers (at most 32 tokens, as
configs/smollm2.yaml) to `--judge-pairs` held-out word-arithmetic problems (320), both served by one
`rft engine serve` of runs/models/smollm2-135m: the fraction of the pairs on which the judge's
verdict is the exact rule reward's (`final_answer`: the last number of a response ended by a stop
is the answer), an unparsed verdict counting as a disagreement; `judge_confusion` is the
confusion matrix (rule correct / wrong x judge yes / no / unparsed) and `judge_s` the judging's
wall time. A measurement of the judge, not a goal. --quick leaves it out (it needs SmolLM2 and
a vLLM server, minutes on 2 cores).

`code_pass1_before` / `code_pass1_after`: the code demo's held-out pass@1 (greedy, one sample a
problem, the code_tests reward in its sandbox; `heldout/pass@1` of the run's evaluations) at
version 0 and at its last version, with --code-demo from `rft run configs/code.yaml` (30 steps,
~35 min on 2 cores), with --code-run DIR from that run made before; `code_steps` the run's
trainer steps, `code_heldout_tasks` its held-out problems, `code_run_s` the command's wall time
(null with --code-run). Null without either: learning is not required of a 135M model, the
machinery is (issue 47).

--quick: 10 executions per side instead of 40, and the reward model is the tests' tiny random
classifier (rl_engine.tiny_model.make_tiny_classifier, no chat template) over 2 steps; the
hostile cases are the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

from bench._report import emit_json, print_table, scratch_dir
from harness.hostile_code import ADD, CASES, TESTS, baited, contain
from rl_engine.config import JudgeReward
from rl_engine.rewards.code_tests import HARNESS, CodeTestsRewardFn
from rl_engine.rewards.sandbox import Sandbox, SandboxLimits, _python

HOSTILE_LIMITS = {"timeout_s": 2.0, "cpu_s": 2, "memory_mb": 256, "file_size_mb": 8, "disk_mb": 32}
SMOLLM2 = Path(__file__).resolve().parents[1] / "runs" / "models" / "smollm2-135m"
REAL_STEP_S = 18.7  # bench.real's SmolLM2 step on the 2-core dev machine (README, docs/guides/real-model.md)
STEP_PAIRS = 32  # configs/smollm2.yaml: explorer.batch_size 4 x algorithm.repeat_times 8


def overhead(runs: int) -> dict[str, float]:
    """Median ms per execution of the code_tests program in the sandbox and bare, and the difference."""
    files = {"main.py": HARNESS.format(tests=TESTS), "solution.py": ADD}
    box = Sandbox(SandboxLimits())
    bare_dir = scratch_dir("bench-rewards-bare-")
    for name, text in files.items():
        Path(bare_dir, name).write_text(text)
    sandboxed, bare = [], []
    box.run(files, "main.py")  # warm: the first run pays the probe and the page cache
    for _ in range(runs):
        started = time.perf_counter()
        result = box.run(files, "main.py")
        sandboxed.append(1000 * (time.perf_counter() - started))
        assert result.status == "ok" and result.results == [f"{i} 1" for i in range(len(TESTS))], result
        started = time.perf_counter()
        subprocess.run([_python(), "-I", "-S", "main.py"], cwd=bare_dir, check=True, capture_output=True)
        bare.append(1000 * (time.perf_counter() - started))
    s, b = statistics.median(sandboxed), statistics.median(bare)
    return {
        "sandbox_ms": s,
        "bare_ms": b,
        "overhead_ms": s - b,
        "isolation": box.isolation,
        "guarantees": box.guarantees(),
    }


def hostile() -> list[dict[str, object]]:
    """One row per hostile case: contained or not, wall seconds, what went wrong."""
    reward = CodeTestsRewardFn(workers=1, sandbox=HOSTILE_LIMITS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-rewards-bait-") as root, baited(Path(root)) as bait:
        names = ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "PREFECT_API_KEY")
        with mock.patch.dict(os.environ, dict.fromkeys(names, bait.secret)):  # the scorer's environment holds it too
            for name, case in CASES.items():
                v = contain(reward, case, bait)
                rows.append({"case": name, "contained": v.contained, "wall_s": round(v.wall_s, 2), "detail": v.detail})
    return rows


def classifier(out: Path, quick: bool) -> str:
    """A reward model directory: the tiny random classifier (quick), or SmolLM2-135M with a fresh one-score head."""
    if quick:
        from rl_engine.tiny_model import make_tiny_classifier

        return str(make_tiny_classifier(out))
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not (SMOLLM2 / "config.json").is_file():
        raise SystemExit(
            f"bench.rewards: no {SMOLLM2}; make it with `rft fetch-model smollm2-135m {SMOLLM2}`, or use --quick"
        )
    AutoModelForSequenceClassification.from_pretrained(SMOLLM2, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(SMOLLM2).save_pretrained(out)
    return str(out)


def step_samples(step: int, explorer: int) -> list:
    """One explorer step's (prompt, response) samples: word-arithmetic questions, 8 answers each."""
    from rl_engine.demos.word_arithmetic import make_word_arithmetic_tasks
    from rl_engine.rewards import RolloutSample, Task

    rows = make_word_arithmetic_tasks(STEP_PAIRS // 8, seed=1000 * explorer + step)
    return [
        RolloutSample(
            r["question"],
            f"Adding them gives {int(r['answer']) + k - 4}, so the answer is {int(r['answer']) + k - 4}.",
            Task(r["id"], r["question"], r["answer"], {}),
            "stop",
        )
        for r in rows
        for k in range(8)
    ]


def reward_model(quick: bool, steps: int) -> dict[str, float]:
    """Throughput and step time of the model reward's service with 1, then 2 explorers sharing it."""
    from rl_engine.rewards.reward_model import ModelRewardFn

    with tempfile.TemporaryDirectory(prefix="bench-rewards-rm-") as root:
        path = classifier(Path(root, "rm"), quick)
        # A generous timeout: this measures throughput, and a busy 2-core machine is slow.
        fns = [ModelRewardFn(path, batch_size=16, max_length=512, timeout_s=900) for _ in range(2)]
        try:
            fns[0].score_samples(step_samples(0, 0))  # start the service and warm it with a step: left out
            out: dict[str, float] = {}
            for n in (1, 2):
                times: list[float] = []
                failed = [0]
                lock = threading.Lock()

                def explore(i: int) -> None:
                    for e in range(1, steps + 1):
                        samples = step_samples(e, i)
                        started = time.perf_counter()
                        outcomes, _ = fns[i].score_samples(samples)
                        took = time.perf_counter() - started
                        with lock:
                            times.append(took)
                            failed[0] += sum(isinstance(o, Exception) for o in outcomes)

                started = time.perf_counter()
                threads = [threading.Thread(target=explore, args=(i,)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - started
                step_s = statistics.median(times)
                suffix = "" if n == 1 else "_2"
                out[f"rm_samples_per_s{suffix}"] = (n * steps * STEP_PAIRS - failed[0]) / wall
                out[f"rm_failed_{n}"] = failed[0]  # timed out or failed: 0 unless the machine is far too busy
                out[f"rm_step_s_{n}"] = step_s
                out[f"rm_step_share_{n}"] = step_s / (REAL_STEP_S + step_s)
            return out
        finally:
            for fn in fns:
                fn.close()


def judge_agreement(pairs: int, log_dir: Path) -> dict[str, object]:
    """SmolLM2 judging its own held-out answers against the exact rule reward (see the module docstring)."""
    import httpx
    import yaml

    from harness.engine_server import engine_server
    from rl_engine.demos.word_arithmetic import FinalAnswerRewardFn, make_word_arithmetic_tasks
    from rl_engine.rewards import Task
    from rl_engine.rewards.judge import JudgeRewardFn

    if not (SMOLLM2 / "config.json").is_file():
        raise SystemExit(f"bench.rewards: no {SMOLLM2}; make it with `rft fetch-model smollm2-135m {SMOLLM2}`")
    config = log_dir / "judge-engine.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(SMOLLM2), "max_model_len": 512},
                "taskset": {"path": "unused.jsonl"},
                "explorer": {"engine": {"kv_cache_space_gib": 1}},
            }
        )
    )
    rows = make_word_arithmetic_tasks(pairs, split="heldout")
    tasks = [Task(r["id"], r["question"], r["answer"], {}) for r in rows]
    with engine_server(config, log_dir) as srv, httpx.Client(timeout=600) as client:

        def answer(task: Task) -> tuple[str, str]:
            body = {"model": str(SMOLLM2), "messages": [{"role": "user", "content": task.prompt}], "max_tokens": 32}
            choice = client.post(f"{srv.url}/v1/chat/completions", json={**body, "temperature": 0.0}).json()["choices"][
                0
            ]
            return choice["message"]["content"], choice["finish_reason"]

        with ThreadPoolExecutor(16) as ex:
            answers = list(ex.map(answer, tasks))
        rule = FinalAnswerRewardFn(correct_weight=1.0, format_weight=0.0)
        correct = [rule(t.prompt, text, t, why)["final_answer"] == 1.0 for t, (text, why) in zip(tasks, answers)]
        judge = JudgeRewardFn(
            base_url=f"{srv.url}/v1", model=str(SMOLLM2), template=JudgeReward.model_fields["template"].default,
            chat=True, max_tokens=4, concurrency=16, timeout_s=600,
        )  # fmt: skip
        started = time.perf_counter()
        outcomes, _ = judge.score_samples([(t.prompt, text, t, why) for t, (text, why) in zip(tasks, answers)])
        judge_s = time.perf_counter() - started
    verdicts = ["unparsed" if isinstance(o, Exception) else ("yes" if o[0] == 1.0 else "no") for o in outcomes]
    confusion = {
        ("rule_correct" if c else "rule_wrong"): {
            v: sum(1 for ci, vi in zip(correct, verdicts) if ci == c and vi == v) for v in ("yes", "no", "unparsed")
        }
        for c in (True, False)
    }
    agree = sum(1 for c, v in zip(correct, verdicts) if (c and v == "yes") or (not c and v == "no"))
    return {
        "judge_agreement": agree / len(tasks),
        "judge_confusion": confusion,
        "judge_pairs": len(tasks),
        "judge_s": judge_s,
    }


CODE_KEYS = ("code_pass1_before", "code_pass1_after", "code_steps", "code_heldout_tasks", "code_run_s")


def code_demo(run_dir: str | None) -> dict[str, float | int | None]:
    """The code demo's held-out pass@1 at version 0 and at the run's last version: of `run_dir`, or
    of a fresh `rft run configs/code.yaml` when it is None (module docstring)."""
    import re
    import sys

    took = None
    if run_dir is None:
        repo = Path(__file__).resolve().parents[1]
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "cli.main", "run", "configs/code.yaml"], cwd=repo, capture_output=True, text=True
        )
        took = round(time.monotonic() - t0, 1)
        found = re.search(r"^run (\S+): engine and library logs", p.stdout, re.MULTILINE)
        if p.returncode != 0 or found is None:
            raise RuntimeError(
                f"rft run configs/code.yaml failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}"
            )
        run_dir = str(repo / found.group(1))
    from rl_engine.run.context import open_run
    from rl_engine.run.report import load_evaluations

    evals = load_evaluations(open_run(run_dir))
    if len(evals) < 2:
        raise RuntimeError(
            f"{run_dir}: {len(evals)} evaluations; a finished run of configs/code.yaml has one at its start and one at its end"
        )
    first, last = evals[0], evals[-1]
    print_table(
        [{"version": r["version"], "pass@1": r["heldout/pass@1"]} for r in evals],
        title=f"code demo ({run_dir}): held-out pass@1 over {int(first['heldout/tasks'])} problems",
    )
    return {
        "code_pass1_before": round(first["heldout/pass@1"], 4),
        "code_pass1_after": round(last["heldout/pass@1"], 4),
        "code_steps": last["version"],
        "code_heldout_tasks": int(first["heldout/tasks"]),
        "code_run_s": took,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 executions per side (default 40)")
    ap.add_argument("--runs", type=int, default=None, help="executions per side")
    ap.add_argument(
        "--steps", type=int, default=None, help="explorer steps the reward model scores (default 3; 2 with --quick)"
    )
    ap.add_argument(
        "--judge-pairs", type=int, default=320, help="held-out problems the judge judges (not with --quick)"
    )
    code = ap.add_mutually_exclusive_group()
    code.add_argument(
        "--code-demo",
        action="store_true",
        help="run `rft run configs/code.yaml` (~35 min) and report its held-out pass@1",
    )
    code.add_argument(
        "--code-run", default=None, help="report the held-out pass@1 of this finished run of configs/code.yaml"
    )
    a = ap.parse_args()
    coded = code_demo(a.code_run) if a.code_demo or a.code_run else {}
    runs = a.runs or (10 if a.quick else 40)
    o = overhead(runs)
    print_table(
        [{"side": "sandbox", "median_ms": o["sandbox_ms"]}, {"side": "bare subprocess.run", "median_ms": o["bare_ms"]}],
        title=f"one execution of a code_tests program, {runs} runs each (sandbox: {o['guarantees']})",
    )
    rows = hostile()
    print_table(rows, title="hostile programs (code_tests reward, 2 s timeout)")
    contained = sum(r["contained"] for r in rows) / len(rows)
    steps = a.steps or (2 if a.quick else 3)
    rm = reward_model(a.quick, steps)
    print_table(
        [
            {
                "explorers": n,
                "samples_per_s": rm[f"rm_samples_per_s{'' if n == 1 else '_2'}"],
                "step_s": rm[f"rm_step_s_{n}"],
                "share_of_step": rm[f"rm_step_share_{n}"],
            }
            for n in (1, 2)
        ],
        title=f"reward model service ({'tiny random classifier' if a.quick else 'SmolLM2-135M + a one-score head'}, {STEP_PAIRS} pairs a step, {steps} steps each)",
    )
    judged: dict[str, object] = {}
    if not a.quick:
        with tempfile.TemporaryDirectory(prefix="bench-rewards-judge-") as logs:
            judged = judge_agreement(a.judge_pairs, Path(logs))
        print_table(
            [{"rule": k, **v} for k, v in judged["judge_confusion"].items()],
            title=f"SmolLM2-135M-Instruct judging its {judged['judge_pairs']} held-out answers: agreement {judged['judge_agreement']:.3f}",
        )
    emit_json(
        {
            "sandbox_overhead_ms": round(o["overhead_ms"], 1),
            "sandbox_ms": round(o["sandbox_ms"], 1),
            "bare_ms": round(o["bare_ms"], 1),
            "sandbox_contained_fraction": contained,
            "sandbox_isolation": o["isolation"],
            "hostile_cases": len(rows),
            "runs": runs,
            **{k: round(v, 4) for k, v in rm.items()},
            "rm_model": "tiny" if a.quick else "smollm2-135m",
            "rm_steps": steps,
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in judged.items()},
            **{k: coded.get(k) for k in CODE_KEYS},
        }
    )


if __name__ == "__main__":
    main()

"""Faults report: how the pipeline meets bad input (and, as they land, killed runs and outages).

    python -m bench.faults --quick      # CI size: every bad input that needs no engine
    python -m bench.faults              # also the rows that start a real run (minutes)

Bad inputs: every row of the table in tests/rl_engine/test_bad_input.py (configs, model
directories, task sets, rewards, prompts, storage, resumes, buffer files, the command line), each
met the way a user meets it; a row is *clear* when it ends in a UserError (exit code 2 and no
traceback through `rft`) whose message names the problem and the fix, or in a counted, excluded
sample where the design says so, with every file stored before it unchanged.

Output: one table per section, then one JSON line. Sections are functions `(args) -> (rows,
summary)`; the JSON line merges their summaries. Keys so far: `bad_inputs` (rows tried),
`bad_inputs_clear` (rows clear), `bad_inputs_fixed` (rows that were not clear before issue 13).
Kill trials add a section with `kills`, `lost`, `duplicated`, `orphans`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from bench._report import emit_json, print_table

Section = Callable[[argparse.Namespace], tuple[list[dict[str, Any]], dict[str, Any]]]


def bad_inputs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every row of the bad-input table (`--quick`: those that start no engine)."""
    from rl_engine.tiny_model import make_tiny_model
    from tests.rl_engine.test_bad_input import CASES, Env, run_case

    cases = [c for c in CASES if not (args.quick and c.needs == "engine")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rft-faults-") as tmp, _S3() as s3:
        model = str(make_tiny_model(Path(tmp) / "model", seed=0))
        for i, case in enumerate(cases):
            case_dir = Path(tmp) / f"case-{i:02d}"
            case_dir.mkdir()
            out = run_case(case, Env(case_dir, model, s3=s3.start))
            rows.append({**{k: out[k] for k in ("area", "case", "outcome", "clear", "before")}, "message": _short(out["why"] or out["message"])})
    summary = {
        "bad_inputs": len(rows),
        "bad_inputs_clear": sum(r["clear"] for r in rows),
        "bad_inputs_fixed": sum(r["before"] == "fixed" for r in rows),
    }
    return rows, summary


def _short(text: str, width: int = 90) -> str:
    # Through `rft`, the message is stderr: its `error:` line, not the logs before it.
    text = next((line for line in reversed(text.splitlines()) if line.startswith("error: ")), text)
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


class _S3:
    """moto's S3 server on loopback, started on first use (the bucket rows), stopped at exit."""

    def __init__(self) -> None:
        self.server: Any = None
        self.value: tuple[str, dict[str, Any]] | None = None

    def start(self) -> tuple[str, dict[str, Any]]:
        if self.value is None:
            from moto.server import ThreadedMotoServer

            from tests.conftest import free_port

            for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
                os.environ.setdefault(k, v)
            port = free_port()
            self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            self.server.start()
            endpoint = f"http://127.0.0.1:{port}"
            self.value = (endpoint, {"client_kwargs": {"endpoint_url": endpoint}})
        return self.value

    def __enter__(self) -> "_S3":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            self.server.stop()


SECTIONS: list[tuple[str, Section]] = [
    ("bad inputs", bad_inputs),
    # ("kill trials", kill_trials),  # kills, lost, duplicated, orphans
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: skip what starts engines")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"quick": args.quick}
    for title, section in SECTIONS:
        rows, summary = section(args)
        print_table(rows, title=f"{title}: {summary}")
        print()
        result.update(summary)
    emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

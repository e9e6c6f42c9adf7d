"""`rft buffer stats RUN`: what a run's buffer holds, without the trainer.

Counts per explorer, per explorer step and per policy version (the oldest token version of an
experience), reward / length / finish-reason / segment-count summaries, files that are written
but not committed, corrupt files, and how far the trainer got: the newest committed trainer state
(`trainer_state/step=<t>/state.json`, what a resume loads) with the buffer cursor it holds, and a
cursor saved on its own under `buffer/cursor/` (`save_cursor`) where one exists. Only committed
files are counted, each checked against its commit record like the reader does.
With partial rollouts it also reads each explorer's continuation store (read only): pending
groups and generations (cut, or finished and waiting for their group), tokens so far, the oldest
pending segment's explorer step, the manifest URI, and a staged batch (outbox) with whether the
buffer already holds its commit.

    python -m rl_engine.buffer.stats runs/my-run
    python -m rl_engine.buffer.stats s3://bucket/runs/my-run --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:5000"}}'
    python -m rl_engine.buffer.stats runs/my-run --json

The files are plain Arrow IPC; other tools read them directly, e.g.
    pyarrow.dataset.dataset(committed_files(*open_storage(run)), format="arrow")    # committed only
    pyarrow.dataset.dataset(f"{run}/buffer", format="arrow", partitioning="hive",
                            ignore_prefixes=[".", "_", "cursor"])                   # every complete file
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

import numpy as np
import pyarrow.compute as pc

from rl_engine.buffer import _files
from rl_engine.buffer.continuations import UNFINISHED, ContinuationStore, store_explorer_ids
from rl_engine.buffer.cursor import ConsumedSet, list_cursor_steps, load_cursor
from rl_engine.errors import UserError
from rl_engine.storage import add_storage_options_arg, join, open_storage, parse_storage_options, read_json

# The committed trainer states, as rl_engine.run.state finds them (trainer_state/step=<t>/, whole
# once COMMITTED exists); named here because that module imports torch and this command does not.
_STATE_DIR, _STATE_COMMITTED = "trainer_state", "COMMITTED"


def committed_files(fs: Any, root: str) -> list[str]:
    """Paths (inside the run's filesystem) of all committed data files of the run at `root`, in commit order."""
    records = commit_records(fs, root)
    return [join(_files.buffer_root(root), r["path"]) for _, r in records]


def commit_records(fs, root: str) -> list[tuple[_files.CommitKey, dict[str, Any]]]:
    """Every commit record of the buffer under run root `root`, in commit order (one batched read)."""
    listed = _files.list_commits(fs, root)
    paths = [p for _, p in listed]
    raw = fs.cat(paths) if paths else {}  # one concurrent batch of GETs on object stores
    if isinstance(raw, bytes):  # fsspec returns bare bytes for a single path on some filesystems
        raw = {paths[0]: raw}
    by_name = {p.rsplit("/", 1)[-1]: v for p, v in raw.items()}
    return [(k, json.loads(by_name[k.name + ".json"])) for k, _ in listed]


def collect(run_url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """All statistics of a run's buffer as a JSON-able dict (what `--json` prints)."""
    fs, root = open_storage(run_url, storage_options)
    if not fs.exists(root):
        raise UserError(f"{run_url}: no such run directory")
    records = commit_records(fs, root)
    rows: dict[str, list[np.ndarray]] = {
        k: [] for k in ("explorer", "step", "version", "reward", "prompt_len", "response_len", "segments")
    }
    finish: Counter[str] = Counter()
    corrupt: list[str] = []
    for _, rec in records:
        path = join(_files.buffer_root(root), rec["path"])
        try:
            batch = _files.read_data(
                fs,
                path,
                size=rec["size"],
                checksum=_files.checksum_of(rec),
                uri=fs.unstrip_protocol(path),
                num_rows=rec["num_rows"],
            )
        except _files.CorruptFileError as e:
            corrupt.append(f"{e.path}: {e.reason}")  # the file and what is wrong; the run-time fix does not apply here
            continue
        t = batch.to_table()
        rows["explorer"].append(t.column("explorer_id").to_numpy())
        rows["step"].append(t.column("explorer_step").to_numpy())
        rows["version"].append(batch.min_versions())
        rows["reward"].append(t.column("reward").to_numpy())
        rows["prompt_len"].append(pc.list_value_length(t.column("prompt_ids")).to_numpy())
        rows["response_len"].append(pc.list_value_length(t.column("response_ids")).to_numpy())
        rows["segments"].append(t.column("num_segments").to_numpy())  # version-1 files: derived on read
        finish.update(t.column("finish_reason").to_pylist())
    cols = {k: np.concatenate(v) if v else np.zeros(0) for k, v in rows.items()}
    committed = {join(_files.buffer_root(root), r["path"]) for _, r in records}
    all_data = [p for p in _find(fs, _files.buffer_root(root)) if p.endswith(".arrow") and "/explorer=" in p]
    steps = Counter(zip(cols["explorer"].tolist(), cols["step"].tolist()))
    return {
        "run": run_url,
        "committed_files": len(records),
        "experiences": len(cols["reward"]),
        "corrupt_files": corrupt,
        "uncommitted_files": len([p for p in all_data if p not in committed]),
        "per_explorer": _per(cols["explorer"], cols["step"]),
        "per_step": [{"explorer": e, "step": s, "experiences": n} for (e, s), n in sorted(steps.items())],
        "per_version": {str(v): int(n) for v, n in sorted(Counter(cols["version"].tolist()).items())},
        "reward": _summary(cols["reward"]),
        "prompt_tokens": _summary(cols["prompt_len"]),
        "response_tokens": _summary(cols["response_len"]),
        "finish_reasons": dict(sorted(finish.items())),
        "num_segments": {str(n): int(c) for n, c in sorted(Counter(cols["segments"].tolist()).items())},
        "continuations": continuations(fs, root, last_committed(records)),
        "trainer_state": _trainer_state_summary(fs, root, records),
        "buffer_cursor": _cursor_summary(fs, root, records),
    }


def last_committed(records: list[tuple[_files.CommitKey, dict[str, Any]]]) -> dict[int, int]:
    """{explorer id: highest explorer step with a commit record} (where a resume starts: one past it)."""
    last: dict[int, int] = {}
    for _, rec in records:
        last[rec["explorer_id"]] = max(last.get(rec["explorer_id"], 0), rec["explorer_step"])
    return last


def continuations(fs: Any, root: str, last_steps: dict[int, int]) -> list[dict[str, Any]]:
    """Per explorer with a continuation store (none without partial rollouts): what it holds.

    `last_steps` is `last_committed(records)`. An outbox is `committed` at or below that step
    (a resume retires it), `staged` one above (a resume writes it as that step), `ahead` beyond
    (a resume refuses: buffer and store disagree), as rl_engine/roles/partial.py resumes.
    """
    out = []
    for i in store_explorer_ids(fs, root):
        store = ContinuationStore(fs, root, i)
        try:
            entries = store.list()
            t = store.load([e.id for e in entries if e.kind == "pending"]).to_table()  # no ids: an empty table
        except UserError as e:  # unreadable manifest, corrupt set: name it, the other explorers still show
            out.append({"explorer": i, "manifest": store.manifest_uri, "error": str(e)})
            continue
        last = last_steps.get(i, 0)
        cut = int(pc.sum(pc.equal(t.column("finish_reason"), UNFINISHED)).as_py() or 0)
        out.append(
            {
                "explorer": i,
                "manifest": store.manifest_uri,
                "pending_groups": len(set(t.column("group_id").to_pylist())),
                "pending_generations": len(t),
                "cut_generations": cut,
                "finished_waiting": len(t) - cut,
                "tokens": int(pc.sum(pc.list_value_length(t.column("response_ids"))).as_py() or 0),
                "oldest_segment_step": pc.min(
                    pc.struct_field(pc.list_flatten(t.column("segments")), "explorer_step")
                ).as_py(),
                "outbox": [
                    {
                        "explorer_step": e.explorer_step,
                        "experiences": e.num_rows,
                        "status": "committed"
                        if e.explorer_step <= last
                        else "staged"
                        if e.explorer_step == last + 1
                        else "ahead",
                    }
                    for e in entries
                    if e.kind == "outbox"
                ],
                "last_committed_step": last,
            }
        )
    return out


def _find(fs, path: str) -> list[str]:
    try:
        return fs.find(path)
    except FileNotFoundError:
        return []


def _per(explorer: np.ndarray, step: np.ndarray) -> list[dict[str, int]]:
    out = []
    for e in sorted(set(explorer.tolist())):
        s = step[explorer == e]
        out.append(
            {
                "explorer": int(e),
                "experiences": len(s),
                "steps": len(set(s.tolist())),
                "first_step": int(s.min()),
                "last_step": int(s.max()),
            }
        )
    return out


def _summary(x: np.ndarray) -> dict[str, float] | None:
    if not len(x):
        return None
    x = x.astype(np.float64)
    return {
        "mean": float(x.mean()),
        "std": float(x.std()),
        "min": float(x.min()),
        "p50": float(np.median(x)),
        "p90": float(np.percentile(x, 90)),
        "max": float(x.max()),
    }


def _trainer_state_summary(fs: Any, root: str, records) -> dict[str, Any] | None:
    """The newest committed trainer state: its step, version and what its buffer cursor consumed."""
    steps = [
        int(p.rsplit("step=", 1)[1].split("/")[0]) for p in fs.glob(join(root, _STATE_DIR, "step=*", _STATE_COMMITTED))
    ]
    if not steps:
        return None
    step = max(steps)
    meta = read_json(fs, join(root, _STATE_DIR, f"step={step}", "state.json"))
    cursor = meta.get("extra", {}).get("cursor")
    return {
        "trainer_step": step,
        "version": meta.get("version"),
        "path": f"{_STATE_DIR}/step={step}",
        **(_consumption(cursor, records) if cursor else {}),
    }


def _cursor_summary(fs: Any, root: str, records) -> dict[str, Any] | None:
    """The newest cursor saved on its own under buffer/cursor/ (`save_cursor`), or None."""
    steps = list_cursor_steps(fs, root)
    if not steps:
        return None
    return {"trainer_step": steps[-1], **_consumption(load_cursor(fs, root, steps[-1]) or {}, records)}


def _consumption(cursor: dict[str, Any], records) -> dict[str, int]:
    """A reader cursor's counters, and how many committed experiences it has not decided yet
    (neither consumed, dropped nor skipped: what a resume from it would still read)."""
    counters = cursor.get("counters", {})
    decided = ConsumedSet.from_json(cursor.get("consumed", {}))
    unread = sum(int((~decided.decided_rows(k, r["num_rows"])).sum()) for k, r in records)
    return {**{k: counters.get(k, 0) for k in ("consumed", "dropped_stale", "skipped_corrupt")}, "unread": unread}


def _consumed_line(c: dict[str, Any]) -> str:
    return (
        f"{c['consumed']} consumed, {c['dropped_stale']} dropped as stale, {c['skipped_corrupt']} corrupt files"
        f" skipped; {c['unread']} committed experiences not read yet"
    )


def render(s: dict[str, Any], max_steps: int = 20) -> str:
    """Human-readable text of `collect`'s dict."""
    out = [
        (
            f"{s['run']}/buffer: {s['experiences']} experiences in {s['committed_files']} committed files"
            f" ({len(s['corrupt_files'])} corrupt, {s['uncommitted_files']} written but not committed)"
        )
    ]
    out += [f"  corrupt: {c}" for c in s["corrupt_files"]]
    out.append("\nper explorer:\n  explorer  experiences  steps  first..last step")
    out += [
        f"  {p['explorer']:>8}  {p['experiences']:>11}  {p['steps']:>5}  {p['first_step']}..{p['last_step']}"
        for p in s["per_explorer"]
    ]
    shown = s["per_step"][-max_steps:]
    out.append(
        f"\nper step{f' (last {max_steps})' if len(s['per_step']) > max_steps else ''}:\n  explorer  step  experiences"
    )
    out += [f"  {p['explorer']:>8}  {p['step']:>4}  {p['experiences']:>11}" for p in shown]
    out.append("\nper generating version (oldest token version):\n  version  experiences")
    out += [f"  {v:>7}  {n:>11}" for v, n in s["per_version"].items()]
    out.append("")
    for name in ("reward", "prompt_tokens", "response_tokens"):
        m = s[name]
        if m:
            out.append(
                f"{name + ':':<17} mean {m['mean']:.4g}  std {m['std']:.4g}  min {m['min']:.4g}  p50 {m['p50']:.4g}  p90 {m['p90']:.4g}  max {m['max']:.4g}"
            )
    total = sum(s["finish_reasons"].values()) or 1
    out.append(
        "finish reasons:   " + "  ".join(f"{k} {n} ({100 * n / total:.0f}%)" for k, n in s["finish_reasons"].items())
    )
    total = sum(s["num_segments"].values()) or 1
    out.append(
        "num segments:     " + "  ".join(f"{k}: {n} ({100 * n / total:.0f}%)" for k, n in s["num_segments"].items())
    )
    t = s["trainer_state"]
    if t is None:
        out.append("trainer state:    none committed yet (a resume starts at the first step)")
    elif "consumed" in t:
        out.append(f"trainer state:    {t['path']} (version {t['version']}): {_consumed_line(t)}")
    else:
        out.append(f"trainer state:    {t['path']} (version {t['version']}): no buffer cursor in it")
    if c := s["buffer_cursor"]:  # a cursor saved on its own (save_cursor); the trainer resumes from its state above
        out.append(f"buffer cursor:    buffer/cursor/ step {c['trainer_step']}: {_consumed_line(c)}")
    out += _render_continuations(s["continuations"])
    return "\n".join(out)


_OUTBOX = {
    "committed": "committed to the buffer, outbox not retired yet (a crash between commit and retire; a resume retires it)",
    "staged": "staged, not committed to the buffer (a write in progress, or a crash between stage and commit; a resume writes it as step {step})",
    "ahead": "staged, but the buffer's last committed step of this explorer is {last}: a resume refuses (buffer and continuation store disagree)",
}


def _render_continuations(cs: list[dict[str, Any]]) -> list[str]:
    if not cs:
        return ["continuations:    none (no partial rollouts pending)"]
    out = ["\ncontinuations (partial rollouts pending):"]
    for c in cs:
        if "error" in c:
            out.append(f"  explorer {c['explorer']}: unreadable: {c['error']}")
            continue
        if c["pending_generations"]:
            out.append(
                f"  explorer {c['explorer']}: {c['pending_groups']} groups, {c['pending_generations']} generations ({c['cut_generations']} cut, "
                f"{c['finished_waiting']} finished and waiting for their group), {c['tokens']} tokens so far, oldest pending segment from step {c['oldest_segment_step']}"
            )
        else:
            out.append(f"  explorer {c['explorer']}: nothing pending")
        out.append(f"    manifest: {c['manifest']}")
        out += [
            f"    outbox: step {o['explorer_step']} ({o['experiences']} experiences) "
            + _OUTBOX[o["status"]].format(step=o["explorer_step"], last=c["last_committed_step"])
            for o in c["outbox"]
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft buffer stats", description="Summarize the experience buffer of a run.")
    ap.add_argument("run", help="Run directory URL: a local path, s3://bucket/prefix/run or memory://...")
    add_storage_options_arg(ap)
    ap.add_argument("--json", action="store_true", help="Print the statistics as one JSON object.")
    args = ap.parse_args(argv)
    try:
        s = collect(args.run, parse_storage_options(args.storage_options))
    except UserError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(s) if args.json else render(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())

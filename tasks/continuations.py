"""Prefect-side mirror of an explorer's pending continuations (partial rollouts).

After every explorer step with partial rollouts the groups it still holds (group, task, finished
members, segments, tokens so far, versions, age in steps) become a table artifact under a key
stable per run and explorer, `continuations-<run>-explorer-<i>`, so the UI shows their history
and a later flow run of the same run finds them by that key; a link artifact beside it points at
the store's manifest (`continuations/explorer=<i>/_manifest.json`), which stays the source of
truth (the table is for people).
"""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_link_artifact, create_table_artifact

from rl_engine.run.report import rounded
from tasks.report import log_step


def continuations_key(run_name: str, explorer_id: int) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    slug = "".join(c if c.isalnum() else "-" for c in run_name.lower()).strip("-")
    return f"continuations-{slug}-explorer-{explorer_id}"


def publish_continuations(m: dict[str, Any]) -> None:
    """Mirror the catalog an explorer step reported (`m['partial']['continuations']`), if any."""
    cat = (m.get("partial") or {}).get("continuations")
    if not cat or not cat.get("publish"):
        return
    key = continuations_key(cat["run"], m["explorer_id"])
    rows = cat["groups"] or [
        {
            "group": "",
            "task": "(none pending)",
            "finished": "",
            "segments": 0,
            "tokens": 0,
            "versions": [],
            "age_steps": 0,
        }
    ]
    create_table_artifact(
        [rounded({**r, "versions": ",".join(map(str, r["versions"]))}) for r in rows],
        key=key,
        description=f"Pending continuations of explorer {m['explorer_id']} of run {cat['run']} after explorer step {m['explorer_step']} ({len(cat['groups'])} groups). Manifest: {cat['manifest']}",
    )
    create_link_artifact(
        cat["manifest"],
        link_text="continuation manifest",
        key=f"{key}-manifest",
        description=f"Source of truth of {key}",
    )


def explorer_step_done(role: str, m: dict[str, Any]) -> dict[str, Any]:
    """The explorer's step callback in Prefect: a progress line, then the continuations' artifacts."""
    log_step(role, m)
    publish_continuations(m)
    return m

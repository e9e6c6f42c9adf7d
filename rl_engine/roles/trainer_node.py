"""`rft trainer-node RUN --node-rank i`: node i's trainer ranks of a run whose trainer spans
machines (trainer.nodes > 1), started on that machine once the run exists. It waits for the run's
config.yaml, reads the trainer's settings from it, and runs this node's ranks as the trainer role
runs node 0's (rl_engine.trainer.launch).

    rft trainer-node s3://my-bucket/runs/my-run --node-rank 1
    python -m rl_engine.roles.trainer_node RUN --node-rank 1
"""

from __future__ import annotations

import argparse

from rl_engine.board import poll_until
from rl_engine.errors import UserError
from rl_engine.run.context import CONFIG_FILE, open_run
from rl_engine.storage import add_storage_options_arg, join, open_storage, parse_storage_options
from rl_engine.trainer.launch import ranks_command, run_ranks


def main(argv: list[str] | None = None) -> int:
    """`rft trainer-node RUN --node-rank i`: node i's trainer ranks of a run whose trainer spans
    machines (trainer.nodes > 1), started on that machine once the run exists."""
    p = argparse.ArgumentParser(prog="rft trainer-node", description=main.__doc__.splitlines()[0])
    p.add_argument("run_url", help="the run's directory or URL (as the trainer role has it)")
    p.add_argument(
        "--node-rank",
        type=int,
        required=True,
        help="this machine's node, 1 .. trainer.nodes - 1 (node 0 is the trainer role's)",
    )
    add_storage_options_arg(p)
    p.add_argument(
        "--wait-s", type=float, default=600.0, help="how long to wait for the run to start (its config.yaml)"
    )
    a = p.parse_args(argv)
    options = parse_storage_options(a.storage_options)
    fs, root = open_storage(a.run_url, options)

    def no_run() -> UserError:
        return UserError(
            f"{a.run_url}: no run there after {a.wait_s:.0f} s (no config.yaml); start the run first (`rft run`), then its trainer nodes"
        )

    poll_until(
        lambda: fs.exists(join(root, CONFIG_FILE)),
        what="the run's config.yaml",
        timeout_s=a.wait_s,
        interval_s=1.0,
        timeout_error=no_run,
        between=fs.invalidate_cache,
    )
    t = open_run(a.run_url, options).cfg.trainer
    if not 0 < a.node_rank < t.nodes:
        raise UserError(
            f"--node-rank {a.node_rank}: the run's trainer spans trainer.nodes = {t.nodes} machines; give 1 .. {t.nodes - 1} (node 0 is the trainer role's)"
        )
    run_ranks(ranks_command(a.run_url, options, t.num_ranks, t.nodes, a.node_rank, t.rendezvous))
    return 0


if __name__ == "__main__":
    from rl_engine.errors import run_main

    run_main(main)

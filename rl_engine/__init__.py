"""The RFT engine: everything a run does, as plain Python; Prefect only orchestrates it (flows/, tasks/).

Where things live:

    roles/       the role loops: explorer, trainer role, partial rollouts, entry points, the plain loop
    run/         a run's lifecycle on storage: context, lease, preflight, lineage, retention, report, timeline
    board.py     the control board (JSON markers under <run>/control/) and its key schema
    buffer/      experiences as Arrow files: writer, reader, cursor, continuation store, stats
    rollout/     the vLLM rollout engine
    sync/        weight sync, trainer to explorers: collective broadcast and checkpoints (both sides, and their retention)
    trainer/     the DeepSpeed trainer, its checkpoints and ranks
    algorithms/  advantages and losses
    rewards/     task sets and reward functions
    config.py    one pydantic model per component; schedule.py the sync schedules; storage.py fsspec
    pruning.py   keep-last pruning of a run's numbered directories (trainer states, sync checkpoints)
    model_dir.py the one check that a path is a local Hugging Face model directory

Floors, bottom up: a module imports only from its own floor or below, and nothing imports in a
circle (tests/test_layering.py reads this list and checks every import, lazy ones included; a
name stands for a module or a whole package):

    0  errors conformance schedule tiny_model run.failpoints run.owner_watch run.reaper
    1  config experience
    2  storage model_dir
    3  board pruning run.lease run.timeline rewards algorithms
    4  buffer rollout
    5  run.storage_checks run.context
    6  trainer sync
    7  run.state run.retention run.lineage run.preflight run.report warmstart
    8  roles run.driver

Above rl_engine: tasks/ (thin Prefect tasks) -> flows/ (orchestration only) -> deployments/ and
cli/ (the `rft` command); bench/ may use any of them, never tests/ (harness/, the run harness tests
and bench share, is beside both).
"""

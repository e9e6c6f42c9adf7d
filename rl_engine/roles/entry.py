"""The roles of a run, explorer i and the trainer (and, under placement `deployments` with a model
reward, the reward role serving the run's reward service): each one plain loop behind one entry point.

A role is started with handles only: the run's URL (plus its non-secret storage options) and
its id. Its entry (a Prefect task, tasks/roles.py, or flow, flows/roles.py) opens the run once
(`open_run`: the resolved config from `<run>/config.yaml`, the run's filesystem and board) and
runs the role on that RunContext, which everything the role builds shares. The role reads
where to start from the run's `start` marker (posted by the run's driver,
`rl_engine.run.context.post_start`), builds its own engine, and meets the other roles only on
the run's storage (board, buffer, checkpoints) and in the weight-sync group. Stop requests,
failures and heartbeats travel on the board (`rl_engine.board`), so the same role runs as a
thread of the mode's flow run (placement `local`) or as its own flow run on another process or
machine (placement `deployments`). Prefect-free; the flows wrap these functions.

    post_start(run.board, ResumePoint(0, {0: 1}))        # the run's driver, once per attempt
    trainer_role(open_run("runs/my-run"))                # in one thread / process / machine
    explorer_role(open_run("runs/my-run"), 0)            # in another
    reward_role(open_run("runs/my-run"))                 # placement deployments, taskset.reward type model

The loops follow the modes' schedules (docs/concepts/modes.md): rendezvous (synchronous, one_step_off_policy: the
explorer syncs after step e iff e > m and (e - m) % k == 0, receiving version e - m) and
decoupled (fully_async, multi_explorer: the trainer publishes every k steps, explorers pick up
the newest between their steps and wait only when admission control says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rl_engine.board import STOP_KEY, RoleSignals, Stopped, restate_failure, role_name, running_roles
from rl_engine.config import RendezvousSync
from rl_engine.rewards.run_service import REWARD_ROLE, serve
from rl_engine.roles.evaluation import Evaluator, OnEval, save_due_weights
from rl_engine.roles.explorer import Explorer
from rl_engine.roles.trainer import TrainerRole
from rl_engine.run.context import ResumePoint, RunContext, read_start
from rl_engine.run.devices import device_plan
from rl_engine.run.lease import Fence, LeaseLost
from rl_engine.run.report import StepFeed, record_step
from rl_engine.schedule import decoupled_publish, resume_catch_up, resumed_rendezvous_syncs
from rl_engine.trainer.launch import RanksFailed, ranks_command, run_ranks

log = logging.getLogger(__name__)

# Roles that share a process (placement `local`) pass the GIL every 0.5 ms, not Python's 5 ms: an
# explorer's vLLM front end takes every model step's outputs and otherwise queues behind the
# trainer's Python (bench.partial, seed 0, one run each, quiet 2-core machine: explorer step
# 0.57 -> 0.48 s without partial rollouts, 0.32 -> 0.26 s with them; trainer step 0.63 -> 0.53 s;
# over 3 seeds the gain was within the run-to-run spread).
SHARED_PROCESS_SWITCH_INTERVAL_S = 0.0005
OnStep = Callable[[str, dict[str, Any]], Any]


@contextlib.contextmanager
def roles_share_process() -> Iterator[None]:
    """While several roles run as threads of this process: the shorter GIL switch interval."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(min(old, SHARED_PROCESS_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def role_names(num_explorers: int) -> list[str]:
    """Every role of a run: the trainer and explorer-0 .. explorer-(N-1)."""
    return [role_name()] + [role_name(i) for i in range(num_explorers)]


def watched_peers(name: str, num_explorers: int) -> list[str]:
    """The roles whose heartbeats role `name` watches: the trainer watches every explorer, an
    explorer the trainer. A silent explorer stops the run through the trainer's stop request,
    which every role sees; explorers watching each other too would read N x N markers a check."""
    return role_names(num_explorers)[1:] if name == role_name() else [role_name()]


@dataclasses.dataclass
class RoleResult:
    """What a role leaves behind: its step metrics, and the stop request that ended it early, if
    one did (kind `cancelled` or `failed`, with the reason naming who asked; None if it ran to
    the end of its schedule)."""

    metrics: list[dict[str, Any]]
    stopped_by: dict[str, Any] | None


class Role:
    """What every role does around its loop: liveness on the board, the stop signal, recording steps."""

    def __init__(self, run: RunContext, name: str, on_step: OnStep | None):
        cfg = run.cfg
        self.run, self.name, self.on_step = run, name, on_step
        self.board = run.board
        self.attempt, self.at, generation = read_start(self.board, cfg.synchronizer.wait_timeout_s)
        self.fence = Fence(*run.fs(), generation)  # checked before every commit of this role
        peers = watched_peers(name, cfg.explorer.count)
        p = cfg.placement
        self.stop = RoleSignals(self.board, name, peers, self.attempt, p.heartbeat_s, p.heartbeat_timeout_s)
        self.metrics: list[dict[str, Any]] = []

    def result(self) -> RoleResult:
        req = self.board.get(STOP_KEY) if self.stop.is_set() else None
        return RoleResult(self.metrics, req if req is not None and req.get("kind") != "finished" else None)

    def record(self, step: int, m: dict[str, Any]) -> None:
        record_step(self.run, self.name, step, m)
        self.metrics.append(m)
        if self.on_step is not None:
            self.on_step(self.name, m)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Run the loop: a stop request ends it quietly; a failure stops every other role first."""
        try:
            yield
        except Stopped:
            # The trainer's "finished" ends decoupled explorers wherever they wait: their schedule is done.
            req = self.board.get(STOP_KEY) or {}
            self.stop.close("done" if req.get("kind") == "finished" else "stopped")
        except LeaseLost:
            self.stop.detach()  # the run is a newer driver's now: no stop request, no final state on its board
            raise
        except BaseException as e:
            if self.stop.is_set():
                # Peers going away mid-exchange (a broadcast whose receivers left) is expected once the run stops.
                log.warning("%s ended during stop: %s: %s", self.name, type(e).__name__, e)
                self.stop.close("stopped", f"{type(e).__name__}: {e}")
                return
            error = f"{type(e).__name__}: {e}"
            self.stop.report_failure(error)
            self.stop.close("failed", error)
            raise
        else:
            self.stop.close("done")


def explorer_role(
    run: RunContext, explorer_id: int = 0, on_step: OnStep | None = None, on_eval: OnEval | None = None
) -> RoleResult:
    """Explorer `explorer_id` of `run` (opened by the role's entry), until its schedule ends or the
    run stops; explorer 0 also runs the held-out evaluations (`rl_engine.roles.evaluation`),
    passing each record to `on_eval`."""
    role = Role(run, role_name(explorer_id), on_step)
    with role.running():
        explorer = Explorer(run, explorer_id, role.stop, first_step=role.at.first_steps[explorer_id], fence=role.fence)
        evaluator = (
            Evaluator(run, explorer, role.at.trainer_version, on_eval)
            if explorer_id == 0 and run.cfg.eval.enabled
            else None
        )
        try:
            loop = _rendezvous_explorer if isinstance(run.cfg.synchronizer, RendezvousSync) else _decoupled_explorer
            try:
                loop(run, explorer, role, evaluator)
            except Stopped:
                if _stop_kind(role) != "finished":
                    raise
            if evaluator is not None and _stop_kind(role) in (None, "finished"):
                evaluator.finish(
                    run.cfg.synchronizer.wait_timeout_s, gone=lambda: _stop_kind(role) not in (None, "finished")
                )
        finally:
            explorer.close()
    return role.result()


def _stop_kind(role: Role) -> str | None:
    """The kind of the run's stop request (finished, cancelled, failed), or None while it runs on."""
    return (role.board.get(STOP_KEY) or {}).get("kind") if role.stop.is_set() else None


def trainer_role(run: RunContext, on_step: OnStep | None = None) -> RoleResult:
    """The trainer of `run` (opened by the role's entry), until `trainer.total_steps` or the run
    stops: in this process, or with `trainer.num_ranks` > 1 in torchrun's ranks, which this
    process watches (each rank opens the run itself: rl_engine.roles.trainer_rank)."""
    plan = device_plan(run.cfg)  # the devices this machine gives the trainer (none set: CPU, deployments)
    if run.cfg.trainer.num_ranks > 1:
        return _trainer_ranks(run, on_step, plan.trainer_env())
    return trainer_loop(run, on_step, plan.trainer_device() or 0)


def _trainer_ranks(run: RunContext, on_step: OnStep | None, env: dict[str, str]) -> RoleResult:
    """Start the trainer's ranks (rank 0 runs `trainer_loop`) with `env` (their devices), pass
    their recorded steps to `on_step` as they come, and turn a rank's failure into the run's stop request."""
    board = run.board
    steps = StepFeed(run, role_name(), on_step)
    try:
        t = run.cfg.trainer
        run_ranks(
            ranks_command(run.url, run.storage_options, t.num_ranks, t.nodes, 0, t.rendezvous),
            poll=steps.poll,
            poll_s=run.cfg.placement.heartbeat_s,
            env=env,
        )
    except RanksFailed as e:
        restate_failure(
            board, f"trainer failed: {e}", role_name()
        )  # torchrun's account of every rank over rank 0's own
        raise
    req = board.get(STOP_KEY)
    return RoleResult(steps.metrics, req if req is not None and req.get("kind") != "finished" else None)


def trainer_loop(run: RunContext, on_step: OnStep | None = None, local_device: int = 0) -> RoleResult:
    """The trainer role's loop in this process (trainer rank 0 when there are several, on its
    launcher's device; alone, on CUDA device `local_device`)."""
    role = Role(run, "trainer", on_step)
    with role.running():
        trainer = TrainerRole(run, resume=role.at.resumed, stop=role.stop, fence=role.fence, local_device=local_device)
        try:
            loop = _rendezvous_trainer if isinstance(run.cfg.synchronizer, RendezvousSync) else _decoupled_trainer
            try:
                loop(run, trainer, role)
            finally:
                if _stop_kind(role) == "cancelled":
                    _keep_what_was_trained(trainer)
            trainer.finish()
        finally:
            trainer.close()
        if trainer.version >= run.cfg.trainer.total_steps:
            role.stop.request_stop("finished", f"trainer reached version {trainer.version}")  # decoupled explorers end
    return role.result()


def reward_role(run: RunContext) -> RoleResult:
    """The reward role of `run` (placement deployments, a model reward; opened by the role's
    entry): the run's reward service (rl_engine.rewards.run_service.serve), up until the run has
    stopped and no explorer of this attempt still runs (explorer 0's last evaluation may score
    with it after the trainer's end; an explorer silent for placement.heartbeat_timeout_s is gone)."""
    role = Role(run, REWARD_ROLE, None)
    explorers = role_names(run.cfg.explorer.count)[1:]
    timeout_s = run.cfg.placement.heartbeat_timeout_s

    def done() -> bool:
        if not role.stop.is_set():
            return False  # no reads of the explorers' markers while the run goes on
        running = running_roles(role.board, explorers, role.attempt)
        return all(age > timeout_s for age in running.values())

    with role.running():
        serve(role.board, run.cfg.taskset.reward, done, before_post=role.fence.check)
    return role.result()


def _plan(run: RunContext, at: ResumePoint) -> dict[int, int]:
    s = run.cfg.synchronizer
    return resumed_rendezvous_syncs(
        run.cfg.trainer.total_steps, s.sync_interval, s.sync_offset, at.trainer_version, at.first_steps[0]
    )


def _catch_up(run: RunContext, at: ResumePoint) -> int:
    s = run.cfg.synchronizer
    return resume_catch_up(s.sync_interval, s.sync_offset, at.trainer_version, at.first_steps[0])


def _rendezvous_explorer(run: RunContext, explorer: Explorer, role: Role, evaluator: Evaluator | None) -> None:
    at, total, stop = role.at, run.cfg.trainer.total_steps, role.stop
    syncs, first = _plan(run, at), at.first_steps[0]
    if at.resumed and first <= total:
        explorer.receive(_catch_up(run, at), stop)  # the version the schedule gives the first step
    for e in range(first, total + 1):
        if evaluator is not None:
            evaluator.after_install()  # before the rollout: the engine holds exactly the version it names
        if stop.is_set():
            break
        role.record(e, explorer.step(e))
        if e in syncs:
            explorer.receive(syncs[e], stop)


def _decoupled_explorer(run: RunContext, explorer: Explorer, role: Role, evaluator: Evaluator | None) -> None:
    at, stop = role.at, role.stop
    e = at.first_steps[explorer.explorer_id]
    while True:
        if evaluator is not None:
            evaluator.catch_up()  # due versions it jumped past, from their saved weights; newer ones are picked up next
        explorer.pick_up_newest(e, stop)  # also after stop: a broadcast in flight needs every explorer
        if evaluator is not None:
            evaluator.after_install()
        if stop.is_set():
            break
        role.record(e, explorer.step(e))
        e += 1


def _rendezvous_trainer(run: RunContext, trainer: TrainerRole, role: Role) -> None:
    cfg, at, stop = run.cfg, role.at, role.stop
    sends = set(_plan(run, at).values())
    save_due_weights(run, trainer, at.trainer_version)  # resumed: the restart version, if due and not evaluated
    if at.resumed and at.first_steps[0] <= cfg.trainer.total_steps:
        sends.add(_catch_up(run, at))  # the resumed explorer waits for it before its first step
        if trainer.version in sends:
            trainer.publish(trainer.version, stop)
    while trainer.version < cfg.trainer.total_steps and not stop.is_set():
        role.record(
            trainer.version + 1,
            {**trainer.step(stop, announce=trainer.version + 1 in sends), "resumed_from": at.trainer_version},
        )
        save_due_weights(run, trainer, at.trainer_version)
        if trainer.version in sends:
            trainer.publish(trainer.version, stop)
        _save_due(trainer, cfg.trainer.checkpoint_interval, cfg.trainer.total_steps)


def _decoupled_trainer(run: RunContext, trainer: TrainerRole, role: Role) -> None:
    cfg, at, stop = run.cfg, role.at, role.stop
    save_due_weights(run, trainer, at.trainer_version)  # resumed: the restart version, if due and not evaluated
    if trainer.version > 0:  # explorers restart from the base model: offer them the restored weights
        # (never version 0: that is the base model, which no explorer takes as newer than its own,
        # so a send of it waits forever for them and holds back every later publish)
        trainer.publish(trainer.version, stop, wait_for_explorers=False)
    while trainer.version < cfg.trainer.total_steps and not stop.is_set():
        role.record(trainer.version + 1, {**trainer.step(stop), "resumed_from": at.trainer_version})
        save_due_weights(run, trainer, at.trainer_version)
        if decoupled_publish(trainer.version, cfg.synchronizer.sync_interval):
            trainer.publish(trainer.version, stop, wait_for_explorers=False)
        _save_due(trainer, cfg.trainer.checkpoint_interval, cfg.trainer.total_steps)


def _keep_what_was_trained(trainer: TrainerRole) -> None:
    """A cancelled run's trainer writes the resumable state of the version it reached, unless saved
    already (a cancel is graceful: its resume repeats no step), and that policy to `<run>/model/`,
    so the cancelled run's report links a model (a resumed run replaces it with its final one).
    A stop comes between steps (a step's batch is taken whole or not at all, and training is not
    interrupted), so the state is consistent. A failure to write is a warning: the cancel goes on."""
    if trainer.version == 0:
        return  # nothing trained: the base model is where it was
    try:
        if trainer.state_version < trainer.version:
            trainer.save_state()
        url = trainer.save_model()
        log.info("run cancelled: the policy at trainer version %d is in %s", trainer.version, url)
    except Exception as e:  # noqa: BLE001 - the run is stopping; the last saved state is what resume takes
        log.warning(
            "run cancelled: could not write the state or model at trainer version %d: %s: %s",
            trainer.version,
            type(e).__name__,
            e,
        )


def _save_due(trainer: TrainerRole, interval: int, total: int) -> None:
    """After a trainer step: resumable state every `interval` steps and at the end, and the
    trained model (`<run>/model/`) once the last step is done."""
    t = trainer.version
    if t % interval == 0 or t == total:
        trainer.save_state()
    if t == total:
        trainer.save_model()

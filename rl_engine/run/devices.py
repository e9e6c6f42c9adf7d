"""The device plan of a run: which GPUs each trainer rank and each explorer's vLLM engine get.

One function, `plan_devices`, says it for every placement, and every role applies what it says:

- `local` on a machine that shows GPUs: the roles share the machine, so the plan splits its
  devices: the trainer's ranks on this machine (trainer.num_ranks / trainer.nodes) take the first
  ones, the explorers' engines the rest, explorer.engine.tensor_parallel_size each, in order (or
  what `placement.devices` says). Where the rest is too small the engines wrap around the devices
  (colocated: fine for checkpoint sync, refused for collective). Applied: torchrun's ranks start
  with CUDA_VISIBLE_DEVICES = the trainer's devices (rank r on the r-th), a trainer that runs in
  this process trains on its device's index (LOCAL_RANK, rl_engine.trainer.dist), and each engine
  process starts with CUDA_VISIBLE_DEVICES = its devices (rl_engine.rollout.engine).
- `local` without a GPU: every role on the CPU (gloo); nothing is set.
- `deployments`: each role runs on the worker that serves its deployment, with the devices its
  job variables give it (`env: {CUDA_VISIBLE_DEVICES: ...}` under `trainer`, `explorer` or
  `explorer-<i>`); the plan reads them and sets nothing (the worker already did). A role without
  one uses what its worker's machine shows.

`check_plan` refuses, before any engine starts (preflight, `rft validate`), what NCCL or vLLM
would refuse later: two members of one collective group on one device (the DeepSpeed ranks of
the trainer; under collective sync the trainer's rank 0 with every engine's workers), more
trainer ranks than devices, an engine with fewer devices than its tensor parallel size. Under
`deployments` roles are only compared with themselves: which roles share a machine is the work
pools' business, which a config cannot see.

    plan = device_plan(cfg)                     # this machine's visible GPUs
    check_plan(plan, cfg.synchronizer.sync_method)
    print(plan.describe())                      # `rft validate`
    plan.engine_visible(0)                      # "2": CUDA_VISIBLE_DEVICES of explorer 0's engine
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rl_engine.config import DeploymentsPlacement, ExplorerConfig, PlacementConfig, RFTConfig, TrainerConfig
from rl_engine.errors import UserError

PLAN_FILE = "devices.json"  # beside config.yaml: the plan of the run's latest attempt
VISIBLE = "CUDA_VISIBLE_DEVICES"
Device = (
    int | str
)  # a visible device index (local), or a CUDA_VISIBLE_DEVICES entry from job variables (an index, a UUID, a MIG id)


class DevicePlan(BaseModel):
    """Devices per role. `None` for a role: nothing assigned (the CPU under local placement; what
    its worker's machine shows under deployments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    placement: Literal["local", "deployments"] = Field(description="The run's placement.type.")
    visible: int | None = Field(
        description="GPUs this machine shows (local; 0: CPU); null under deployments, where each role has its worker's machine."
    )
    source: str = Field(
        description="Where the devices come from: `cpu`, `split` (trainer first, explorers the rest), `placement.devices` or `job_variables`."
    )
    trainer_ranks: int = Field(
        ge=1, description="The trainer's ranks on its (first) machine: trainer.num_ranks / trainer.nodes."
    )
    tensor_parallel_size: int = Field(
        ge=1, description="explorer.engine.tensor_parallel_size: devices each engine needs."
    )
    trainer: list[Device] | None = Field(description="The trainer's devices: rank r on trainer[r].")
    explorers: list[list[Device] | None] = Field(
        description="Each explorer's engine devices: explorer i on explorers[i]."
    )

    @property
    def assigns(self) -> bool:
        """Whether this process sets the devices (local placement with GPUs); under deployments the workers do."""
        return self.placement == "local" and bool(self.visible)

    def trainer_env(self) -> dict[str, str]:
        """Environment for the trainer's torchrun: its devices, rank r on the r-th ({} when nothing is assigned)."""
        return {VISIBLE: cuda_visible(self.trainer)} if self.assigns and self.trainer else {}

    def trainer_device(self) -> int | None:
        """Device index of a trainer that runs alone in this process (one rank); None: the default, device 0."""
        return int(self.trainer[0]) if self.assigns and self.trainer else None

    def engine_visible(self, explorer_id: int) -> str | None:
        """CUDA_VISIBLE_DEVICES of explorer `explorer_id`'s engine processes; None: inherit this process's."""
        devs = self.explorers[explorer_id] if explorer_id < len(self.explorers) else None
        return cuda_visible(devs) if self.assigns and devs else None

    def describe(self) -> str:
        """One line for people: `devices: ...` (rft validate, the run's log)."""
        if self.placement == "local" and not self.visible:
            return f"devices: no GPU visible, every role on the CPU (gloo): trainer {self.trainer_ranks} rank(s), {len(self.explorers)} explorer engine(s)"
        head = (
            f"devices ({self.placement}, {self.visible} GPU(s) visible, {self.source})"
            if self.placement == "local"
            else "devices (deployments, each role's own worker machine)"
        )
        unit = "GPU" if self.placement == "local" else f"{VISIBLE}="
        ranks = "trainer rank 0" if self.trainer_ranks == 1 else f"trainer ranks 0-{self.trainer_ranks - 1}"
        roles = [f"{ranks} on {_shown(self.trainer, unit)}"]
        roles += [
            f"explorer {i} (tensor parallel {self.tensor_parallel_size}) on {_shown(d, unit)}"
            for i, d in enumerate(self.explorers)
        ]
        used = {d for devs in [self.trainer or [], *[e or [] for e in self.explorers]] for d in devs}
        idle = [d for d in range(self.visible or 0) if d not in used]
        return f"{head}: " + "; ".join(roles) + (f"; unused: GPU {','.join(map(str, idle))}" if idle else "")


def _shown(devices: list[Device] | None, unit: str) -> str:
    if devices is None:
        return "what its worker shows"
    return f"{unit}{','.join(map(str, devices))}" if unit.endswith("=") else f"{unit} {','.join(map(str, devices))}"


# --------------------------------------------------------------------------- the plan


def plan_devices(
    placement: PlacementConfig, trainer: TrainerConfig, explorer: ExplorerConfig, visible: int
) -> DevicePlan:
    """The plan for `visible` GPUs on this machine (the count matters under local placement only)."""
    ranks, tp, count = trainer.num_ranks // trainer.nodes, explorer.engine.tensor_parallel_size, explorer.count
    common = dict(trainer_ranks=ranks, tensor_parallel_size=tp)
    if isinstance(placement, DeploymentsPlacement):
        jv = placement.job_variables
        explorers = [_job_devices(jv, f"explorer-{i}" if f"explorer-{i}" in jv else "explorer") for i in range(count)]
        return DevicePlan(
            placement="deployments",
            visible=None,
            source="job_variables",
            trainer=_job_devices(jv, "trainer"),
            explorers=explorers,
            **common,
        )
    if visible <= 0:
        return DevicePlan(placement="local", visible=0, source="cpu", trainer=None, explorers=[None] * count, **common)
    if placement.devices is not None:
        for field, devs in [("trainer", placement.devices.trainer)] + [
            (f"explorers[{i}]", d) for i, d in enumerate(placement.devices.explorers)
        ]:
            if max(devs) >= visible:
                raise UserError(
                    f"placement.devices.{field} names GPU {max(devs)}, but this machine shows {visible} GPU(s) (0..{visible - 1}); "
                    f"give indices below {visible}, or set placement.devices to null for the default split"
                )
        d = placement.devices
        return DevicePlan(
            placement="local",
            visible=visible,
            source="placement.devices",
            trainer=list(d.trainer),
            explorers=[list(e) for e in d.explorers],
            **common,
        )
    return DevicePlan(
        placement="local",
        visible=visible,
        source="split",
        trainer=list(range(ranks)),
        explorers=_split_engines(ranks, tp, count, visible),
        **common,
    )


def _split_engines(ranks: int, tp: int, count: int, visible: int) -> list[list[Device] | None]:
    """Engines on the devices after the trainer's, tp each, in order; where those are fewer than
    one engine needs, on all the machine's devices (colocated with the trainer), wrapping around."""
    rest = list(range(ranks, visible))
    pool = rest if len(rest) >= tp else list(range(visible))
    return [[pool[(i * tp + j) % len(pool)] for j in range(tp)] for i in range(count)]


def _job_devices(job_variables: dict[str, dict[str, Any]], key: str) -> list[Device] | None:
    """The devices `job_variables[key].env.CUDA_VISIBLE_DEVICES` lists, or None where it sets none."""
    env = (job_variables.get(key) or {}).get("env") or {}
    if VISIBLE not in env:
        return None
    entries = [e.strip() for e in str(env[VISIBLE]).split(",") if e.strip()]
    return [int(e) if e.isdigit() else e for e in entries]


def device_plan(cfg: RFTConfig, visible: int | None = None) -> DevicePlan:
    """The plan of `cfg` on this machine (`visible` GPUs; default: what torch sees here)."""
    return plan_devices(cfg.placement, cfg.trainer, cfg.explorer, visible_gpus() if visible is None else visible)


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without CUDA). torch counts them through NVML where it
    can, which leaves CUDA unstarted, so vLLM may still fork its engine processes from this one."""
    import torch

    return torch.cuda.device_count()


def cuda_visible(devices: list[Device]) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that should see `devices` (this process's visible
    indices): through this process's own CUDA_VISIBLE_DEVICES where it has one."""
    mine = [e.strip() for e in os.environ.get(VISIBLE, "").split(",") if e.strip()] if os.environ.get(VISIBLE) else None
    return ",".join(mine[d] if mine is not None and isinstance(d, int) and d < len(mine) else str(d) for d in devices)


# --------------------------------------------------------------------------- what NCCL and vLLM refuse


def check_plan(plan: DevicePlan, sync_method: str) -> None:
    """Raise UserError for what the plan's devices cannot run, naming the fix."""
    if plan.placement == "local" and not plan.visible:
        return  # CPU: gloo takes any number of ranks per device
    _check_trainer(plan)
    for i, devs in enumerate(plan.explorers):
        _check_engine(plan, i, devs)
    if sync_method == "collective" and plan.placement == "local":
        _check_sync_group(plan)


def _where(plan: DevicePlan, role: str) -> str:
    """The field that sets a role's devices: what a message tells the user to change."""
    if plan.placement == "deployments":
        key = "trainer" if role == "trainer" else f"{role} (or explorer)"
        return f"placement.job_variables.{key}.env.{VISIBLE}"
    return "placement.devices." + ("trainer" if role == "trainer" else f"explorers[{role.split('-')[1]}]")


def _check_trainer(plan: DevicePlan) -> None:
    devs, ranks = plan.trainer, plan.trainer_ranks
    if plan.placement == "local" and ranks > plan.visible:
        raise UserError(
            f"trainer.num_ranks = {ranks} but this machine shows {plan.visible} GPU(s): the trainer runs one rank per GPU (NCCL refuses two ranks of one group "
            f"on one device); lower trainer.num_ranks to at most {plan.visible}, or spread the ranks over machines (trainer.nodes, `rft trainer-node`)"
        )
    if not devs:
        return
    if len(devs) < ranks:
        raise UserError(
            f"{_where(plan, 'trainer')} = {','.join(map(str, devs))} gives the trainer {len(devs)} device(s) for its {ranks} rank(s) on that machine "
            f"(trainer.num_ranks / trainer.nodes): the trainer runs one rank per GPU; list {ranks} devices, or lower trainer.num_ranks"
        )
    shared = _first_repeat(devs[:ranks])
    if shared is not None:
        raise UserError(
            f"{_where(plan, 'trainer')} gives two trainer ranks GPU {shared}: NCCL refuses two ranks of one group on one device; give each rank its own GPU"
        )


def _check_engine(plan: DevicePlan, i: int, devs: list[Device] | None) -> None:
    tp = plan.tensor_parallel_size
    if not devs:
        return  # nothing assigned, or CUDA_VISIBLE_DEVICES="" (a CPU worker)
    if len(set(devs)) < tp:
        what = (
            f"this machine shows {plan.visible} GPU(s)"
            if plan.source == "split"
            else f"{_where(plan, f'explorer-{i}')} gives it {','.join(map(str, devs))}"
        )
        raise UserError(
            f"explorer.engine.tensor_parallel_size = {tp}, but explorer {i}'s engine gets {len(set(devs))} distinct device(s) ({what}): vLLM runs one tensor "
            f"parallel worker per GPU; give the engine {tp} GPUs, or lower explorer.engine.tensor_parallel_size to {max(1, len(set(devs)))}"
        )


def _check_sync_group(plan: DevicePlan) -> None:
    """Collective sync: trainer rank 0 and every engine's workers form one NCCL group; no two members on one device."""
    members = [("the trainer's rank 0", plan.trainer[0])] + [
        (f"explorer {i}'s engine", d) for i, devs in enumerate(plan.explorers) for d in dict.fromkeys(devs or [])
    ]
    seen: dict[Device, str] = {}
    for who, d in members:
        if d in seen and seen[d] != who:
            needed = plan.trainer_ranks + len(plan.explorers) * plan.tensor_parallel_size
            if plan.visible == 1:
                where = "on a single GPU: the explorer's vLLM worker and the trainer share the device"
            else:
                where = f"puts {seen[d]} and {who} on GPU {d} ({_how(plan)})"
            raise UserError(
                f"synchronizer.sync_method = collective {where}, and NCCL refuses two ranks of one group on one device; use sync_method: checkpoint here "
                f"(weights go through storage), or give every role its own GPUs (placement.devices: trainer ranks and engines on separate devices, "
                f"{needed} GPUs in all for trainer.num_ranks = {plan.trainer_ranks} and {len(plan.explorers)} engine(s) of tensor parallel size "
                f"{plan.tensor_parallel_size}; this machine shows {plan.visible}), or run the roles on separate machines (placement: deployments)"
            )
        seen.setdefault(d, who)


def _how(plan: DevicePlan) -> str:
    if plan.source == "split":
        return f"the default split: trainer first, then the engines; {plan.visible} GPU(s) are too few to give each its own"
    return "placement.devices"


def _first_repeat(devices: list[Device]) -> Device | None:
    seen: set[Device] = set()
    for d in devices:
        if d in seen:
            return d
        seen.add(d)
    return None


# --------------------------------------------------------------------------- the run's record


def record_plan(fs: Any, root: str, plan: DevicePlan, attempt: str | None = None) -> None:
    """Write the plan to `<run>/devices.json` (`root`: the run's directory in `fs`); each attempt
    writes its own over the last (a resume may run on another machine)."""
    from rl_engine.storage import join, write_json

    write_json(
        fs, join(root, PLAN_FILE), {"attempt": attempt, **plan.model_dump(mode="json"), "summary": plan.describe()}
    )

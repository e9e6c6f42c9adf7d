"""A run's identity and directory: the resolved config, saved once, and reopened on resume.

`start_run(cfg)` resolves the config, creates `<storage>/<name>/` and writes `config.yaml`
(without credentials: they never enter the config). `open_run(url)` reads it back for
`rft run --resume`. `rl_engine.run.lease.RunLease` keeps two drivers (say, two `rft run --resume`
of one run) from running it at once.

The run handle: a `RunContext` opens the run's filesystem and its control board once, when it is
made, and is passed down inside its process. Across a process (or Prefect task) boundary a role
gets handles only, the run's URL and storage options, and opens its own RunContext at its entry
(`open_run`); what it builds takes the context, or from it the pieces a lower floor needs:

    run = open_run(run_url, storage_options)   # once, at a role's (or the driver's) entry
    fs, root = run.fs()                        # the run's filesystem and its directory in it
    run.board                                  # its control board (rl_engine.board)
    BufferWriter(fs, root, explorer_id)        # components below `run` get the pieces
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import fsspec

from rl_engine.board import START_KEY, Board
from rl_engine.config import RFTConfig, parse_yaml, to_yaml, validate_config
from rl_engine.errors import UserError
from rl_engine.run.storage_checks import check_storage
from rl_engine.storage import OUTAGE_KEY, join, open_storage, write_bytes_atomic

CONFIG_FILE = "config.yaml"


@dataclasses.dataclass(frozen=True)
class RunContext:
    """Where a run lives and how it is configured (resolved), with its filesystem and control
    board, opened once when the context is made; pass it down inside a process (across processes
    and Prefect tasks: its URL and `storage_options`)."""

    cfg: RFTConfig
    url: str  # <storage.url>/<name>

    def __post_init__(self) -> None:
        fs, root = open_storage(self.url, self.storage_options)
        # Not dataclass fields: derived from cfg and url (equality, repr and dataclasses.replace see those two only).
        object.__setattr__(self, "_fs", fs)
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_board", Board(fs, root, self.cfg.buffer.poll_interval_s))

    @property
    def storage_options(self) -> dict[str, Any]:
        # fsspec's options plus buffer.storage.outage_timeout_s: what another process opens the run with
        return self.cfg.buffer.storage.fs_options()

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """(filesystem, path of the run directory inside it): the pieces a component below `run` takes."""
        return self._fs, self._root

    @property
    def root(self) -> str:
        """Path of the run directory inside its filesystem."""
        return self._root

    @property
    def board(self) -> Board:
        """The run's control board (buffer.poll_interval_s), shared by everything of this context."""
        return self._board

    def path(self, *parts: str) -> str:
        """Path of a file of the run inside its filesystem."""
        return join(self._root, *parts)


def start_run(cfg: RFTConfig) -> RunContext:
    """Resolve `cfg`, create the run directory and save the resolved config (refuses to reuse a run)."""
    cfg = cfg.resolved()
    run = RunContext(cfg=cfg, url=cfg.run_url)
    check_storage(
        cfg.buffer.storage.url, run.storage_options
    )  # a missing bucket is an error, never created by makedirs below
    fs, root = run.fs()
    if fs.exists(join(root, CONFIG_FILE)):
        raise UserError(
            f"run {run.url} already exists; resume it with `rft run --resume {run.url}` or pick another name (name: ...)"
        )
    fs.makedirs(root, exist_ok=True)
    write_bytes_atomic(fs, join(root, CONFIG_FILE), to_yaml(cfg).encode())
    return run


def open_run(url: str, storage_options: dict[str, Any] | None = None) -> RunContext:
    """Reopen an existing run from its saved `config.yaml` (for resume and inspection)."""
    fs, root = open_storage(url, storage_options)
    path = join(root, CONFIG_FILE)
    if not fs.exists(path):
        raise UserError(
            f"{url}: not a run directory (no {CONFIG_FILE}); runs live under buffer.storage.url, e.g. runs/<name>"
        )
    data = parse_yaml(fs.cat_file(path), f"{url}/{CONFIG_FILE}")
    if storage_options:
        # The inverse of StorageConfig.fs_options(): the outage limit goes back to its own field.
        opts = dict(storage_options)
        storage = data.setdefault("buffer", {}).setdefault("storage", {})
        if OUTAGE_KEY in opts:
            storage["outage_timeout_s"] = opts.pop(OUTAGE_KEY)
        storage["options"] = opts
    # validate_config migrates a config.yaml an older version stored (rl_engine/config/migrate.py), so its runs still resume.
    cfg = validate_config(data, f"{url}/{CONFIG_FILE}")
    return RunContext(cfg=cfg, url=url.rstrip("/"))


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where the loops of a (resumed) run start: the trainer's restored version and, per
    explorer, one past its last committed explorer step. A fresh run is (0, all 1)."""

    trainer_version: int
    first_steps: dict[int, int]

    @property
    def resumed(self) -> bool:
        return self.trainer_version > 0 or any(s > 1 for s in self.first_steps.values())


def post_start(board: Board, at: ResumePoint, lease_generation: int | None = None) -> str:
    """Announce a new attempt of the run, where its loops start and the generation of the run's
    lease its driver holds (roles commit only while it is the newest: rl_engine.run.lease.Fence);
    returns the attempt id."""
    attempt = uuid.uuid4().hex[:12]
    first_steps = {str(i): s for i, s in at.first_steps.items()}
    board.post(
        START_KEY,
        {
            "attempt": attempt,
            "trainer_version": at.trainer_version,
            "first_steps": first_steps,
            "lease_generation": lease_generation,
        },
    )
    return attempt


def read_start(board: Board, timeout_s: float) -> tuple[str, ResumePoint, int | None]:
    """(attempt id, where the loops start, the driver's lease generation) from the start marker."""
    m = board.wait(
        START_KEY,
        lambda m: True,
        what="the run's start marker (roles are started by the mode's flow: `rft run`)",
        timeout_s=timeout_s,
    )
    return (
        m["attempt"],
        ResumePoint(m["trainer_version"], {int(i): s for i, s in m["first_steps"].items()}),
        m.get("lease_generation"),
    )


def last_committed_steps(run: RunContext) -> dict[int, int]:
    """{explorer id: highest explorer step with committed experiences} from the buffer's commit records."""
    from rl_engine.buffer.stats import commit_records, last_committed

    return last_committed(commit_records(*run.fs()))


def resume_point(run: RunContext, trainer_version: int) -> ResumePoint:
    last = last_committed_steps(run)
    return ResumePoint(trainer_version, {i: last.get(i, 0) + 1 for i in range(run.cfg.explorer.count)})

"""Task sets: load prompts from JSONL or Parquet (local or any fsspec URL), iterate them in
seeded epochs that a resumed run continues exactly, and turn a prompt into model input.

    tasks = load_taskset(cfg.taskset, cfg.buffer.storage.fs_options())
    it = TaskIterator(tasks, batch_size=4, seed=42, shuffle=True)
    batch = it.next_batch()
    saved = it.state_dict()            # JSON-able; TaskIterator(...).load_state_dict(saved) resumes
    text = format_prompt(tokenizer, cfg.taskset.template, batch[0].prompt)
    text, ids = encode_task(tokenizer, cfg.taskset.template, batch[0], cfg.model.max_model_len)
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from rl_engine.errors import UserError

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


@dataclass(frozen=True)
class Task:
    """One prompt of a task set; `row` is the whole source row, for user rewards."""

    task_id: str
    prompt: str
    answer: str | None
    row: dict[str, Any] = field(default_factory=dict, compare=False)


# --------------------------------------------------------------------------- loading


def _file_format(path: str, field: str = "taskset.path") -> str:
    name = path.lower()
    for c in _COMPRESSIONS:
        name = name.removesuffix(c)
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    raise UserError(f"{field} = {path!r}: unknown file type; use .jsonl (one JSON object per line) or .parquet")


def _read_rows(path: str, storage_options: dict[str, Any] | None, field: str = "taskset.path") -> list[tuple[int, Any]]:
    """(row number, raw row) pairs; row numbers are 1-based lines (JSONL) or rows (Parquet)."""
    from rl_engine.storage import open_storage

    fmt = _file_format(path, field)
    try:
        fs, file = open_storage(path, storage_options)  # the run's storage options, outage retries included
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with fs.open(file, "rb") as f:
                table = pq.read_table(f)
            return list(enumerate(table.to_pylist(), start=1))
        # utf-8-sig drops a BOM; split on "\n" only: str.splitlines would also break a row at a raw
        # U+2028 inside a JSON string and shift every later line number.
        with fs.open(file, "rt", encoding="utf-8-sig", newline="", compression="infer") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise UserError(
            f"{field} = {path!r}: file not found; fix {field} (a relative path starts at the working directory) or write the demo's tasks with `rft make-tasks {path}`"
        ) from None
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file to the user
        raise UserError(f"{field} = {path!r}: cannot read it as {fmt} ({type(e).__name__}: {e})") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, spacing) are not rows
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path}: line {lineno}: not valid JSON ({e.msg} at column {e.colno}); fix or delete that line (JSONL: one JSON object per line)"
            ) from None
    return rows


def _to_task(path: str, name: str, where: str, num: int, raw: Any, prompt_key: str, answer_key: str) -> Task:
    if not isinstance(raw, dict):
        raise UserError(
            f"{path}: {where}: expected a JSON object with a {prompt_key!r} key, got {type(raw).__name__}; make that row an object"
        )
    if prompt_key not in raw:
        raise UserError(
            f"{path}: {where}: no {prompt_key!r} key (keys: {sorted(raw)}); set taskset.prompt_key to the prompt column"
        )
    prompt = raw[prompt_key]
    if not isinstance(prompt, str):
        raise UserError(
            f"{path}: {where}: {prompt_key!r} must be a string, got {type(prompt).__name__} {prompt!r}; write the prompt as a string (or set taskset.prompt_key to the column that holds it)"
        )
    answer = raw.get(answer_key)
    task_id = str(raw["id"]) if raw.get("id") is not None else f"{name}#{num}"
    return Task(task_id=task_id, prompt=prompt, answer=None if answer is None else str(answer), row=raw)


def _is_task_file(path: str) -> bool:
    name = path.lower()
    for c in _COMPRESSIONS:
        name = name.removesuffix(c)
    return name.endswith(_JSONL_SUFFIXES + _PARQUET_SUFFIXES)


def taskset_files(path: str, storage_options: dict[str, Any] | None = None, field: str = "taskset.path") -> list[str]:
    """The files of a task set, sorted by name: `path` itself if it is a file, else the task files
    (.jsonl, .parquet, ...) in the directory `path`, else those whose path starts with `path` (a
    prefix such as `s3://bucket/tasks/day-`), so a folder where new task files arrive is one task set."""
    from rl_engine.storage import open_storage

    fs, root = open_storage(path, storage_options)
    if fs.isfile(root) or _is_task_file(path) and not fs.isdir(root):
        return [path]  # also a missing file: _read_rows names it
    found = fs.find(root) if fs.isdir(root) else [p for p in fs.glob(root + "*") if fs.isfile(p)]
    if fs.isdir(root):
        found = [p for p in found if p.rsplit("/", 1)[0] == root]  # the folder's own files, not subfolders'
    files = sorted(
        (p for p in found if _is_task_file(p) and not p.rsplit("/", 1)[-1].startswith((".", "_"))),
        key=lambda p: p.rsplit("/", 1)[-1],
    )
    if not files and "." in path.rstrip("/").rsplit("/", 1)[-1]:
        return [path]  # meant as one file: _read_rows names what is wrong with it
    if not files:
        raise UserError(
            f"{field} = {path!r}: no task files (.jsonl or .parquet) there; point {field} at a task file, a folder of them or a prefix of their paths"
        )
    return [fs.unstrip_protocol(p) if "://" in path else p for p in files]


# --------------------------------------------------------------------------- task views

VIEW_SUFFIX = ".taskview.json"


def is_task_view(path: str) -> bool:
    """Whether `path` is a task view (`*.taskview.json`; a lineage writes one per run)."""
    return path.lower().endswith(VIEW_SUFFIX)


def beside(path: str, rel: str) -> str:
    """`rel`, a path relative to the folder of `path` (`..` allowed), as a path or URL like `path`."""
    import posixpath

    protocol, sep, rest = path.rpartition("://")
    return protocol + sep + posixpath.normpath(posixpath.join(posixpath.dirname(rest), rel))


def read_task_view(
    path: str, storage_options: dict[str, Any] | None = None, field: str = "taskset.path"
) -> tuple[list[str], set[str]]:
    """(task files, ids left out) of the task view at `path`: task files stored once and shared,
    minus the ids a JSONL file lists, as of a given number of its lines (a lineage's runs.jsonl:
    what its completed runs consumed before this run began), so the view stays the same while
    that file grows:

        {"task_view": 1,
         "files": ["pool/day-1-1f2e3d4c5b6a7980.jsonl"],    # relative to the view's folder, in order
         "exclude_ids_in": {"path": "../runs.jsonl", "lines": 3, "field": "tasks", "where": {"status": "completed"}}}

    The ids left out: those under `field` of the first `lines` lines of `path` that match `where`."""
    from rl_engine.storage import open_storage

    fs, file = open_storage(path, storage_options)
    try:
        view = json.loads(fs.cat_file(file))
    except FileNotFoundError:
        raise UserError(f"{field} = {path!r}: task view not found; fix {field}") from None
    files = [beside(path, f) for f in view["files"]]
    ex = view.get("exclude_ids_in")
    if not ex or not ex["lines"]:
        return files, set()
    source = beside(path, ex["path"])
    fs, file = open_storage(source, storage_options)
    try:
        lines = [ln for ln in fs.cat_file(file).decode().splitlines() if ln.strip()][: ex["lines"]]
    except FileNotFoundError:
        raise UserError(
            f"{field} = {path!r}: its task view leaves out the ids listed in {source}, which is missing; restore it"
        ) from None
    where = ex.get("where", {})
    rows = [json.loads(ln) for ln in lines]
    return files, {str(t) for r in rows if all(r.get(k) == v for k, v in where.items()) for t in r.get(ex["field"], [])}


def load_taskset(
    cfg: Any,
    storage_options: dict[str, Any] | None = None,
    answer_needed_by: str | None = None,
    field: str = "taskset.path",
) -> list[Task]:
    """All tasks of `cfg.path` (a TasksetConfig: a file, a folder of task files or a prefix, see
    `taskset_files`; or a task view, `read_task_view`), in file order; UserError names file and row of a bad row. With
    `answer_needed_by` (the reward that scores against the answer, as the message names it), a
    row without a `cfg.answer_key` value is one too, reported after every row's prompt checked out.
    `field` names the config field that gave the path (an eval set's: `eval.tasksets[0].path`).

    Task ids come from an `id` column when present, else `<file name>#<row number>`, so they
    stay the same when the file moves, and rows of several files never share one.
    """
    tasks, seen, no_answer = [], {}, []
    if is_task_view(cfg.path):
        files, left_out = read_task_view(cfg.path, storage_options, field)
    else:
        files, left_out = taskset_files(cfg.path, storage_options, field), set()
    for path in files:
        raw_rows = _read_rows(path, storage_options, field)
        where_word = "row" if _file_format(path) == "parquet" else "line"
        name = path.rstrip("/").rsplit("/", 1)[-1]
        for num, raw in raw_rows:
            where = f"{where_word} {num}"
            task = _to_task(path, name, where, num, raw, cfg.prompt_key, cfg.answer_key)
            if task.task_id in seen:
                # GRPO groups and the buffer key on task ids: duplicates would merge unrelated groups.
                raise UserError(
                    f"{path}: {where}: duplicate id {task.task_id!r} (first at {seen[task.task_id]}); give every row its own id (or drop the id column: rows are then named by line)"
                )
            seen[task.task_id] = where if len(files) == 1 else f"{name} {where}"
            if task.task_id in left_out:
                continue
            tasks.append(task)
            if answer_needed_by and task.answer is None:
                no_answer.append((path, where, raw))
    if no_answer:
        path, where, raw = no_answer[0]
        more = f" (and {len(no_answer) - 1} more row(s))" if len(no_answer) > 1 else ""
        raise UserError(
            f"{path}: {where}: no {cfg.answer_key!r} value (keys: {sorted(raw)}){more}, and {answer_needed_by} scores every response against it; "
            f"give every row its answer, or set taskset.answer_key to the column that holds it"
        )
    if not tasks:
        raise UserError(
            f"{field} = {cfg.path!r}: the task set is empty (no rows); add rows, one JSON object per line with a {cfg.prompt_key!r} key, or point {field} at another file"
        )
    return tasks


def write_taskset(path_or_url: str, rows: list[dict[str, Any]], storage_options: dict[str, Any] | None = None) -> str:
    """Write task rows as JSONL (atomically) to a local path or fsspec URL; returns it."""
    from rl_engine.storage import open_storage, write_bytes_atomic

    fs, path = open_storage(path_or_url, storage_options)
    write_bytes_atomic(fs, path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path_or_url


# --------------------------------------------------------------------------- iteration


def _fingerprint(tasks: list[Task]) -> str:
    return hashlib.sha256("\n".join(t.task_id for t in tasks).encode()).hexdigest()[:16]


class TaskIterator:
    """Batches of tasks in seeded epochs; batches wrap across epoch boundaries so each is full.

    The order of epoch `k` depends only on (seed, k), so `state_dict()` is just the position.
    """

    def __init__(self, tasks: list[Task], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not tasks:
            raise UserError("TaskIterator: the task set is empty")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tasks, self.batch_size, self.seed, self.shuffle = list(tasks), batch_size, seed, shuffle
        self.epoch, self.pos, self.batches = 0, 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            # An int seed mixing (seed, epoch): stable across Python versions and processes.
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_task(self) -> Task:
        """The next task of the stream (partial rollouts draw tasks one at a time)."""
        if self.pos == len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        self.pos += 1
        return self.tasks[self._order[self.pos - 1]]

    def next_batch(self) -> list[Task]:
        out = [self.next_task() for _ in range(self.batch_size)]
        self.batches += 1
        return out

    def advance(self, batches: int) -> None:
        """Skip `batches` batches, exactly as that many `next_batch()` calls would (a resumed
        explorer continues its task stream where it stopped instead of replaying it)."""
        taken = self.epoch * len(self.tasks) + self.pos + batches * self.batch_size
        self.epoch, self.pos = divmod(taken, len(self.tasks))
        self.batches += batches
        self._order = self._epoch_order(self.epoch)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "batches": self.batches,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_tasks": len(self.tasks),
            "fingerprint": _fingerprint(self.tasks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_tasks", "fingerprint"):
            if state.get(key) != mine[key]:
                raise UserError(
                    f"cannot resume the task order: {key} was {state.get(key)!r}, now {mine[key]!r} "
                    "(the task set or seed changed since the run was saved)"
                )
        self.epoch, self.pos, self.batches = int(state["epoch"]), int(state["pos"]), int(state["batches"])
        self._order = self._epoch_order(self.epoch)


# --------------------------------------------------------------------------- prompt text


def format_prompt(tokenizer: Any, template: str | None, prompt: str) -> str:
    """Model input text of a prompt: `template` with `{prompt}` filled in if set, else the
    tokenizer's chat template (one user turn + generation prompt) if it has one, else `prompt`.
    """
    if template is not None:
        try:
            return template.format(prompt=prompt)
        except (KeyError, IndexError, ValueError) as e:
            raise UserError(
                f"taskset.template = {template!r}: not a valid format string with only {{prompt}} ({type(e).__name__}: {e}); "
                "write literal braces as {{ and }}"
            ) from None
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def encode_task(tokenizer: Any, template: str | None, task: Task, max_model_len: int) -> tuple[str, list[int]]:
    """(text, token ids) of `task`'s prompt as an engine gets it (plain and partial rollouts, held-out evaluation).

    The text is `format_prompt`'s (taskset.template, else the tokenizer's chat template, applied
    once), and it already holds every special token the template writes: it is tokenized without
    adding special tokens, so no second BOS or <|im_start|> sneaks in. A prompt that leaves no
    room for a response within model.max_model_len is refused here, naming the task, before any
    engine call (the engine's own check can only say "prompt i").
    """
    text = format_prompt(tokenizer, template, task.prompt)
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if not ids:
        raise UserError(
            f"task {task.task_id!r}: its prompt is empty (no tokens after formatting); give that row a prompt or drop it"
        )
    if len(ids) >= max_model_len:
        raise UserError(
            f"task {task.task_id!r}: its prompt is {len(ids)} tokens (template included), which leaves no room for a response within "
            f"model.max_model_len = {max_model_len}; shorten that task's prompt (or drop its row from the task set), or raise model.max_model_len"
        )
    return text, ids

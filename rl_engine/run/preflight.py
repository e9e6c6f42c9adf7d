"""Preflight: check a run's inputs before any engine starts, each failure a UserError that names
the problem and the fix.

An engine takes ~20 s to start and a trainer more; a bad model directory, task set, reward or
storage URL found by them costs that wait and ends in whichever role tripped first (a tokenizer
without a pad token used to fail the trainer while the explorer waited for it forever). So
`rft run` calls `preflight` before its flow starts, and checks, cheapest first:

- the run: a new run's name is free; a resumed run exists, has the same mode, and the config
  given with `--resume` is the one it was started with (a resumed run keeps its config);
- storage: it opens, an object store answers within seconds (`PREFLIGHT_OUTAGE_S`, not the
  run's `buffer.storage.outage_timeout_s`), accepts the credentials, its bucket exists (rft never
  creates one), and a probe file can be written and removed;
- on resume: the run's saved config.yaml reads, and the run is not complete already;
- the reward imports and takes `(prompt, response, task[, finish_reason])`; a python workflow
  imports (and a workflow class builds with its kwargs);
- the task set: readable, not empty, every row with a string prompt (rows named by line), and
  with an answer where the reward needs one (the built-in rewards);
- the model directory: model.path a directory holding a config.json (`check_model_paths`, which `rft validate`
  makes too), a parseable config.json, safetensors weights that are not truncated and
  whose shapes fit config.json, `max_position_embeddings` not below model.max_model_len, model.lora's
  target modules among its linear modules; the tokenizer loads and has a pad token;
- every prompt, as the explorer will format it, leaves room for a response in model.max_model_len;
- on resume, the latest trainer state fits the model;
- the run's device plan (rl_engine.run.devices) can run: one trainer rank per GPU, no two members
  of a collective group on one device (collective sync with the trainer and an engine on one GPU),
  every engine with as many GPUs as its tensor parallel size.

    cfg = preflight(load_config("configs/demo.yaml"))                  # a new run: the config back
    cfg = preflight(load_config(path), resume="runs/my-run", source=path)  # the run's saved config

What can only fail later (a reward failing on every sample, a corrupt buffer file) fails there
with the same kind of error (rl_engine.rewards.scoring, rl_engine.buffer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from rl_engine.config import ConfigError, ModelConfig, RFTConfig
from rl_engine.config.base import redact
from rl_engine.errors import UserError
from rl_engine.model_dir import require_model_dir
from rl_engine.run.devices import DevicePlan, check_plan, device_plan, visible_gpus
from rl_engine.run.storage_checks import check_reachable, check_storage, checked_call, open_for_checks
from rl_engine.storage import join

MAX_LISTED = 5  # rows / fields named in one message
# The built-in rewards score a response against the task's answer (rl_engine.rewards); a user's
# reward may not use it, so its rows are not checked for one.
REWARDS_NEEDING_ANSWER = ("arithmetic", "countdown", "final_answer")


def preflight(cfg: RFTConfig, resume: str | None = None, source: str = "the config") -> RFTConfig:
    """Check everything a run needs that can be checked without an engine; returns the config the
    run will use (on resume: the run's saved one). Raises UserError naming the problem and the fix."""
    inputs = check_inputs(cfg, resume, source)
    check_model(inputs, resume)
    return inputs.cfg


class Inputs(NamedTuple):
    """What `check_inputs` read, for `check_model`: the run's config, its tasks, the model's config.json and weight shapes."""

    cfg: RFTConfig
    tasks: list[Any]
    config: dict[str, Any]
    weights: dict[str, tuple[int, ...]]


def check_inputs(cfg: RFTConfig, resume: str | None = None, source: str = "the config") -> Inputs:
    """Preflight's first part, milliseconds on local storage: the run, storage, reward, workflow,
    task set (made here first when taskset.make says so and it is missing) and the model directory's files."""
    opts = cfg.buffer.storage.fs_options()
    check_reachable(resume or cfg.buffer.storage.url, opts)
    if resume is None:
        check_new_run(cfg)
        check_storage(cfg.buffer.storage.url, opts)
    else:
        cfg = check_resume(cfg, resume, source)
        check_storage(resume, opts)
        check_not_complete(resume, cfg)
    from rl_engine.rewards import build_reward, load_taskset

    build_reward(cfg.taskset.reward)
    from rl_engine.rollout.workflow import build_workflow

    build_workflow(cfg.taskset.workflow)
    from rl_engine.rewards.make_tasks import make_taskset

    make_taskset(cfg.taskset, opts)  # taskset.make: the task set is made on the run's first start
    reward = cfg.taskset.reward.type
    tasks = load_taskset(
        cfg.taskset, opts, answer_needed_by=f"the {reward} reward" if reward in REWARDS_NEEDING_ANSWER else None
    )
    check_algorithm(cfg)
    check_eval_sets(cfg, opts)
    check_engine_servers(cfg)
    check_model_paths(cfg.model)
    config, weights = check_model_dir(cfg.model.path)
    check_context_length(cfg.model.max_model_len, config, cfg.model.path)
    check_lora_targets(cfg.model, weights)
    return Inputs(cfg, tasks, config, weights)


def check_lora_targets(model: ModelConfig, weights: dict[str, tuple[int, ...]]) -> None:
    """Every model.lora.target_modules entry names a module with a 2-D weight (a Linear) in the
    model directory's safetensors headers, by name or dotted suffix as peft matches them."""
    if model.lora is None:
        return
    from rl_engine.adapter import missing_targets

    missing = missing_targets(weights, model.lora.target_modules)
    if missing:
        linear = sorted(
            {
                n.removesuffix(".weight").rsplit(".", 1)[-1]
                for n, s in weights.items()
                if n.endswith(".weight") and len(s) == 2
            }
        )
        raise UserError(
            f"model.lora.target_modules: {missing} match no linear module of {model.path!r}; "
            f"its linear modules are named {linear[:20]} (give names or dotted suffixes of these)"
        )


def check_algorithm(cfg: RFTConfig) -> None:
    """The loss and the estimator a config names (a built-in, a plugin's or a `python` function)
    load and take the trainer's call with their kwargs: a mistake shows here, naming the field,
    not as a TypeError in the trainer's first step."""
    from rl_engine.registry import ESTIMATORS, LOSSES, bound

    a = cfg.algorithm
    bound(LOSSES, a.loss, ("logprobs", "proximal", "advantages", "mask"))
    bound(ESTIMATORS, a.advantage, ("rewards", "group_index"))


def check_engine_servers(cfg: RFTConfig, timeout_s: float = 5.0) -> None:
    """Each engine server of explorer.engine.servers answers (its model list), before any role
    starts: a server that is gone is named with its field, not found by explorer i minutes later."""
    import httpx

    for i, url in enumerate(cfg.explorer.engine.servers):
        try:
            httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s).raise_for_status()
        except httpx.HTTPError as e:
            raise UserError(
                f"explorer.engine.servers[{i}] = {url!r}: no engine server answers there ({type(e).__name__}: {e}); "
                "start it (`rft engine serve CONFIG`), or drop explorer.engine.servers to have the run start its own engines"
            ) from None


def check_eval_sets(cfg: RFTConfig, opts: dict[str, Any] | None) -> None:
    """Every held-out set of eval.tasksets reads as a task set (it exists, parses, is not empty, its
    rows have the keys the set's reward needs) and its reward builds: checked before any engine
    starts, so a bad set fails the run at once, naming `eval.tasksets[i]`, not at its first evaluation."""
    from rl_engine.rewards import build_reward, load_taskset

    for i, s in enumerate(cfg.eval.tasksets):
        reward = s.reward or cfg.taskset.reward
        if s.reward is not None:
            try:
                build_reward(s.reward)
            except UserError as e:
                raise UserError(f"eval.tasksets[{i}].reward ({s.name!r}): {e}") from None
        load_taskset(
            cfg.taskset.model_copy(update={"path": s.path}),
            opts,
            answer_needed_by=f"the {reward.type} reward" if reward.type in REWARDS_NEEDING_ANSWER else None,
            field=f"eval.tasksets[{i}].path",
        )


def check_model(inputs: Inputs, resume: str | None = None) -> None:
    """Preflight's second part, seconds (it imports transformers and torch): the tokenizer, the
    prompts' lengths, the weights against config.json, a resumed run's trainer state, the devices."""
    cfg, tasks, config, weights = inputs
    model = cfg.model.path
    vocab = config.get("vocab_size")
    tokenizer = check_tokenizer(
        cfg.model.tokenizer_path or model,
        "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path",
        vocab if isinstance(vocab, int) else None,
    )
    check_prompts(tokenizer, tasks, cfg)
    params = check_weights_fit(model, weights)
    if resume is not None:
        if cfg.model.lora is not None:  # the state holds the adapter only
            from rl_engine.adapter import adapter_shapes

            params = adapter_shapes(weights, cfg.model.lora)
        check_trainer_state(resume, cfg.buffer.storage.fs_options(), params)
    check_devices(cfg, visible_gpus())


# --------------------------------------------------------------------------- devices


def check_devices(cfg: RFTConfig, gpus: int) -> DevicePlan:
    """What the run's device plan on a machine with `gpus` visible CUDA devices (0: CPU, gloo)
    cannot run (rl_engine.run.devices.check_plan: two members of a collective group on one device,
    more trainer ranks than devices, an engine with fewer devices than its tensor parallel size);
    returns the plan."""
    plan = device_plan(cfg, gpus)
    check_plan(plan, cfg.synchronizer.sync_method)
    return plan


# --------------------------------------------------------------------------- the run


def check_new_run(cfg: RFTConfig) -> None:
    """A named new run must not exist yet (an unnamed one gets a fresh name)."""
    if cfg.name is None:
        return
    from rl_engine.run.context import CONFIG_FILE

    url = cfg.resolved().run_url
    fs, root = open_for_checks(cfg.buffer.storage.url, cfg.buffer.storage.fs_options())
    if checked_call(fs.exists, join(root, cfg.name, CONFIG_FILE), url=url, op="look for an existing run"):
        raise UserError(
            f"run {url} already exists; resume it with `rft run CONFIG --resume {url}` or give the new run another name (name: ...)"
        )


def check_resume(cfg: RFTConfig, resume: str, source: str) -> RFTConfig:
    """The run to resume exists, and `cfg` (what the user gave with --resume) is its config; returns the saved config."""
    from rl_engine.run.context import CONFIG_FILE, open_run

    saved_file = f"{resume.rstrip('/')}/{CONFIG_FILE}"
    try:
        saved = open_run(resume, cfg.buffer.storage.fs_options()).cfg
    except ConfigError as e:  # not UTF-8, not YAML, a key twice, or values this version refuses
        raise UserError(
            f"--resume {resume}: the run's saved config {saved_file} is damaged, not readable as a config ({e}); "
            f"restore it from a copy (it is the run's resolved config: `rft validate CONFIG --set name={resume.rstrip('/').rsplit('/', 1)[-1]} --print` "
            "prints it from the config the run was started with), or start a new run"
        ) from None
    if saved.synchronizer.mode != cfg.synchronizer.mode:
        raise UserError(
            f"--resume {resume}: that run is mode {saved.synchronizer.mode!r}, {source} says {cfg.synchronizer.mode!r}; a run keeps its mode: "
            f"resume it with its own config (`rft run {saved_file} --resume {resume}`), or start a new run for the other mode"
        )
    given = cfg if cfg.name is not None else cfg.model_copy(update={"name": saved.name})
    diffs = config_diff(saved.model_dump(mode="json"), given.resolved().model_dump(mode="json"))
    if diffs:
        shown = ", ".join(  # a credential under its key (a reward's kwargs) is not shown
            f"{k} (the run's {redact(a, k.rsplit('.', 1)[-1])!r}, given {redact(b, k.rsplit('.', 1)[-1])!r})"
            for k, a, b in diffs[:MAX_LISTED]
        )
        raise UserError(
            f"--resume {resume}: {source} differs from the config the run was started with in {len(diffs)} field(s): {shown}; a resumed run keeps its config, "
            f"so resume with that one (`rft run {saved_file} --resume {resume}`, no --set), or start a new run to change settings"
        )
    return saved


def check_not_complete(resume: str, saved: RFTConfig) -> None:
    """A run whose trainer reached trainer.total_steps (a committed trainer state there), whose model is
    saved and whose report is written has nothing left to do: resuming it would start every engine for
    nothing. (Killed before its report, it still resumes: the report and the lineage's record follow.)"""
    from rl_engine.run.context import RunContext
    from rl_engine.run.state import latest_state_step

    run = RunContext(saved, resume.rstrip("/"))  # `saved` was read from it already (check_resume, open_run)
    step = latest_state_step(run)
    if step is None or step < saved.trainer.total_steps:
        return
    fs, root = run.fs()
    if fs.exists(join(root, "model", "config.json")) and fs.exists(join(root, "report", "summary.json")):
        raise UserError(
            f"--resume {resume}: the run is complete, its trainer reached step {step} of trainer.total_steps = {saved.trainer.total_steps} "
            f"and its model is in {run.url}/model; nothing to resume: use that model, or start a new run to train further (model.path: {run.url}/model)"
        )


def config_diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, a's value, b's value) of every leaf where two config dumps differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys()) for d in config_diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [(prefix.rstrip("."), a, b)]


# --------------------------------------------------------------------------- model directory


def check_model_paths(model: ModelConfig) -> None:
    """model.path is a model directory (with a config.json) and model.tokenizer_path, if given, a directory:
    the cheap local check `rft validate` makes too (the config's validators never touch the filesystem)."""
    for field, given in (("path", model.path), ("tokenizer_path", model.tokenizer_path)):
        if given is not None:  # a tokenizer directory needs only the tokenizer's files (check_tokenizer)
            require_model_dir(given, f"model.{field}", config=field == "path")


def check_model_dir(path: str, what: str = "model.path") -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """config.json parses and every *.safetensors file is whole; returns (config.json, {tensor name: shape} of the weights)."""
    d = Path(require_model_dir(path, what))
    try:
        config = json.loads((d / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(
            f"{d / 'config.json'}: not valid JSON ({e}); restore the model's config.json from where the model came from (or rebuild the model)"
        ) from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserError(
            f"{d / 'config.json'}: not a Hugging Face model config (no 'model_type'); restore the model's config.json from where the model came from"
        )
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (
            f"it has only pickle weights {pickles} (never loaded: unsafe); convert them with model.save_pretrained(dir, safe_serialization=True)"
            if pickles
            else "save the model with model.save_pretrained(dir)"
        )
        raise UserError(f"{what} = {path!r}: no *.safetensors weights; {hint}")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(safetensors_shapes(f))
    return config, shapes


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header, after checking that the file holds
    every byte the header describes (a truncated copy is caught without reading the data)."""
    fix = "copy it again from where the model came from (or rebuild the model)"
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise UserError(f"{path}: truncated ({size} bytes, not even its header); {fix}")
        try:
            header = json.loads(f.read(n))
            spans = {k: (tuple(v["shape"]), v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError) as e:
            raise UserError(f"{path}: not a safetensors file (unreadable header: {e}); {fix}") from None
    need = 8 + n + max((end for _, end in spans.values()), default=0)
    if size < need:
        raise UserError(f"{path}: truncated ({size} bytes, its header describes {need}); {fix}")
    return {k: shape for k, (shape, _) in spans.items()}


# A tokenizer directory holds one of these; without any, transformers builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")


def check_tokenizer(path: str, what: str = "model.path", vocab_size: int | None = None) -> Any:
    """The tokenizer loads, has a pad token (the trainer pads batches with it) and no more tokens
    than the model's embedding has rows; returns it."""
    from transformers import AutoTokenizer

    files = "the directory needs tokenizer.json and tokenizer_config.json as tokenizer.save_pretrained(dir) writes them (or set model.tokenizer_path to a tokenizer directory)"
    if not any((Path(path).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{what} = {path!r}: cannot load a tokenizer, it has none of {list(TOKENIZER_FILES)}; {files}")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - missing files, bad JSON, unknown class
        raise UserError(
            f"{what} = {path!r}: cannot load a tokenizer ({type(e).__name__}: {str(e)[:300]}); {files}"
        ) from None
    if tok.pad_token_id is None:
        raise UserError(
            f"{what} = {path!r}: the tokenizer has no pad token, and the trainer pads batches with it; set one and save it "
            "(tokenizer.pad_token = tokenizer.eos_token; tokenizer.save_pretrained(dir)) or use a tokenizer that has one"
        )
    if vocab_size is not None and len(tok) > vocab_size:
        raise UserError(
            f"{what} = {path!r}: the tokenizer has {len(tok)} tokens but the model's embedding only {vocab_size} rows (config.json vocab_size), "
            "so it belongs to another model; use the model's own tokenizer (model.tokenizer_path)"
        )
    return tok


def check_weights_fit(path: str, weights: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The weights' shapes fit the architecture config.json describes (built on the meta device:
    no memory); returns the model's {parameter name: shape}."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - unknown model_type, inconsistent sizes
        raise UserError(
            f"{path}/config.json: transformers cannot build a causal LM from it ({type(e).__name__}: {str(e)[:300]}); restore the model's config.json"
        ) from None
    params = {k: tuple(v.shape) for k, v in model.named_parameters()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [
        f"{k} {list(s)} (config.json makes it {list(expected[k])})"
        for k, s in sorted(weights.items())
        if k in expected and expected[k] != s
    ]
    if wrong or not weights.keys() & expected.keys():
        raise UserError(
            f"model.path = {path!r}: its weights do not fit its config.json, they come from another model ({'; '.join(wrong[:3]) or 'no tensor name in common'}); "
            "put the config.json and the *.safetensors of one model together (or rebuild the model)"
        )
    return params


def check_trainer_state(run_url: str, options: dict[str, Any] | None, params: dict[str, tuple[int, ...]]) -> None:
    """The trainer state a resume would load (the latest committed one) fits the model."""
    from rl_engine.run.context import open_run
    from rl_engine.run.state import STATE_DIR, latest_state_step
    from rl_engine.trainer.checkpoint import check_fits

    run = open_run(run_url, options)
    step = latest_state_step(run)
    if step is None:
        return
    fs, root = run.fs()
    path = join(root, STATE_DIR, f"step={step}", "model.safetensors")
    with fs.open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    check_fits(params, shapes, where=f"--resume {run_url}: its trainer state {STATE_DIR}/step={step}")


def check_context_length(max_model_len: int, config: dict[str, Any], model: str) -> None:
    """model.max_model_len fits the positions the model was built for (vLLM refuses more, but
    only once the explorer's engine starts, while the trainer waits for it)."""
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and max_model_len > positions:
        raise UserError(
            f"model.max_model_len = {max_model_len}: the model at model.path = {model!r} has max_position_embeddings = {positions} "
            f"(its config.json), so longer sequences have no trained positions; set model.max_model_len <= {positions}"
        )


# --------------------------------------------------------------------------- prompts


def check_prompts(tokenizer: Any, tasks: list[Any], cfg: RFTConfig) -> None:
    """Every prompt, formatted as the explorer formats it, has tokens and leaves room for a response."""
    from rl_engine.rewards import format_prompt

    limit = cfg.model.max_model_len
    texts = [format_prompt(tokenizer, cfg.taskset.template, t.prompt) for t in tasks]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids] if texts else []
    empty = [t.task_id for t, n in zip(tasks, lengths) if n == 0]
    if empty:
        raise UserError(
            f"taskset.path = {cfg.taskset.path!r}: {len(empty)} prompt(s) are empty, e.g. task(s) {empty[:MAX_LISTED]}; give every row a prompt (or set taskset.template)"
        )
    long = [(t.task_id, n) for t, n in zip(tasks, lengths) if n >= limit]
    if long:
        shown = ", ".join(f"{tid!r} ({n} tokens)" for tid, n in long[:MAX_LISTED])
        raise UserError(
            f"taskset.path = {cfg.taskset.path!r}: {len(long)} prompt(s) leave no room for a response within model.max_model_len = {limit}: {shown}; "
            "shorten or drop those rows, or raise model.max_model_len"
        )

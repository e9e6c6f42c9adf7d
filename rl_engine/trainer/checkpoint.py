"""Trainer files on fsspec storage, without pickle: HF model directories and resumable state.

Why not DeepSpeed's own `save_checkpoint`: it writes `torch.save` pickles (model states,
optimizer states, and the universal-checkpoint conversion `ds_to_universal` writes per-parameter
`.pt` files too), and DESIGN.md forbids pickle in storage. Instead the state is saved
*consolidated*, parameter by parameter under its Hugging Face name, through DeepSpeed's
fragment API (`safe_get_full_fp32_param` / `safe_get_full_optimizer_state` and the `set`
twins), which assembles full tensors from ZeRO 1/2/3 partitions (or reads the plain torch
optimizer at stage 0). Like DeepSpeed's universal checkpoint, it restores on any world size.

A state directory (`trainer_state/step=<t>/`):

    model.safetensors      fp32 master weights, HF names
    optimizer.safetensors  <name>.exp_avg, <name>.exp_avg_sq (and <name>.step at stage 0)
    rng.safetensors        torch CPU / CUDA generator states, numpy's MT state
    state.json             version, engine counters, optimizer hyper-parameters and step,
                           LR scheduler state, python/numpy RNG scalars, the caller's `extra`
    COMMITTED              written last: a state without it is incomplete and never loaded
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from rl_engine.errors import UserError
from rl_engine.storage import is_local, join, open_storage, read_json, write_bytes_atomic, write_json

FORMAT = "rft-trainer-state"
FORMAT_VERSION = 1
COMMIT_MARKER = "COMMITTED"


def write_tensors(fs, path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically (CPU, contiguous copies; no shared storage)."""
    data = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    write_bytes_atomic(fs, path, st_save(data, metadata=metadata))


def read_tensors(fs, path: str) -> dict[str, torch.Tensor]:
    return st_load(fs.cat_file(path))


def upload_dir(local_dir: str | Path, url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Copy every file of a local directory to `url` (any fsspec URL), each file atomically."""
    fs, root = open_storage(url, storage_options)
    fs.makedirs(root, exist_ok=True)
    for f in sorted(Path(local_dir).iterdir()):
        if not f.is_file():
            continue
        target = join(root, f.name)
        if is_local(fs):
            # copy beside the target, then rename: a reader never sees half a weight file
            tmp = join(root, f".tmp-{uuid.uuid4().hex}")
            shutil.copyfile(f, tmp)
            os.replace(tmp, target)
        else:
            fs.put_file(str(f), target)  # one PUT (or a multipart upload completed at the end)


# --------------------------------------------------------------------------- RNG


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON) of every generator a train step may draw from."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    py_version, py_state, py_gauss = random.getstate()
    meta = {"numpy": [kind, int(pos), int(has_gauss), float(cached)], "python": [py_version, list(py_state), py_gauss]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if states:
            torch.cuda.set_rng_state_all(states)
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    py_version, py_state, py_gauss = meta["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))


# --------------------------------------------------------------------------- parameters and optimizer state


def _zero_managed(p: torch.nn.Parameter) -> bool:
    """True when DeepSpeed's ZeRO/bf16 optimizer owns an fp32 master copy of `p` (fragment API works)."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer itself, under DeepSpeed's ZeRO / bf16 wrappers if any."""
    return getattr(optimizer, "optimizer", optimizer)


def collect_state(module: torch.nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """(master weights, optimizer tensors, optimizer JSON) of every parameter, full-size, HF names.

    Collective under ZeRO-3: every rank must call it (the fragment getters all-gather).
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    weights, opt_tensors = {}, {}
    base = _base_optimizer(optimizer)
    has_state = bool(base.state) and all(base.state.values())  # Adam creates its state at the first step
    for name, p in module.named_parameters():
        if _zero_managed(p):
            weights[name] = safe_get_full_fp32_param(p).float().cpu()
            for key in ("exp_avg", "exp_avg_sq") if has_state else ():
                value = safe_get_full_optimizer_state(p, key)
                if value is not None:
                    opt_tensors[f"{name}.{key}"] = value.float().cpu()
        else:
            weights[name] = p.detach().float().cpu()
            for key, value in base.state.get(p, {}).items():
                opt_tensors[f"{name}.{key}"] = torch.as_tensor(value).cpu()
    # Hyper-parameters the LR scheduler changes (lr) or that must match on load; `params` are ids.
    groups = [{k: v for k, v in g.items() if k in ("lr", "initial_lr", "weight_decay", "eps") and isinstance(v, (int, float))} for g in base.param_groups]
    steps = [int(s["step"]) for s in base.state.values() if "step" in s]
    return weights, opt_tensors, {"param_groups": groups, "step": max(steps, default=0)}


def _shape(t: Any) -> tuple[int, ...]:
    # A ZeRO-3 parameter's own shape is its (empty) partition; ds_shape is the full one.
    return tuple(getattr(t, "ds_shape", None) or t.shape) if hasattr(t, "shape") else tuple(t)


def check_fits(params: dict[str, Any], weights: dict[str, Any], where: str = "trainer state") -> None:
    """UserError unless `weights` has exactly the model's parameter names and shapes (values:
    tensors, or shapes as tuples, so a file's header is enough)."""
    missing, unexpected = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
    wrong = [f"{k} {list(_shape(weights[k]))}, the model's {list(_shape(params[k]))}" for k in sorted(params.keys() & weights.keys()) if _shape(params[k]) != _shape(weights[k])]
    problems = [f"{what} {names[:5]}" for what, names in (("missing", missing), ("unexpected", unexpected), ("shapes", wrong)) if names]
    if problems:
        raise UserError(
            f"{where} does not fit this model, it was saved from another one ({'; '.join(problems)}). "
            "Resume with the model the run was started from (model.path in the run's config.yaml), or start a new run"
        )


def restore_state(module: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor], opt_tensors: dict[str, torch.Tensor], opt_meta: dict[str, Any]) -> None:
    """Inverse of `collect_state`: load weights (model and fp32 master) and optimizer state."""
    check_fits(dict(module.named_parameters()), weights)
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    base = _base_optimizer(optimizer)
    if opt_tensors and any(_zero_managed(p) for p in module.parameters()):
        _materialize_optimizer_state(optimizer)
    for name, p in module.named_parameters():
        _copy_into_param(p, weights[name])
        if _zero_managed(p):
            safe_set_full_fp32_param(p, weights[name].to(p.device))
            for key in ("exp_avg", "exp_avg_sq"):
                if f"{name}.{key}" in opt_tensors:
                    safe_set_full_optimizer_state(p, opt_tensors[f"{name}.{key}"].to(p.device), key)
        elif f"{name}.exp_avg" in opt_tensors:
            state = base.state[p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                value = opt_tensors[f"{name}.{key}"]
                state[key] = value.clone() if key == "step" else value.to(device=p.device, dtype=p.dtype).clone()
    for group, saved in zip(base.param_groups, opt_meta["param_groups"]):
        group.update(saved)
    if opt_meta["step"] and any(_zero_managed(p) for p in module.parameters()):
        # ZeRO's base optimizer holds flat partitions: their Adam step is one shared counter.
        for s in base.state.values():
            if "step" in s:
                s["step"] = torch.full_like(s["step"], opt_meta["step"]) if torch.is_tensor(s["step"]) else opt_meta["step"]


def _materialize_optimizer_state(optimizer) -> None:
    """Create Adam's state on ZeRO's flat fp32 partitions if no step has run yet (zeros: it is
    overwritten right after), and link DeepSpeed's per-parameter views to it, as its own
    universal-checkpoint loader does; without this the fragment setters have nothing to write to."""
    base = _base_optimizer(optimizer)
    for hp in _flat_master_partitions(optimizer):
        state = base.state[hp]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(hp), exp_avg_sq=torch.zeros_like(hp))
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO 1/2 and bf16 optimizers
    if link is not None:
        link()


def _flat_master_partitions(optimizer) -> list[torch.Tensor]:
    """The flat fp32 tensors Adam's state is keyed by: ZeRO-3, ZeRO-1/2 and bf16 optimizers keep
    them in their own attributes (ZeRO-3's base optimizer even has empty param_groups between steps)."""
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(optimizer, attr):
            return list(getattr(optimizer, attr))
    return [p for g in _base_optimizer(optimizer).param_groups for p in g["params"]]


def _copy_into_param(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """p <- value for the (low-precision) model parameter, gathering it first under ZeRO-3."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if int(os.environ.get("RANK", "0")) == 0:
                p.data.copy_(value.to(device=p.device, dtype=p.dtype))
        return
    with torch.no_grad():
        p.data.copy_(value.to(device=p.device, dtype=p.dtype))


def check_format(meta: dict[str, Any], url: str) -> None:
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{url}: not a trainer state of this version (format {meta.get('format')!r} v{meta.get('format_version')!r}, "
            f"expected {FORMAT!r} v{FORMAT_VERSION})"
        )


__all__ = [
    "COMMIT_MARKER",
    "check_fits",
    "FORMAT",
    "FORMAT_VERSION",
    "check_format",
    "collect_state",
    "read_json",
    "read_tensors",
    "restore_state",
    "rng_state",
    "set_rng_state",
    "upload_dir",
    "write_json",
    "write_tensors",
]

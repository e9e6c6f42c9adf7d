"""A LoRA adapter's layout, shared by the trainer that trains it and the engines that serve it
(`model.lora`): peft's tensor names, its `adapter_config.json`, the adapter's shapes on a model,
and the zero adapter an engine serves as version 0. No torch or peft at the top level: preflight
reads shapes from a model directory's safetensors headers alone.

    adapter_shapes(model_shapes(model_dir), lora)   # {peft parameter name: shape}, as the trainer holds them
    synced_adapter(lora)                  # the LoRA config a weight sync carries the adapter of, or None
    wire_name(name)                       # that name as an adapter file (and a weight sync) carries it
    peft_config(lora)                     # the adapter_config.json of such an adapter
    write_zero_adapter(model_dir, lora, out_dir)   # B = 0 (and A = 0): the base model's outputs
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_engine.config import LoRAConfig

ADAPTER = "default"  # peft's adapter name
PREFIX = "base_model.model."  # peft's prefix before the HF model's own parameter names
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"  # peft's layout
MODEL_SUBDIR = "adapter"  # a LoRA run's saved model directory keeps its adapter in this subdirectory
ENGINE_ADAPTER_ID = 1  # vLLM's lora_int_id of the one adapter an engine serving a LoRA policy holds


def _matches(module: str, target: str) -> bool:
    """peft's rule for a target given as a name: the module's name is it, or ends with `.` + it."""
    return module == target or module.endswith("." + target)


def target_weights(weight_shapes: dict[str, tuple[int, ...]], targets: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """{module name: [out, in]} of the 2-D `<module>.weight` tensors a target matches."""
    modules = {n[: -len(".weight")]: s for n, s in weight_shapes.items() if n.endswith(".weight") and len(s) == 2}
    return {m: s for m, s in modules.items() if any(_matches(m, t) for t in targets)}


def missing_targets(weight_shapes: dict[str, tuple[int, ...]], targets: Iterable[str]) -> list[str]:
    """The targets that match no 2-D weight of the model (names from its safetensors headers)."""
    modules = [n[: -len(".weight")] for n, s in weight_shapes.items() if n.endswith(".weight") and len(s) == 2]
    return [t for t in targets if not any(_matches(m, t) for m in modules)]


def adapter_shapes(weight_shapes: dict[str, tuple[int, ...]], lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """{peft parameter name: shape} of the adapters `lora` puts on a model with these weights:
    what trainer state holds under LoRA (preflight checks a resumed run's state against it)."""
    out: dict[str, tuple[int, ...]] = {}
    for module, (rows, cols) in target_weights(weight_shapes, lora.target_modules).items():
        out[f"{PREFIX}{module}.lora_A.{ADAPTER}.weight"] = (lora.rank, cols)
        out[f"{PREFIX}{module}.lora_B.{ADAPTER}.weight"] = (rows, lora.rank)
    return out


def synced_adapter(lora: LoRAConfig | None) -> LoRAConfig | None:
    """The adapter a weight sync sends and the engines serve (model.lora with `sync: adapter`);
    None when syncs carry whole weights (full fine-tuning, or LoRA with `sync: merged`)."""
    return lora if lora is not None and lora.sync == "adapter" else None


def wire_name(name: str) -> str:
    """A peft parameter name as peft's adapter file stores it (the adapter's own name dropped:
    `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`), which vLLM loads."""
    return name.replace(f".{ADAPTER}.", ".")


def is_adapter_tensor(name: str) -> bool:
    """Whether a tensor name is an adapter's (a weight sync of a LoRA run carries only these)."""
    return ".lora_A." in name or ".lora_B." in name


def peft_config(lora: LoRAConfig, base_model: str | None = None) -> dict[str, Any]:
    """The adapter_config.json peft writes for `lora` (what vLLM and `PeftModel.from_pretrained` read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "base_model_name_or_path": base_model,
        "inference_mode": True,
    }


def model_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a model directory's safetensors files, from their headers alone."""
    import glob

    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(f, framework="pt") as sf:
            shapes.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
    return shapes


def write_zero_adapter(model_dir: str, lora: LoRAConfig, out_dir: str) -> str:
    """An adapter of zeros for the model in `model_dir` in peft's layout under `out_dir`: served,
    it computes exactly the base model (B @ A = 0); an engine's version 0. Returns `out_dir`."""
    import torch
    from safetensors.torch import save_file

    zeros = {wire_name(n): torch.zeros(s) for n, s in adapter_shapes(model_shapes(model_dir), lora).items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(zeros, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(peft_config(lora, model_dir), f, indent=2)
    return out_dir

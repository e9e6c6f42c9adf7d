"""LoRA on the trainer side (`model.lora`, issue 46 phase 1): peft adapters on the Hugging Face
model, the base frozen, and the merged weights for everything that reads the policy's weights.

    model = wrap(hf_model, settings.lora)               # before deepspeed.initialize: adapters trainable only
    for name, w in merged_weights(model): ...           # base HF names, W + (alpha / r) * B @ A
    with model.disable_adapter(): ...                   # the base model: the KL reference, no second copy

Weight sync (collective, checkpoint, delta) and `save_hf` take `merged_weights`, so the explorers
load an ordinary model and need no LoRA support. Phase 2 (adapter-only sync through vLLM's LoRA)
would send `adapter_weights` instead; the names there are peft's (`adapter_state`).

This module's top level imports no torch or peft: preflight uses `missing_targets` and `adapter_shapes`
on a model directory's safetensors header alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rl_engine.config import LoRAConfig

ADAPTER = "default"  # peft's adapter name
PREFIX = "base_model.model."  # peft's prefix before the HF model's own parameter names


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


def wrap(model: torch.nn.Module, lora: LoRAConfig) -> torch.nn.Module:
    """`model` with LoRA adapters (B = 0: the wrapped model computes what `model` did); only the
    adapters require grad. A target that is not a Linear is refused by peft, named."""
    from peft import LoraConfig, get_peft_model

    from rl_engine.errors import UserError

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UserError(f"model.lora.target_modules = {lora.target_modules}: peft refuses them ({e})") from None


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(base HF name, tensor) of every parameter of the base model, a target's weight merged with
    its adapter (W + alpha / r * B @ A, in W's dtype), the others as they are: the names and shapes
    the model had before `wrap` (tied weights once), so sync and checkpoints see an ordinary model."""
    import torch

    layers = _lora_layers(model)
    for name, p in model.get_base_model().named_parameters():
        if ".lora_" in name:
            continue
        module, sep, leaf = name.rpartition(".base_layer.")
        if not sep:
            yield name, p.detach()
            continue
        if leaf == "weight":
            with torch.no_grad():
                delta = layers[module].get_delta_weight(ADAPTER)  # [out, in]: scale * B @ A
                yield f"{module}.weight", (p.detach() + delta.to(p.dtype)).detach()
        else:
            yield f"{module}.{leaf}", p.detach()


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, tensor) of every adapter parameter (what trains; phase 2 would sync these)."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield name, p.detach()


def save_adapter(model: torch.nn.Module, directory: str) -> None:
    """The adapter in peft's layout (adapter_model.safetensors + adapter_config.json): loadable with
    `PeftModel.from_pretrained(base, directory)` or by vLLM's LoRA support."""
    import os

    model.save_pretrained(directory, safe_serialization=True)
    card = os.path.join(directory, "README.md")  # peft's generated model card: nothing a loader reads
    if os.path.exists(card):
        os.remove(card)

"""LoRA on the trainer side (`model.lora`): peft adapters on the Hugging Face model, the base
frozen; the adapter is what a weight sync sends, the merged weights what a saved model holds.

    model = wrap(hf_model, settings.lora)               # before deepspeed.initialize: adapters trainable only
    for name, a in adapter_weights(model): ...          # what weight sync sends (peft's file names)
    for name, w in merged_weights(model): ...           # base HF names, W + (alpha / r) * B @ A: save_hf
    with model.disable_adapter(): ...                   # the base model: the KL reference, no second copy

Weight sync (collective, checkpoint, delta) takes `adapter_weights`: the explorers' engines serve
the base model with vLLM's LoRA and install each version's adapter in place (rl_engine.sync.worker_ext).
The adapter's layout (peft names, config, shapes) is rl_engine.adapter's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rl_engine.adapter import ADAPTER, wire_name

if TYPE_CHECKING:
    import torch

    from rl_engine.config import LoRAConfig


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
    """(name in peft's adapter file, tensor) of every adapter parameter: what trains, and what a
    weight sync of a LoRA run sends."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield wire_name(name), p.detach()


def save_adapter(model: torch.nn.Module, directory: str) -> None:
    """The adapter in peft's layout (adapter_model.safetensors + adapter_config.json): loadable with
    `PeftModel.from_pretrained(base, directory)` or by vLLM's LoRA support."""
    import os

    model.save_pretrained(directory, safe_serialization=True)
    card = os.path.join(directory, "README.md")  # peft's generated model card: nothing a loader reads
    if os.path.exists(card):
        os.remove(card)

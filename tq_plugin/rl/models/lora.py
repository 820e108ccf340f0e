"""``model.lora``: LoRA adapters on a transformers model through PEFT, the base weights frozen.

``attach_lora`` wraps the transformers model with PEFT's ``get_peft_model``, which injects the
adapter layers *in place*: the model keeps its class and its forward, its adapted linears gain
``base_layer`` / ``lora_A`` / ``lora_B`` children, and every weight but the adapters' stops
requiring gradients. The ``PeftModel`` stays on the policy as ``peft_model`` (not a submodule, so
the state dict names each tensor once) for what only it does: switch the adapters off
(:func:`adapter_disabled`, the reference model of ``recipe.beta``) and write the adapter as a PEFT
directory (:func:`save_adapter`). LoRA's ``B`` starts at zero, so the initial policy is the base.

A rollout engine holds the same frozen base (:func:`base_state_dict`, the checkpoint's own names)
plus the adapter (``engine_init/adapter``) and takes only the adapter's tensors at each sync
(``tq_plugin.rollout.engine.synced_parameters``). A merged copy, ``merged=True``, adds each
adapter's update to its base weight in float32 (merging in bf16 drifts, TRL #6688) and casts back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tq_plugin.config import ConfigError
from tq_plugin.rollout.engine import ADAPTER_DIR

try:
    import peft
except ImportError:  # pragma: no cover - exercised only without the extra
    peft = None

ADAPTER_NAME = "default"  # PEFT's name of a model's one adapter
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def lora_options(lora: Any) -> dict[str, Any] | None:
    """``model.lora`` as a plain dict (a Hydra node, a dict or a ``LoraConfig``), ``None`` when it
    asks for no adapters (``null``, or ``r: null``)."""
    if lora is None:
        return None
    keys = ("r", "alpha", "dropout", "target_modules")
    if hasattr(lora, "get"):
        options = {k: lora.get(k) for k in keys if lora.get(k) is not None}
    else:
        options = {k: getattr(lora, k) for k in keys}
    return None if options.get("r") is None else options


def attach_lora(model: nn.Module, options: dict[str, Any], *, causal_lm: bool) -> Any:
    """Inject ``options``' adapters into ``model`` in place; the ``PeftModel`` around it."""
    if peft is None:
        raise ConfigError("model.lora: LoRA needs peft: pip install 'tq_plugin[lora]'")
    targets = options.get("target_modules")
    if targets is not None and not isinstance(targets, str):
        targets = [str(t) for t in targets]
    config = peft.LoraConfig(r=int(options["r"]), lora_alpha=float(options.get("alpha", 8.0)),
                             lora_dropout=float(options.get("dropout", 0.0)),
                             target_modules=targets, bias="none",
                             task_type="CAUSAL_LM" if causal_lm else None)
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:  # a target no module matches, a model type PEFT has no default for
        raise ConfigError(f"model.lora.target_modules: {exc}") from exc


def peft_model_of(model: nn.Module) -> Any:
    """The ``PeftModel`` of a policy or value model with adapters, else ``None``."""
    return getattr(model, "peft_model", None)


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing with its base weights alone (PEFT's ``disable_adapter``) inside the
    block; a model without adapters as it is."""
    wrapped = peft_model_of(model)
    if wrapped is None:
        yield model
        return
    with wrapped.disable_adapter():
        yield model


def _lora_layers(backbone: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in backbone.named_modules():
        if peft is not None and isinstance(module, peft.tuners.lora.LoraLayer):
            yield name, module


def base_state_dict(backbone: nn.Module, *, merged: bool = False,
                    state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The transformers model's weights under the checkpoint's own names (``base_layer`` folded
    away, no adapter tensors): the frozen base, or ``merged`` each adapter's update
    (``B @ A * alpha / r``) added in float32. ``state``: the model's state dict as full tensors
    (a sharded model's, gathered), by default its own. A model without adapters: its state."""
    state = backbone.state_dict() if state is None else state
    layers = dict(_lora_layers(backbone))
    if not layers:
        return state
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    if merged:
        for name, layer in layers.items():
            key = f"{name}.weight"
            out[key] = (out[key].float() + _delta(name, layer, state)).to(out[key].dtype)
    return out


def _delta(name: str, layer: nn.Module, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """One adapted linear's update in float32, from ``state``'s (full) ``lora_A`` / ``lora_B``."""
    a, b = (state.get(f"{name}.lora_{x}.{ADAPTER_NAME}.weight") for x in "AB")
    if a is None or b is None or not isinstance(layer, peft.tuners.lora.Linear):
        with torch.no_grad():  # another layer kind (an embedding, a conv): PEFT's own formula
            return layer.get_delta_weight(ADAPTER_NAME).float()
    delta = (b.float() @ a.float()) * float(layer.scaling[ADAPTER_NAME])
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def save_adapter(model: nn.Module, directory: str | Path,
                 state: dict[str, torch.Tensor] | None = None) -> Path:
    """The adapter as a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``PeftModel.from_pretrained(base, directory)`` loads onto the untouched base.
    ``state``: the transformers model's state dict as full tensors (a sharded model's,
    gathered), by default its own."""
    wrapped = peft_model_of(model)
    if wrapped is None:
        raise ValueError(f"{type(model).__qualname__} has no LoRA adapter (model.lora.r is null)")
    directory = Path(directory)
    kwargs = {} if state is None else {
        "state_dict": {f"base_model.model.{k}": v for k, v in state.items() if ".lora_" in k}}
    wrapped.save_pretrained(str(directory), safe_serialization=True, **kwargs)
    return directory


def trainable_parameters(*models: nn.Module | None) -> int:
    """How many parameters the optimizer trains (each tensor counted once)."""
    seen: dict[int, int] = {}
    for model in models:
        if model is not None:
            seen |= {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    return sum(seen.values())


__all__ = ["ADAPTER_DIR", "ADAPTER_NAME", "PEFT_FILES", "adapter_disabled", "attach_lora",
           "base_state_dict", "lora_options", "peft_model_of", "save_adapter",
           "trainable_parameters"]

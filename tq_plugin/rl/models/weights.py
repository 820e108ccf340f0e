"""The trained policy (and value) weights a recipe leaves in its output dir, in safetensors;
and what a rollout engine is given of the policy (its HF checkpoint, its named weights).

``policy.safetensors`` / ``value.safetensors`` hold the modules' ``state_dict`` (tied tensors
stored once), with the model class and role in the header metadata. Each file is written beside
its final name and renamed over it, so a reader sees the old file or the whole new one, never a
partial write. Loading never unpickles: safetensors holds raw tensors only.

An HF-format policy (``model=hf_causal_lm``) is also written as a ``save_pretrained`` directory
by :func:`write_hf_checkpoint`, the one writer of HF directories: the engines' starting
checkpoint (``engine_init/``) and the trained policy (``hf_policy/``: config, safetensors,
tokenizer, generation config), which ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM``
load as it is. A sharded (FSDP2) policy's full tensors are gathered for it as for the weight
files.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model
from torch import nn

from tq_plugin.rl.models import fsdp as sharding
from tq_plugin.rl.models.lora import base_state_dict, peft_model_of, save_adapter
from tq_plugin.rollout import NamedWeights
from tq_plugin.rollout.engine import ADAPTER_DIR, StreamedWeights, synced_parameters

POLICY_WEIGHTS = "policy.safetensors"
VALUE_WEIGHTS = "value.safetensors"
HF_POLICY_DIR = "hf_policy"
GENERATION_CONFIG = "generation_config.json"


def save_weights(model: nn.Module, path: str | Path, *, role: str) -> Path:
    """Write ``model``'s weights to ``path`` atomically; the header names the class and role."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    cls = type(model)
    save_model(model, str(tmp), metadata={"role": role,
                                          "class": f"{cls.__module__}.{cls.__qualname__}"})
    os.replace(tmp, path)
    return path


def save_final_weights(output_dir: str | Path, *, policy: nn.Module,
                       value: nn.Module | None = None) -> list[Path]:
    """``policy.safetensors`` and, when there is a value model, ``value.safetensors``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [save_weights(policy, out / POLICY_WEIGHTS, role="policy")]
    if value is not None:
        written.append(save_weights(value, out / VALUE_WEIGHTS, role="value"))
    return written


def save_full_weights(module: nn.Module, path: str | Path, *, role: str, rank: int,
                      bucket_bytes: int = sharding.DEFAULT_BUCKET_BYTES) -> Path | None:
    """Write a sharded ``module``'s full weights to ``path`` on rank 0, in the format
    `save_weights` writes (safetensors, class and role in the header,
    renamed over the final name); every rank must call it (the gathers are collectives)."""
    state = sharding.full_state_dict(module, rank=rank, bucket_bytes=bucket_bytes)
    if state is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    cls = sharding.unsharded_class(module)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp),
              metadata={"role": role, "class": f"{cls.__module__}.{cls.__qualname__}"})
    os.replace(tmp, path)
    return path


def save_final_full_weights(output_dir: str | Path, *, policy: nn.Module,
                            value: nn.Module | None, rank: int) -> list[Path]:
    """``policy.safetensors`` (and ``value.safetensors``) of sharded models, as
    `save_final_weights` writes them for whole ones; every rank calls
    it, rank 0 writes (the paths written; none on the other ranks)."""
    out = Path(output_dir)
    models = [(policy, POLICY_WEIGHTS, "policy")] + ([(value, VALUE_WEIGHTS, "value")]
                                                     if value is not None else [])
    written = [save_full_weights(m, out / name, role=role, rank=rank) for m, name, role in models]
    return [p for p in written if p is not None]


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a file :func:`save_weights` wrote into ``model`` (built with the run's config).

    Every tensor must match a parameter or buffer by name and shape, or this raises and leaves
    ``model`` untouched: the file is loaded into a copy first, and only a full match is applied.
    """
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    cls = type(model)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if meta.get("class") not in (None, name):
        raise ValueError(f"{path} holds weights of {meta['class']}, not of {name}")
    staged = copy.deepcopy(model)
    load_model(staged, str(path), strict=True)
    model.load_state_dict(staged.state_dict())
    return model


def hf_backbone(policy: nn.Module) -> nn.Module | None:
    """The transformers model inside an HF-format policy (``model=hf_causal_lm``), else None."""
    backbone = getattr(policy, "backbone", None)
    return backbone if hasattr(backbone, "save_pretrained") else None


def _generation_ids(directory: Path, tokenizer) -> None:
    """The tokenizer's EOS / pad / BOS ids in ``directory``'s generation config where it has
    none (a random-init model's config may not name them)."""
    path = directory / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if config.get(key) is None and getattr(tokenizer, key, None) is not None:
            config[key] = int(getattr(tokenizer, key))
    path.write_text(json.dumps(config, indent=2) + "\n")


def write_hf_checkpoint(policy: nn.Module, directory: str | Path, *, rank: int = 0,
                        barrier: Callable[[], None] | None = None, tokenizer=None,
                        merged: bool = True) -> Path:
    """Save the policy's transformers model as a ``save_pretrained`` directory (config,
    safetensors, generation config; with ``tokenizer``, its files and its EOS / pad ids in the
    generation config where the model's name none). The policy's output restriction
    (``output_token_ids``) is not in it: the engines apply it from the sampling parameters.

    Written beside ``directory`` and renamed over it: a reader sees the old directory or the
    whole new one. Several ranks (``rank``; ``barrier``: when every rank reads the one
    ``directory`` afterwards): rank 0 writes (as transformers' ``save_pretrained`` does under
    ``torch.distributed``), the others wait at ``barrier``. A sharded (FSDP2) policy's full
    tensors are gathered first, a bounded bucket at a time, every rank joining each gather
    (``sharding.full_state_dict``: rank 0 keeps them).

    A policy with LoRA adapters (``model.lora``) is written under the checkpoint's own names:
    ``merged``, each adapter's update added to its base weight (in float32); else the frozen base
    alone, with the adapter beside it as a PEFT directory (``ADAPTER_DIR``), what the engines
    start from."""
    backbone = hf_backbone(policy)
    if backbone is None:
        raise ValueError(f"{type(policy).__qualname__} is not an HF-format policy")
    directory = Path(directory)
    adapter = peft_model_of(policy)
    full = sharding.full_state_dict(backbone, rank=rank) if sharding.is_sharded(backbone) else None
    state = full
    if adapter is not None and rank == 0:
        state = base_state_dict(backbone, merged=merged, state=full)
    if rank == 0:
        tmp = directory.with_name(f".{directory.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        backbone.save_pretrained(str(tmp), state_dict=state)
        if adapter is not None and not merged:
            save_adapter(policy, tmp / ADAPTER_DIR, state=full)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
            _generation_ids(tmp, tokenizer)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    del state, full
    if barrier is not None:
        barrier()
    return directory


def write_adapter(policy: nn.Module, directory: str | Path, *, rank: int = 0) -> Path | None:
    """A LoRA policy's adapter as a PEFT directory (``lora.save_adapter``); a sharded policy's
    adapter tensors gathered first (every rank calls it, rank 0 writes; ``None`` elsewhere)."""
    backbone = hf_backbone(policy)
    full = None
    if backbone is not None and sharding.is_sharded(backbone):
        adapters = [(n, p) for n, p in backbone.named_parameters() if ".lora_" in n]
        full = {n: t for n, t in sharding.iter_full_tensors(adapters, device="cpu")}
    return save_adapter(policy, directory, state=full) if rank == 0 else None


def write_engine_checkpoint(policy: nn.Module, directory: str | Path, *, rank: int = 0,
                            barrier: Callable[[], None] | None = None) -> Path:
    """The HF checkpoint the ``hf`` and ``vllm`` engines start from (:func:`write_hf_checkpoint`;
    a LoRA policy's: the frozen base and its adapter beside it)."""
    return write_hf_checkpoint(policy, directory, rank=rank, barrier=barrier, merged=False)


def engine_weights(policy: nn.Module, engine: str) -> NamedWeights:
    """The policy's weights named as ``engine``'s model names them: the module's own parameters
    for ``native``, the transformers model's (the checkpoint's names) for ``hf`` and ``vllm``;
    of a LoRA policy only the adapters' (``synced_parameters``: the engine holds the base).

    A sharded (FSDP2) policy's go to ``hf`` and ``vllm`` as ``StreamedWeights``: full tensors
    gathered a bounded bucket at a time while the engine copies them in (a collective: every
    rank syncs its engine in step). ``native`` serves the policy itself: nothing to copy."""
    if engine == "native":
        return synced_parameters(policy)
    named = synced_parameters(hf_backbone(policy))
    if not sharding.is_sharded(policy):
        return named
    return StreamedWeights({n: tuple(p.shape) for n, p in named},
                           lambda: sharding.iter_full_tensors(named))


__all__ = ["HF_POLICY_DIR", "POLICY_WEIGHTS", "VALUE_WEIGHTS", "engine_weights", "hf_backbone",
           "load_weights", "save_final_full_weights", "save_final_weights", "save_full_weights",
           "save_weights", "write_adapter", "write_engine_checkpoint", "write_hf_checkpoint"]

"""The trained policy (and value) weights a recipe leaves in its output dir, in safetensors;
and what a rollout engine is given of the policy (its HF checkpoint, its named weights).

``policy.safetensors`` / ``value.safetensors`` hold the modules' ``state_dict`` (tied tensors
stored once), with the model class and role in the header metadata. Each file is written beside
its final name and renamed over it, so a reader sees the old file or the whole new one, never a
partial write. Loading never unpickles: safetensors holds raw tensors only.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model
from torch import nn

from tq_plugin.rl.models import fsdp as sharding
from tq_plugin.rollout import NamedWeights
from tq_plugin.rollout.engine import StreamedWeights

POLICY_WEIGHTS = "policy.safetensors"
VALUE_WEIGHTS = "value.safetensors"


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


def write_engine_checkpoint(policy: nn.Module, directory: str | Path, *, rank: int = 0,
                            barrier: Callable[[], None] | None = None) -> Path:
    """Save the policy's transformers model as an HF checkpoint (config + safetensors) that the
    ``hf`` and ``vllm`` engines start from. The policy's output restriction is not in it: the
    engines apply it from the sampling parameters.

    Several ranks (``rank``; ``barrier``: when every rank builds an engine from the one
    ``directory``): rank 0 writes (as transformers' ``save_pretrained`` does under
    ``torch.distributed``), the others wait at ``barrier``. A sharded (FSDP2) policy's full
    tensors are gathered first, a bounded bucket at a time, every rank joining each gather
    (``sharding.full_state_dict``: rank 0 keeps them)."""
    backbone = hf_backbone(policy)
    if backbone is None:
        raise ValueError(f"{type(policy).__qualname__} is not an HF-format policy")
    directory = Path(directory)
    state = sharding.full_state_dict(backbone, rank=rank) if sharding.is_sharded(backbone) else None
    if rank == 0:
        backbone.save_pretrained(str(directory), state_dict=state)
    del state
    if barrier is not None:
        barrier()
    return directory


def engine_weights(policy: nn.Module, engine: str) -> NamedWeights:
    """The policy's weights named as ``engine``'s model names them: the module's own parameters
    for ``native``, the transformers model's (the checkpoint's names) for ``hf`` and ``vllm``.

    A sharded (FSDP2) policy's go to ``hf`` and ``vllm`` as ``StreamedWeights``: full tensors
    gathered a bounded bucket at a time while the engine copies them in (a collective: every
    rank syncs its engine in step). ``native`` serves the policy itself: nothing to copy."""
    if engine == "native":
        return policy.named_parameters()
    named = list(hf_backbone(policy).named_parameters())
    if not sharding.is_sharded(policy):
        return named
    return StreamedWeights({n: tuple(p.shape) for n, p in named},
                           lambda: sharding.iter_full_tensors(named))


__all__ = ["POLICY_WEIGHTS", "VALUE_WEIGHTS", "engine_weights", "hf_backbone", "load_weights",
           "save_final_full_weights", "save_final_weights", "save_full_weights", "save_weights",
           "write_engine_checkpoint"]

"""FSDP2 sharding of the recipe's models, and their full weights gathered back in bounded buckets.

``trainer=fsdp_cpu`` / ``trainer=fsdp`` run Lightning's ``ModelParallelStrategy``, which calls
the module's ``configure_model`` on every rank; there :func:`shard_model` applies
``fully_shard`` to each of a model's sharding units (``sharding_units()``: the decoder layers of
an ``hf_causal_lm``; none for the tiny model, which is sharded whole) and then to the model
itself, over the data-parallel mesh. Every parameter becomes a ``DTensor`` holding this rank's
``1/N`` slice; forward and backward all-gather a unit's parameters just before it runs and free
them after, and backward reduce-scatters (averages) the gradients, as DDP all-reduces them.

Whatever needs a whole tensor (an engine's or a worker's weights, the final ``policy.safetensors``)
reads it through :func:`iter_full_tensors`: every rank takes part in each all-gather, in the same
order, and at most one bucket of full tensors (``bucket_bytes``, or one tensor larger than that)
exists on a rank at once, never a second whole copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

# 64 MiB of full tensors at most per bucket (a tensor larger than that is its own bucket).
DEFAULT_BUCKET_BYTES = 64 << 20


def _dtensor_cls() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return DTensor


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are FSDP2 shards (``DTensor``)."""
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(p, cls) for p in module.parameters())


def shard_model(model: nn.Module, mesh: Any, *, mp_policy: Any = None) -> nn.Module:
    """``fully_shard`` each of ``model.sharding_units()`` (when the model has them), then the
    model itself, over ``mesh`` (the strategy's data-parallel mesh); a model sharded already is
    left as it is (``configure_model`` may run again, e.g. for a later fit)."""
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model):
        return model
    kwargs = {"mesh": mesh} | ({"mp_policy": mp_policy} if mp_policy is not None else {})
    units = getattr(model, "sharding_units", None)
    for unit in (units() if callable(units) else []):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s full (gathered) value: its global shape, not this rank's shard."""
    return tensor.numel() * tensor.element_size()


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> list[list[tuple[str, torch.Tensor]]]:
    """``named`` cut, in order, into buckets of at most ``bucket_bytes`` full bytes each (a
    tensor larger than that is a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in named:
        nbytes = full_nbytes(tensor)
        if not buckets or (buckets[-1] and size + nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def iter_full_tensors(named: Iterable[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every ``(name, tensor)`` of ``named``, in order.

    ``DTensor`` shards are gathered (``full_tensor()``: one all-gather per tensor, a collective,
    so every rank iterates the same names in the same order) a bucket at a time
    (:func:`plan_buckets`): the next bucket is gathered only once the consumer has taken every
    tensor of this one, so a consumer that copies each tensor out and drops it holds at most
    ``bucket_bytes`` of gathered weights (or one larger tensor). Plain tensors pass through
    detached. ``device``: where the full tensors go (``"cpu"`` for a file), by default where
    they were gathered.
    """
    dtensor = _dtensor_cls()
    for bucket in plan_buckets(named, bucket_bytes):
        gathered = []
        for name, tensor in bucket:
            tensor = tensor.detach()
            if dtensor is not None and isinstance(tensor, dtensor):
                tensor = tensor.full_tensor()
            gathered.append((name, tensor if device is None else tensor.to(device)))
        del tensor  # the generator keeps no full tensor of its own once it is handed out
        gathered.reverse()
        while gathered:  # popped, so the consumer holds the only reference once it has one
            yield gathered.pop()


def full_state_dict(module: nn.Module, *, rank: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
                    ) -> dict[str, torch.Tensor] | None:
    """``module``'s parameters and persistent buffers as full CPU tensors on ``rank`` 0 (which
    writes the file), ``None`` on the others, which take part in every gather and keep nothing."""
    keep = rank == 0
    out: dict[str, torch.Tensor] = {}
    named = list(module.state_dict().items())
    for name, tensor in iter_full_tensors(named, bucket_bytes=bucket_bytes, device="cpu"):
        if keep:
            out[name] = tensor
    return out if keep else None


def unsharded_class(module: nn.Module) -> type:
    """``module``'s own class: ``fully_shard`` swaps it for a subclass ``FSDP<name>``."""
    return next(c for c in type(module).__mro__
                if not c.__module__.startswith("torch.distributed.fsdp"))


__all__ = ["DEFAULT_BUCKET_BYTES", "full_nbytes", "full_state_dict", "is_sharded",
           "iter_full_tensors", "plan_buckets", "shard_model", "unsharded_class"]

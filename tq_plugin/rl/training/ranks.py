"""How the recipes run over several DDP ranks: which runs they accept, and how a step is split.

One RL step under DDP trains on the same global batch as one process would:

* **shared store** (a backend class with ``shared = True``: ``tq/backend=ray`` or
  ``tq/backend=transferqueue``): every rank attaches to one store; rank 0 generates the step
  once and writes it; the step meta is broadcast and each rank reads a length-balanced shard
  (``MetaDataModule(rows="shared")``). Which cluster: the one ``tq.backend.address`` names, or,
  without an address, the one the launching process starts before the ranks exist
  (:func:`share_store_across_ranks`: the backend's ``start_cluster``) and hands to the ranks in
  ``TQ_PLUGIN_CLUSTER_ADDRESS`` (``ddp``: Lightning re-runs the command for ranks 1..N with the
  launching process's environment) or in the pickled config (``ddp_spawn``). That process hosts
  the cluster, so it outlives its ranks (:func:`wait_for_launched_ranks`).
* **embedded store** (``tq/backend=local``, one private store per rank): every rank replays the
  step: same seed, same weights (DDP keeps them identical), hence the same rollouts, rows, values
  and advantages. :func:`replica_shard` checks that the replicas agree (a mismatch raises instead
  of training on a wrong batch), keeps this rank's length-balanced shard of every global batch
  and clears the other rows from the rank's store (``MetaDataModule(rows="local")``).
  Rollout generation is repeated on every rank, not split; only training is.

Either way DDP averages gradients over ranks, so a rank divides its loss by
``loss_norm / world_size``: the averaged gradient is then the one-process gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict

from tq_plugin.config import ConfigError
from tq_plugin.data_plane import KVBatchMeta, call_dp
from tq_plugin.data_plane.sharding import shard_meta_for_dp
from tq_plugin.rl.training.metrics import IS_MAX_STATS, rl_metrics

# Per-rank microbatch sums whose rank values are the rank's share times the world size (the
# loss is divided by loss_norm / world_size): summed over ranks they count the world size once
# too often.
SCALED_BY_WORLD = ("loss", "value_loss")
PARALLEL_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "ModelParallelStrategy")
# Lightning's FSDP1 wrapper: the recipes shard with FSDP2 through ModelParallelStrategy instead.
SHARDED_PRESETS = "trainer=fsdp_cpu (CPU ranks) or trainer=fsdp (GPUs)"
# The cluster address the launching process hands to the DDP ranks Lightning starts.
CLUSTER_ADDRESS_ENV = "TQ_PLUGIN_CLUSTER_ADDRESS"


def check_parallel_run(trainer: Any, *, backend: Any, global_batch: int,
                       save_artifacts: bool, workers_generate: bool = False) -> None:
    """Refuse, before anything is built, a trainer setup the recipe cannot run correctly.

    One process per device: ``ddp`` and the sharded presets take any number of CPU ranks or
    CUDA GPUs (``trainer.devices``), each rank training on its shard of the global batch."""
    strategy = type(trainer.strategy).__name__
    if strategy == "FSDPStrategy":
        raise ConfigError(f"trainer.strategy=fsdp is Lightning's FSDP1 wrapper: the recipes shard "
                          f"their models with FSDP2, use {SHARDED_PRESETS}")
    if strategy not in PARALLEL_STRATEGIES:
        raise ConfigError(f"trainer.strategy: the recipes run on one device, data-parallel "
                          f"(auto, ddp, ddp_spawn) or sharded ({SHARDED_PRESETS}); got {strategy}")
    accelerator = type(trainer.accelerator).__name__
    world = trainer.world_size
    if accelerator not in ("CPUAccelerator", "CUDAAccelerator"):
        raise ConfigError(f"trainer.accelerator: the recipes run on the CPU or CUDA GPUs "
                          f"(trainer=cpu, gpu, ddp_cpu, fsdp_cpu, fsdp); got {accelerator}")
    if strategy == "ModelParallelStrategy":
        check_sharded_run(trainer.strategy, world=world, backend=backend,
                          workers_generate=workers_generate)
    if world == 1:
        return
    if global_batch % world:
        raise ConfigError(
            f"recipe.prompts_per_step * recipe.group_size / recipe.minibatches = {global_batch} "
            f"rows per global batch must divide evenly over {world} DDP ranks")
    from tq_plugin.data_plane import LocalDataPlane

    backend_cls = get_class(backend._target_)
    if not (issubclass(backend_cls, LocalDataPlane) or rank_shared_store(backend)
            or (shares_rows(backend_cls) and hasattr(backend_cls, "start_cluster"))):
        raise ConfigError(
            f"tq.backend={backend_cls.__name__} with {world} DDP ranks: every rank must attach to "
            "one store, but the config names no cluster and the backend cannot start one for the "
            "ranks (no start_cluster). Attach them to a running cluster (tq.backend.address="
            "<host:port>), use tq/backend=local, ray or transferqueue, or run one process")
    if not save_artifacts and strategy == "DDPStrategy" and trainer.strategy.launcher is not None \
            and type(trainer.strategy.launcher).__name__ == "_MultiProcessingLauncher":
        raise ConfigError("recipe.save_artifacts=false with trainer.strategy=ddp_spawn: the "
                          "run's summary only reaches the launching process through result.json")


def is_sharded_run(trainer: Any) -> bool:
    """FSDP2 over several ranks: every forward of the models is a collective all ranks join."""
    return trainer.world_size > 1 and type(trainer.strategy).__name__ == "ModelParallelStrategy"


def check_sharded_run(strategy: Any, *, world: int, backend: Any,
                      workers_generate: bool = False) -> None:
    """Refuse a ``ModelParallelStrategy`` run the recipe cannot honour, naming the key.

    FSDP2 shards every parameter over the ranks, so every forward is a collective: each step's
    rollouts and no-grad passes must run on every rank in lockstep, which the embedded store's
    replay does (every rank generates the same step) and a rank-0-only step does not (a shared
    store's rank 0: the other ranks would never join its gathers). A step source whose
    ``workers_generate`` (the disaggregated topology) runs: its workers generate, and every
    trainer rank joins the step's no-grad passes and the weights' gathers
    (``tq_plugin.rl.topology.disaggregated``)."""
    tp = getattr(strategy, "_tensor_parallel_size", 1)
    if tp not in (1, "auto") or (tp == "auto" and world > 1):
        raise ConfigError(f"trainer.strategy.tensor_parallel_size={tp}: the recipes shard with "
                          f"FSDP2 only; set it to 1")
    dp = getattr(strategy, "_data_parallel_size", world)
    if dp not in ("auto", world):
        raise ConfigError(f"trainer.strategy.data_parallel_size={dp} must equal the number of "
                          f"ranks ({world}: trainer.devices x trainer.num_nodes)")
    if world == 1:
        return
    if workers_generate:
        return
    replayed = issubclass(get_class(backend._target_), _local_store())
    if not replayed:
        raise ConfigError(f"tq.backend={backend._target_.rsplit('.', 1)[-1]} with a sharded "
                          f"trainer ({SHARDED_PRESETS}): rank 0 would generate each step alone, "
                          f"but FSDP's forwards need every rank; use tq/backend=local (every rank "
                          f"replays the step), recipe.topology=disaggregated (workers generate) "
                          f"or trainer=ddp_cpu")


def _local_store() -> type:
    from tq_plugin.data_plane import LocalDataPlane

    return LocalDataPlane


def shares_rows(backend_cls: type) -> bool:
    """Whether a backend class states, as a class attribute, that other processes reach its
    rows (``LocalDataPlane.shared`` is a property that says False)."""
    return getattr(backend_cls, "shared", False) is True


def rank_shared_store(backend: Any) -> bool:
    """Whether every DDP rank that builds ``backend`` (the ``tq.backend`` node) reaches one store:
    the class shares its rows across processes and the config names the cluster to attach to."""
    if not shares_rows(get_class(backend._target_)):
        return False
    address = backend.get("address") or (backend.get("ray_init") or {}).get("address")
    return address not in (None, "", "local")


def share_store_across_ranks(backend: DictConfig) -> str | None:
    """Point ``backend`` (the ``tq.backend`` node, edited in place) at the one cluster every DDP
    rank attaches to; the address when this process started that cluster, else ``None``.

    A backend that is not shared, or whose config names a cluster already, is left as it is. A
    rank Lightning launched finds the address in ``CLUSTER_ADDRESS_ENV``; the launching process
    starts the cluster (``start_cluster`` of the backend class, with the node's options) and
    returns its address, which :func:`exported_address` hands to the ranks for the fit.
    """
    cls = get_class(backend._target_)
    if not shares_rows(cls) or rank_shared_store(backend):
        return None
    address = os.environ.get(CLUSTER_ADDRESS_ENV)
    started = None
    if not address:
        options = OmegaConf.to_container(backend, resolve=True)
        options.pop("_target_", None)
        address = started = cls.start_cluster(**options)
    with open_dict(backend):
        backend.address = address
    return started


@contextlib.contextmanager
def exported_address(address: str | None) -> Iterator[None]:
    """``CLUSTER_ADDRESS_ENV=address`` in this process's environment while the block runs (the
    fit, when Lightning launches the ranks), and as it was afterwards."""
    if address is None:
        yield
        return
    before = os.environ.get(CLUSTER_ADDRESS_ENV)
    os.environ[CLUSTER_ADDRESS_ENV] = address
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CLUSTER_ADDRESS_ENV, None)
        else:
            os.environ[CLUSTER_ADDRESS_ENV] = before


def wait_for_launched_ranks(trainer: Any, timeout_s: float = 120.0) -> None:
    """Wait for the rank processes this process's trainer launched (``ddp``: Lightning re-runs
    the command for ranks 1..N) to exit, so a cluster this process hosts outlives every rank
    attached to it. A rank still running after ``timeout_s`` raises ``TimeoutError``.
    (``ddp_spawn``'s launcher has joined its processes, and raised for a failed one, before the
    fit returns.)"""
    procs = [p for p in getattr(trainer.strategy.launcher, "procs", None) or []
             if isinstance(p, subprocess.Popen)]
    for rank, proc in enumerate(procs, start=1):
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"DDP rank {rank} (pid {proc.pid}) still runs {timeout_s:g} s "
                               "after rank 0 finished") from None
        if code != 0:
            raise RuntimeError(f"DDP rank {rank} (pid {proc.pid}) exited with status {code}")


def replica_shard(meta: KVBatchMeta, client: Any, *, strategy: Any, global_batch: int) -> KVBatchMeta:
    """This rank's length-balanced shard of a step every rank generated identically.

    The ranks first compare a fingerprint of the step's row lengths: replicas that differ would
    shard different rows (and plan different microbatch counts, which deadlocks DDP).
    """
    lengths = torch.tensor(meta.sequence_lengths, dtype=torch.int64)
    position = torch.arange(1, len(lengths) + 1, dtype=torch.int64)
    fingerprint = torch.stack([lengths.sum(), (lengths * position).sum(),
                               torch.tensor(len(lengths))]).to(strategy.root_device)
    high = strategy.reduce(fingerprint.clone(), reduce_op="max")
    low = -strategy.reduce(-fingerprint, reduce_op="max")
    if not torch.equal(high, low):
        raise RuntimeError(
            "DDP ranks generated different rollouts for one step (row lengths differ): with "
            "tq/backend=local every rank must replay the same step (same recipe.seed, same "
            "weights, same torch build and threads)")
    shards, _ = shard_meta_for_dp(meta, dp_world=strategy.world_size, batch_size=global_batch)
    mine = shards[strategy.global_rank]
    others = sorted(set(meta.sample_ids) - set(mine.sample_ids))
    if others:
        call_dp(client, "clear_samples", sample_ids=others, partition_id=meta.partition_id)
    return mine


def gather_objects(obj: Any, world: int) -> list[Any]:
    """``obj`` from every rank, in rank order (one rank: ``[obj]``)."""
    if world == 1 or not torch.distributed.is_initialized():
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def _unscale(sums: dict[str, float], world: int) -> dict[str, float]:
    """Rank-summed ``sums`` with the losses counted once: each rank's loss carries the world size
    (its normalizer is divided by it: DDP averages gradients over ranks)."""
    for key in SCALED_BY_WORLD:
        if key in sums:
            sums[key] /= world
    return sums


def reduce_over_ranks(trainer: Any, sums: dict[str, float]) -> dict[str, float]:
    """One global batch's microbatch sums over every rank, combined as :func:`merge_rank_steps`
    combines a step's: summed, the losses counted once, ``seconds`` the slowest rank's and
    ``is_ratio_max`` the largest. So the logged ``rl/*`` are the figures ``metrics.csv`` holds,
    not rank 0's (one all-reduce sum, one max)."""
    world = trainer.world_size
    if world == 1:
        return dict(sums)
    strategy = trainer.strategy
    keys = sorted(sums)
    values = torch.tensor([sums[k] for k in keys], dtype=torch.float64,
                          device=strategy.root_device)
    longest = strategy.reduce(values.clone(), reduce_op="max")
    total = _unscale(dict(zip(keys, strategy.reduce(values, reduce_op="sum").tolist(),
                              strict=True)), world)
    for key in ("seconds", *IS_MAX_STATS):
        if key in total:
            total[key] = float(longest[keys.index(key)])
    return total


def merge_rank_steps(per_rank: list[list[Any]]) -> list[Any]:
    """One step record per RL step from every rank's records of that step.

    The ranks' microbatch sums add up (tokens, clipped and action tokens, ...) and the per-step
    figures are derived again from the totals; the rollout fields are the same on every rank;
    ``train_s`` is the slowest rank's (the ranks wait for each other every optimizer step);
    each rank's peak memory is kept, in rank order (``peak_mem_mb_rank<r>`` in ``metrics.csv``).
    """
    merged = []
    world = len(per_rank)
    for records in zip(*per_rank, strict=True):
        if len({r.step for r in records}) != 1:
            raise RuntimeError(f"ranks trained different RL steps: {[r.step for r in records]}")
        sums: dict[str, float] = {}
        for record in records:
            for key, value in record.sums.items():
                sums[key] = sums.get(key, 0.0) + value
        _unscale(sums, world)
        is_sums: dict[str, float] = {}
        for record in records:
            for key, value in record.is_sums.items():
                pick = max if key in IS_MAX_STATS else (lambda a, b: a + b)
                is_sums[key] = pick(is_sums[key], value) if key in is_sums else value
        first = records[0]
        train_s = max(r.train_s for r in records)
        figures = rl_metrics(sums, first.global_batches)
        figures["tokens_per_s"] = sums.get("real_tokens", 0.0) / train_s if train_s else 0.0
        merged.append(dataclasses.replace(
            first, sums=sums, is_sums=is_sums, **figures, train_s=train_s,
            real_tokens=sums.get("real_tokens", 0.0), padded_tokens=sums.get("padded_tokens", 0.0),
            microbatches=sum(r.microbatches for r in records),
            rank_peak_mem_mb=[r.peak_mem_mb for r in records],
            dp_bytes=sum(r.dp_bytes for r in records)))
    return merged

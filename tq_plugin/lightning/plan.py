"""Per-step microbatch planning: mint the pad target, shard over ranks, cut microbatches.

``plan_step`` is what the DataModule runs for each RL step on each rank. It is deterministic
given the step meta, so every rank (and a resumed run) computes the same plan.

* ``rows="shared"``: every rank sees the whole step meta (a backend all ranks share). The pad
  target is minted on the whole meta, the meta is length-balanced over ``world_size`` ranks and
  each rank keeps its shard, which inherits the target.
* ``rows="local"``: each rank holds the rows it produced (the embedded backend under DDP). Each
  rank plans its own rows; the ranks agree on the pad target and on the microbatch count of every
  global batch through ``reduce_max`` (the strategy's all-reduce), so every rank pads to the same
  width and runs the same number of steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import (
    ELEM_COUNTS_PER_GB,
    GLOBAL_FORWARD_PAD_SEQLEN,
    MICRO_BATCH_INDICES,
    MICRO_BATCH_LENGTHS,
)
from tq_plugin.lightning.driver import PackingConfigError, TQDriverMixin
from tq_plugin.lightning.module import (
    MICRO_BATCH_LENGTH,
    MICROBATCH_INFO,
    PACK_PAD_MULTIPLE,
    STEP_SAMPLE_IDS,
)

ROW_PLACEMENTS = ("shared", "local")
# The planners' name for a token budget; errors are reworded with the key the user set.
BUDGET_ARG = "max_tokens_per_microbatch"
ReduceMax = Callable[[list[int]], list[int]]
ShardFn = Callable[..., tuple[list[KVBatchMeta], Any]]
_PLAN_KEYS = (MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS, ELEM_COUNTS_PER_GB)


def default_shard_fn(meta: KVBatchMeta, **kwargs: Any) -> tuple[list[KVBatchMeta], Any]:
    from tq_plugin.data_plane.sharding import shard_meta_for_dp

    return shard_meta_for_dp(meta, **kwargs)


def _row_ranges(rows: int, per_gb: int | None, micro: int | None) -> list[list[list[int]]]:
    """Global batches of ``per_gb`` rows, each cut into microbatches of ``micro`` rows."""
    per_gb = per_gb or rows
    plan = []
    for g in range(0, rows, per_gb):
        end = min(g + per_gb, rows)
        step = micro or (end - g)
        plan.append([[s, min(s + step, end)] for s in range(g, end, step)])
    return plan


def _equalize(ranges: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest microbatches until there are ``count``; empty ones when none splits.

    Splitting only shrinks microbatches, so a token budget that held still holds.
    """
    out = [list(r) for r in ranges]
    while len(out) < count:
        i = max(range(len(out)), key=lambda k: out[k][1] - out[k][0], default=None)
        if i is None or out[i][1] - out[i][0] < 2:
            end = out[-1][1] if out else 0
            out.append([end, end])
            continue
        s, e = out[i]
        mid = (s + e) // 2
        out[i : i + 1] = [[s, mid], [mid, e]]
    return out


def _shard_plan(shard: KVBatchMeta, per_gb: int | None, micro: int | None) -> list[list[list[int]]]:
    """A shard's microbatch row ranges per global batch: the packer's plan, else fixed rows."""
    plan = shard.extra_info.get(MICRO_BATCH_INDICES)
    if plan is None:
        plan = _row_ranges(shard.size, per_gb, micro) if shard.size else []
    return [[list(r) for r in gb] for gb in plan]


def _tokens(shard: KVBatchMeta, ranges: list[list[int]]) -> int:
    seq = shard.sequence_lengths or []
    return sum(sum(seq[s:e]) for s, e in ranges)


def plan_step(
    meta: KVBatchMeta,
    *,
    host: TQDriverMixin,
    fields: Sequence[str],
    task_name: str,
    step: int,
    epoch: int = 0,
    num_epochs: int = 1,
    mb_tokens_key: str = "train_mb_tokens",
    world_size: int = 1,
    rank: int = 0,
    rows: str = "shared",
    reduce_max: ReduceMax | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    shard_fn: ShardFn | None = None,
) -> list[KVBatchMeta]:
    """This rank's microbatch metas for one pass over a step, in training order.

    ``micro_batch_size`` (rows per microbatch when neither packing mode is on) defaults to the
    host's ``cfg["train_micro_batch_size"]``, else one microbatch per global batch.
    """
    if rows not in ROW_PLACEMENTS:
        raise ValueError(f"rows must be one of {list(ROW_PLACEMENTS)}, got {rows!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    agree = rows == "local" and world_size > 1
    if agree and reduce_max is None:
        raise ValueError("rows='local' with world_size > 1 needs reduce_max (an all-reduce max)")
    if global_batch_size is not None and global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be divisible by world_size ({world_size})"
        )
    if micro_batch_size is None:
        micro_batch_size = (getattr(host, "cfg", None) or {}).get("train_micro_batch_size")
    sp_args, db_args = host.packing_args(mb_tokens_key)
    isolated = host.isolated_meta(meta, fields=fields, task_name=task_name)
    if rows == "shared":
        dp_world, shard_rank, batch_size = world_size, rank, global_batch_size
    else:
        dp_world, shard_rank = 1, 0
        batch_size = None if global_batch_size is None else global_batch_size // world_size
    if isolated.size:
        try:
            shards, _ = (shard_fn or default_shard_fn)(
                isolated,
                dp_world=dp_world,
                batch_size=batch_size,
                sequence_packing_args=sp_args,
                dynamic_batching_args=db_args,
            )
        except ValueError as exc:
            if BUDGET_ARG not in str(exc):
                raise
            key = host.packing_config_key(mb_tokens_key)
            raise PackingConfigError(str(exc).replace(BUDGET_ARG, key)) from exc
        shard = shards[shard_rank]
    else:
        shard = isolated
    per_gb = None if batch_size is None else batch_size // dp_world
    lengths = shard.extra_info.get(MICRO_BATCH_LENGTHS)
    if MICRO_BATCH_INDICES not in shard.extra_info:
        lengths = None
    plan = _shard_plan(shard, per_gb, micro_batch_size)
    # Real tokens of each global batch over every rank: known here when every rank plans the
    # whole step (shared rows); with local rows each rank knows only its own.
    gb_tokens = [_tokens(shard, gb) for gb in plan]
    if rows == "shared" and isolated.size and world_size > 1:
        gb_tokens = [0] * len(plan)
        for other in shards:
            for g, gb in enumerate(_shard_plan(other, per_gb, micro_batch_size)[: len(plan)]):
                gb_tokens[g] += _tokens(other, gb)
    if agree:
        target = int(isolated.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0))
        target, n_gb = reduce_max([target, len(plan)])  # type: ignore[misc]
        isolated.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = target
        shard.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = target
        plan += [[] for _ in range(n_gb - len(plan))]
        counts = reduce_max([len(gb) for gb in plan])  # type: ignore[misc]
        equalized = [_equalize(gb, c) for gb, c in zip(plan, counts)]
        if equalized != plan:
            lengths = None
        plan = equalized
    base = {k: v for k, v in shard.extra_info.items() if k not in _PLAN_KEYS}
    if sp_args is not None:
        base[PACK_PAD_MULTIPLE] = int(sp_args.get("sequence_length_pad_multiple", 1))
    total = sum(len(gb) for gb in plan)
    spread = world_size if rows == "shared" else 1
    out: list[KVBatchMeta] = []
    for g, gb in enumerate(plan):
        tokens = gb_tokens[g] if g < len(gb_tokens) else 0
        for j, (start, end) in enumerate(gb):
            mb = shard.slice(start, end) if end > start else shard.subset([])
            extra = dict(base)
            if lengths is not None and db_args is not None:  # a padded width, not a packed length
                extra[MICRO_BATCH_LENGTH] = int(lengths[g][j])
            last = epoch == num_epochs - 1 and len(out) == total - 1
            extra[MICROBATCH_INFO] = {
                "step": step,
                "epoch": epoch,
                "global_batch": g,
                "index": j,
                "count": len(gb),
                "index_in_step": epoch * total + len(out),
                "last_in_global_batch": j == len(gb) - 1,
                "last_in_step": last,
                # The loss normalizer (MetaBatchMixin.dp_token_mean): the global batch's real
                # tokens over the ranks DDP averages across, so rank-mean of the per-rank
                # losses is the token mean of the whole global batch, in every packing mode.
                "global_batch_tokens": tokens,
                "loss_tokens": tokens / spread,
            }
            if last:
                extra[STEP_SAMPLE_IDS] = list(shard.sample_ids)
            mb.extra_info = extra
            out.append(mb)
    return out

"""Which sweep jobs are the same run, and which differ only in their seed (torch-free).

A packing mode ignores some ``tq.packing`` keys (``none`` never reads a token budget), so a
sweep over ``tq/packing=none,sequence_packing tq.packing.train_mb_tokens=256,1024`` would run
``none`` twice. :func:`run_key` names a job's run with those keys left out; the ``tq_dedup``
sweeper launches one job per key and the sweep report aggregates per :func:`setting_key`.
"""

from __future__ import annotations

from collections.abc import Sequence

PACKING_GROUP = "tq/packing"
SEED_KEYS = ("recipe.seed",)
# tq.packing keys each mode never reads (plan_step, the planners and the mixin).
IGNORED_BY_MODE: dict[str, tuple[str, ...]] = {
    "none": ("train_mb_tokens", "logprob_mb_tokens", "algorithm", "microbatch_order"),
    "sequence_packing": ("micro_batch_size",),
    "dynamic_batching": ("micro_batch_size", "algorithm", "microbatch_order"),
}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def run_key(overrides: Sequence[str], default_mode: str | None = None) -> tuple[str, ...]:
    """The job's overrides without the ``tq.packing`` keys its packing mode ignores, sorted."""
    mode = default_mode
    for o in overrides:
        if _key(o) == PACKING_GROUP:
            mode = o.split("=", 1)[1]
    ignored = {f"tq.packing.{k}" for k in IGNORED_BY_MODE.get(mode or "", ())}
    return tuple(sorted(o for o in overrides if _key(o) not in ignored))


def setting_key(overrides: Sequence[str], default_mode: str | None = None) -> tuple[str, ...]:
    """:func:`run_key` without the seed: the setting a comparison aggregates over seeds."""
    return tuple(o for o in run_key(overrides, default_mode) if _key(o) not in SEED_KEYS)

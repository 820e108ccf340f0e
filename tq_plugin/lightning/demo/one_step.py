"""One GRPO-shaped step through the embedded data plane, printed: what moved, and where.

Run: ``python -m tq_plugin.demo``. It mints keys at rollout, writes the rollout with one flat put,
stamps per-row tags, shards the meta over two data-parallel ranks, writes logprobs and advantages
back under the same keys, reads padded training columns, and clears the step.
"""

from __future__ import annotations

import time
import uuid

import torch

from tq_plugin.data_plane import (
    DP_TRAIN_FIELDS,
    GLOBAL_FORWARD_PAD_SEQLEN,
    LocalDataPlane,
    first_write,
    nested_from_lengths,
    read_columns,
    stamp_global_forward_pad_seqlen,
    write_columns,
)


def main(num_prompts: int = 16, group_size: int = 4, seed: int = 0) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    n = num_prompts * group_size
    lengths = torch.randint(100, 2001, (n,), generator=g)
    total = int(lengths.sum())
    rollout = {
        "input_ids": nested_from_lengths(torch.randint(0, 32_000, (total,), generator=g), lengths),
        "token_mask": nested_from_lengths((torch.rand(total, generator=g) > 0.3).float(), lengths),
        "generation_logprobs": nested_from_lengths(torch.rand(total, generator=g).neg_(), lengths),
        "input_lengths": lengths,
        "sample_mask": torch.ones(n),
        "total_reward": torch.rand(n, generator=g),
    }
    ids = [f"{uuid.uuid4().hex[:8]}_g{i}" for _ in range(num_prompts) for i in range(group_size)]

    client = LocalDataPlane()
    client.register_partition("train", [*DP_TRAIN_FIELDS, "total_reward"], num_samples=n)
    t0 = time.perf_counter()
    meta = first_write(rollout, sample_ids=ids, client=client, partition_id="train")
    rewards = rollout["total_reward"].view(num_prompts, group_size)
    baseline = rewards.mean(1, keepdim=True).expand_as(rewards)
    meta.stamp_tags({"baseline": baseline.flatten().tolist()})
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=64)
    pad = meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN]

    # Each "rank" reads its half, computes logprobs, and writes them back under the same keys.
    for rank_meta in (meta.slice(0, n // 2), meta.slice(n // 2, n)):
        cols = read_columns(client, rank_meta, ["input_ids", "token_mask"])
        write_columns(client, rank_meta, {
            "prev_logprobs": torch.zeros(cols["input_ids"].shape),
            "reference_policy_logprobs": torch.zeros(cols["input_ids"].shape),
        })
    adv = (rewards - baseline).flatten()[:, None].expand(n, pad).contiguous()
    write_columns(client, meta, {"advantages": adv})
    train = read_columns(client, meta, list(DP_TRAIN_FIELDS))
    elapsed = time.perf_counter() - t0
    stats = client.stats()
    client.clear_samples(partition_id="train", sample_ids=meta.sample_ids)
    client.close()

    real = int(lengths.sum())
    padded = n * pad
    summary = {
        "rows": n,
        "pad_target": pad,
        "real_tokens": real,
        "padded_tokens": padded,
        "live_mb": stats["live_bytes"] / 1e6,
        "elapsed_ms": elapsed * 1e3,
    }
    print(f"rollout: {n} rows ({num_prompts} prompts x {group_size}), {real:,} real tokens")
    print(f"keys minted once at rollout, e.g. {ids[0]!r}; every write-back landed under them")
    print(f"pad target (one per step, every rank): {pad}; padded read {tuple(train['input_ids'].shape)}")
    print(f"columns held jagged: {stats['live_bytes'] / 1e6:.1f} MB live in the store "
          f"(padding would cost {padded / real:.1f}x the tokens)")
    print(f"fields read for training: {', '.join(train.keys())}")
    print(f"whole step through the data plane: {elapsed * 1e3:.1f} ms")
    return summary


if __name__ == "__main__":
    main()

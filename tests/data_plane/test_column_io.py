"""Column I/O: first write, write-back, padded reads and the pad target (reference §5.1, §7, §14.5)."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.data_plane import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    KVBatchMeta,
    first_write,
    jaggedize,
    materialize,
    read_columns,
    round_up,
    stamp_global_forward_pad_seqlen,
    write_columns,
)

from .conftest import ragged


def _rollout(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    lens = [5, 9, 3, 7][:n]
    return {
        "input_ids": ragged(lens, torch.int64, seed=seed),
        "token_mask": ragged(lens, torch.float32, seed=seed + 1),
        "generation_logprobs": ragged(lens, torch.float32, seed=seed + 2),
        "input_lengths": torch.tensor(lens),
        "sample_mask": torch.ones(n),
        "total_reward": torch.arange(n, dtype=torch.float32),
    }


@pytest.fixture
def step(client):
    client.register_partition("train", [])
    batch = _rollout()
    ids = [f"uid_g{i}" for i in range(4)]
    meta = first_write(batch, sample_ids=ids, client=client, partition_id="train", pad_to_multiple=4)
    return client, batch, meta


def test_round_up():
    assert [round_up(v, 64) for v in (1, 64, 65)] == [64, 64, 128]
    assert round_up(13, 1) == 13 and round_up(13, 0) == 13


def test_first_write_returns_the_step_meta(step):
    client, batch, meta = step
    assert meta.sample_ids == ["uid_g0", "uid_g1", "uid_g2", "uid_g3"]
    assert meta.task_name == "train" and meta.sequence_lengths == [5, 9, 3, 7]
    assert set(meta.fields) == set(batch)
    assert meta.extra_info == {"pad_to_multiple": 4}
    assert client.list_sample_ids("train") == sorted(meta.sample_ids)


def test_first_write_rejects_bad_batches(client):
    client.register_partition("train", [])
    batch = _rollout()
    with pytest.raises(ValueError, match="3 sample_ids for a batch of 4"):
        first_write(batch, sample_ids=["a", "b", "c"], client=client, partition_id="train")
    with pytest.raises(ValueError, match="needs a 'sample_mask'"):
        first_write({"input_lengths": batch["input_lengths"]}, sample_ids=list("abcd"), client=client, partition_id="train")
    with pytest.raises(TypeError, match="'names' is list"):
        first_write({**batch, "names": ["x"] * 4}, sample_ids=list("abcd"), client=client, partition_id="train")
    with pytest.raises(ValueError, match="2 tags"):
        first_write(batch, sample_ids=list("abcd"), client=client, partition_id="train", tags=[{}, {}])
    assert client.list_sample_ids("train") == []


def test_first_write_jaggedizes_padded_per_token_columns(client):
    client.register_partition("train", [])
    padded = torch.arange(12).reshape(2, 6)
    meta = first_write(
        {"input_ids": padded, "input_lengths": torch.tensor([2, 6]), "sample_mask": torch.ones(2)},
        sample_ids=["a", "b"], client=client, partition_id="train",
    )
    got = client.get_samples(
        partition_id="train", sample_ids=meta.sample_ids, select_fields=["input_ids"]
    )["input_ids"]
    assert [r.tolist() for r in got.unbind()] == [[0, 1], [6, 7, 8, 9, 10, 11]]


def test_padded_read_matches_manual_padding_at_the_pad_target(step):
    client, batch, meta = step
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=8)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 16
    shard = meta.subset([2, 0])
    out = read_columns(client, shard, ["input_ids", "token_mask", "total_reward"], pad_value_dict={"input_ids": -1})
    assert out["input_ids"].shape == (2, 16) and out["token_mask"].shape == (2, 16)
    rows = batch["input_ids"].unbind()
    expect = torch.full((2, 16), -1, dtype=torch.int64)
    expect[0, :3] = rows[2]
    expect[1, :5] = rows[0]
    assert torch.equal(out["input_ids"], expect)
    assert out["token_mask"][0, 3:].eq(0).all()
    assert out["total_reward"].tolist() == [2.0, 0.0]


def test_jagged_read_returns_nested_untouched(step):
    client, batch, meta = step
    out = read_columns(client, meta, ["generation_logprobs"], layout="jagged")
    assert out["generation_logprobs"].is_nested
    assert torch.equal(out["generation_logprobs"].values(), batch["generation_logprobs"].values())


def test_write_back_of_padded_columns_lands_at_row_lengths(step):
    client, _, meta = step
    stamp_global_forward_pad_seqlen(meta)
    adv = torch.arange(4 * 9, dtype=torch.float32).reshape(4, 9)
    write_columns(client, meta, {"advantages": adv, "baseline": torch.ones(4)})
    got = client.get_samples(
        partition_id="train", sample_ids=meta.sample_ids, select_fields=["advantages"]
    )["advantages"]
    assert [r.shape[0] for r in got.unbind()] == [5, 9, 3, 7]
    assert torch.equal(got.unbind()[2], adv[2, :3])
    padded = read_columns(client, meta, ["advantages", "input_ids"])
    assert padded["advantages"].shape == padded["input_ids"].shape == (4, 12)  # pad_to_multiple=4


def test_write_back_refuses_to_truncate_and_to_misalign(step):
    client, _, meta = step
    with pytest.raises(ValueError, match="refusing to truncate"):
        write_columns(client, meta, {"advantages": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match="row lengths differ"):
        write_columns(client, meta, {"advantages": ragged([5, 9, 3, 6], torch.float32)})
    with pytest.raises(KeyError):
        client.get_samples(
            partition_id="train", sample_ids=meta.sample_ids, select_fields=["advantages"]
        )


class _CallLog:
    """A client that passes every method call on to ``client`` and logs the method's name."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, []

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return call


def _stored(client, names: list[str]) -> tuple[list[str], list[dict], dict]:
    """The partition's ids, tags and the bytes of ``names`` (a jagged column's values and
    offsets)."""
    ids = client.list_sample_ids("train")
    td = client.get_samples(partition_id="train", sample_ids=ids, select_fields=names)
    parts = {n: (td[n].values(), td[n].offsets()) if td[n].is_nested else (td[n],) for n in names}
    return ids, client.get_tags(partition_id="train", sample_ids=ids), parts


def test_write_columns_with_nothing_writes_nothing(step):
    from tensordict import TensorDict

    client, batch, meta = step
    ids, tags, columns = _stored(client, sorted(batch))
    logged = _CallLog(client)
    write_columns(logged, meta, {})
    write_columns(logged, meta, TensorDict({}, batch_size=[meta.size]))
    assert logged.calls == []  # not even a put of no fields
    after_ids, after_tags, after = _stored(client, sorted(batch))
    assert (after_ids, after_tags) == (ids, tags)
    for name, parts in columns.items():
        assert all(torch.equal(a, b) for a, b in zip(after[name], parts, strict=True)), name
    with pytest.raises(KeyError):
        client.get_samples(partition_id="train", sample_ids=ids, select_fields=["advantages"])


def test_read_never_mints_and_stamp_is_a_ratchet():
    meta = KVBatchMeta("p", None, ["a", "b"], sequence_lengths=[10, 70])
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=64)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 128
    meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = 256
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=64)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 256
    empty = KVBatchMeta("p", None, [])
    stamp_global_forward_pad_seqlen(empty)
    assert GLOBAL_FORWARD_PAD_SEQLEN not in empty.extra_info


def test_materialize_widens_only_per_token_columns():
    from tensordict import TensorDict

    td = TensorDict(
        {
            "input_ids": ragged([3, 5], torch.int64),
            "pixel_values": torch.zeros(2, 5, 4, 4),
            "prev_logprobs": torch.zeros(2, 5),
        },
        [2],
    )
    out = materialize(td, "padded", pad_to_seqlen=64)
    assert out["input_ids"].shape == (2, 64)
    assert out["prev_logprobs"].shape == (2, 64)
    assert out["pixel_values"].shape == (2, 5, 4, 4)
    with pytest.raises(ValueError, match="layout"):
        materialize(td, "packed")  # type: ignore[arg-type]


def test_jaggedize_checks_shapes():
    with pytest.raises(ValueError, match=r"\[N=2, S, ...\]"):
        jaggedize("x", torch.zeros(3), torch.tensor([1, 2]))
    nt = jaggedize("x", torch.arange(6).reshape(2, 3, 1), torch.tensor([1, 3]))
    assert nt.unbind()[1].shape == (3, 1)


def test_first_write_carries_dense_multimodal_extras_exactly(client):
    client.register_partition("train", [])
    feats = torch.randn(4, 16, 32).to(torch.bfloat16)
    meta = first_write({**_rollout(), "image_features": feats}, sample_ids=list("abcd"),
                       client=client, partition_id="train")
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=64)
    out = read_columns(client, meta, ["image_features", "input_ids"])
    assert out["image_features"].dtype == torch.bfloat16
    assert torch.equal(out["image_features"], feats)  # dim 1 counts patches: never widened
    assert out["input_ids"].shape == (4, 64)


def test_write_columns_accepts_a_tensordict(step):
    from tensordict import TensorDict

    client, _, meta = step
    write_columns(client, meta, TensorDict({"baseline": torch.arange(4.0)}, [4]))
    assert client.get_samples(
        partition_id="train", sample_ids=meta.sample_ids, select_fields=["baseline"]
    )["baseline"].tolist() == [0, 1, 2, 3]


def test_dynamic_sampling_drops_and_clears_zero_std_groups(client):
    """Keys are minted once at rollout; a dropped group is cleared, survivors stay readable."""
    client.register_partition("train", [])
    n_prompts, group = 3, 2
    lens = [4, 6, 5, 3, 7, 2]
    batch = {
        "input_ids": ragged(lens, torch.int64),
        "input_lengths": torch.tensor(lens),
        "sample_mask": torch.ones(6),
        "total_reward": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
    }
    ids = [f"u{p}_g{i}" for p in range(n_prompts) for i in range(group)]
    meta = first_write(batch, sample_ids=ids, client=client, partition_id="train")
    std = batch["total_reward"].view(n_prompts, group).std(1).repeat_interleave(group)
    meta.stamp_tags({"std": std.tolist()})
    zero = [i for i, t in enumerate(meta.tags) if t["std"] == 0.0]
    dropped = meta.subset(zero)
    kept = meta.drop(zero)
    client.clear_samples(partition_id="train", sample_ids=dropped.sample_ids)
    assert kept.sample_ids == ["u0_g0", "u0_g1", "u2_g0", "u2_g1"]
    with pytest.raises(KeyError, match="u1_g0"):
        client.get_samples(
            partition_id="train", sample_ids=dropped.sample_ids, select_fields=["input_ids"]
        )
    out = read_columns(client, kept, ["input_ids", "total_reward"], layout="jagged")
    assert [r.shape[0] for r in out["input_ids"].unbind()] == [4, 6, 7, 2]


def test_payload_bytes_counts_values_buffers_not_padding():
    from tq_plugin.data_plane import payload_bytes

    fields = {"ids": ragged([3, 5], torch.int64), "mask": torch.zeros(2, 4), "note": "x"}
    assert payload_bytes(fields) == 8 * 8 + 2 * 4 * 4
    assert payload_bytes(None) == 0

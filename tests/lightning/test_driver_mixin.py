"""TQDriverMixin against the reference behaviour (seed 000, reference section 8 and 14.7)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tq_plugin.data_plane import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_IDS,
    INPUT_LENGTHS,
    PAD_TO_MULTIPLE,
    SAMPLE_MASK,
    VALUE_SEED_FIELDS,
    KVBatchMeta,
    LocalDataPlane,
    first_write,
    nested_from_lengths,
)
from tq_plugin.lightning import PackingConfigError, TQDriverMixin


class Host(TQDriverMixin):
    def __init__(self, cfg: dict[str, Any] | None = None, **attrs: Any) -> None:
        self.cfg = cfg or {}
        self.dp_client = None
        for k, v in attrs.items():
            setattr(self, k, v)


def dyn_host(round_: int = 8, **tokens: int) -> Host:
    return Host(
        {"dynamic_batching": {"train_mb_tokens": 1024, **tokens}},
        use_dynamic_batches=True,
        dynamic_batching_args={"sequence_length_round": round_, "max_tokens_per_microbatch": 0},
    )


def pack_host(**tokens: int) -> Host:
    return Host(
        {"sequence_packing": {"train_mb_tokens": 256, **tokens}},
        use_sequence_packing=True,
        sequence_packing_args={"algorithm": "modified_first_fit_decreasing"},
    )


def meta(lengths: list[int], **extra: Any) -> KVBatchMeta:
    return KVBatchMeta(
        "train", "train", [f"k{i}" for i in range(len(lengths))],
        sequence_lengths=list(lengths), extra_info=dict(extra),
    )


class TestPackingArgs:
    def test_dynamic_batching_branch(self) -> None:
        host = dyn_host(8, logprob_mb_tokens=512)
        assert host._packing_args("logprob_mb_tokens") == (
            None, {"sequence_length_round": 8, "max_tokens_per_microbatch": 512}
        )
        assert host._packing_args("train_mb_tokens")[1]["max_tokens_per_microbatch"] == 1024

    def test_sequence_packing_branch(self) -> None:
        spa, dba = pack_host()._packing_args("train_mb_tokens")
        assert dba is None
        assert spa == {"algorithm": "modified_first_fit_decreasing", "max_tokens_per_microbatch": 256}

    def test_neither_mode(self) -> None:
        assert Host()._packing_args("train_mb_tokens") == (None, None)

    def test_returns_copies_and_never_mutates_the_host(self) -> None:
        host = dyn_host(8, logprob_mb_tokens=512)
        before = copy.deepcopy(host.dynamic_batching_args)
        first = host._packing_args("logprob_mb_tokens")[1]
        first["sequence_length_round"] = 999
        second = host._packing_args("train_mb_tokens")[1]
        assert host.dynamic_batching_args == before
        assert second is not first and second["sequence_length_round"] == 8

    def test_missing_logprob_budget_is_a_key_error(self) -> None:
        with pytest.raises(KeyError, match="logprob_mb_tokens"):
            dyn_host()._packing_args("logprob_mb_tokens")
        with pytest.raises(KeyError, match="logprob_mb_tokens"):
            pack_host()._packing_args("logprob_mb_tokens")

    def test_unknown_stage_key(self) -> None:
        with pytest.raises(ValueError, match="mb_tokens_key"):
            Host()._packing_args("eval_mb_tokens")

    def test_both_modes_is_a_configuration_error(self) -> None:
        host = dyn_host()
        host.use_sequence_packing = True
        host.sequence_packing_args = {}
        with pytest.raises(PackingConfigError, match="mutually exclusive"):
            host._packing_args("train_mb_tokens")
        with pytest.raises(PackingConfigError, match="mutually exclusive"):
            Host().configure_packing(use_sequence_packing=True, use_dynamic_batches=True,
                                     sequence_packing_args={}, dynamic_batching_args={})

    def test_configure_packing_needs_the_mode_args(self) -> None:
        with pytest.raises(PackingConfigError, match="dynamic_batching_args"):
            Host().configure_packing(use_dynamic_batches=True)


class TestStampPadSeqlen:
    def test_mints_max_rounded_by_the_dynamic_batching_round(self) -> None:
        m = meta([1208, 1320, 944, 1080])
        dyn_host(64)._stamp_pad_seqlen(m)
        assert m.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 1344

    def test_pad_to_multiple_and_sequence_packing_do_not_round(self) -> None:
        m = meta([7, 9], **{PAD_TO_MULTIPLE: 4})
        pack_host()._stamp_pad_seqlen(m)
        assert m.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 12
        m2 = meta([7, 9])
        pack_host()._stamp_pad_seqlen(m2)
        assert m2.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 9

    def test_idempotent_first_writer_wins(self) -> None:
        m = meta([7, 9], **{GLOBAL_FORWARD_PAD_SEQLEN: 4096})
        dyn_host(64)._stamp_pad_seqlen(m)
        assert m.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 4096
        m2 = meta([7, 9])
        Host()._stamp_pad_seqlen(m2)
        dyn_host(64)._stamp_pad_seqlen(m2)
        assert m2.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 9

    def test_no_lengths_is_a_no_op(self) -> None:
        for m in (KVBatchMeta("train", None, ["a"]), meta([])):
            Host()._stamp_pad_seqlen(m)
            assert GLOBAL_FORWARD_PAD_SEQLEN not in m.extra_info


class TestPadTargetIsolation:
    """Mirrors the reference's TestPadTargetIsolation (the ppo_epochs > 1 leak fix)."""

    def test_dispatch_does_not_stamp_the_callers_meta(self) -> None:
        caller = meta([7, 9])
        dispatched = Host()._isolated_meta(caller, fields=list(VALUE_SEED_FIELDS), task_name="value_fwd")
        assert GLOBAL_FORWARD_PAD_SEQLEN not in caller.extra_info
        assert dispatched.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 9
        assert dispatched.fields == list(VALUE_SEED_FIELDS)
        assert dispatched.task_name == "value_fwd"
        assert caller.fields is None and caller.task_name == "train"

    def test_a_stamped_caller_meta_does_not_decide_the_critic_pad(self) -> None:
        caller = meta([7, 9], **{GLOBAL_FORWARD_PAD_SEQLEN: 4096})
        dispatched = Host()._isolated_meta(caller, fields=[INPUT_IDS], task_name="value_train")
        assert dispatched.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 9
        assert caller.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 4096

    def test_second_epoch_critic_target_never_comes_from_the_policy(self) -> None:
        step = meta([7, 9, 30])
        policy, value = dyn_host(64), Host()
        for _epoch in range(2):
            policy._stamp_pad_seqlen(step)  # what the driver's read_from_dataplane does
            assert step.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 64
            v = value._isolated_meta(step, fields=[INPUT_IDS], task_name="value_train")
            p = policy._isolated_meta(step, fields=[INPUT_IDS], task_name="train")
            assert v.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 30
            assert p.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 64

    def test_isolated_meta_copies_rows(self) -> None:
        caller = meta([3, 4])
        caller.tags = [{"std": 1.0}, {"std": 2.0}]
        iso = Host()._isolated_meta(caller, fields=[INPUT_IDS], task_name="t")
        iso.sample_ids.append("x")
        iso.tags[0]["std"] = 0.0  # type: ignore[index]
        assert caller.sample_ids == ["k0", "k1"] and caller.tags[0]["std"] == 1.0


def _stored_step(client: LocalDataPlane, lengths: list[int]) -> KVBatchMeta:
    client.register_partition("train", fields=[])
    lens = torch.tensor(lengths)
    return first_write(
        {INPUT_IDS: nested_from_lengths(torch.arange(1, int(lens.sum()) + 1), lens),
         INPUT_LENGTHS: lens, SAMPLE_MASK: torch.ones(len(lengths))},
        sample_ids=[f"k{i}" for i in range(len(lengths))], client=client, partition_id="train",
    )


def test_read_from_dataplane_stamps_the_callers_meta_and_pads_to_it() -> None:
    host = dyn_host(4)
    host.dp_client = LocalDataPlane()
    step = _stored_step(host.dp_client, [2, 3])
    td = host.read_from_dataplane(step, select_fields=[INPUT_IDS], pad_value_dict={INPUT_IDS: -1})
    assert step.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 4
    assert td[INPUT_IDS].tolist() == [[1, 2, -1, -1], [3, 4, 5, -1]]


def test_write_to_dataplane_lands_jagged_at_the_rows_lengths() -> None:
    host = Host()
    host.dp_client = LocalDataPlane()
    step = _stored_step(host.dp_client, [2, 3])
    host.write_to_dataplane(step, {"advantages": torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])})
    got = host.dp_client.get_samples(
        partition_id="train", sample_ids=step.sample_ids, select_fields=["advantages"]
    )["advantages"]
    assert [r.tolist() for r in got.unbind()] == [[1.0, 2.0], [3.0, 4.0, 5.0]]


# ----------------------------------------------------------------------- one definition each
def test_public_names_and_the_seeds_aliases_are_one_method() -> None:
    assert TQDriverMixin._packing_args is TQDriverMixin.packing_args
    assert TQDriverMixin._stamp_pad_seqlen is TQDriverMixin.stamp_pad_seqlen
    assert TQDriverMixin._isolated_meta is TQDriverMixin.isolated_meta


@pytest.mark.parametrize("mode", ["none", "sequence_packing", "dynamic_batching"])
def test_demo_packing_setup_is_packing_config(mode: str) -> None:
    from tq_plugin.config import PackingConfig
    from tq_plugin.lightning.demo import packing_setup

    cfg, attrs = packing_setup(mode, train_mb_tokens=64, micro_batch_size=4,
                               sequence_length_round=8)
    packing = PackingConfig(name=mode, use_sequence_packing=mode == "sequence_packing",
                            use_dynamic_batches=mode == "dynamic_batching", train_mb_tokens=64,
                            micro_batch_size=4, sequence_length_round=8)
    assert (cfg, attrs) == (packing.model_cfg(), packing.host_attributes())


def test_layouts_are_defined_once() -> None:
    from tq_plugin.config import schema
    from tq_plugin.lightning import layout

    assert layout.LAYOUTS is schema.LAYOUTS

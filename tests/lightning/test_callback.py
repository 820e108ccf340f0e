"""DataPlaneCallback lifecycle: client ownership, write-back, clears, metrics, failures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

from tq_plugin.data_plane import INPUT_IDS, PREV_LOGPROBS, LocalDataPlane
from tq_plugin.lightning import DataPlaneCallback, MetaDataModule, MeteredClient
from tq_plugin.lightning.demo import (
    POLICY_FIELDS,
    DemoPolicy,
    DemoValue,
    SyntheticRollouts,
    partition_spec,
)


class CountingClient(LocalDataPlane):
    def __init__(self) -> None:
        super().__init__()
        self.close_calls = 0

    def close(self) -> None:
        self.close_calls += 1
        super().close()


class WriteBackPolicy(DemoPolicy):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.written: dict[str, list[float]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        rows = self.dp_rows(out["write_back"][PREV_LOGPROBS])
        assert self.dp_meta is not None and self.dp_meta.sequence_lengths is not None
        for sid, n, row in zip(self.dp_meta.sample_ids, self.dp_meta.sequence_lengths, rows.unbind()):
            self.written[sid] = row[:n].tolist()
        return out


class FailingPolicy(DemoPolicy):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise RuntimeError("boom in training_step")


def fit(make_trainer: Callable[..., Trainer], model: Any, callbacks: list[Any], **dm: Any) -> Trainer:
    opts: dict[str, Any] = {"num_steps": 2, "fields": POLICY_FIELDS}
    opts.update(dm)
    source = opts.pop("source", SyntheticRollouts(rows=4))
    trainer = make_trainer(callbacks=callbacks)
    trainer.fit(model, datamodule=MetaDataModule(source, **opts))
    return trainer


def test_setup_builds_meters_and_hands_the_client_to_the_module(make_trainer: Any) -> None:
    built: list[CountingClient] = []

    def factory() -> CountingClient:
        built.append(CountingClient())
        return built[-1]

    cb = DataPlaneCallback(factory, partitions=[partition_spec()])
    model = DemoPolicy()
    fit(make_trainer, model, [cb])
    assert len(built) == 1 and isinstance(model.dp_client, MeteredClient)
    assert model.dp_client.inner is built[0]
    assert built[0].close_calls == 1  # closed in teardown, once


def test_a_failing_training_step_closes_the_client_exactly_once(make_trainer: Any) -> None:
    client = CountingClient()
    cb = DataPlaneCallback(lambda: client, partitions=[partition_spec()])
    with pytest.raises(RuntimeError, match="boom"):
        fit(make_trainer, FailingPolicy(), [cb])
    assert client.close_calls == 1 and client.closed
    cb.teardown(None, None, "fit")  # type: ignore[arg-type]  # a late teardown stays a no-op
    assert client.close_calls == 1


def test_an_attached_client_is_left_open_unless_asked(make_trainer: Any) -> None:
    shared = CountingClient()
    fit(make_trainer, DemoPolicy(), [DataPlaneCallback(shared, partitions=[partition_spec()])])
    assert shared.close_calls == 0 and not shared.closed
    fit(make_trainer, DemoPolicy(),
        [DataPlaneCallback(shared, partitions=[partition_spec()], close_client=True)])
    assert shared.close_calls == 1


def test_write_back_lands_under_the_step_keys_and_rows_clear_at_step_end(make_trainer: Any) -> None:
    shared = LocalDataPlane()
    for layout, mode in (("padded", "none"), ("packed", "sequence_packing")):
        model = WriteBackPolicy(layout=layout, packing=mode, train_mb_tokens=32)
        source = SyntheticRollouts(rows=4, seed=1)
        cb = DataPlaneCallback(shared, partitions=[partition_spec()], clear_rows=False)
        fit(make_trainer, model, [cb], source=source, num_steps=1)
        ids = source.sample_ids(0)
        got = shared.get_samples(
            partition_id="train", sample_ids=ids, select_fields=[PREV_LOGPROBS]
        )[PREV_LOGPROBS]
        assert [r.tolist() for r in got.unbind()] == [model.written[s] for s in ids]
        assert cb.rows_written == 4
        shared.clear_samples(partition_id="train", sample_ids=None)
    source = SyntheticRollouts(rows=4)
    fit(make_trainer, DemoPolicy(), [DataPlaneCallback(shared, partitions=[partition_spec()])],
        source=source)
    assert shared.list_sample_ids("train") == []


def test_per_step_metrics_are_logged_as_window_means(make_trainer: Any) -> None:
    cb = DataPlaneCallback(partitions=[partition_spec()], role="actor", log_every_n_steps=2)
    trainer = fit(make_trainer, DemoPolicy(), [cb])  # 2 steps x 1 microbatch of 4 rows
    metrics = trainer.callback_metrics
    for name in ("bytes_read", "bytes_written", "rows_read", "rows_written", "real_tokens",
                 "padded_tokens", "pad_fraction", "dp_time_s", "layout_time_s"):
        assert f"dp/actor/{name}" in metrics
    assert metrics["dp/actor/rows_read"] == 4  # per step: the mean over the 2-step window
    assert metrics["dp/actor/bytes_read"] > 0
    assert metrics["dp/actor/padded_tokens"] >= metrics["dp/actor/real_tokens"]
    expected = 1 - metrics["dp/actor/real_tokens"] / metrics["dp/actor/padded_tokens"]
    assert float(metrics["dp/actor/pad_fraction"]) == pytest.approx(float(expected), abs=1e-6)


def test_metrics_wait_for_the_logging_window(make_trainer: Any) -> None:
    trainer = fit(make_trainer, DemoPolicy(), [DataPlaneCallback(partitions=[partition_spec()])])
    assert not [k for k in trainer.callback_metrics if k.startswith("dp/")]  # 2 steps < 50


def test_state_key_is_per_role_and_state_round_trips() -> None:
    policy, value = DataPlaneCallback(role="policy"), DataPlaneCallback(role="value")
    assert policy.state_key != value.state_key and "value" in value.state_key
    policy.completed_steps, policy.microbatches_done = 3, 1
    value.load_state_dict(policy.state_dict())
    assert value.resume_cursor() == (3, 1)


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="role"):
        DataPlaneCallback(role="")
    with pytest.raises(ValueError, match="partition_id"):
        DataPlaneCallback(partitions=[{"fields": []}])
    with pytest.raises(TypeError, match="client must be"):
        from tq_plugin.lightning import build_client
        build_client(42)


def test_a_hydra_backend_config_is_instantiated() -> None:
    from tq_plugin.lightning import build_client

    client, built = build_client({"_target_": "tq_plugin.data_plane.LocalDataPlane"})
    assert isinstance(client, LocalDataPlane) and built


class ActorCritic(DemoPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.critic = DemoValue()


def test_policy_and_value_callbacks_keep_separate_checkpoint_entries(
    make_trainer: Callable[..., Trainer], tmp_path: Any
) -> None:
    policy_cb = DataPlaneCallback(role="policy", partitions=[partition_spec()])
    value_cb = DataPlaneCallback(LocalDataPlane(), role="value", attach_to="critic")
    model = ActorCritic()
    trainer = fit(make_trainer, model, [policy_cb, value_cb])
    assert model.dp_client is policy_cb.client and model.critic.dp_client is value_cb.client
    value_cb.completed_steps = 7
    trainer.save_checkpoint(tmp_path / "both.ckpt")
    states = torch.load(tmp_path / "both.ckpt", weights_only=False)["callbacks"]
    assert states[policy_cb.state_key]["completed_steps"] == 2
    assert states[value_cb.state_key]["completed_steps"] == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_on_cuda_the_host_batch_is_pinned_and_lands_on_the_device() -> None:
    """For real on a GPU: the host batch is pinned, copied non-blocking, and equal on the device."""
    client = LocalDataPlane()
    client.register_partition(**partition_spec())
    mb = SyntheticRollouts(rows=2)(0, client)
    mb.fields = [INPUT_IDS]
    model = DemoPolicy().to("cuda")
    model.dp_client = client
    host = model.on_before_batch_transfer(mb, 0)
    assert all(v.is_pinned() for v in host.values() if isinstance(v, torch.Tensor) and not v.is_nested)
    on_device = model.transfer_batch_to_device(host, torch.device("cuda", 0), 0)
    torch.cuda.synchronize()
    assert on_device[INPUT_IDS].is_cuda
    assert torch.equal(on_device[INPUT_IDS].cpu(), host[INPUT_IDS])

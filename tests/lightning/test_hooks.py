"""Hook order of one data-plane step, recorded the way Lightning's test_hooks.py does."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch import Callback

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.lightning import DataPlaneCallback, MetaDataModule
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []


class HookedClient(LocalDataPlane):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def register_partition(self, *args: Any, **kwargs: Any) -> None:
        self.rec.calls.append("dp.register_partition")
        super().register_partition(*args, **kwargs)

    def put_samples(self, *args: Any, **kwargs: Any) -> Any:
        self.rec.calls.append("dp.put_samples")
        return super().put_samples(*args, **kwargs)

    def get_samples(self, *args: Any, **kwargs: Any) -> Any:
        self.rec.calls.append("dp.get_samples")
        return super().get_samples(*args, **kwargs)

    def clear_samples(self, *args: Any, **kwargs: Any) -> None:
        self.rec.calls.append("dp.clear_samples")
        super().clear_samples(*args, **kwargs)

    def close(self) -> None:
        self.rec.calls.append("dp.close")
        super().close()


CALLBACK_HOOKS = ("setup", "on_fit_start", "on_train_batch_start", "on_train_batch_end",
                  "on_fit_end", "on_exception", "teardown")
MODULE_HOOKS = ("setup", "on_before_batch_transfer", "transfer_batch_to_device",
                "on_after_batch_transfer", "training_step", "on_train_batch_end", "teardown")


def hooked_callback(rec: Recorder) -> Callback:
    def make(name: str) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> None:
            rec.calls.append(f"Callback.{name}")
        return hook

    return type("HookedCallback", (Callback,), {n: make(n) for n in CALLBACK_HOOKS})()


def hooked_policy(rec: Recorder, base: type = DemoPolicy) -> DemoPolicy:
    def make(name: str) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            rec.calls.append(name)
            return getattr(super(cls, self), name)(*args, **kwargs)
        return hook

    cls = type("HookedPolicy", (base,), {n: make(n) for n in MODULE_HOOKS})
    return cls()


def test_one_step_hook_order(make_trainer: Any) -> None:
    rec = Recorder()
    dp_cb = DataPlaneCallback(lambda: HookedClient(rec), partitions=[partition_spec()])
    trainer = make_trainer(callbacks=[hooked_callback(rec), dp_cb])
    source = SyntheticRollouts(rows=2)
    trainer.fit(hooked_policy(rec), datamodule=MetaDataModule(source, num_steps=1, fields=POLICY_FIELDS))
    assert rec.calls == [
        "Callback.setup",
        "dp.register_partition",   # DataPlaneCallback.setup, on every rank
        "setup",
        "Callback.on_fit_start",
        "dp.put_samples",          # the step source writes the rollout (dataloader fetch)
        "on_before_batch_transfer",
        "dp.get_samples",          # the microbatch's columns, read on the host
        "transfer_batch_to_device",
        "on_after_batch_transfer",
        "Callback.on_train_batch_start",
        "training_step",
        "Callback.on_train_batch_end",
        "dp.put_samples",          # DataPlaneCallback.on_train_batch_end: write-back
        "dp.clear_samples",        # the step's last microbatch: its rows are cleared
        "on_train_batch_end",
        "Callback.on_fit_end",
        "Callback.teardown",
        "dp.close",                # DataPlaneCallback.teardown
        "teardown",
    ]


class FailingPolicy(DemoPolicy):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise RuntimeError("boom")


def test_a_failing_step_releases_the_client_from_on_exception(make_trainer: Any) -> None:
    rec = Recorder()
    dp_cb = DataPlaneCallback(lambda: HookedClient(rec), partitions=[partition_spec()])
    trainer = make_trainer(callbacks=[hooked_callback(rec), dp_cb])
    dm = MetaDataModule(SyntheticRollouts(rows=2), num_steps=1, fields=POLICY_FIELDS)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(hooked_policy(rec, FailingPolicy), datamodule=dm)
    tail = rec.calls[rec.calls.index("training_step"):]
    # Lightning calls no teardown when fit raises: on_exception is where the client is closed.
    assert tail == ["training_step", "Callback.on_exception", "dp.close"]

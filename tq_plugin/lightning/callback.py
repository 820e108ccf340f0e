"""``DataPlaneCallback``: owns the data-plane client for one model role during a fit.

Lifecycle (Lightning hooks):

* ``setup`` (every rank): build the client (or attach a given one), meter it, hand it to the
  module as ``dp_client``, register the configured partitions.
* ``on_train_batch_end``: write back what the step returned under ``write_back``, advance the
  resume cursor, clear the step's rows after its last microbatch, log data-plane metrics.
* ``teardown`` and ``on_exception``: close the client. Lightning skips ``teardown`` when fit
  raises, so both hooks close, idempotently, and a failed fit releases the client too.

The resume cursor (steps completed, microbatches done in the current step) is the callback's
checkpointed state; the ``MetaDataModule`` starts from it, so a resumed fit neither re-reads nor
re-writes a microbatch. ``state_key`` includes the role, so a Policy and a Value instance keep
separate entries in one checkpoint.

With ``checkpoint_store`` (the default) every Lightning checkpoint also saves the store
(``on_save_checkpoint``: safetensors + JSON, no pickle) under
``<store_dir>/<role>/step-<global step>/rank-<r>`` and records that path in the callback's
state; ``on_load_checkpoint`` puts the rows back into the freshly built client. The role's
``MetaDataModule`` source, wrapped by ``step_source`` in ``setup``, then hands the interrupted
step's meta back instead of generating the step again. An embedded store is saved by every
rank (each holds its own rows); any other client with a ``save`` method (``RayDataPlane``) is
shared: global rank 0 saves it and, on resume, restores it (through the client's ``restore`` when
it has one, so the store keeps its claims), and no rank goes on before the rows are back.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from tq_plugin.data_plane.checkpoint import CheckpointError, load_into
from tq_plugin.data_plane.client import call_dp
from tq_plugin.data_plane.column_io import write_columns
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.lightning.metered import DataPlaneCounters, MeteredClient
from tq_plugin.lightning.module import MICROBATCH_INFO, STEP_SAMPLE_IDS

ClientSpec = Any  # a client, a zero-arg factory, a Hydra config with ``_target_``, or None
StepSource = Callable[[int, Any], KVBatchMeta]  # source(step, client) -> the step meta
_STEP_META = "step_meta"  # the store checkpoint's metadata key for the in-flight step


def build_client(spec: ClientSpec) -> tuple[Any, bool]:
    """``(client, built_here)`` from a client, a factory, a Hydra node, or ``None`` (embedded)."""
    if spec is None:
        from tq_plugin.data_plane.backends.local import LocalDataPlane

        return LocalDataPlane(), True
    if isinstance(spec, Mapping) or type(spec).__name__ == "DictConfig":
        from hydra.utils import instantiate

        return instantiate(spec), True
    if hasattr(spec, "put_samples"):
        return spec, False
    if callable(spec):
        return spec(), True
    raise TypeError(
        f"client must be a DataPlaneClient, a zero-arg factory or a Hydra config with _target_, "
        f"got {type(spec).__name__}"
    )


class DataPlaneCallback(Callback):
    """Connects one model role (``"policy"``, ``"value"``, ...) to the data plane.

    Args:
        client: an existing client, a zero-arg factory (e.g. a Hydra ``_partial_``), a Hydra
            config with ``_target_``, or ``None`` for the embedded ``LocalDataPlane``.
        role: names the checkpoint entry and the logged metrics (``dp/<role>/...``).
        partitions: ``register_partition`` keyword sets, registered in ``setup`` on every rank.
        attach_to: attribute of the LightningModule that hosts this role (``None``: the module).
        write_back_key: the key of ``training_step``'s output holding ``{field: tensor}`` to write.
        clear_rows: clear each step's rows after its last microbatch (leave it to the last
            consumer when several roles read one step).
        close_client: close the client in ``teardown``/``on_exception``; default: only a client
            this callback built.
        log_metrics: log per-step data-plane metrics through ``pl_module.log``: bytes and rows
            read and written, real and padded tokens, pad fraction, seconds in the data plane
            and in the layout, each as a per-step mean over the logging window.
        log_every_n_steps: the logging window in microbatch steps (default: the Trainer's).
        checkpoint_store: save the store with every Lightning checkpoint and put its rows back
            on resume (a client without ``save`` is skipped with a warning).
        store_dir: where store checkpoints go (default: ``<trainer.default_root_dir>/dataplane``).
        keep_last_stores: keep only this many of this role's newest store checkpoints (``None``:
            keep all; match it to ``ModelCheckpoint(save_top_k=...)``'s retention).
    """

    def __init__(
        self,
        client: ClientSpec = None,
        *,
        role: str = "policy",
        partitions: Sequence[Mapping[str, Any]] = (),
        attach_to: str | None = None,
        write_back_key: str = "write_back",
        clear_rows: bool = True,
        close_client: bool | None = None,
        log_metrics: bool = True,
        log_every_n_steps: int | None = None,
        checkpoint_store: bool = True,
        store_dir: str | None = None,
        keep_last_stores: int | None = None,
    ) -> None:
        if not role:
            raise ValueError("DataPlaneCallback: role must be a non-empty string")
        for p in partitions:
            if "partition_id" not in p:
                raise ValueError(f"DataPlaneCallback: partition spec {dict(p)!r} needs partition_id")
        self.role = role
        self.partitions = [dict(p) for p in partitions]
        self.attach_to = attach_to
        self.write_back_key = write_back_key
        self.clear_rows = clear_rows
        self.log_metrics = log_metrics
        self.log_every_n_steps = log_every_n_steps
        self.checkpoint_store = checkpoint_store
        self.store_dir = store_dir
        if keep_last_stores is not None and keep_last_stores < 1:
            raise ValueError(
                f"DataPlaneCallback: keep_last_stores must be >= 1 or None, got {keep_last_stores}"
            )
        self.keep_last_stores = keep_last_stores
        self._spec = client
        self._close_client = close_client
        self.client: MeteredClient | None = None
        self._owns = False
        self._closed = True
        self._last = DataPlaneCounters()
        self._last_meta: KVBatchMeta | None = None
        self._written: tuple[int, int] | None = None  # the microbatch whose write-back landed
        self._window: dict[str, float] = {}
        self._window_steps = 0
        self.completed_steps = 0
        self.microbatches_done = 0
        self.rows_written = 0
        self.store_path: str | None = None  # where the last checkpoint saved the store
        self.restored_from: str | None = None  # the store checkpoint a resume put back
        self._step_meta: dict[str, Any] | None = None  # {"step", "meta"}: last step produced
        self._restored_step: dict[str, Any] | None = None  # the same, from a resumed store

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(role=self.role)

    def host(self, pl_module: LightningModule) -> Any:
        return pl_module if self.attach_to is None else getattr(pl_module, self.attach_to)

    def resume_cursor(self) -> tuple[int, int]:
        """``(steps completed, microbatches done in the next step)``."""
        return self.completed_steps, self.microbatches_done

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.client is None or self._closed:
            inner, built = build_client(self._spec)
            self.client = MeteredClient(inner)
            self._owns = built if self._close_client is None else self._close_client
            self._closed = False
        self.host(pl_module).dp_client = self.client
        for spec in self.partitions:
            call_dp(self.client, "register_partition", **spec)
        self._last = self.client.snapshot()
        self._wrap_datamodule_source(trainer)

    def _wrap_datamodule_source(self, trainer: Trainer) -> None:
        """Route this role's ``MetaDataModule`` source through ``step_source`` (once)."""
        dm = getattr(trainer, "datamodule", None)
        source = getattr(dm, "source", None)
        ours = getattr(dm, "role", None) == self.role
        if not (self.checkpoint_store and ours and callable(source)):
            return
        if getattr(source, "resumes_for", None) is not self:
            dm.source = self.step_source(getattr(source, "__wrapped__", source))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(trainer, "world_size", 1) > 1:
            # No rank closes before every rank is done with the fit: on a shared store the
            # client that opened it first drops it on close, and another rank may still be in
            # its last hooks (e.g. rank 0 stopping the rollout workers that write there).
            trainer.strategy.barrier("DataPlaneCallback.teardown")
        self._close()

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns and self.client is not None:
            self.client.close()

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        host = self.host(pl_module)
        meta = batch if isinstance(batch, KVBatchMeta) else getattr(host, "dp_meta", None)
        if meta is None or meta is self._last_meta:
            return  # not a data-plane batch (a stale dp_meta is never handled twice)
        info = meta.extra_info.get(MICROBATCH_INFO)
        position = None if info is None else (info["step"], self._index_in_step(info))
        if position is not None and position < self.resume_cursor():
            return  # already trained and written before a resume: never write it twice
        fields = outputs.get(self.write_back_key) if isinstance(outputs, Mapping) else None
        # The cursor moves only once the write-back and the step's clear have landed: a hook
        # that raises part-way is retried (or resumed) from the start, and both are idempotent.
        if fields and (position is None or position != self._written):
            self._write_back(host, meta, fields)
            self._written = position  # a retry after a failed clear must not write cleared rows
        if info is not None:
            self._advance(host, meta, info)
        self._last_meta = meta
        if self.log_metrics:
            self._log(trainer, pl_module, host)

    def _index_in_step(self, info: Mapping[str, Any]) -> int:
        return int(info.get("index_in_step", self.microbatches_done))

    def _write_back(self, host: Any, meta: KVBatchMeta, fields: Mapping[str, Any]) -> None:
        to_rows: Callable[[torch.Tensor], torch.Tensor] = getattr(host, "dp_rows", lambda v: v)
        rows = {
            name: to_rows(value.detach()) if isinstance(value, torch.Tensor) else value
            for name, value in fields.items()
        }
        writer = getattr(host, "write_to_dataplane", None)
        if writer is not None:
            writer(meta, rows)
        else:
            write_columns(self.client, meta, rows)
        self.rows_written += meta.size

    def _advance(self, host: Any, meta: KVBatchMeta, info: Mapping[str, Any]) -> None:
        if not info["last_in_step"]:
            self.microbatches_done = self._index_in_step(info) + 1
            return
        step_rows = meta.extra_info.get(STEP_SAMPLE_IDS)
        if self.clear_rows and step_rows:  # before the cursor moves past the step
            call_dp(self.client, "clear_samples", sample_ids=step_rows, partition_id=meta.partition_id)
        self.completed_steps = int(info["step"]) + 1
        self.microbatches_done = 0

    def _log(self, trainer: Trainer, pl_module: LightningModule, host: Any) -> None:
        """Accumulate this step's figures; log their per-step mean every ``log_every_n_steps``.

        ``pl_module.log`` costs a few hundred microseconds a key, so the figures are logged as
        often as Lightning writes to its loggers, not on every microbatch.
        """
        assert self.client is not None
        now = self.client.snapshot()
        delta = now.minus(self._last)
        self._last = now
        window = self._window
        for name in ("bytes_read", "bytes_written", "rows_read", "rows_written"):
            window[name] = window.get(name, 0.0) + getattr(delta, name)
        window["dp_time_s"] = window.get("dp_time_s", 0.0) + delta.seconds
        stats = getattr(host, "dp_batch_stats", None) or {}
        for name, key in (("real_tokens", "real_tokens"), ("padded_tokens", "padded_tokens"),
                          ("layout_time_s", "layout_s")):
            if key in stats:
                window[name] = window.get(name, 0.0) + stats[key]
        self._window_steps += 1
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if self._window_steps < every:
            return
        steps = self._window_steps
        values = {name: total / steps for name, total in window.items()}
        if window.get("padded_tokens"):
            values["pad_fraction"] = 1.0 - window["real_tokens"] / window["padded_tokens"]
        self._window, self._window_steps = {}, 0
        pl_module.log_dict(
            {f"dp/{self.role}/{k}": float(v) for k, v in values.items()},
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

    # ------------------------------------------------------------------ step source
    def step_source(self, source: StepSource) -> StepSource:
        """Wrap a step source so a resumed fit reuses the restored step instead of making it.

        The wrapper remembers the meta of the last step it produced (saved with the store); on
        resume, the step whose rows came back from the store is served from that meta, and
        ``source`` is called only for steps the checkpoint did not hold. ``setup`` applies it
        to the source of this role's ``MetaDataModule``; call it yourself for another loader.
        """

        def produce(step: int, client: Any) -> KVBatchMeta:
            held = self._restored_step
            if held is not None and held["step"] == step:
                self._restored_step = None
                meta = KVBatchMeta(**held["meta"])
            else:
                meta = source(step, client)
            if meta is not None:  # None: a rank whose source only joined rank 0's collectives
                self._remember_step(step, meta)
            return meta

        produce.resumes_for = self  # type: ignore[attr-defined]
        produce.__wrapped__ = source  # type: ignore[attr-defined]
        return produce

    def _remember_step(self, step: int, meta: KVBatchMeta) -> None:
        state = {"step": int(step), "meta": asdict(meta)}
        try:
            faithful = json.loads(json.dumps(state, allow_nan=False)) == state
        except (TypeError, ValueError):
            faithful = False
        if not faithful:
            rank_zero_warn(
                f"DataPlaneCallback(role={self.role!r}): a step meta holds values JSON cannot "
                "carry (tuples, tensors, NaN...); a fit resumed inside that step generates it "
                "again"
            )
        self._step_meta = state if faithful else None

    # ------------------------------------------------------------------ checkpoint state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "completed_steps": self.completed_steps,
            "microbatches_done": self.microbatches_done,
            "rows_written": self.rows_written,
            "store_path": None,  # set by on_save_checkpoint once the store is saved
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.completed_steps = int(state_dict["completed_steps"])
        self.microbatches_done = int(state_dict["microbatches_done"])
        self.rows_written = int(state_dict.get("rows_written", 0))

    def _inner(self) -> Any:
        assert self.client is not None
        return self.client.inner

    def _store_rank(self, trainer: Trainer) -> int | None:
        """This rank's store directory index, or None when another rank saves a shared store."""
        if not getattr(self._inner(), "shared", True):  # each rank holds its own rows
            return trainer.global_rank
        return 0 if trainer.is_global_zero else None

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not self.checkpoint_store or state is None or self.client is None or self._closed:
            return  # a weights-only checkpoint resumes nothing, so it needs no rows
        if not hasattr(self._inner(), "save"):
            rank_zero_warn(
                f"DataPlaneCallback(role={self.role!r}): {type(self._inner()).__name__} has no "
                "save(); the store is not checkpointed (pass checkpoint_store=False to silence)"
            )
            return
        root = Path(self.store_dir or Path(trainer.default_root_dir) / "dataplane")
        base = root / self.role / f"step-{trainer.global_step}"
        rank = self._store_rank(trainer)
        if rank is not None:
            metadata = {_STEP_META: self._step_meta} if self._step_meta else {}
            call_dp(self._inner(), "save", path=str(base / f"rank-{rank}"), metadata=metadata)
            if self.keep_last_stores is not None:
                self._prune_stores(base, f"rank-{rank}")
        self.store_path = str(base)
        state["store_path"] = self.store_path

    def _prune_stores(self, saved: Path, rank_dir: str) -> None:
        """Drop this rank's older store checkpoints beyond ``keep_last_stores`` (newest kept)."""
        assert self.keep_last_stores is not None
        older = [p for p in saved.parent.glob("step-*") if p != saved and (p / rank_dir).is_dir()]
        older.sort(key=lambda p: (p / rank_dir).stat().st_mtime_ns)
        for step_dir in older[: max(0, len(older) - (self.keep_last_stores - 1))]:
            shutil.rmtree(step_dir / rank_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # other ranks' entries may still be there
                step_dir.rmdir()

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key) or {}
        base = state.get("store_path")
        if not self.checkpoint_store or not base or self.client is None:
            return
        rank = self._store_rank(trainer)
        try:
            if rank is not None:
                self._restore_store(Path(base), rank)
        finally:
            if getattr(trainer, "world_size", 1) > 1 and getattr(self._inner(), "shared", True):
                # Rank 0 alone restores a shared store: no rank reads it before the rows are back.
                trainer.strategy.barrier("DataPlaneCallback.on_load_checkpoint")

    def _restore_store(self, base: Path, rank: int) -> None:
        path = base / f"rank-{rank}"
        inner = self._inner()
        try:
            restore = getattr(inner, "restore", None)
            restored = restore(str(path)) if callable(restore) else load_into(inner, path)
        except CheckpointError as err:
            raise CheckpointError(
                f"DataPlaneCallback(role={self.role!r}) cannot restore the store this "
                f"checkpoint was saved with: {err}. Pass checkpoint_store=False to resume "
                "without it (the interrupted step is then generated again)."
            ) from err
        self.restored_from = str(base)
        held = restored.metadata.get(_STEP_META)
        if held is not None:
            meta = held["meta"]
            pid = meta["partition_id"]
            present = set(call_dp(self.client, "list_sample_ids", partition_id=pid))
            if present.issuperset(meta["sample_ids"]):
                self._restored_step = held

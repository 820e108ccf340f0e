"""Lightning integration: per-step overhead of callback + mixin, and padded tokens per mode.

1. Overhead. The same one-layer token model trains on the same packed microbatches (~4k tokens
   each, lengths uniform 100..2000) two ways, both through ``Trainer.fit`` on CPU: fed the
   prepared ``TensorDict``s directly by a DataLoader, and through the integration (a
   ``MetaDataModule`` yielding metas, ``MetaBatchMixin`` reading and packing each microbatch,
   ``DataPlaneCallback`` writing ``prev_logprobs`` back, clearing the step and logging metrics).
   Rows are written to the data plane before each fit: the rollout's own write is not counted.
   Step time is the median interval between consecutive ``on_train_batch_end`` calls.
2. Padded-token fraction on the real read path (``dp_materialize``), 512 rows of the standard
   distribution, train budget 4096 tokens: wasted = 1 - real tokens / tokens a step computes.

Run: ``.venv/bin/python -m benchmarks.bench_lightning``.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from benchmarks._common import table
from tq_plugin.data_plane import INPUT_IDS, INPUT_LENGTHS, KVBatchMeta, LocalDataPlane
from tq_plugin.data_plane.column_io import first_write
from tq_plugin.data_plane.jagged import nested_from_lengths
from tq_plugin.lightning import DataPlaneCallback, MetaDataModule, plan_step
from tq_plugin.lightning.demo import POLICY_FIELDS, DemoPolicy, SyntheticRollouts, partition_spec

MB_TOKENS = 4096
STEP_ROWS = 48
STEPS = 2
REPEATS = 4
VOCAB, HIDDEN = 2048, 256
LOG_EVERY = 10  # data-plane metrics logging window (the Trainer's default is 50)


class _StepClock(Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.stamps.append(time.perf_counter())

    def per_step(self, skip: int = 2) -> float:
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])][skip:]
        return statistics.median(gaps)


class _TimedCallback(DataPlaneCallback):
    """Accounts the callback's own time per step (write-back, clear, metrics)."""

    seconds: list[float]

    def on_train_batch_end(self, *args: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args)
        self.seconds.append(time.perf_counter() - start)


class _TimedDataModule(MetaDataModule):
    """Accounts the time to produce each microbatch meta (planning; the rows are pre-written)."""

    seconds: list[float]

    def iter_microbatches(self) -> Any:
        inner = super().iter_microbatches()
        while True:
            start = time.perf_counter()
            try:
                mb = next(inner)
            except StopIteration:
                return
            self.seconds.append(time.perf_counter() - start)
            yield mb


def _trainer(callbacks: list[Callback]) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                   enable_progress_bar=False, enable_checkpointing=False,
                   enable_model_summary=False, callbacks=callbacks)


def _model(cls: type[DemoPolicy] = DemoPolicy) -> DemoPolicy:
    torch.manual_seed(0)
    return cls(vocab_size=VOCAB, hidden=HIDDEN, packing="sequence_packing",
               layout="packed", train_mb_tokens=MB_TOKENS)


class _DirectPolicy(DemoPolicy):
    """The same model fed ready tensors, without the data plane: a plain masked token mean per
    microbatch and one optimizer step per batch (no meta to accumulate over)."""

    dp_accumulate = False

    def dp_token_mean(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = torch.ones_like(values) if mask is None else mask
        return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _rollouts() -> SyntheticRollouts:
    return SyntheticRollouts(rows=STEP_ROWS, min_len=100, max_len=2000, vocab_size=VOCAB)


def _write_steps(client: LocalDataPlane, source: SyntheticRollouts) -> dict[int, KVBatchMeta]:
    client.register_partition(**partition_spec())
    return {s: source(s, client) for s in range(STEPS)}


def _direct_batches(metas: dict[int, KVBatchMeta], client: LocalDataPlane) -> list[Any]:
    host = _model()
    host.dp_client = client
    return [host.dp_materialize(mb) for s in range(STEPS)
            for mb in plan_step(metas[s], host=host, fields=POLICY_FIELDS, task_name="train", step=s)]


def _fit_direct(batches: list[Any]) -> float:
    clock = _StepClock()
    loader = DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    _trainer([clock]).fit(_model(_DirectPolicy), train_dataloaders=loader)
    return clock.per_step()


def _fit_integrated() -> tuple[float, float, int]:
    """(median step seconds, median accounted host seconds per step, microbatches)."""
    client = LocalDataPlane()
    metas = _write_steps(client, _rollouts())
    clock = _StepClock()
    cb = _TimedCallback(client, partitions=[partition_spec()], log_every_n_steps=LOG_EVERY)
    cb.seconds = []
    dm = _TimedDataModule(lambda step, _c: metas[step], num_steps=STEPS, fields=POLICY_FIELDS)
    dm.seconds = []
    model = _model()
    layout: list[float] = []
    materialize = model.dp_materialize

    def timed(meta: KVBatchMeta) -> Any:
        td = materialize(meta)
        layout.append(model.dp_batch_stats["layout_s"])
        return td

    model.dp_materialize = timed  # type: ignore[method-assign]
    _trainer([cb, clock]).fit(model, datamodule=dm)
    host = [a + b + c for a, b, c in zip(cb.seconds, dm.seconds, layout)]
    return clock.per_step(), statistics.median(host), len(clock.stamps)


def measure_overhead() -> dict[str, float]:
    client = LocalDataPlane()
    batches = _direct_batches(_write_steps(client, _rollouts()), client)
    tokens = statistics.median(int(b[INPUT_IDS].shape[1]) for b in batches)
    direct, integrated, host = [], [], []
    for _ in range(REPEATS):
        direct.append(_fit_direct(batches))
        step, extra, n = _fit_integrated()
        integrated.append(step)
        host.append(extra)
    # Other processes share the CPU: the least-disturbed fit of each kind is the fair pair.
    d, i, h = min(direct), min(integrated), statistics.median(host)
    return {"direct_ms": d * 1e3, "integrated_ms": i * 1e3, "overhead_pct": 100 * (i - d) / d,
            "host_ms": h * 1e3, "host_pct": 100 * h / d,
            "microbatches": float(n), "tokens_per_microbatch": float(tokens)}


def measure_padding(rows: int = 512) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 2001, (rows,), generator=g)
    client = LocalDataPlane()
    client.register_partition("train", fields=[])
    meta = first_write(
        {INPUT_IDS: nested_from_lengths(torch.zeros(int(lengths.sum()), dtype=torch.int64), lengths),
         INPUT_LENGTHS: lengths, "sample_mask": torch.ones(rows)},
        sample_ids=[f"r{i}" for i in range(rows)], client=client, partition_id="train")
    modes = {
        "none, rows padded to the step target (mbs 8)": ("none", "padded", "target", 1),
        "dynamic batching, padded to the step target": ("dynamic_batching", "padded", "target", 1),
        "dynamic batching, padded per microbatch (round 64)": ("dynamic_batching", "padded", "microbatch", 64),
        "sequence packing, packed row": ("sequence_packing", "packed", "target", 1),
        "sequence packing, packed row, pad multiple 64": ("sequence_packing", "packed", "target", 64),
    }
    out = {}
    for name, (mode, layout, pad_to, multiple) in modes.items():
        host = DemoPolicy(packing=mode, layout=layout, train_mb_tokens=MB_TOKENS, micro_batch_size=8,
                          sequence_length_round=multiple, sequence_length_pad_multiple=multiple)
        host.dp_client, host.dp_pad_to = client, pad_to
        real = padded = 0.0
        mbs = plan_step(meta, host=host, fields=[INPUT_IDS], task_name="train", step=0)
        for mb in mbs:
            host.dp_materialize(mb)
            real += host.dp_batch_stats["real_tokens"]
            padded += host.dp_batch_stats["padded_tokens"]
        out[name] = {"wasted_pct": 100 * (1 - real / padded), "microbatches": float(len(mbs))}
    return out


def main() -> dict[str, Any]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small host-side ops suffer badly from thread contention
    try:
        overhead = measure_overhead()
        padding = measure_padding()
    finally:
        torch.set_num_threads(threads)
    intro = (
        f"Per-step time of a one-layer token model (vocab {VOCAB}, hidden {HIDDEN}) on packed "
        f"microbatches of <= {MB_TOKENS} tokens (median {overhead['tokens_per_microbatch']:.0f}), "
        "CPU, 1 torch thread, median of steady-state steps over "
        f"{REPEATS} fits each (the fastest fit of each kind; the wall-clock pair is noisy on a "
        "shared machine, the accounted host time is not). Target: overhead <= 5%."
    )
    host_row = (
        "integration's own host work (plan + read + layout + write-back + clear + "
        f"metrics, logged every {LOG_EVERY} steps)"
    )
    padding_intro = (
        f"Padded-token fraction, lengths uniform 100..2000, 512 rows, budget {MB_TOKENS} tokens "
        "(measured on the tensors `dp_materialize` builds). Target: <= 2% with sequence packing."
    )
    markdown = "\n\n".join([
        "## Lightning integration (`bench_lightning`)",
        intro,
        table(["path", "ms / step", "vs direct"], [
            ["tensors fed directly", overhead["direct_ms"], "-"],
            ["MetaDataModule + MetaBatchMixin + DataPlaneCallback", overhead["integrated_ms"],
             f"{overhead['overhead_pct']:+.1f}% (wall clock)"],
            [host_row, overhead["host_ms"], f"{overhead['host_pct']:.1f}% (accounted)"],
        ]),
        padding_intro,
        table(["mode", "wasted tokens", "microbatches"],
              [[k, f"{v['wasted_pct']:.1f}%", int(v["microbatches"])] for k, v in padding.items()]),
    ])
    print(markdown)
    return {"overhead": overhead, "padding": padding, "markdown": markdown}


if __name__ == "__main__":
    main()

"""Real lengths (issue 25 §5): the data plane at 64 rollouts x 4,096-token completions.

Every rollout is one call: a 256-token prompt and a 4,096-token completion of ids below Qwen2.5's
151,936-id vocabulary, with a float32 logprob per generated token (4,352 tokens a row; a step is
64 rows, 278,528 tokens).

* **A step through the data plane**, per backend (``local``, ``ray``), the path a colocated step
  runs: each call's record built from the engine's lists (digests) and staged (``TQTokenSink``,
  one put a call), the group finalized (``RolloutReassembler.finalize_group``: one batched read,
  verification, linearization, one put of the training rows, the staged calls cleared), the
  training rows read back and cleared. Beside it the store alone: a put of the same training rows
  and a read of them back, against a plain copy of the same bytes (each buffer cloned once). All
  contenders take turns in one process (copy, local, ray, ...), several runs: best and median.
* **Packing modes** over the step's rows (``tq_plugin.data_plane.plan_microbatches``): rows padded
  to the step's pad target, dynamic batching, and sequence packing (first fit decreasing, modified
  first fit decreasing): plan time, microbatches, padded-token fraction, and the read + layout of
  every microbatch (``get_samples`` then the padded or packed layout the trainer receives) against
  a plain copy of the step's bytes; for completions of 4,096 tokens and for completions of
  U(256, 4,096) tokens (rows that stopped early).
* **Driver memory from 1k to 16k rollouts**: in a fresh process per backend, step after step of
  64 rollouts goes through the same staging path, the driver keeping every step's
  ``KVBatchMeta`` (the rows stay in the store). The driver's RSS is read from
  ``/proc/self/status`` and split into ``RssAnon`` (its private memory: what it holds) and
  ``RssShmem`` (pages of Ray's shared-memory object store it has touched: the store's bytes,
  mapped); the Ray store actor's own RSS is read from ``/proc/<pid>/status`` of the
  ``_StoreHost`` process (a descendant of this one). The goal (issue 25): the driver's RSS grows
  at most 1.1x from 1k to 16k rollouts with the Ray backend.

Sizes: the default run goes to 4k rollouts (minutes); ``TQ_BENCH_LONG=1`` (or ``--long``) goes
to 16k. Run: ``python -m benchmarks.run_all bench_real_lengths``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB = 151_936
ROLLOUTS = 64
PROMPT = 256
COMPLETION = 4096
TRAIN = "train"
DIRECT = "direct"
STAGING = "staging"
BACKENDS = ("local", "ray")
RUNS = 5
BUDGET = 16_384  # tokens per microbatch: three 4,352-token rows
ROUND = 64  # sequence_length_round / sequence_length_pad_multiple
RSS_SIZES = (1024, 2048, 4096)
LONG_RSS_SIZES = (1024, 2048, 4096, 8192, 16384)
# Room in Ray's object store for 16k rows of 4,352 tokens (ids, mask, logprobs: ~1.1 GB).
RAY_INIT = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
            "object_store_memory": 2 << 30}


def long_run() -> bool:
    return os.environ.get("TQ_BENCH_LONG", "") == "1"


# ---------------------------------------------------------------------------- the rollouts
def engine_outputs(n: int = ROLLOUTS, *, seed: int = 0, varied: bool = False
                   ) -> list[tuple[list[int], list[int], list[float]]]:
    """What an engine hands the rollout worker for ``n`` calls, as Python lists: prompt ids,
    generated ids and their logprobs (``COMPLETION`` tokens, or U(256, ``COMPLETION``) when
    ``varied``)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(256, COMPLETION + 1, (n,), generator=g) if varied
               else torch.full((n,), COMPLETION))
    prompts = torch.randint(0, VOCAB, (n, PROMPT), generator=g).tolist()
    ids = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
    lps = -torch.rand(int(lengths.sum()), generator=g)
    cuts = lengths.tolist()
    return list(zip(prompts, [c.tolist() for c in ids.split(cuts)],
                    [c.tolist() for c in lps.split(cuts)]))


def make_store(kind: str, name: str = "bench_real_lengths") -> Any:
    if kind == "local":
        from tq_plugin.data_plane import LocalDataPlane

        return LocalDataPlane()
    if kind == "ray":
        from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

        return RayDataPlane(name, ray_init={**RAY_INIT, "_node_ip_address": "127.0.0.2"})
    raise ValueError(f"backend must be one of {list(BACKENDS)}, got {kind!r}")


class StepPath:
    """The staging sink, the reassembler and the train partition on one store: what a colocated
    step's rollouts go through."""

    def __init__(self, client: Any) -> None:
        from tq_plugin.staging import RolloutReassembler, build_token_sink
        from tq_plugin.staging.reassembler import REASSEMBLED_FIELDS

        self.client = client
        self.fields = list(REASSEMBLED_FIELDS)
        self.sink = build_token_sink(client, staging_partition=STAGING)
        client.register_partition(TRAIN, self.fields)
        client.register_partition(DIRECT, self.fields)
        self.reassembler = RolloutReassembler(client, staging_partition=STAGING, clear_staged=True)

    def stage(self, outputs: list, step: int) -> list[Any]:
        """Every call's record built and staged (one put each); the rollouts' receipts."""
        from tq_plugin.staging import (
            CaptureAdmission,
            make_rollout_receipt,
            make_staged_call_record,
        )

        receipts = []
        for i, (prompt, generated, logprobs) in enumerate(outputs):
            admission = CaptureAdmission(rollout_id=f"s{step}-r{i}", model_call_id="call0",
                                         mode="text")
            record = make_staged_call_record(admission, prompt_ids=prompt, generated_ids=generated,
                                             generated_logprobs=logprobs, weight_version=step)
            result = self.sink.stage(record)
            if not result.ok:
                raise RuntimeError(f"staging call {i} of step {step} failed: {result}")
            receipts.append(make_rollout_receipt([record], reward=float(i % 7) / 7,
                                                 staging_keys=[result.staging_key]))
        return receipts

    def finalize(self, receipts: list[Any]) -> Any:
        meta = self.reassembler.finalize_group(receipts, partition_id=TRAIN)
        bad = [t for t in meta.tags if t.get("staging_status") != "ok"]
        if bad:
            raise RuntimeError(f"{len(bad)} rollouts did not verify: {bad[:2]}")
        return meta

    def read(self, meta: Any, partition: str = TRAIN) -> Any:
        return self.client.get_samples(partition_id=partition, sample_ids=meta.sample_ids,
                                       select_fields=self.fields)

    def clear(self, meta: Any, partition: str = TRAIN) -> None:
        self.client.clear_samples(partition_id=partition, sample_ids=meta.sample_ids)


def buffers(td: Any) -> dict[str, Any]:
    """The training rows as the store keeps them: each jagged column's values (and offsets),
    each per-row column."""
    out = {}
    for name, value in td.items():
        if value.is_nested:
            out[name] = value.values()
            out[f"{name}/offsets"] = value.offsets()
        else:
            out[name] = value
    return out


def nbytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rows_of(td: Any) -> dict[str, Any]:
    """Fresh (store-independent) copies of the rows read back, to put again."""
    import torch

    out = {}
    for name, value in td.items():
        if value.is_nested:
            out[name] = torch.nested.nested_tensor_from_jagged(value.values().clone(),
                                                               value.offsets().clone())
        else:
            out[name] = value.clone()
    return out


def timed_phases(first: tuple[str, Callable[[], Any]],
                 then: list[tuple[str, Callable[[Any], Any]]],
                 times: dict[str, list[float]]) -> None:
    """Run ``first``, then each of ``then`` on the previous one's result, appending each one's
    seconds to ``times[name]``."""
    out = None
    for i, (name, fn) in enumerate([first, *then]):
        t0 = time.perf_counter()
        out = fn() if i == 0 else fn(out)
        times.setdefault(name, []).append(time.perf_counter() - t0)


# ---------------------------------------------------------------------------- a step
def step_and_store(runs: int = RUNS) -> dict[str, Any]:
    """Per backend: the step's phases (stage, finalize, read, clear) and the store alone (put,
    read back, clear) against a plain copy of the same bytes; all contenders taking turns."""
    import torch

    outputs = engine_outputs(seed=0)
    paths = {kind: StepPath(make_store(kind)) for kind in BACKENDS}
    # One warm-up step per backend; its rows are the direct put's payload.
    warm = paths["local"]
    meta = warm.finalize(warm.stage(outputs, step=0))
    rows = rows_of(warm.read(meta))
    warm.clear(meta)
    flat = buffers(rows)
    payload = nbytes(flat)
    for kind, path in paths.items():
        if kind != "local":
            path.clear(path.finalize(path.stage(outputs, step=0)))
    times: dict[str, dict[str, list[float]]] = {k: {} for k in ("copy", *BACKENDS)}
    ids = [f"d{i}" for i in range(ROLLOUTS)]
    for run in range(1, runs + 1):
        t0 = time.perf_counter()
        copies = {k: v.clone() for k, v in flat.items()}
        times["copy"].setdefault("copy", []).append(time.perf_counter() - t0)
        del copies
        for kind, path in paths.items():
            c, t = path.client, times[kind]

            def put(c: Any = c) -> Any:
                return c.put_samples(partition_id=DIRECT, sample_ids=ids, fields=rows)

            timed_phases(("put", put),
                         [("get", lambda m, p=path: (p.read(m, DIRECT), m)[1]),
                          ("direct clear", lambda m, p=path: p.clear(m, DIRECT))], t)
            timed_phases(("stage", lambda p=path, r=run: p.stage(outputs, step=r)),
                         [("finalize", path.finalize),
                          ("read", lambda m, p=path: (p.read(m), m)[1]),
                          ("clear", lambda m, p=path: p.clear(m))], t)
            gc.collect()
        print(f"  run {run}: " + ", ".join(
            f"{k} step {sum(times[k][p][-1] for p in ('stage', 'finalize', 'read', 'clear')):.2f} s"
            for k in BACKENDS), flush=True)
    for path in paths.values():
        path.client.close()
    return {"times": times, "payload": payload, "tokens": int(rows["input_lengths"].sum()),
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------- packing modes
MODES: dict[str, dict[str, Any]] = {
    "padded to the step's pad target": {"layout": "target"},
    "dynamic batching": {"dynamic_batching_args": {"sequence_length_round": ROUND,
                                                   "max_tokens_per_microbatch": BUDGET}},
    "packed, first fit decreasing": {"sequence_packing_args": {
        "algorithm": "first_fit_decreasing", "sequence_length_pad_multiple": ROUND,
        "max_tokens_per_microbatch": BUDGET}},
    "packed, modified first fit decreasing": {"sequence_packing_args": {
        "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": ROUND,
        "max_tokens_per_microbatch": BUDGET}},
}


def plan(mode: dict[str, Any], lengths: list[int]) -> tuple[list[list[int]], str, int | None]:
    """``(microbatches, layout, pad_to)`` of one packing mode over the step's row lengths."""
    from tq_plugin.data_plane import plan_microbatches, round_up

    if mode.get("layout") == "target":
        target = round_up(max(lengths), ROUND)
        per = max(1, BUDGET // target)
        return [list(range(s, min(s + per, len(lengths)))) for s in range(0, len(lengths), per)], \
            "padded", target
    keys = {"input_key": "input_ids", "input_lengths_key": "input_lengths"}
    if "dynamic_batching_args" in mode:
        mbs, _ = plan_microbatches(lengths, dynamic_batching_args={
            **mode["dynamic_batching_args"], **keys})
        return mbs, "padded", None
    mbs, _ = plan_microbatches(lengths, sequence_packing_args={
        **mode["sequence_packing_args"], **keys})
    return mbs, "packed", None


def lay_out(client: Any, meta: Any, fields: list[str], mbs: list[list[int]], layout: str,
            pad_to: int | None) -> int:
    """Read every microbatch and lay it out as the trainer receives it; the tokens computed."""
    import torch

    from tq_plugin.data_plane import materialize, round_up
    from tq_plugin.lightning.layout import PackedIndex, packed_batch

    computed = 0
    for mb in mbs:
        sub = meta.subset(mb)
        td = client.get_samples(partition_id=meta.partition_id, sample_ids=sub.sample_ids,
                                select_fields=fields)
        lengths = torch.tensor(sub.sequence_lengths, dtype=torch.int64)
        if layout == "packed":
            index = PackedIndex(lengths, ROUND)
            out = packed_batch(td, index)
            computed += index.total
        else:
            width = pad_to or round_up(int(lengths.max()), ROUND)
            out = materialize(td, "padded", None, width)
            computed += width * len(mb)
        del out
    return computed


def packing_modes(runs: int = RUNS) -> dict[str, Any]:
    """Per length set and packing mode: plan ms, microbatches, padded fraction, read + layout
    of the step against a plain copy of its bytes (LocalDataPlane; modes and copy taking turns)."""
    from tq_plugin.data_plane import padded_token_fraction

    out: dict[str, Any] = {}
    for label, varied in (("4,096-token completions", False),
                          ("U(256, 4,096)-token completions", True)):
        path = StepPath(make_store("local"))
        meta = path.finalize(path.stage(engine_outputs(seed=1, varied=varied), step=0))
        lengths = list(meta.sequence_lengths)
        flat = buffers(path.read(meta))
        plans, times = {}, {"copy": []}
        for name, mode in MODES.items():
            t0 = time.perf_counter()
            mbs, layout, pad_to = plan(mode, lengths)
            plans[name] = {"mbs": mbs, "layout": layout, "pad_to": pad_to,
                           "plan_ms": (time.perf_counter() - t0) * 1e3}
            times[name] = []
            lay_out(path.client, meta, path.fields, mbs, layout, pad_to)  # warm-up, untimed
        for _ in range(runs):
            t0 = time.perf_counter()
            copies = {k: v.clone() for k, v in flat.items()}
            times["copy"].append(time.perf_counter() - t0)
            del copies
            for name, p in plans.items():
                t0 = time.perf_counter()
                p["computed"] = lay_out(path.client, meta, path.fields, p["mbs"], p["layout"],
                                        p["pad_to"])
                times[name].append(time.perf_counter() - t0)
        for name, p in plans.items():
            mode = "packed" if p["layout"] == "packed" else "padded"
            p["padded_fraction"] = padded_token_fraction(lengths, p["mbs"], mode=mode,
                                                         multiple=ROUND, pad_to=p["pad_to"])
        path.client.close()
        out[label] = {"plans": plans, "times": times, "tokens": sum(lengths),
                      "bytes": nbytes(flat)}
    return out


# ---------------------------------------------------------------------------- driver memory
def _status(pid: int | str = "self") -> dict[str, float]:
    """VmRSS, RssAnon, RssFile, RssShmem of a process, in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(line.split()[1]) / 1024.0
    return out


def _store_actor_pid() -> int | None:
    """The pid of the Ray store actor (``ray::_StoreHost``) among this process's descendants."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if any("_StoreHost" in part for part in child.cmdline()):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def rss_child(kind: str, sizes: list[int]) -> dict[str, Any]:
    """In this (fresh) process: steps of ``ROLLOUTS`` rollouts through the staging path into
    ``kind``'s store until ``max(sizes)`` rollouts are held, every step's meta kept; memory
    figures at each size."""
    import torch

    torch.set_num_threads(1)
    outputs = engine_outputs(seed=2)
    path = StepPath(make_store(kind))
    metas: list[Any] = []
    points, t0 = [], time.perf_counter()
    step = 0
    while len(metas) * ROLLOUTS < max(sizes):
        step += 1
        metas.append(path.finalize(path.stage(outputs, step=step)))
        held = len(metas) * ROLLOUTS
        if held in sizes:
            gc.collect()
            pid = _store_actor_pid() if kind == "ray" else None
            stats = path.client.stats()
            points.append({"rollouts": held, "driver": _status(),
                           "store": _status(pid) if pid else None,
                           "live_mb": stats["live_bytes"] / 1e6,
                           "seconds": time.perf_counter() - t0})
            print(f"  {kind} {held} rollouts: driver {points[-1]['driver']}, store "
                  f"{points[-1]['store']}, {points[-1]['live_mb']:,.0f} MB live", flush=True,
                  file=sys.stderr)
    path.client.close()
    return {"backend": kind, "points": points}


def driver_memory(sizes: tuple[int, ...]) -> dict[str, Any]:
    """``rss_child`` per backend, each in a fresh process."""
    out = {}
    for kind in BACKENDS:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_real_lengths", "--rss", kind,
             "--sizes", ",".join(map(str, sizes))],
            capture_output=True, text=True, timeout=3600, check=False)
        sys.stderr.write(proc.stderr[-2000:])
        if proc.returncode:
            raise RuntimeError(f"the {kind} memory run exited {proc.returncode}: "
                               f"{proc.stderr[-3000:]}")
        out[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# ---------------------------------------------------------------------------- the section
def _ms(values: list[float]) -> str:
    """``best / median`` in ms (one decimal under 10 ms)."""
    best, median = min(values) * 1e3, statistics.median(values) * 1e3
    return " / ".join(f"{v:,.1f}" if v < 10 else f"{v:,.0f}" for v in (best, median))


def markdown(step: dict[str, Any], packing: dict[str, Any], memory: dict[str, Any],
             load: float, command: str) -> str:
    from benchmarks._common import table

    t, mb = step["times"], step["payload"] / 1e6
    copy = t["copy"]["copy"]
    rows = []
    for kind in BACKENDS:
        k = t[kind]
        put_get = [a + b for a, b in zip(k["put"], k["get"])]
        total = [sum(x) for x in zip(k["stage"], k["finalize"], k["read"], k["clear"])]
        rows.append([kind, _ms(k["put"]), _ms(k["get"]), _ms(put_get),
                     (f"{min(copy) / min(put_get):.2f} / "
                     f"{statistics.median([c / p for c, p in zip(copy, put_get)]):.2f}"),
                     _ms(k["stage"]), _ms(k["finalize"]), _ms(k["read"]), _ms(k["clear"]),
                     _ms(total)])
    parts = [
        (f"### Real lengths: {ROLLOUTS} rollouts x {COMPLETION:,}-token completions "
        "(`bench_real_lengths`)"),
        (f"`{command}`; load average {load:.1f} on 2 cores when it started. A step: "
         f"{ROLLOUTS} calls of a {PROMPT}-token prompt and a {COMPLETION:,}-token completion "
         f"(ids below {VOCAB:,}, float32 logprobs), {step['tokens']:,} tokens; its training rows "
         f"are {mb:.1f} MB (int64 ids, float32 mask and logprobs, per-row fields). Each cell is "
         f"best / median of {len(copy)} runs in ms, every contender taking turns in one process "
         f"({step['threads']} torch thread(s)). *put*, *get*: the store alone, the training rows "
         f"put and read back; *copy / put+get*: a plain copy of the same bytes "
         f"({_ms(copy)} ms, {mb / min(copy) / 1e3:,.1f} GB/s at best) over the put+get, best "
         "over best, then the median of the per-run ratios (1.0 would be as fast as one copy). "
         "The step: *stage* builds each call's record from the engine's lists (digests) and "
         "stages it (one put a call), *finalize* is `RolloutReassembler.finalize_group` (one "
         "batched read, verification, linearization, one put of the rows, the staged calls "
         "cleared), *read* the rows back, *clear* them."),
        table(["backend", "put", "get", "put+get", "copy / put+get", "stage", "finalize",
               "read", "clear", "step"], rows),
    ]
    for label, res in packing.items():
        copy = res["times"]["copy"]
        prow = []
        for name, p in res["plans"].items():
            lay = res["times"][name]
            prow.append([name, len(p["mbs"]), f"{p['padded_fraction'] * 100:.1f}%",
                         f"{p['plan_ms']:.2f}", _ms(lay),
                         f"{min(copy) / min(lay):.2f}"])
        parts += [
            (f"Packing modes, {label} ({res['tokens']:,} tokens, {res['bytes'] / 1e6:.1f} MB; "
             f"`plan_microbatches`, {BUDGET:,} tokens per microbatch, lengths rounded to "
             f"{ROUND}; LocalDataPlane): *read + layout* gets every microbatch's rows and lays "
             "them out as the trainer receives them (padded `[B, S]`, or one packed row with "
             f"`cu_seqlens`), best / median ms; plain copy of the step's bytes {_ms(copy)} ms."),
            table(["mode", "microbatches", "padded tokens", "plan ms", "read + layout ms",
                   "copy / read + layout (best)"], prow),
        ]
    parts.append(memory_markdown(memory))
    return "\n\n".join(parts)


def memory_markdown(memory: dict[str, Any]) -> str:
    from benchmarks._common import table

    rows = []
    for kind, res in memory.items():
        for p in res["points"]:
            d, s = p["driver"], p["store"]
            rows.append([kind, f"{p['rollouts']:,}", f"{p['live_mb']:,.0f}", f"{d['VmRSS']:,.0f}",
                         f"{d['RssAnon']:,.0f}", f"{d['RssShmem']:,.0f}",
                         "–" if s is None else f"{s['RssAnon']:,.0f}",
                         "–" if s is None else f"{s['RssShmem']:,.0f}",
                         f"{p['seconds']:.0f}"])
    growth = []
    for kind, res in memory.items():
        first, last = res["points"][0], res["points"][-1]
        d0, d1 = first["driver"], last["driver"]
        growth.append(
            f"{kind}: VmRSS {d1['VmRSS'] / d0['VmRSS']:.2f}x, RssAnon "
            f"{d1['RssAnon'] / d0['RssAnon']:.2f}x ({first['rollouts']:,} to "
            f"{last['rollouts']:,} rollouts; RssShmem +{d1['RssShmem'] - d0['RssShmem']:,.0f} MB "
            f"while the store's live bytes grew {last['live_mb'] - first['live_mb']:,.0f} MB)")
    return "\n\n".join([
        (f"Driver memory while rollouts accumulate: steps of {ROLLOUTS} rollouts through the "
         "staging path into the store, every step's `KVBatchMeta` kept by the driver; each "
         "backend in a fresh process, one torch thread. MB from `/proc/<pid>/status`: the "
         "driver's `VmRSS`, split into `RssAnon` (its private memory) and `RssShmem` (shared "
         "memory it has touched: with `ray`, pages of Ray's object store the driver wrote (a "
         "put's arguments) or mapped (reads); with `local`, the embedded store's own column "
         "buffers, which are shared anonymous maps); the Ray store actor's (`_StoreHost`, found "
         "among the driver's descendant processes) own `RssAnon` and `RssShmem`. *live*: "
         "the store's live row bytes (`stats()`), staging and training rows. *s*: since the "
         "first step. Goal (issue 25): the driver's RSS grows at most 1.1x from 1k to 16k "
         "rollouts with the Ray backend."),
        table(["backend", "rollouts", "live MB", "driver VmRSS", "driver RssAnon",
               "driver RssShmem", "store RssAnon", "store RssShmem", "s"], rows),
        "Growth: " + "; ".join(growth) + ".",
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--long", action="store_true", help="driver memory up to 16k rollouts")
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--rss", choices=BACKENDS, help="(internal) one backend's memory run")
    parser.add_argument("--sizes", default="")
    args = parser.parse_args(argv if argv is not None else [])
    if args.rss:
        return rss_child(args.rss, [int(s) for s in args.sizes.split(",")])
    import torch

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    sizes = LONG_RSS_SIZES if (args.long or long_run()) else RSS_SIZES
    command = ("TQ_BENCH_LONG=1 " if sizes == LONG_RSS_SIZES else "") + \
        "python -m benchmarks.run_all bench_real_lengths"
    step = step_and_store(args.runs)
    packing = packing_modes(args.runs)
    memory = driver_memory(sizes)
    return {"markdown": markdown(step, packing, memory, load, command), "step": step,
            "packing": packing, "memory": memory}


if __name__ == "__main__":
    if "--rss" in sys.argv:
        print(json.dumps(main(sys.argv[1:])))
    else:
        print(main(sys.argv[1:])["markdown"])

"""A simulated fleet on the shared store (issue 39): N mock rollout workers, M mock trainer ranks.

``python -m benchmarks.bench_fleet --workers 64 --ranks 2`` (``make bench`` runs a short default).

The store's load depends on how many clients call it, how often and with how many bytes, not on
what computes the tokens, so generation is a sleep and everything that touches the store is real:

* **a rollout worker** (a thread; the N threads share ``--procs`` Ray actor processes) draws a
  GRPO group of ``--group`` rollouts with lengths from a clipped log-normal (median 1,024 tokens,
  256-4,096), sleeps as an engine generating ``--tokens-per-s`` tokens a second would, stages
  every call through a real ``TQTokenSink`` (into its process's own embedded store, as
  ``recipe.worker_staging=local`` does), reads the newest weight version from the shared store
  (``list_sample_ids`` of the weights partition, as the real worker does) and puts the group's
  rows (``input_ids`` int64, ``generation_logprobs`` float32, ``token_mask`` int8 per token;
  ``input_lengths``, ``reward``, ``weight_version`` per row; the real worker's tags) in one put;
* **a trainer rank** (a thread of the driver) claims 16 rows through the real claim path
  (``claim_meta``, one consumer task shared by the ranks; non-blocking, polling every 2 ms when
  nothing is ready, so a claim's latency is the store's and not the wait for rows), drops rows past the real
  staleness bound (``StalenessFilter``, a bound of 1 step), reads the rows' tokens and logprobs,
  writes a per-token column back (``put_samples(mode="update")``) and clears them; every
  256 rows the step advances and rank 0 publishes a weights row.

Measured per run: store calls/s, rows/s and bytes/s (put and read), p50/p99 latency of a stage,
a put, a claim and a read, the store processes' CPU (the controller actor and the storage units,
as a share of one core), the whole box's CPU, the receipts' bytes per step. Where the simulation
stops: the workers are threads in a few processes on the same 2 cores as the store, so past the
point where the box's CPU is spent the figures measure the box, not the store (the tables say
which runs reached that point).

``--transferqueue`` adds the S = 1 and 2 runs at 4,096 tokens on ``tq/backend=transferqueue``
(TransferQueue's controller and storage units, each configuration in a process and a Ray of its
own, since TransferQueue starts once per cluster).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
import psutil
import torch

from benchmarks._common import table

PARTITION = "rollouts"
WEIGHTS = "weights"
TASK = "train"
FIELDS = ["input_ids", "generation_logprobs", "token_mask"]
BYTES_PER_TOKEN = 8 + 4 + 1


def lengths(rng: np.random.Generator, n: int, fixed: int | None) -> np.ndarray:
    if fixed:
        return np.full(n, fixed, dtype=np.int64)
    return np.clip(np.exp(rng.normal(np.log(1024), 0.8, n)), 256, 4096).astype(np.int64)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


# ---------------------------------------------------------------- rollout workers
class FleetHost:
    """A Ray actor process running ``n`` mock rollout workers as threads."""

    def pid(self) -> int:
        """The process id, once the modules a run needs are imported (off the clock)."""
        import tq_plugin.staging  # noqa: F401

        return os.getpid()

    def run(self, client: Any, cfg: dict, first: int, n: int) -> dict:
        from tq_plugin.data_plane import LocalDataPlane
        from tq_plugin.staging import TQTokenSink, make_staged_chain, register_staging_partition

        torch.set_num_threads(1)
        stop_at = cfg["stop_at"]
        out = {"stage": [], "put": [], "version": [], "rows": 0, "bytes": 0, "calls": 0}
        lock = threading.Lock()

        def worker(w: int) -> None:
            rng = np.random.default_rng(cfg["seed"] * 10_007 + w)
            staging = LocalDataPlane()
            register_staging_partition(staging, "staging")
            sink = TQTokenSink(staging, staging_partition="staging")
            stage_t, put_t, version_t = [], [], []
            rows = nbytes = calls = 0
            g = 0
            bare = cfg.get("bare", False)  # puts only: one group built once, put again and again
            fields: dict[str, torch.Tensor] = {}
            version = 0
            while time.time() < stop_at:
                if not (bare and fields):
                    lens = lengths(rng, cfg["group"], cfg["fixed_len"])
                if cfg["tokens_per_s"]:
                    time.sleep(float(lens.max()) / cfg["tokens_per_s"])
                ids = [f"w{w}/g{g}/r{i}" for i in range(cfg["group"])]
                g += 1
                for sid, n_tok in zip([] if bare else ids, lens.tolist()):
                    gen = n_tok - 32
                    chain = make_staged_chain(sid, [(rng.integers(0, 150_000, 32).tolist(),
                                                     rng.integers(0, 150_000, gen).tolist(),
                                                     (-rng.random(gen)).tolist())])
                    t = time.perf_counter()
                    for record in chain:
                        sink.stage(record)
                    stage_t.append(time.perf_counter() - t)
                if not bare and g % 16 == 0:  # the staged calls were finalized: drop them
                    staging.clear_samples(partition_id="staging",
                                          sample_ids=staging.list_sample_ids("staging"))
                if not bare:
                    t = time.perf_counter()
                    weights = client.list_sample_ids(WEIGHTS)
                    version_t.append(time.perf_counter() - t)
                    version = max((int(s.split("/")[1]) for s in weights), default=0)
                total = int(lens.sum())
                if not (bare and fields):
                    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
                    offsets[1:] = torch.from_numpy(np.cumsum(lens))
                    nt = torch.nested.nested_tensor_from_jagged
                    fields = {
                        "input_ids": nt(torch.randint(0, 150_000, (total,)), offsets),
                        "generation_logprobs": nt(-torch.rand(total), offsets),
                        "token_mask": nt(torch.ones(total, dtype=torch.int8), offsets),
                        "input_lengths": torch.from_numpy(lens.copy()),
                        "reward": torch.rand(len(ids)),
                        "weight_version": torch.full((len(ids),), version, dtype=torch.int64),
                    }
                tags = [{"ticket": g, "version": version, "worker": w}] * len(ids)
                t = time.perf_counter()
                client.put_samples(partition_id=cfg["partition"], sample_ids=ids, fields=fields,
                                   tags=tags)
                put_t.append(time.perf_counter() - t)
                rows += len(ids)
                nbytes += total * BYTES_PER_TOKEN + len(ids) * 20
                calls += 1 if bare else 2
            staging.close()
            with lock:
                out["stage"] += stage_t
                out["put"] += put_t
                out["version"] += version_t
                out["rows"] += rows
                out["bytes"] += nbytes
                out["calls"] += calls

        threads = [threading.Thread(target=worker, args=(first + i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


# ---------------------------------------------------------------- trainer ranks
def rank_loop(client: Any, cfg: dict, rank: int, state: dict, out: dict, lock: threading.Lock) -> None:
    from tq_plugin.rl.topology.staleness import StalenessFilter

    bound = StalenessFilter(max_staleness=cfg["max_staleness"])
    claim_t, read_t, write_t, clear_t = [], [], [], []
    rows = nbytes = calls = empty = 0
    meta_bytes = 0
    stale_max = 0
    part = cfg["partition"]
    while time.time() < cfg["stop_at"] + 0.5:
        # Non-blocking, so a claim's latency is the store's, not the wait for rows; an empty
        # claim is a call too, then the rank polls again 2 ms later.
        t = time.perf_counter()
        meta = client.claim_meta(part, TASK, ["input_ids"], batch_size=cfg["claim_rows"],
                                 blocking=False)
        claim_t.append(time.perf_counter() - t)
        calls += 1
        if not meta.size:
            empty += 1
            time.sleep(0.002)
            continue
        meta_bytes += len(pickle.dumps(meta))
        version = state["version"]
        keep = [i for i, tag in enumerate(meta.tags)
                if bound.admits(version, min(int(tag["version"]), version), 1)]
        for tag in meta.tags:
            stale_max = max(stale_max, version - min(int(tag["version"]), version))
        ids = [meta.sample_ids[i] for i in keep]
        if ids:
            t = time.perf_counter()
            td = client.get_samples(partition_id=part, sample_ids=ids,
                                    select_fields=["input_ids", "generation_logprobs"])
            read_t.append(time.perf_counter() - t)
            lp = td["generation_logprobs"]
            t = time.perf_counter()
            client.put_samples(partition_id=part, sample_ids=ids, mode="update",
                               fields={"prev_logprobs": lp})
            write_t.append(time.perf_counter() - t)
            nbytes += (td["input_ids"].values().numel() * 12) + lp.values().numel() * 4
            calls += 2
        t = time.perf_counter()
        client.clear_samples(partition_id=part, sample_ids=meta.sample_ids)
        clear_t.append(time.perf_counter() - t)
        calls += 1
        rows += meta.size
        with lock:
            state["consumed"] += meta.size
            step = state["consumed"] // cfg["rows_per_step"]
            publish = step > state["version"]
            if publish:
                state["version"] = step
        if publish:  # a weights row (the real one carries the weights; here a marker)
            client.put_samples(partition_id=WEIGHTS, sample_ids=[f"v/{step}"],
                               fields={"version": torch.tensor([step])})
            old = [s for s in client.list_sample_ids(WEIGHTS) if s != f"v/{step}"]
            if old:
                client.clear_samples(partition_id=WEIGHTS, sample_ids=old)
            calls += 3
    with lock:
        for k, v in (("claim", claim_t), ("read", read_t), ("write", write_t), ("clear", clear_t)):
            out[k] += v
        out["rows"] += rows
        out["bytes"] += nbytes
        out["calls"] += calls
        out["empty"] += empty
        out["meta_bytes"] += meta_bytes
        out["dropped"] += bound.rows_dropped
        out["stale_max"] = max(out["stale_max"], stale_max)


# ---------------------------------------------------------------- one run
def _store_pids(client: Any) -> tuple[list[int], list[int]]:
    """The controller's processes (found among this driver's Ray processes: the Ray store's
    actor, or TransferQueue's controller) and the storage units'."""
    units_of = getattr(client, "storage_units", None)
    units = [] if units_of is None else units_of.pids()
    controller = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "_StoreHost" in line or "TransferQueueController" in line:
            controller.append(p.pid)
        elif "SimpleStorageUnit" in line:
            units.append(p.pid)
    return controller, units


def _ray_pids() -> dict[str, list[int]]:
    """The rest of the box's CPU this run uses: the rollout workers' processes, the driver (the
    trainer ranks' threads) and Ray's own (raylet, GCS, the rest)."""
    out: dict[str, list[int]] = {"workers": [], "driver": [os.getpid()], "ray": []}
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "FleetHost" in line:
            out["workers"].append(p.pid)
        elif not any(k in line for k in ("_StoreHost", "_StorageUnit", "TransferQueueController",
                                         "SimpleStorageUnit")):
            out["ray"].append(p.pid)
    return out


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_fleet(hosts: list[Any], *, units: int, workers: int, ranks: int, seconds: float,
              fixed_len: int | None, tokens_per_s: float, group: int = 4, claim_rows: int = 16,
              rows_per_step: int = 256, max_staleness: int = 1, seed: int = 0,
              backend: str = "ray", bare: bool = False) -> dict:
    import ray

    from tq_plugin.data_plane import RayDataPlane

    if backend == "transferqueue":
        from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

        client = TransferQueueDataPlane(f"fleet-{uuid.uuid4().hex[:8]}", num_storage_units=units,
                                        ray_init=RAY_INIT)
    else:
        client = RayDataPlane(f"fleet-{uuid.uuid4().hex[:8]}", actor_name="tq_fleet",
                              num_storage_units=units, ray_init=RAY_INIT)
    part = f"{PARTITION}-{uuid.uuid4().hex[:6]}"
    client.register_partition(part, [], consumer_tasks=[TASK])
    client.register_partition(WEIGHTS, [])
    client.put_samples(partition_id=WEIGHTS, sample_ids=["v/0"], fields={"version": torch.tensor([0])})
    controller, unit_pids = _store_pids(client)
    cfg = {"partition": part, "group": group, "fixed_len": fixed_len, "tokens_per_s": tokens_per_s,
           "claim_rows": claim_rows, "rows_per_step": rows_per_step, "max_staleness": max_staleness,
           "seed": seed, "bare": bare}
    start = time.time() + 1.0  # every host starts together
    cfg["stop_at"] = start + seconds
    per = [workers // len(hosts) + (i < workers % len(hosts)) for i in range(len(hosts))]
    firsts = np.cumsum([0, *per[:-1]]).tolist()
    time.sleep(max(0.0, start - 1.0 - time.time()))
    others = _ray_pids()
    ctl0, units0 = _cpu_seconds(controller), _cpu_seconds(unit_pids)
    others0 = {k: _cpu_seconds(v) for k, v in others.items()}
    box0, t0 = psutil.cpu_times(), time.time()
    futures = [h.run.remote(client, cfg, f, n) for h, f, n in zip(hosts, firsts, per) if n]
    state = {"consumed": 0, "version": 0}
    out = {"claim": [], "read": [], "write": [], "clear": [], "rows": 0, "bytes": 0, "calls": 0,
           "meta_bytes": 0, "dropped": 0, "stale_max": 0, "empty": 0}
    lock = threading.Lock()
    threads = [threading.Thread(target=rank_loop, args=(client, cfg, r, state, out, lock))
               for r in range(ranks)]
    for t in threads:
        t.start()
    got = ray.get(futures)
    for t in threads:
        t.join()
    wall = time.time() - t0
    ctl = _cpu_seconds(controller) - ctl0
    unit_cpu = _cpu_seconds(unit_pids) - units0
    other_cpu = {k: (_cpu_seconds(v) - others0[k]) / wall for k, v in others.items()}
    box1 = psutil.cpu_times()
    busy = sum(getattr(box1, k) - getattr(box0, k) for k in ("user", "system", "nice"))
    w = {k: [x for g in got for x in g[k]] for k in ("stage", "put", "version")}
    put_rows = sum(g["rows"] for g in got)
    calls = sum(g["calls"] for g in got) + out["calls"]
    if client.list_sample_ids(part):  # the ranks cleared what they claimed; the rest goes
        client.clear_samples(partition_id=part, sample_ids=None)
    client.close()
    steps = max(1, out["rows"] / rows_per_step)
    return {
        "units": units, "workers": workers, "ranks": ranks, "wall": wall,
        "calls_s": calls / wall, "rows_s": put_rows / wall, "consumed_s": out["rows"] / wall,
        "mb_s": (sum(g["bytes"] for g in got) + out["bytes"]) / wall / 1e6,
        "put_mb_s": sum(g["bytes"] for g in got) / wall / 1e6,
        "stage_p50": _pct(w["stage"], 50), "stage_p99": _pct(w["stage"], 99),
        "put_p50": _pct(w["put"], 50), "put_p99": _pct(w["put"], 99),
        "claim_p50": _pct(out["claim"], 50), "claim_p99": _pct(out["claim"], 99),
        "read_p50": _pct(out["read"], 50), "read_p99": _pct(out["read"], 99),
        "store_cpu": (ctl + unit_cpu) / wall, "controller_cpu": ctl / wall,
        "units_cpu": unit_cpu / wall, "ms_per_call": 1e3 * ctl / max(1, calls),
        "empty_s": out["empty"] / wall, "puts": sum(len(g["put"]) for g in got),
        "controller_ms_per_put_row": 1e3 * ctl / max(1, put_rows), "box_cpu": busy / wall / (psutil.cpu_count() or 1),
        "meta_kb_step": out["meta_bytes"] / steps / 1e3, "dropped": out["dropped"],
        "stale_max": out["stale_max"], "workers_cpu": other_cpu["workers"],
        "ranks_cpu": other_cpu["driver"], "ray_cpu": other_cpu["ray"],
    }


# Logical CPUs: TransferQueue's actors take one each (1 controller + 2 units); everything
# else here takes none.
RAY_INIT = {"num_cpus": 3, "include_dashboard": False, "_node_ip_address": "127.0.0.1"}


def _hosts(procs: int) -> list[Any]:
    import ray

    from tq_plugin.data_plane.backends.ray_cluster import start_ray_on_loopback

    start_ray_on_loopback(None, "tq_plugin", RAY_INIT)  # loopback, token-authenticated
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    remote = ray.remote(FleetHost).options(num_cpus=0, max_concurrency=2)
    hosts = [remote.remote() for _ in range(procs)]
    ray.get([h.pid.remote() for h in hosts])
    return hosts


def _side(name: str, units: int, full: list[dict], bare: list[dict]) -> list[str]:
    """A row of the side-by-side table: medians of the full workload's and the store-alone runs."""
    def med(rs: list[dict], k: str) -> float:
        return statistics.median(r[k] for r in rs)

    store_ms = statistics.median(1e3 * (r["controller_cpu"] + r["units_cpu"]) * r["wall"]
                                 / max(1, r["puts"]) for r in bare)
    return [name, str(units), f"{med(full, 'rows_s'):,.0f}", f"{med(full, 'put_mb_s'):,.1f}",
            f"{med(full, 'put_p99'):.1f}", f"{med(full, 'claim_p99'):.1f}",
            f"{100 * med(full, 'controller_cpu'):.0f}%", f"{100 * med(full, 'units_cpu'):.0f}%",
            f"{100 * med(full, 'box_cpu'):.0f}%", f"{med(bare, 'rows_s'):,.0f}", f"{store_ms:.2f}"]


def _row(r: dict) -> list[str]:
    return [str(r["units"]), str(r["workers"]), f"{r['calls_s']:,.0f} ({r['empty_s']:,.0f})",
            f"{r['ms_per_call']:.2f}", f"{r['rows_s']:,.0f}",
            f"{r['put_mb_s']:,.1f}", f"{r['stage_p50']:.1f} / {r['stage_p99']:.1f}",
            f"{r['put_p50']:.1f} / {r['put_p99']:.1f}", f"{r['claim_p50']:.1f} / {r['claim_p99']:.1f}",
            f"{r['read_p50']:.1f} / {r['read_p99']:.1f}", f"{100 * r['store_cpu']:.0f}%",
            f"{100 * r['box_cpu']:.0f}%", f"{r['meta_kb_step']:.1f}", str(r["stale_max"])]


HEADERS = ["S", "N", "calls/s (empty claims)", "controller CPU ms/call", "rows/s", "put MB/s", "stage p50/p99 ms", "put p50/p99 ms",
           "claim p50/p99 ms", "read p50/p99 ms", "store CPU (of a core)", "box CPU",
           "receipts KB/step", "staleness max"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=int(os.environ.get("TQ_BENCH_FLEET_WORKERS", "16")))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--procs", type=int, default=2, help="Ray actor processes hosting the workers")
    p.add_argument("--seconds", type=float, default=float(os.environ.get("TQ_BENCH_FLEET_SECONDS", "5")))
    p.add_argument("--tokens-per-s", type=float, default=20_000.0,
                   help="one mock engine's generation rate (the sleep before each group)")
    p.add_argument("--rounds", type=int, default=int(os.environ.get("TQ_BENCH_FLEET_ROUNDS", "2")),
                   help="interleaved rounds of the S sweep (TQ_BENCH_FLEET_ROUNDS)")
    p.add_argument("--transferqueue", action="store_true",
                   default=os.environ.get("TQ_BENCH_FLEET_TQ") == "1",
                   help="also run the S = 1, 2 workload on tq/backend=transferqueue, each in a "
                        "process of its own (TQ_BENCH_FLEET_TQ=1 under run_all)")
    p.add_argument("--tq-only", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--shards-only", action="store_true",
                   help="only the S = 1, 2, 4 interleaved rounds (no N sweep, no ceiling)")
    args = p.parse_args([] if argv is None else argv)
    load = os.getloadavg()
    hosts = _hosts(max(1, min(args.procs, args.workers)))
    common = {"ranks": args.ranks, "seconds": args.seconds}
    if args.tq_only:  # one TransferQueue run, its figures as JSON on the last line
        import json

        runs = {}
        for bare in (False, True, False, True):  # interleaved, as the Ray store's rounds
            runs.setdefault("bare" if bare else "full", []).append(run_fleet(
                hosts, units=args.tq_only, workers=args.workers, fixed_len=4096, tokens_per_s=0,
                backend="transferqueue", bare=bare, seconds=args.seconds,
                ranks=0 if bare else args.ranks))
        print(json.dumps(runs))
        return {}
    # 1. N grows, one store actor, realistic lengths and generation time.
    ns = sorted({n for n in (1, 4, 16, 64, 128, 256) if n <= args.workers} | {args.workers})
    sweep = [] if args.shards_only else [
        run_fleet(hosts, units=1, workers=n, fixed_len=None, tokens_per_s=args.tokens_per_s,
                  **common) for n in ns]
    # 2. The single actor's ceiling: no generation sleep, fixed lengths.
    ceiling = [] if args.shards_only else [
        run_fleet(hosts, units=1, workers=args.workers, fixed_len=L, tokens_per_s=0, **common)
        for L in (256, 4096)]
    # 3. Shards at N = workers, 4,096-token rows, no sleep: S = 1, 2, 4 interleaved.
    # 4. The store alone: the same puts, no staging, no version reads, no trainer ranks; each
    #    worker puts one prebuilt group again and again (what the store's CPU per put is).
    by_s: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    bare_s: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for _ in range(args.rounds):
        for s, runs in by_s.items():
            runs.append(run_fleet(hosts, units=s, workers=args.workers, fixed_len=4096,
                                  tokens_per_s=0, **common))
        for s, runs in bare_s.items():
            runs.append(run_fleet(hosts, units=s, workers=args.workers, fixed_len=4096,
                                  tokens_per_s=0, ranks=0, seconds=args.seconds, bare=True))
    tq_runs: dict[int, tuple[list[dict], list[dict]]] = {}
    if args.transferqueue:  # each in a process (and a Ray) of its own: TransferQueue starts once
        import json
        import subprocess

        for s in (1, 2):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_fleet", "--tq-only", str(s),
                 "--workers", str(args.workers), "--ranks", str(args.ranks),
                 "--procs", str(args.procs), "--seconds", str(args.seconds)],
                capture_output=True, text=True, timeout=600, check=True)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            tq_runs[s] = (got["full"], got["bare"])
    load_after = os.getloadavg()
    first_10ms = next((r["workers"] for r in sweep if r["claim_p99"] > 10), None)

    def med(rs: list[dict], k: str) -> float:
        return statistics.median(r[k] for r in rs)

    base = med(by_s[1], "rows_s")
    spread = {s: f"{med(rs, 'rows_s'):,.0f} ({min(r['rows_s'] for r in rs):,.0f}–"
                 f"{max(r['rows_s'] for r in rs):,.0f})" for s, rs in by_s.items()}
    shard_rows = [[str(s), spread[s], f"{med(rs, 'put_mb_s'):,.1f}",
                   f"{med(rs, 'rows_s') / base:.2f}x", f"{med(rs, 'put_p99'):.1f}",
                   f"{med(rs, 'claim_p99'):.1f}", f"{100 * med(rs, 'controller_cpu'):.0f}%",
                   f"{100 * med(rs, 'units_cpu'):.0f}%",
                   f"{med(rs, 'controller_ms_per_put_row'):.2f}",
                   (f"{100 * med(rs, 'workers_cpu'):.0f}% / {100 * med(rs, 'ranks_cpu'):.0f}% / "
                   f"{100 * med(rs, 'ray_cpu'):.0f}%"),
                   f"{100 * med(rs, 'box_cpu'):.0f}%"] for s, rs in by_s.items()]
    s2 = med(by_s[2], "rows_s") / base
    bare_base = med(bare_s[1], "rows_s")

    def per_put(rs: list[dict], k: str) -> str:  # CPU ms per put
        return f"{statistics.median(1e3 * r[k] * r['wall'] / max(1, r['puts']) for r in rs):.2f}"

    bare_rows = [[str(s), (f"{med(rs, 'rows_s') / 4:,.0f} ({min(r['rows_s'] for r in rs) / 4:,.0f}–"
                          f"{max(r['rows_s'] for r in rs) / 4:,.0f})"),
                  f"{med(rs, 'rows_s'):,.0f}", f"{med(rs, 'rows_s') / bare_base:.2f}x",
                  f"{med(rs, 'put_p50'):.1f} / {med(rs, 'put_p99'):.1f}",
                  " / ".join(per_put(rs, k) for k in ("controller_cpu", "units_cpu", "workers_cpu",
                                                      "ray_cpu")),
                  f"{100 * med(rs, 'box_cpu'):.0f}%"] for s, rs in bare_s.items()]
    bare2 = med(bare_s[2], "rows_s") / bare_base
    md = "\n".join([
        "## Simulated fleet on the shared Ray store (bench_fleet)",
        "",
        (f"Simulated fleet (`python -m benchmarks.bench_fleet --workers {args.workers} --ranks "
         f"{args.ranks}`): {args.workers} mock rollout workers (threads in {len(hosts)} Ray actor "
         f"processes), {args.ranks} mock trainer ranks, {args.seconds:g} s a run, groups of 4 rows "
         f"a put, claims of 16 rows, {args.tokens_per_s:,.0f} generated tokens/s per worker where "
         f"it sleeps. Load average {load[0]:.1f} before, {load_after[0]:.1f} after, "
         f"{psutil.cpu_count()} cores. Latencies in ms; store CPU is the controller actor plus the "
         "storage units, as a share of one core; box CPU is the whole machine's."),
        "",
        "N grows (one store actor, lengths 256-4,096, median 1,024):",
        "",
        table(HEADERS, [_row(r) for r in sweep]),
        "",
        f"p99 claim latency first passes 10 ms at N = {first_10ms if first_10ms else 'none of these'}.",
        "",
        "The single store actor's ceiling (no generation sleep, every row the same length):",
        "",
        table(["row tokens", *HEADERS[1:]], [[str(L), *_row(r)[1:]] for L, r in zip((256, 4096), ceiling)]),
        "",
        (f"Storage units at N = {args.workers}, 4,096-token rows, no sleep ({args.rounds} rounds "
         "interleaved, median (min-max)):"),
        "",
        table(["S", "rows/s", "put MB/s", "vs S=1", "put p99 ms", "claim p99 ms",
               "controller CPU", "units CPU", "controller CPU ms per row",
               "workers / ranks / Ray CPU", "box CPU"], shard_rows),
        "",
        (f"The store alone at N = {args.workers} (the same 4,096-token groups of 4 rows, built "
         "once per worker and put again and again: no staging, no version reads, no trainer "
         "ranks; same rounds, interleaved with the runs above; CPU per put in ms):"),
        "",
        table(["S", "puts/s", "rows/s", "vs S=1", "put p50/p99 ms",
               "CPU ms/put: controller / units / workers / Ray", "box CPU"], bare_rows),
    ])
    if tq_runs:
        md += "\n\n" + "\n".join([
            ("The same workloads on `tq/backend=transferqueue` (TransferQueue 0.1.11; each unit "
             "count in a process and a Ray of its own, after the Ray store's rounds, its full and "
             "store-alone runs interleaved, 2 of each, medians; its controller and storage units "
             "count as the store) beside the Ray store's medians above:"),
            "",
            table(["backend", "units", "rows/s", "put MB/s", "put p99 ms", "claim p99 ms",
                   "controller CPU", "units CPU", "box CPU", "store alone: rows/s",
                   "store alone: store CPU ms/put"],
                  [_side(name, s, full, bare)
                   for s in (1, 2)
                   for name, full, bare in (("ray", by_s[s], bare_s[s]),
                                            ("transferqueue", *tq_runs[s]))]),
        ])
    print(md)
    key = {"fleet_s2_vs_s1": f"{s2:.2f}x", "fleet_bare_s2_vs_s1": f"{bare2:.2f}x"}
    if ceiling:
        key = {"fleet_ceiling_rows_256": f"{ceiling[0]['rows_s']:,.0f}",
               "fleet_ceiling_rows_4096": f"{ceiling[1]['rows_s']:,.0f}", **key}
    return {"markdown": md, "key_figures": key, "sweep": sweep, "ceiling": ceiling, "shards": by_s,
            "bare": bare_s}


if __name__ == "__main__":
    main(sys.argv[1:])

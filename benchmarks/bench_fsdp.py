"""DDP against FSDP2 on 2 CPU ranks (``make bench``; ``python -m benchmarks.bench_fsdp``).

An ``hf_causal_lm`` policy (llama, d_model 512, 8 layers: ~34 M parameters, 134 MB in float32)
trains 2 Adam steps on 2 gloo ranks, once wrapped in DDP and once sharded per decoder layer with
FSDP2 (:func:`tq_plugin.rl.models.fsdp.shard_model`, what ``trainer=fsdp_cpu`` does); each rank
reports

* the bytes of parameters + gradients + optimizer state it holds (its local tensors: exact);
* its peak RSS over the two steps (the kernel's high-water mark, reset once the model is built
  and sharded).

Then, under FSDP, the gather for a weight sync: rank 0 copies the full weights into a whole
model of its own (the engine's copy) through :func:`tq_plugin.rl.models.fsdp.iter_full_tensors`
at several bucket sizes, against a plain copy of the same bytes between two whole models; its
seconds and the most full bytes it holds at once (the largest bucket), next to the model's size.

Last, the issue's two done-when commands, each run once through ``tq-train`` (2 ranks): GRPO
colocated and PPO disaggregated on Ray with one rollout worker; their steps, rewards, each
rank's peak memory (``peak_mem_mb_rank<r>`` of the last step) and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import table, tq_train

SIZES = {"d_model": 512, "n_layers": 8, "n_heads": 8, "max_seq_len": 64}
VOCAB, BATCH, SEQ = 16, 4, 32
BUCKETS_MB = (4, 16, 64)
RUNS = 5


def _mb(n: float) -> float:
    return n / 2**20


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _held_bytes(model: Any, optimizer: Any) -> dict[str, float]:
    import torch

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params_mb": _mb(_local_bytes(params)),
            "grads_mb": _mb(_local_bytes([p.grad for p in params if p.grad is not None])),
            "optim_mb": _mb(_local_bytes(state))}


def worker(mode: str, out: str) -> None:
    """One rank (``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tq_plugin.rl.models import fsdp as sharding
    from tq_plugin.rl.models.hf import HFCausalLM
    from tq_plugin.rl.training.metrics import peak_rss_mb

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    policy = HFCausalLM(VOCAB, **SIZES)
    size_mb = _mb(sum(p.numel() * p.element_size() for p in policy.parameters()))
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(policy)
    else:
        model = sharding.shard_model(policy, init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    dist.barrier()
    before = _rss_mb()
    _reset_peak()
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        model(ids).float().logsumexp(-1).mean().backward()
        optimizer.step()
    result: dict[str, Any] = {"mode": mode, "rank": rank, "size_mb": size_mb,
                              "rss_before_mb": before, "peak_rss_mb": peak_rss_mb(),
                              **_held_bytes(model, optimizer)}
    if mode == "fsdp":
        result["sync"] = _sync(policy, rank)
    Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _sync(policy: Any, rank: int) -> list[dict[str, float]]:
    """Rank 0 fills a whole engine copy from the shards, per bucket size; a plain whole-model
    copy of the same bytes as the baseline (rank 0 only; the other rank joins the gathers)."""
    import statistics

    import torch

    from tq_plugin.rl.models import fsdp as sharding
    from tq_plugin.rl.models.hf import HFCausalLM

    engine = dict(HFCausalLM(VOCAB, **SIZES).named_parameters()) if rank == 0 else {}
    source = {k: v.detach().clone() for k, v in engine.items()}
    rows = []
    for bucket_mb in BUCKETS_MB:
        times = []
        largest = max(sum(sharding.full_nbytes(t) for _, t in bucket) for bucket in
                      sharding.plan_buckets(policy.named_parameters(), bucket_mb << 20))
        for _ in range(RUNS):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                for name, full in sharding.iter_full_tensors(
                        policy.named_parameters(), bucket_bytes=bucket_mb << 20):
                    if rank == 0:
                        engine[name].copy_(full)
                    del full
            times.append(time.perf_counter() - t0)
        rows.append({"bucket_mb": bucket_mb, "s": statistics.median(times),
                     "s_min": min(times), "s_max": max(times), "largest_mb": _mb(largest)})
    plain = []
    if rank == 0:
        with torch.no_grad():
            for _ in range(RUNS):
                t0 = time.perf_counter()
                for name, tensor in source.items():
                    engine[name].copy_(tensor)
                plain.append(time.perf_counter() - t0)
    rows.append({"bucket_mb": "plain copy", "s": statistics.median(plain) if plain else 0.0,
                 "s_min": min(plain, default=0.0), "s_max": max(plain, default=0.0),
                 "largest_mb": 0.0})
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, tmp: Path, world: int = 2) -> list[dict[str, Any]]:
    port = _free_port()
    procs, outs = [], []
    for rank in range(world):
        out = tmp / f"{mode}{rank}.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.bench_fsdp", "--worker",
                                       mode, "--out", str(out)], env=env))
        outs.append(out)
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise RuntimeError(f"bench_fsdp {mode} ranks exited with {codes}")
    return [json.loads(o.read_text()) for o in outs]


# The done-when commands (their overrides after ``tq-train``).
DONE_WHEN = (
    ("recipe=grpo", "model=hf_causal_lm", "trainer=fsdp_cpu"),
    ("recipe=ppo", "model=hf_causal_lm", "trainer=fsdp_cpu", "recipe.topology=disaggregated",
     "tq/backend=ray", "recipe.rollout_workers=1"),
)


def done_when_run(overrides: tuple[str, ...]) -> list[Any]:
    """One ``tq-train`` run of ``overrides`` to its end: its table row."""
    run = tq_train(overrides)
    last = run.rows[-1]
    return [f"`tq-train {' '.join(overrides)}`", len(run.rows),
            f"{run.result['reward_first_avg']:.3f} → {run.result['reward_last_avg']:.3f}",
            f"{float(last['peak_mem_mb_rank0']):.0f} / {float(last['peak_mem_mb_rank1']):.0f}",
            f"{run.wall_s:.0f}"]


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        ranks = {mode: _launch(mode, Path(tmp)) for mode in ("ddp", "fsdp")}
    runs = [done_when_run(overrides) for overrides in DONE_WHEN]
    size = ranks["ddp"][0]["size_mb"]
    rows = []
    for mode in ("ddp", "fsdp"):
        for r in ranks[mode]:
            held = r["params_mb"] + r["grads_mb"] + r["optim_mb"]
            rows.append([mode, r["rank"], f"{r['params_mb']:.0f}", f"{r['grads_mb']:.0f}",
                         f"{r['optim_mb']:.0f}", f"{held:.0f}",
                         f"{r['peak_rss_mb'] - r['rss_before_mb']:.0f}",
                         f"{r['peak_rss_mb']:.0f}"])
    held = {m: max(r["params_mb"] + r["grads_mb"] + r["optim_mb"] for r in ranks[m])
            for m in ranks}
    sync = ranks["fsdp"][0]["sync"]
    sync_rows = [[s["bucket_mb"], (f"{s['s'] * 1e3:.0f} ({s['s_min'] * 1e3:.0f}–"
                                   f"{s['s_max'] * 1e3:.0f})"), f"{s['largest_mb']:.1f}"]
                 for s in sync]
    md = "\n\n".join([
        "## Sharded training: DDP vs FSDP2 on 2 CPU ranks (bench_fsdp)",
        (f"`hf_causal_lm` llama, d_model {SIZES['d_model']}, {SIZES['n_layers']} layers: "
         f"{size:.0f} MB of float32 parameters; 2 Adam steps on {BATCH}x{SEQ} tokens per rank, "
         f"gloo, one thread per rank. *Held*: the rank's local parameter + gradient + Adam-state "
         f"bytes (exact); *peak RSS*: the kernel's high-water mark over the two steps, and its "
         f"rise over the RSS before them (the whole model built before sharding is freed by then)."),
        table(["strategy", "rank", "params MB", "grads MB", "Adam MB", "held MB",
               "peak RSS rise MB", "peak RSS MB"], rows),
        (f"FSDP holds {held['fsdp'] / held['ddp']:.2f}x of DDP's per-rank parameter + gradient + "
         f"optimizer bytes."),
        ("Peak RSS is the allocator's view: gloo and FSDP's gather and reduce-scatter buffers "
         "and freed-but-kept heap memory sit in it next to the tensors, so on the CPU it does "
         "not show the halving the held bytes show (on a GPU `peak_mem_mb_rank<r>` is "
         "`torch.cuda.max_memory_allocated`). The recipe builds each model whole on every rank "
         "before `configure_model` shards it, so a run's peak also holds one whole model at "
         "start."),
        (f"Weight-sync gather under FSDP (rank 0 fills a whole engine copy of the {size:.0f} MB "
         f"model from the shards, `sharding.iter_full_tensors`, one all-gather per tensor; the "
         f"other rank joins each): ms, median (min–max) of {RUNS}, and the most full bytes "
         f"gathered at once (the largest bucket: the bound the gather holds beside the engine's "
         f"copy); the plain copy moves the same bytes between two whole models."),
        table(["bucket MB", "ms", "largest bucket MB"], sync_rows),
        ("The done-when commands, once each (2 CPU ranks; reward: mean of the first / last 5 "
         "steps; peak memory: `peak_mem_mb_rank0` / `1` of the last step, RSS on the CPU; wall: "
         "the whole command, imports and start-up included). Not run on GPUs "
         "(`trainer=fsdp`): no device was lent."),
        table(["command", "steps", "reward", "peak MB rank 0 / 1", "wall s"], runs),
    ])
    return {"markdown": md, "ranks": ranks}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("ddp", "fsdp"))
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out)
    else:
        print(main()["markdown"])

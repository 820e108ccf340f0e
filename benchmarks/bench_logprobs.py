"""Memory of the taken tokens' logprobs at a real vocabulary: the plain formula against the chunked
one (``make bench``; ``python -m benchmarks.run_all bench_logprobs``; alone:
``python -m benchmarks.bench_logprobs [--reps N]``).

The output head of the issue's Qwen2-shaped model: vocabulary 151,936, hidden 256, float32
weights, the policy's logit bias; ``T`` hidden states (the scored positions of one microbatch)
and their target ids, ``T`` in 1,024 / 2,048 / 4,096. Two passes, as the trainer runs them:

* *training*: forward + backward of the logprobs' sum (gradients for the hidden states, the
  weight and the bias);
* *no-grad*: the logprob pass (``prev_logprobs``) under ``torch.no_grad``.

Contenders: *plain*, the trainer's formula today (``log_softmax((h @ W.T + b).float() /
temperature).gather``, ``tq_plugin.rl.models.tiny.token_logprobs`` after the model's head) and
*chunked*, :func:`tq_plugin.rl.models.logprobs.token_logprobs_from_hidden` at its default
``chunk_tokens=1024``. Per run, in one process, taking turns (plain, chunked, plain, ...):

* *peak allocated*: the most bytes the CPU allocator held at once during the pass, above what
  was live before it (the profiler's allocation events; the weight and inputs are not counted,
  the gradients it makes are);
* *peak RSS rise*: the kernel's high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` before each run) less the RSS before it;
* seconds.

Each figure is the best (lowest) of ``--reps`` runs; the slope is the least-squares fit of the
best peaks against T, in MB (10^6 bytes) per token. One ``[T, V]`` float32 tensor is 0.608 MB
per token here.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks._common import table

VOCAB, HIDDEN = 151_936, 256
TOKENS = (1024, 2048, 4096)
CHUNK = 1024
REPS = 3
MB = 1e6


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_allocated(fn: Callable[[], object]) -> tuple[int, int]:
    """``(peak allocated bytes above the start, peak RSS rise)`` while ``fn`` runs."""
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    rss_ok = _reset_hwm()
    before = _rss()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    rss_rise = _hwm() - before if rss_ok else 0
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == torch.device("cpu").type:
            events.append((e.start_time_ns, e.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak, rss_rise


def _slope(ts: list[int], ys: list[float]) -> float:
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sum((t - mt) ** 2 for t in ts)


def measure(tokens: tuple[int, ...] = TOKENS, reps: int = REPS, chunk: int = CHUNK) -> dict:
    import torch

    from tq_plugin.rl.models.logprobs import token_logprobs_from_hidden

    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN ** 0.5).requires_grad_()
    bias = torch.zeros(VOCAB, requires_grad=True)
    temperature = 1.0

    def plain(h, t):
        lsm = torch.log_softmax((h @ weight.T + bias).float() / temperature, dim=-1)
        return lsm.gather(-1, t.unsqueeze(-1)).squeeze(-1)

    def chunked(h, t):
        return token_logprobs_from_hidden(h, weight, bias, t, chunk_tokens=chunk,
                                          temperature=temperature)[0]

    contenders = {"plain": plain, "chunked": chunked}
    runs: dict[tuple[str, str, int], list[tuple[int, int, float]]] = {}
    for rep in range(reps):
        for n in tokens:
            hidden = torch.randn(n, HIDDEN, generator=g).requires_grad_()
            targets = torch.randint(0, VOCAB, (n,), generator=g)
            for mode in ("training", "no-grad"):
                for name, fn in contenders.items():
                    def one(fn=fn, mode=mode, hidden=hidden, targets=targets):
                        if mode == "training":
                            fn(hidden, targets).sum().backward()
                        else:
                            with torch.no_grad():
                                fn(hidden, targets)
                    t0 = time.perf_counter()
                    peak, rss = peak_allocated(one)
                    secs = time.perf_counter() - t0
                    hidden.grad = weight.grad = bias.grad = None
                    runs.setdefault((mode, name, n), []).append((peak, rss, secs))
                    print(f"rep {rep} {mode:8s} {name:7s} T={n}: peak {peak / MB:,.0f} MB, "
                          f"RSS rise {rss / MB:,.0f} MB, {secs:.1f} s", flush=True)
    best = {k: (min(r[0] for r in v), min(r[1] for r in v), min(r[2] for r in v))
            for k, v in runs.items()}
    load = os.getloadavg()[1] if hasattr(os, "getloadavg") else float("nan")
    slopes = {(mode, name): (_slope(list(tokens), [best[(mode, name, n)][0] / MB for n in tokens]),
                             _slope(list(tokens), [best[(mode, name, n)][1] / MB for n in tokens]))
              for mode in ("training", "no-grad") for name in contenders}
    return {"best": best, "slopes": slopes, "tokens": tokens, "reps": reps, "chunk": chunk,
            "load": load, "threads": torch.get_num_threads()}


def markdown(res: dict) -> str:
    tokens, best, slopes = res["tokens"], res["best"], res["slopes"]
    rows = []
    for mode in ("training", "no-grad"):
        for name in ("plain", "chunked"):
            peaks = [f"{best[(mode, name, n)][0] / MB:,.0f} / {best[(mode, name, n)][1] / MB:,.0f}"
                     for n in tokens]
            secs = [f"{best[(mode, name, n)][2]:.1f}" for n in tokens]
            s_alloc, s_rss = slopes[(mode, name)]
            rows.append([mode, name, *peaks, f"{s_alloc:.3f} / {s_rss:.3f}", " / ".join(secs)])
    headers = ["pass", "logprobs", *[f"T={n}: peak alloc / RSS rise MB" for n in tokens],
               "slope MB/token (alloc / RSS)", "seconds (" + " / ".join(map(str, tokens)) + ")"]
    tv = 4 * VOCAB / MB
    return "\n\n".join([
        "## Memory-bounded logprobs (`bench_logprobs`)",
        (f"The output head of the issue's Qwen2-shaped model (vocabulary {VOCAB:,}, hidden "
         f"{HIDDEN}, float32, with the policy's logit bias) on T scored positions: the plain "
         f"formula the trainer uses today (`log_softmax((h @ W.T + b).float() / temperature)"
         f".gather`) against `tq_plugin.rl.models.logprobs.token_logprobs_from_hidden` "
         f"(`chunk_tokens={res['chunk']}`). *training*: forward + backward of the logprobs' sum "
         f"(gradients for hidden, weight and bias); *no-grad*: the logprob pass. Peak allocated: "
         f"the most bytes the CPU allocator held at once above the start (profiler allocation "
         f"events; the weight gradient's {VOCAB * HIDDEN * 4 / MB:,.0f} MB included); peak RSS "
         f"rise: `VmHWM` (reset before each run) less the RSS before it. Best of {res['reps']} "
         f"runs in one process, contenders interleaved; MB = 10^6 bytes; slope: least squares "
         f"over T. One [T, V] float32 tensor is {tv:.3f} MB per token. Command: "
         f"`python -m benchmarks.run_all bench_logprobs`."),
        table(headers, rows),
        (f"Training slope: plain {slopes[('training', 'plain')][0]:.3f} MB/token "
         f"({slopes[('training', 'plain')][0] / tv:.1f} [T, V] float32 tensors), chunked "
         f"{slopes[('training', 'chunked')][0]:.4f} MB/token: what grows "
         f"with T is the [T, H] hidden states' gradient and [T] float32 scalars; the chunk's "
         f"[{res['chunk']}, V] float32 work ({res['chunk'] * tv:,.0f} MB for the logprobs alone, "
         f"twice that with an entropy) and the weight's gradient are constants. The issue's goal for the whole training step is <= 0.25 MB per "
         f"microbatch token. Seconds: best of {res['reps']}, on a machine with a 5-minute load "
         f"average of {res['load']:.1f} at the end over {os.cpu_count()} cores, "
         f"{res['threads']} torch threads (the memory "
         f"figures do not depend on it); the chunked pass recomputes each chunk's logits in "
         f"backward (one more [T, H] x [H, V] matmul: ~4/3 of the plain FLOPs)."),
    ])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--chunk", type=int, default=CHUNK)
    args = parser.parse_args(argv if argv is not None else [])
    res = measure(reps=args.reps, chunk=args.chunk)
    text = markdown(res)
    return {"markdown": text, **res}


if __name__ == "__main__":
    import sys

    print(main(sys.argv[1:])["markdown"])

"""Rollout engines side by side (``make bench``; ``python -m benchmarks.bench_engines``).

On one HF policy (a 2-layer llama, d_model 64, head_dim 32, the pattern task's vocabulary) and
the same prompts, in one run, interleaved:

* generated tokens/s of ``native``, ``hf`` and ``vllm`` (64 prompts, up to 16 new tokens);
* one weight sync's seconds (``update_weights`` of the trainer's named weights) for ``hf`` and
  ``vllm`` against a plain copy of the same bytes into preallocated tensors;
* GRPO steps/s colocated with each engine (``model=hf_causal_lm model.n_heads=2``), steady
  state (step 1 to the end of the fit).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import Stat, interleaved, ratios, table

ENGINES = ("native", "hf", "vllm")
PROMPTS, NEW_TOKENS = 64, 16


def _policy(seed: int = 0) -> Any:
    from tq_plugin.rl.models.hf import HFCausalLM
    from tq_plugin.rl.tasks.pattern import PatternTask

    task = PatternTask()
    torch.manual_seed(seed)
    return task, HFCausalLM(task.vocab_size, d_model=64, n_heads=2, n_layers=2, max_seq_len=64,
                            output_token_ids=task.output_token_ids).eval()


def generation_and_sync(*, runs: int) -> dict[str, Any]:
    from tq_plugin.config.schema import EngineConfig
    from tq_plugin.rl.models.weights import engine_weights, write_engine_checkpoint
    from tq_plugin.rl.tasks.pattern import EOS
    from tq_plugin.rollout import SamplingParams, build_engine

    task, policy = _policy()
    prompts = [e.prompt for e in task.sample(PROMPTS, torch.Generator().manual_seed(0))]
    # No stop token: every engine generates the same number of tokens.
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0,
                            allowed_token_ids=tuple(t for t in task.output_token_ids if t != EOS))
    seeds = list(range(PROMPTS))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_engine_checkpoint(policy, Path(tmp) / "ckpt")
        engines = {name: build_engine(EngineConfig(name=name), model=copy.deepcopy(policy),
                                      checkpoint=ckpt, max_model_len=64) for name in ENGINES}
        try:
            gen = interleaved({n: (lambda e=e: e.generate(prompts, params, seeds=seeds))
                               for n, e in engines.items()}, runs=runs, warmup=1)
            _, trained = _policy(seed=1)
            named = [(n, t.detach().clone()) for n, t in engine_weights(trained, "hf")]
            dst = [t.clone() for _, t in named]

            def plain() -> None:
                for d, (_, t) in zip(dst, named):
                    d.copy_(t)

            sync = interleaved({"plain copy": plain, **{
                n: (lambda e=engines[n]: e.update_weights(iter(named), version=1))
                for n in ("hf", "vllm")}}, runs=runs, warmup=1)
        finally:
            for e in engines.values():
                e.close()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    return {"gen": gen, "sync": sync, "bytes": nbytes}


def grpo_steps(engine: str, *, steps: int) -> float:
    from benchmarks.bench_topology import timed_fit

    span, _ = timed_fit("grpo", ["model=hf_causal_lm", f"engine={engine}",
                                 f"recipe.num_steps={steps}"])
    return (steps - 1) / span


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv if argv is not None else [])
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(".pytest_cache") / "inductor"))
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    figures = generation_and_sync(runs=args.runs)
    tokens = PROMPTS * NEW_TOKENS
    gen, sync = figures["gen"], figures["sync"]
    rates = {n: Stat.of(s).map(lambda x: tokens / x) for n, s in gen.items()}
    gen_rows = [[n, rates[n].fmt(",.0f"), f"{ratios(gen['native'], gen[n]).median:.1f}x"]
                for n in ENGINES]
    speedup = {n: f"{ratios(gen['native'], gen[n]).median:.1f}x" for n in ENGINES}
    sync_ms = {n: f"{Stat.of(s).map(lambda x: x * 1e3).median:.3f} ms" for n, s in sync.items()}
    sync_ratio = {n: f"{ratios(s, sync['plain copy']).median:,.0f}x" for n, s in sync.items()}
    sync_rows = [[n, Stat.of(s).map(lambda x: x * 1e3).fmt(".3f", " ms"),
                  "1.0x" if n == "plain copy" else sync_ratio[n]] for n, s in sync.items()]
    steps = {n: [] for n in ENGINES}
    for _ in range(args.repeats):
        for n in ENGINES:
            steps[n].append(grpo_steps(n, steps=args.steps))
            print(f"  grpo engine={n}: {steps[n][-1]:.2f} steps/s", flush=True)
    base = Stat.of(steps["native"]).median
    step_rows = [[n, Stat.of(v).fmt(".2f"), f"{Stat.of(v).median / base:.2f}x"]
                 for n, v in steps.items()]
    markdown = "\n\n".join([
        "## Rollout engines (`bench_engines`)",
        (f"One HF policy (llama, 2 layers, d_model 64, head_dim 32, vocabulary 18), the same "
         f"{PROMPTS} prompts x {NEW_TOKENS} new tokens (no stop token), one torch thread, "
         f"{args.runs} interleaved runs; vLLM in-process, float32, eager, 64 MiB KV cache."),
        table(["engine", "generated tokens/s", "speed-up vs native"], gen_rows),
        (f"One weight sync ({figures['bytes'] / 1e6:.2f} MB of float32) against a plain copy of "
         "the same bytes into preallocated tensors:"),
        table(["sync", "time", "vs plain copy"], sync_rows),
        (f"GRPO colocated, `model=hf_causal_lm model.n_heads=2`, {args.steps} steps, "
         f"{args.repeats} alternating repeats; steps/s from step 1 to the end of the fit "
         "(the weight sync before each step's rollouts included):"),
        table(["engine", "GRPO steps/s", "vs native"], step_rows),
    ])
    print(markdown)
    # The figures the README and docs cite (benchmarks/headline.py), each as the tables print it.
    key = {f"{n}_tok_s": f"{rates[n].median:,.0f}" for n in ENGINES}
    key.update(hf_speedup=speedup["hf"], vllm_speedup=speedup["vllm"],
               sync_mb=f"{figures['bytes'] / 1e6:.2f} MB", hf_sync=sync_ms["hf"],
               hf_sync_ratio=sync_ratio["hf"], vllm_sync=sync_ms["vllm"],
               vllm_sync_ratio=sync_ratio["vllm"])
    return {"markdown": markdown, "figures": figures, "steps": steps, "key_figures": key}


if __name__ == "__main__":
    main(__import__("sys").argv[1:])

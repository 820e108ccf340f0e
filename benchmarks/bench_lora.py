"""LoRA against full fine-tuning on SmolLM2-135M-Instruct (issue 35): what one rank holds, one
training step, one weight sync per engine.

Each figure comes from a process of its own (``python -m benchmarks.bench_lora --probe ...``), so
its peak RSS is that work's alone:

* ``step``: the policy (``model=hf_causal_lm``, float32), ``recipe.optimizer=adamw``; the bytes
  of parameters + gradients + optimizer state after one step, and the seconds of a step
  (forward with the trainer's chunked token scoring, backward, AdamW) on ``BATCH`` rows of
  ``SEQ`` tokens, median of ``STEPS`` after a warm-up;
* ``sync``: the policy's weights pushed to an engine as the recipes push them
  (``engine_weights`` -> ``update_weights``): bytes moved and seconds (median of ``SYNCS``).
  ``hf`` and ``native`` copy into their own model; ``vllm`` reloads the weights in place (full)
  or serves a new adapter version (LoRA), timed with the first one-token request after it
  (vLLM loads a new adapter then), for both.

The learning comparison (held-out accuracy at equal steps, and TRL's GRPOTrainer with
``peft_config``) is not measured here yet.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import machine, table

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "outputs" / "real_models" / "smollm2"
LORA = {"r": 8, "alpha": 16.0}
BATCH, SEQ, STEPS, SYNCS = 4, 128, 3, 5
ENGINES = ("hf", "native", "vllm")


def _policy(lora: dict[str, Any] | None) -> Any:
    import json as _json

    from tq_plugin.rl.models.hf import HFCausalLM

    vocab = _json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    return HFCausalLM(vocab, pretrained_path=str(MODEL_DIR), max_seq_len=SEQ, lora=lora)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def probe_step(lora: dict[str, Any] | None) -> dict[str, float]:
    import torch

    from tq_plugin.rl.models.lora import trainable_parameters
    from tq_plugin.rl.models.protocol import TokenScoring, score_tokens
    from tq_plugin.rl.training.optim import build_optimizer

    torch.manual_seed(0)
    model = _policy(lora).train()
    rc = argparse.Namespace(optimizer="adamw", weight_decay=0.0)
    opt = build_optimizer(rc, [(model, 1e-5)])
    ids = torch.randint(0, 1000, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ)
    scoring = TokenScoring(mask=mask > 0, temperature=1.0, chunk_tokens=256)
    times = []
    for _ in range(STEPS + 1):
        t0 = time.perf_counter()
        lp, _ = score_tokens(model, ids, scoring)
        (-(lp * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    params = list(model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t))
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return {"trainable": trainable_parameters(model),
            "total": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": grads, "optimizer_bytes": state,
            "step_s": statistics.median(times[1:]), "peak_rss_mb": _peak_rss_mb()}


def probe_sync(lora: dict[str, Any] | None, engine_name: str) -> dict[str, float]:
    import torch

    from tq_plugin.config.schema import EngineConfig
    from tq_plugin.rl.models.weights import engine_weights, write_engine_checkpoint
    from tq_plugin.rollout import SamplingParams, build_engine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = _policy(lora).eval()
    with tempfile.TemporaryDirectory() as tmp:
        if engine_name == "native":  # a rollout worker's own copy (colocated it copies nothing)
            engine = build_engine(EngineConfig(name="native"), model=_policy(lora).eval())
        else:
            engine = build_engine(EngineConfig(name=engine_name, kv_cache_memory_bytes=64 << 20),
                                  checkpoint=write_engine_checkpoint(policy, Path(tmp) / "e"),
                                  max_model_len=SEQ, max_loras=2)
        times, moved = [], 0
        try:
            for version in range(1, SYNCS + 2):
                with torch.no_grad():
                    for p in policy.parameters():
                        if p.requires_grad:
                            p.mul_(1.0001)  # a new version
                weights = list(engine_weights(policy, engine_name))
                moved = sum(t.numel() * t.element_size() for _, t in weights)
                t0 = time.perf_counter()
                engine.update_weights(weights, version=version)
                if engine_name == "vllm":  # vLLM loads a new adapter at its first request
                    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1), seeds=[0])
                times.append(time.perf_counter() - t0)
        finally:
            engine.close()
    return {"sync_bytes": moved, "sync_s": statistics.median(times[1:]),
            "peak_rss_mb": _peak_rss_mb()}


def _run_probe(*args: str) -> dict[str, float]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_lora", "--probe", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    if proc.returncode:
        raise RuntimeError(f"bench_lora probe {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    modes = {"full fine-tuning": "full", f"LoRA r={LORA['r']}": "lora"}
    load_before = os.getloadavg()[0]
    steps = {label: _run_probe("step", mode) for label, mode in modes.items()}
    syncs = {(label, e): _run_probe("sync", mode, e) for label, mode in modes.items()
             for e in ENGINES}

    def held(s: dict[str, float]) -> float:
        return (s["param_bytes"] + s["grad_bytes"] + s["optimizer_bytes"]) / 1e6

    def trained(s: dict[str, float]) -> float:  # the trained parameters, their grads and Adam
        return (s["trainable"] * 4 + s["grad_bytes"] + s["optimizer_bytes"]) / 1e6

    step_rows = [[label, f"{s['trainable']:,}", f"{s['trainable'] / s['total']:.2%}",
                  f"{held(s):,.0f}", f"{trained(s):,.1f}", f"{s['step_s']:.2f}",
                  f"{s['peak_rss_mb']:,.0f}"] for label, s in steps.items()]
    sync_rows = [[label, e, f"{s['sync_bytes'] / 1e6:,.2f}", f"{s['sync_s'] * 1e3:,.2f}",
                  f"{s['peak_rss_mb']:,.0f}"] for (label, e), s in syncs.items()]
    full_label, lora_label = modes
    full, lora = steps[full_label], steps[lora_label]
    ratio = {e: syncs[(lora_label, e)]["sync_s"] / syncs[(full_label, e)]["sync_s"]
             for e in ENGINES}
    markdown = "\n\n".join([
        "## LoRA against full fine-tuning (`bench_lora`)",
        (f"SmolLM2-135M-Instruct, float32, `model.lora` r={LORA['r']} alpha={LORA['alpha']} on "
         f"PEFT's default targets (q_proj, v_proj); a step is {BATCH} rows of {SEQ} tokens "
         f"(chunked token scoring, backward, AdamW), median of {STEPS} after one; a sync is "
         f"median of {SYNCS} after one. Each row is a process of its own (its peak RSS). "
         f"{machine()}."),
        table(["", "trainable", "of all", "params+grads+Adam MB",
               "trained params+grads+Adam MB", "step s", "peak RSS MB"], step_rows),
        (f"Per rank, LoRA / full: {trained(lora) / trained(full):.2%} of the trained bytes "
         f"(goal <= 5%), {held(lora) / held(full):.1%} of all held (the frozen base included); "
         f"step time {lora['step_s'] / full['step_s']:.2f}x full fine-tuning's (goal <= 0.8x)."),
        table(["", "engine", "sync MB", "sync ms", "peak RSS MB"], sync_rows),
        ("vllm's sync is timed with its first one-token request after it (where vLLM loads a "
         "new adapter), for both."),
        "One sync, LoRA / full: " + ", ".join(f"{e} {r:.3f}x" for e, r in ratio.items())
        + " (goal <= 0.1x). Learning at equal steps is not measured here yet.",
        (f"Load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
         f"{os.cpu_count()} cores: the bytes are exact, the seconds are this machine's at that "
         f"load (the probes run one after another, not interleaved)."),
    ])
    print(markdown)
    return {"markdown": markdown, "steps": steps,
            "syncs": {f"{k[0]}|{k[1]}": v for k, v in syncs.items()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe", nargs="+")
    args = parser.parse_args()
    if args.probe:
        what, mode, *rest = args.probe
        lora = LORA if mode == "lora" else None
        out = probe_step(lora) if what == "step" else probe_sync(lora, rest[0])
        print(json.dumps(out))
    else:
        main()

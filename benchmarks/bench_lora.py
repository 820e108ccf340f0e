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

* ``learning``: the real-model task of ``bench_real_model`` (``--config-name grpo_real``,
  seed 0) trained three ways at equal steps: full fine-tuning (the preset), LoRA (``LEARN``:
  adapters on every linear layer at 10x the full lr, the recipe of Schulman et al., "LoRA
  Without Regret", 2025, for RL) and TRL's ``GRPOTrainer`` with the same ``peft_config``; held-out
  greedy accuracy before and after, all three scored by one evaluator. About an hour on the
  2-core box; ``TQ_BENCH_LORA_LEARN=0`` skips it. An arm whose run dir under
  ``benchmarks/out/lora_learn/`` already finished with the same overrides is read, not re-run.
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
# The adapters measured throughout: the ones the learning comparison trains (every linear layer,
# as "LoRA Without Regret" (Schulman et al., 2025) recommends for RL; PEFT's default for llama,
# q_proj and v_proj alone, is not measured here).
LORA = {"r": 8, "alpha": 32.0, "target_modules": "all-linear"}
BATCH, SEQ, STEPS, SYNCS = 4, 128, 3, 5
# Step probes run in rounds, full and LoRA alternating (A, B, A, B, ...): on a shared 2-core box
# the load moves between processes, and a ratio of neighbours is steadier than one of medians.
ROUNDS = 3
ENGINES = ("hf", "native", "vllm")
LEARN_OUT = ROOT / "benchmarks" / "out" / "lora_learn"
LEARN_SEED = 0
LEARN = [f"model.lora.r={LORA['r']}", f"model.lora.alpha={LORA['alpha']:g}",
         f"model.lora.target_modules={LORA['target_modules']}", "recipe.lr=2e-4"]


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
            plain = []  # vllm: the same one-token request with no sync before it
            for _ in range(SYNCS if engine_name == "vllm" else 0):
                t0 = time.perf_counter()
                engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1), seeds=[0])
                plain.append(time.perf_counter() - t0)
        finally:
            engine.close()
    return {"sync_bytes": moved, "sync_s": statistics.median(times[1:]),
            "request_s": statistics.median(plain) if plain else 0.0,
            "peak_rss_mb": _peak_rss_mb()}


def _run_probe(*args: str) -> dict[str, float]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_lora", "--probe", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    if proc.returncode:
        raise RuntimeError(f"bench_lora probe {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Where a saved config's values differ from today's composition (keys added since are
    defaults, left out of the comparison)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in old if k in new
                for d in _differences(old[k], new[k], f"{path}.{k}".lstrip("."))]
    return [] if old == new else [f"{path}: {old!r} then, {new!r} now"]


def _finished_ours(out: Path, extra: list[str]) -> dict[str, Any] | None:
    """A run dir of :func:`benchmarks.bench_real_model.run_ours` that finished with ``extra``
    and whose saved config is what the preset composes today (else it is run again)."""
    import yaml
    from omegaconf import OmegaConf

    from benchmarks.bench_real_model import compose_cfg, read_run

    try:
        said = yaml.safe_load((out / ".hydra" / "overrides.yaml").read_text())
        saved = yaml.safe_load((out / ".hydra" / "config.yaml").read_text())
        result, _, curve = read_run(out)
    except (OSError, ValueError):
        return None
    if result.get("status") != "ok" or not set(extra) <= set(said):
        return None
    now = OmegaConf.to_container(compose_cfg(said), resolve=False)
    if _differences({k: saved.get(k) for k in ("task", "model", "recipe", "engine", "tq")},
                    now):
        return None
    return {"curve": curve, "final": result.get("eval", {}), "wall_s": float(result.get("wall_s", 0)),
            "trainable_parameters": result.get("trainable_parameters"), "run_dir": str(out)}


def learning(out: Path = LEARN_OUT) -> dict[str, Any]:
    """Held-out accuracy before/after, seed ``LEARN_SEED``: full fine-tuning, LoRA, TRL + LoRA."""
    from benchmarks import bench_real_model as real

    out.mkdir(parents=True, exist_ok=True)
    model_dir = real.ensure_model()
    arms: dict[str, dict[str, Any]] = {}
    # full fine-tuning is bench_real_model's seed-0 run where that finished on today's preset
    real_full = real.OUT / f"ours_s{LEARN_SEED}"
    for label, extra in (("full fine-tuning", []), ("LoRA", LEARN)):
        run_dir = out / f"{'lora' if extra else 'full'}_s{LEARN_SEED}"
        found = _finished_ours(run_dir, [f"recipe.seed={LEARN_SEED}", *extra])
        if found is None and not extra:
            found = _finished_ours(real_full, [f"recipe.seed={LEARN_SEED}"])
        if found is None:
            ran = real.run_ours(model_dir, LEARN_SEED, run_dir, extra=extra)
            found = _finished_ours(run_dir, extra)
            if found is None:
                raise RuntimeError(f"{run_dir}: the run ended without an ok result.json")
            found.update(wall_s=ran["wall_s"])
        arms[label] = found
        print(f"{label}: {found['curve']} -> {found['final']}", flush=True)
    trl = trl_arm(model_dir, out / f"trl_lora_s{LEARN_SEED}")
    arms["TRL GRPOTrainer + peft_config"] = {
        "curve": [(0, trl["eval_start"]["accuracy"])], "final": trl["eval_end"],
        "wall_s": trl["wall_s"], "trainable_parameters": trl.get("trainable_parameters")}
    return arms


def trl_arm(model_dir: Path, trl_dir: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer with ``peft_config`` (``LEARN``), scored by bench_real_model's one
    evaluator; read back from ``trl_dir`` where it finished with the same ``LEARN``."""
    from benchmarks import bench_real_model as real

    done = trl_dir / "bench_result.json"
    if done.exists() and json.loads(done.read_text()).get("extra") == LEARN:
        return json.loads(done.read_text())
    trl = real.run_trl(model_dir, LEARN_SEED, trl_dir, extra=LEARN)
    task = real.build_task(model_dir, LEARN_SEED)
    max_new = int(real.compose_cfg([f"model.pretrained_path={model_dir}"]).recipe.max_new_tokens)
    trl["eval_start"] = real.evaluate_dir(model_dir, task, max_new)
    trl["eval_end"] = real.evaluate_dir(trl_dir / "trl_policy", task, max_new)
    trl["extra"] = LEARN
    done.write_text(json.dumps(trl, default=str))
    return trl


def learning_markdown(arms: dict[str, dict[str, Any]]) -> tuple[str, dict[str, str]]:
    """The learning part of the section, and its key figures as it prints them."""
    rows, gains = [], {}
    for label, a in arms.items():
        start, end = float(a["curve"][0][1]), float(a["final"]["accuracy"])
        gains[label] = end - start
        trainable = a.get("trainable_parameters")
        rows.append([label, f"{trainable:,}" if trainable else "", f"{start:.3f}",
                     f"{end:.3f}", f"{end - start:+.3f}", f"{a['wall_s']:.0f}"])
    full, lora = gains["full fine-tuning"], gains["LoRA"]
    trl = gains["TRL GRPOTrainer + peft_config"]
    figures = {"full_gain": f"{full:+.3f}", "lora_gain": f"{lora:+.3f}",
               "trl_lora_gain": f"{trl:+.3f}"}
    source = arms["full fine-tuning"].get("run_dir", "")
    reused = (" The full fine-tuning row is `bench_real_model`'s seed-0 run (its saved config "
              "equal to today's composition of the preset), not run again."
              if "real_model" in source else "")
    if full > 0:
        figures["lora_of_full"] = f"{lora / full:.0%}"
        verdict = (f"LoRA's gain is {figures['lora_of_full']} of full fine-tuning's (goal >= "
                   f"80%); TRL with `peft_config` gained {figures['trl_lora_gain']} against our "
                   f"LoRA's {figures['lora_gain']}, one seed each.")
    else:
        verdict = "Full fine-tuning gained nothing here: the ratio is undefined."
    markdown = "\n\n".join([
        (f"Learning at equal steps: `tq-train --config-name grpo_real` (SmolLM2-135M-Instruct, "
         f"two-digit sums, 12 RL steps of 8 x 8, 96 held-out questions, greedy, seed "
         f"{LEARN_SEED}), full fine-tuning as the preset (lr 2e-5, linear decay) against LoRA "
         f"(`{' '.join(LEARN)}`: every linear layer, 10x the full lr, as \"LoRA Without "
         f"Regret\" found for RL) and TRL 1.16's `GRPOTrainer` with the same `peft_config` "
         f"(`bench_real_model`'s TRL side: the same questions in the same order, reward, "
         f"schedule, loss; its merged model scored by the same evaluator). Wall seconds are "
         f"each process's, on the shared box: not a speed comparison.{reused}"),
        table(["", "trainable", "held-out start", "end", "gain", "wall s"], rows),
        verdict,
    ])
    return markdown, figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    modes = {"full fine-tuning": "full", f"LoRA r={LORA['r']}": "lora"}
    load_before = os.getloadavg()[0]
    rounds = [{label: _run_probe("step", mode) for label, mode in modes.items()}
              for _ in range(ROUNDS)]
    # each mode's figures from its median round; the step-time ratio round by round
    steps = {label: sorted((r[label] for r in rounds), key=lambda s: s["step_s"])[ROUNDS // 2]
             for label in modes}
    full_label, lora_label = modes
    step_ratios = sorted(r[lora_label]["step_s"] / r[full_label]["step_s"] for r in rounds)
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
                  f"{(s['sync_s'] - s['request_s']) * 1e3:,.2f}", f"{s['peak_rss_mb']:,.0f}"]
                 for (label, e), s in syncs.items()]
    full, lora = steps[full_label], steps[lora_label]
    def net(s: dict[str, float]) -> float:  # the sync without the request timed with it
        return s["sync_s"] - s["request_s"]

    ratio = {e: net(syncs[(lora_label, e)]) / net(syncs[(full_label, e)]) for e in ENGINES}
    markdown = "\n\n".join([
        "## LoRA against full fine-tuning (`bench_lora`)",
        (f"SmolLM2-135M-Instruct, float32, `model.lora` r={LORA['r']} alpha={LORA['alpha']:g} "
         f"on {LORA['target_modules']} (every linear layer but the LM head, the adapters the "
         f"learning comparison below trains); a step is {BATCH} rows of {SEQ} tokens "
         f"(chunked token scoring, backward, AdamW), median of {STEPS} after one, in {ROUNDS} "
         f"rounds (the table: each mode's median round); a sync is "
         f"median of {SYNCS} after one. Each row is a process of its own (its peak RSS). "
         f"{machine()}."),
        table(["", "trainable", "of all", "params+grads+Adam MB",
               "trained params+grads+Adam MB", "step s", "peak RSS MB"], step_rows),
        (f"Per rank, LoRA / full: {trained(lora) / trained(full):.2%} of the trained bytes "
         f"(goal <= 5%), {held(lora) / held(full):.1%} of all held (the frozen base included); "
         f"step time {statistics.median(step_ratios):.2f}x full fine-tuning's (goal <= 0.8x; "
         f"median of {ROUNDS} rounds run alternately, each round's ratio: "
         f"{', '.join(f'{x:.2f}' for x in step_ratios)})."),
        table(["", "engine", "sync MB", "sync ms", "net ms", "peak RSS MB"], sync_rows),
        ("vllm's sync is timed with its first one-token request after it (where vLLM loads a "
         "new adapter), for both; net ms takes away the same request's median with no sync "
         "before it (hf and native: no request, net = sync)."),
        "One sync (net), LoRA / full: " + ", ".join(f"{e} {r:.3f}x" for e, r in ratio.items())
        + " (goal <= 0.1x).",
        (f"Load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
         f"{os.cpu_count()} cores: the bytes are exact, the seconds are this machine's at that "
         f"load (the probes run one after another, not interleaved)."),
    ])
    figures = {"trainable": f"{lora['trainable']:,}",
               "trainable_share": f"{lora['trainable'] / lora['total']:.2%}",
               "trained_bytes_share": f"{trained(lora) / trained(full):.2%}",
               "step_ratio": f"{statistics.median(step_ratios):.2f}x",
               **{f"{e}_sync_ratio": f"{e} {r:.3f}x" for e, r in ratio.items()}}
    learned = None
    if os.environ.get("TQ_BENCH_LORA_LEARN", "1") == "1":
        learned = learning()
        for arm in learned.values():  # an older run's result.json may not have the count
            if not arm.get("trainable_parameters"):
                arm["trainable_parameters"] = (full if arm is learned["full fine-tuning"]
                                               else lora)["trainable"]
        text, learned_figures = learning_markdown(learned)
        markdown += "\n\n" + text
        figures.update(learned_figures)
    print(markdown)
    return {"markdown": markdown, "key_figures": figures, "steps": steps, "learning": learned,
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

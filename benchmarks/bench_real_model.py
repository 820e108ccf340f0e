"""A real pretrained model on a real task: SmolLM2-135M-Instruct (``make real-model``) trained by
``tq-train --config-name grpo_real`` on a reasoning-gym task, held-out greedy accuracy at the
start and the end over several seeds, side by side with TRL 1.16's ``GRPOTrainer`` on the same
work (``python -m benchmarks.run_all bench_real_model``; the full run is ~1 h on the 2-core box,
``TQ_BENCH_REAL_SEEDS=0`` runs one seed).

The same work on both sides: the model directory (its parameters hashed as each side loads
them), the task's training questions in the order our run draws them (TRL's sampler is told not
to shuffle), the reward (the task's ``score`` reward: the dataset's ``score_answer`` on the
extracted answer), group size, completion length, temperature, the optimiser (AdamW), learning
rate and its schedule (``recipe.lr_scheduler`` / ``warmup_steps`` as TRL's
``lr_scheduler_type`` / ``warmup_steps``), weight decay, gradient-norm clip, one PPO epoch /
``num_iterations=1``, the ``dapo`` loss, no KL, and the number of optimizer steps. Both trained models are scored by one
evaluator (the task's ``evaluate`` over greedy completions from ``engine=hf``), so the accuracy
figures are comparable whatever each library logs.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "outputs" / "real_models" / "smollm2"
OUT = ROOT / "benchmarks" / "out" / "real_model"
PRESET = "grpo_real"
# engine=vllm beside engine=hf: the first steps of seed 0's run, again with engine=vllm.
VLLM_STEPS = 3
# recipe.lr_scheduler -> transformers' lr_scheduler_type (ours warms up under every schedule).
TRL_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def seeds() -> list[int]:
    raw = os.environ.get("TQ_BENCH_REAL_SEEDS", "0,1,2")
    return [int(s) for s in raw.split(",") if s.strip()]


def ensure_model(name: str = "smollm2") -> Path:
    """The converted model directory (``python -m tq_plugin.rl.models.gguf``: converts once)."""
    out = ROOT / "outputs" / "real_models" / name
    proc = subprocess.run([sys.executable, "-m", "tq_plugin.rl.models.gguf", "--model", name,
                           "--out", str(out)], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"converting {name} failed: {proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def compose_cfg(overrides: list[str]) -> Any:
    """The ``grpo_real`` preset with ``overrides``, as ``tq-train`` composes it."""
    from hydra import compose, initialize_config_module

    import tq_plugin.config  # noqa: F401  (registers the schemas)
    from tq_plugin.cli import CONFIG_MODULE

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(PRESET, overrides=overrides)


def build_task(model_dir: Path, seed: int) -> Any:
    from tq_plugin.rl.topology.build import build_task as build

    return build(compose_cfg([f"model.pretrained_path={model_dir}", f"recipe.seed={seed}"]))


def params_sha(model: Any) -> str:
    """sha256 over a model's parameters as loaded (name, dtype, bytes)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(p.dtype).encode())
        h.update(p.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def evaluate_dir(model_dir: Path, task: Any, max_new_tokens: int) -> dict[str, float]:
    """The one evaluator of every model here: greedy ``engine=hf`` completions of the task's
    held-out questions, scored by the task."""
    from tq_plugin.rl.training.evaluation import evaluate
    from tq_plugin.rollout.engines.hf import HFEngine

    engine = HFEngine(model_dir)
    try:
        return evaluate(task, engine, max_new_tokens=max_new_tokens)
    finally:
        engine.close()


# ---------------------------------------------------------------------------- ours
def run_ours(model_dir: Path, seed: int, out: Path, *, extra: list[str] | None = None,
             timeout_s: float = 3600) -> dict[str, Any]:
    """One ``tq-train --config-name grpo_real`` run in a fresh process, its run dir kept."""
    overrides = [f"model.pretrained_path={model_dir}", f"recipe.seed={seed}", *(extra or [])]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tq_plugin.cli", "--config-name", PRESET,
                           *overrides, f"hydra.run.dir={out}", "trainer.enable_progress_bar=false"],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"tq-train {' '.join(overrides)} exited {proc.returncode}: "
                           f"{proc.stderr[-3000:]}")
    result, rows, curve = read_run(out)
    return {"wall_s": wall, "run_s": float(result.get("wall_s", wall)), "rows": rows,
            "curve": curve, "final": result.get("eval", {}), "overrides": overrides,
            "reward": [float(r["reward"]) for r in rows],
            "phases": {k: sum(float(r[k]) for r in rows) / len(rows)
                       for k in ("rollout_s", "prepare_s", "train_s")}}


def read_run(out: Path) -> tuple[dict[str, Any], list[dict[str, str]], list[tuple[int, float]]]:
    """A finished run dir's ``result.json``, ``metrics.csv`` rows and held-out accuracy curve
    (step, accuracy)."""
    result = json.loads((out / "result.json").read_text())
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    curve = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if r.get("eval/accuracy")]
    return result, rows, curve


# ---------------------------------------------------------------------------- TRL
def trl_run(model_dir: Path, seed: int, out: Path, extra: list[str] | None = None
            ) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` on the same work (module docstring), in this process. ``extra``:
    overrides of the preset, read as ours reads them; with ``model.lora.r`` set, TRL trains
    PEFT adapters of the same ``r``, ``alpha``, ``dropout`` and ``target_modules`` through its
    ``peft_config``, and the merged model is saved for the evaluator."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    cfg = compose_cfg([f"model.pretrained_path={model_dir}", f"recipe.seed={seed}",
                       *(extra or [])])
    rc = cfg.recipe
    lora = cfg.model.get("lora")
    peft_config = None
    if lora is not None and lora.get("r") is not None:
        from peft import LoraConfig

        targets = lora.get("target_modules")
        peft_config = LoraConfig(
            r=int(lora.r), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
            target_modules=targets if isinstance(targets, str) or targets is None
            else list(targets), bias="none", task_type="CAUSAL_LM")
    if str(rc.optimizer) != "adamw":
        raise ValueError("the TRL side runs AdamW: keep recipe.optimizer=adamw")
    torch.set_num_threads(int(rc.num_threads))
    task = build_task(model_dir, seed)
    order = [i for _ in range(int(rc.num_steps)) for i in task.next_rows(int(rc.prompts_per_step))]
    data = datasets.Dataset.from_list([
        {"prompt": task.rows[i]["prompt"], "question": task.rows[i]["question"],
         "answer": task.rows[i]["answer"], "metadata": json.dumps(task.rows[i]["metadata"])}
        for i in order])

    def score(completions: list[Any], question: list[str], answer: list[str],
              metadata: list[str], **_: Any) -> list[float]:
        return task.score_reward(completions, question, answer,
                                 [json.loads(m) for m in metadata])

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                              dtype=torch.float32)
    sha = params_sha(model)
    batch = int(rc.prompts_per_step) * int(rc.group_size)
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, seed=seed, beta=0.0,
        per_device_train_batch_size=batch, num_generations=int(rc.group_size),
        gradient_accumulation_steps=1, num_iterations=1, max_steps=int(rc.num_steps),
        max_completion_length=int(rc.max_new_tokens), temperature=float(rc.temperature),
        learning_rate=float(rc.lr), lr_scheduler_type=TRL_SCHEDULES[str(rc.lr_scheduler)],
        warmup_steps=int(rc.warmup_steps), weight_decay=float(rc.weight_decay),
        optim="adamw_torch", max_grad_norm=float(rc.max_grad_norm), loss_type="dapo",
        report_to=[], logging_steps=1,
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[score], args=args, train_dataset=data,
                          processing_class=tok, peft_config=peft_config)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if peft_config is not None:  # the evaluator loads a plain transformers directory
        trainer.model.merge_and_unload().save_pretrained(str(out / "trl_policy"))
    else:
        trainer.save_model(str(out / "trl_policy"))
    tok.save_pretrained(str(out / "trl_policy"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"train_s": train_s, "rewards": rewards, "params_sha": sha,
            "prompts_first": order[:4], "trainable_parameters": trainable}


def run_trl(model_dir: Path, seed: int, out: Path, *, extra: list[str] | None = None,
            timeout_s: float = 3600) -> dict[str, Any]:
    """:func:`trl_run` in a fresh process: its figures and the process seconds."""
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_real_model", "--trl",
                           str(model_dir), "--seed", str(seed), "--out", str(out),
                           *(f"--override={o}" for o in extra or [])], env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False,
                          cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"the TRL run exited {proc.returncode}: {proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return {**json.loads(line[len("RESULT "):]), "wall_s": wall}


def trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------- the bench
def plot(runs: dict[int, dict[str, Any]], path: Path) -> None:
    """Held-out accuracy and sampled reward against RL step, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for seed, run in runs.items():
        # The trained weights' evaluation is the last row's (metrics.csv), after its step.
        steps, acc = zip(*run["curve"]) if run["curve"] else ((), ())
        xs = [s + 1 if s == len(run["reward"]) - 1 else s for s in steps]
        a.plot(xs, list(acc), marker="o", label=f"seed {seed}")
        b.plot(range(len(run["reward"])), run["reward"], label=f"seed {seed}")
    a.set(xlabel="RL step", ylabel="held-out accuracy (greedy)", title="SmolLM2-135M-Instruct")
    b.set(xlabel="RL step", ylabel="sampled reward (mean)", title="training reward")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def generation_figures(rows: list[dict[str, str]], batch: int) -> dict[str, float]:
    """Per RL step, means over ``rows`` (metrics.csv): generation seconds, generated tokens per
    second (``completions/mean_length`` x the step's completions / ``rollout_s``) and the
    whole step (generation + logprob passes + training)."""
    n = max(len(rows), 1)
    gen = sum(float(r["rollout_s"]) for r in rows) / n
    tokens = sum(float(r["completions/mean_length"]) * batch for r in rows) / n
    step = sum(float(r["rollout_s"]) + float(r["prepare_s"]) + float(r["train_s"])
               for r in rows) / n
    return {"generation_s": gen, "tokens_per_s": tokens / gen if gen else 0.0, "step_s": step}


def _mean_spread(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    m = sum(xs) / len(xs)
    return f"{m:.3f} ({min(xs):.3f}–{max(xs):.3f})"


def main(out: Path = OUT) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model()
    cfg = compose_cfg([f"model.pretrained_path={model_dir}"])
    rc, task_cfg = cfg.recipe, cfg.task
    results: dict[str, Any] = {"model": str(model_dir), "preset": PRESET,
                               "recipe": {k: rc[k] for k in ("num_steps", "prompts_per_step",
                                                             "group_size", "max_new_tokens",
                                                             "lr", "lr_scheduler", "warmup_steps",
                                                             "temperature", "ppo_epochs",
                                                             "eval_every", "num_threads")},
                               "task": {"dataset": task_cfg.dataset,
                                        "config": dict(task_cfg.config),
                                        "eval_size": task_cfg.eval_size}}
    ours: dict[int, dict[str, Any]] = {}
    for seed in seeds():
        ours[seed] = run_ours(model_dir, seed, out / f"ours_s{seed}")
        print(f"ours seed {seed}: {ours[seed]['curve']} final {ours[seed]['final']} "
              f"wall {ours[seed]['wall_s']:.0f} s", flush=True)
    results["ours"] = {s: {k: v for k, v in r.items() if k != "rows"} for s, r in ours.items()}
    first = seeds()[0]
    missing = trl_missing()
    if missing is None:
        trl = run_trl(model_dir, first, out / f"trl_s{first}")
        task = build_task(model_dir, first)
        trl["eval_start"] = evaluate_dir(model_dir, task, int(rc.max_new_tokens))
        trl["eval_end"] = evaluate_dir(out / f"trl_s{first}" / "trl_policy", task,
                                       int(rc.max_new_tokens))
        import transformers

        ours_model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                                       local_files_only=True)
        trl["ours_params_sha"] = params_sha(ours_model)
        ours_end = evaluate_dir(out / f"ours_s{first}" / "hf_policy", task,
                                int(rc.max_new_tokens))
        trl["ours_eval_end_same_evaluator"] = ours_end
        results["trl"] = trl
        print(f"trl seed {first}: {trl['eval_start']} -> {trl['eval_end']}, wall "
              f"{trl['wall_s']:.0f} s", flush=True)
    else:
        results["trl"] = {"missing": missing}
    if os.environ.get("TQ_BENCH_REAL_VLLM", "1") == "1":
        try:
            vllm = run_ours(model_dir, first, out / f"ours_vllm_s{first}",
                            extra=["engine=vllm", f"recipe.num_steps={VLLM_STEPS}",
                                   "recipe.eval_every=0"])
            batch = int(rc.prompts_per_step) * int(rc.group_size)
            results["vllm"] = {"steps": VLLM_STEPS, "wall_s": vllm["wall_s"],
                               "vllm": generation_figures(vllm["rows"], batch),
                               "hf": generation_figures(ours[first]["rows"][:VLLM_STEPS], batch)}
        except RuntimeError as exc:
            results["vllm"] = {"error": str(exc)[-500:]}
    plot(ours, out / "real_model_curve.png")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return {**results, "markdown": markdown(results)}


def markdown(r: dict[str, Any]) -> str:
    ours = r["ours"]
    starts = [float(run["curve"][0][1]) for run in ours.values() if run["curve"]]
    ends = [float(run["final"]["accuracy"]) for run in ours.values() if run["final"]]
    gains = [e - s for s, e in zip(starts, ends)]
    rc, task = r["recipe"], r["task"]
    lines = [
        "## A real model on a real task (bench_real_model)",
        "",
        (f"SmolLM2-135M-Instruct (`make real-model`, 134.5M parameters) trained by `tq-train "
        f"--config-name {r['preset']} model.pretrained_path=<it> recipe.seed=<s>` on reasoning-gym "
        f"`{task['dataset']}` ({task['config']}), {task['eval_size']} held-out questions scored "
        f"greedy by the dataset's `score_answer`: {rc['num_steps']} RL steps of "
        f"{rc['prompts_per_step']} prompts x {rc['group_size']} completions of up to "
        f"{rc['max_new_tokens']} tokens, lr {rc['lr']} ({rc.get('lr_scheduler', 'constant')}"
        f" schedule), {rc['ppo_epochs']} PPO epoch, "
        f"temperature {rc['temperature']}, {rc['num_threads']} torch threads, `engine=hf`."),
        "",
        "| seed | held-out accuracy, start | end | gain | wall s |",
        "|---|---|---|---|---|",
    ]
    for seed, run in ours.items():
        s = run["curve"][0][1] if run["curve"] else float("nan")
        e = run["final"].get("accuracy", float("nan"))
        lines.append(f"| {seed} | {s:.3f} | {e:.3f} | {e - s:+.3f} | {run['wall_s']:.0f} |")
    lines += ["", (f"Mean gain over {len(gains)} seeds: **{_mean_spread(gains)}** "
              f"(start {_mean_spread(starts)}, end {_mean_spread(ends)}); goal +0.20. "
              "Curve: `benchmarks/out/real_model/real_model_curve.png`.")]
    trl = r.get("trl", {})
    if "missing" in trl:
        lines += ["", f"TRL: not run ({trl['missing']})."]
    elif trl:
        seed = next(iter(ours))
        run = ours[seed]
        same = run.get("phases", {})
        lines += [
            "", (f"Against TRL 1.16 `GRPOTrainer` on the same work (seed {seed}; initial "
            f"parameters as each side loads them: sha256 {trl['ours_params_sha']} ours, "
            f"{trl['params_sha']} TRL; one evaluator for both):"), "",
            "| | held-out accuracy start -> end | wall s (process) | seconds per RL step |",
            "|---|---|---|---|",
            (f"| ours | {trl['eval_start']['accuracy']:.3f} -> "
            f"{trl['ours_eval_end_same_evaluator']['accuracy']:.3f} | {run['wall_s']:.0f} | "
            f"{run['run_s'] / max(len(run['reward']), 1):.1f} (rollout {same.get('rollout_s', 0):.1f},"
            f" prepare {same.get('prepare_s', 0):.1f}, train {same.get('train_s', 0):.1f}) |"),
            (f"| TRL | {trl['eval_start']['accuracy']:.3f} -> {trl['eval_end']['accuracy']:.3f} | "
            f"{trl['wall_s']:.0f} | {trl['train_s'] / max(len(trl['rewards']), 1):.1f} |"),
            "", (f"Wall time ours / TRL: **{run['wall_s'] / trl['wall_s']:.2f}x** (goal <= 0.8x; "
            "ours includes its in-run evaluations, TRL's none).")]
    v = r.get("vllm")
    if v and "error" not in v:
        lines += ["", (f"`engine=vllm` beside `engine=hf`: the first {v['steps']} RL steps of "
                  f"seed {next(iter(ours))}'s run (the same prompts and settings), means per "
                  "step; generated tokens/s counts the step's completion tokens "
                  "(`completions/mean_length` x completions) over its generation seconds."), "",
                  ("| engine | generation s | generated tokens/s | step s (generation + logprob "
                  "passes + training) |"), "|---|---|---|---|"]
        for name in ("hf", "vllm"):
            f = v[name]
            lines.append(f"| {name} | {f['generation_s']:.1f} | {f['tokens_per_s']:.0f} | "
                         f"{f['step_s']:.1f} |")
    elif v:
        lines += ["", f"`engine=vllm`: failed: {v['error']}"]
    return "\n".join(lines)


def _cli(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl", type=Path, help="run TRL's side on this model dir (internal)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT / "trl")
    p.add_argument("--override", action="append", default=[],
                   help="a Hydra override of the preset for TRL's side (internal)")
    args = p.parse_args(argv)
    if args.trl is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        print("RESULT " + json.dumps(trl_run(args.trl, args.seed, args.out, args.override)),
              flush=True)
        return
    print(main()["markdown"])


if __name__ == "__main__":
    _cli()

"""The plumbing's per-step cost at toy shapes (issue 25 §6): the 120-step GRPO pattern task,
ours (``engine=native`` and ``engine=hf``) against TRL 1.16's ``GRPOTrainer``.

The model: the ``hf_causal_lm`` group's default shape (a llama, 64 wide, 2 layers, 2 heads of
32, 64 positions, 4x MLP) over the pattern task's 18-id vocabulary, random init with seed 0,
written once with ``save_pretrained`` beside a word-level tokenizer whose ids are the task's
own (``<bos> s2 L3 <sep>`` is the prompt ``[1, 9, 15, 3]``). TRL needs a transformers model and
a tokenizer; ours loads the same directory (``model=hf_causal_lm model.pretrained_path=``), so
the three contenders start from the same weights.

The same work in each: 120 RL steps of 16 prompts x 4 completions, at most 8 new tokens at
temperature 1, 4 optimizer steps per RL step on all 64 rows (``recipe.ppo_epochs=4``; TRL's
``num_iterations=4``: 480 optimizer steps), Adam at 7e-4 with a constant rate, gradients clipped
to norm 1, ``dapo`` token-mean loss, no KL, one torch thread. TRL's ``GRPOTrainer`` runs one
turn, so the task runs one turn here (``task.turns=1``; the preset's default is 2). TRL draws
the task's prompts from a dataset of the task's episodes (seed 0) and shuffles them; ours draws
them from the run's generator: the same distribution, not the same order. TRL samples with the
policy's non-output tokens suppressed (``generation_kwargs``), as our engines restrict them.

Measured: each run's wall time in a fresh process, imports and start-up included, and inside
it (ours: ``result.json``'s ``wall_s``; TRL: ``trainer.train()``), contenders taking turns,
best and median of a few. Then one run of ours under py-spy, its samples put into the buckets
of one step (generation, staging, reassembly, the logprob pass, training, Lightning hooks, the
data plane). Run alone: ``python -m benchmarks.run_all bench_toy_steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

STEPS, PROMPTS, GROUP, NEW_TOKENS, EPOCHS, LR, SEED = 120, 16, 4, 8, 4, 7e-4, 0
# The pattern task's defaults (conf/task/pattern.yaml).
NUM_SYMBOLS, MIN_LEN, MAX_LEN = 6, 2, 5


def _task() -> Any:
    from tq_plugin.rl.tasks.pattern import PatternTask

    return PatternTask(num_symbols=NUM_SYMBOLS, min_len=MIN_LEN, max_len=MAX_LEN, turns=1)


def token_names(task: Any) -> list[str]:
    """One word per id of the task's vocabulary, in id order."""
    from tq_plugin.rl.tasks.pattern import NUM_SPECIAL

    special = ["<pad>", "<bos>", "<eos>", "<sep>", "GOOD", "BAD", "<img>"][:NUM_SPECIAL]
    return [*special, *(f"s{i}" for i in range(task.num_symbols)),
            *(f"L{n}" for n in range(1, task.max_len + 1))]


def make_model(out: str | Path, *, seed: int = SEED) -> Path:
    """Write the policy (``out/model``: config, safetensors, tokenizer) once; returns it."""
    model_dir = Path(out) / "model"
    if (model_dir / "config.json").is_file():
        return model_dir
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tq_plugin.rl.models.hf import HFCausalLM
    from tq_plugin.rl.models.weights import write_hf_checkpoint

    task = _task()
    names = token_names(task)
    assert len(names) == task.vocab_size, (len(names), task.vocab_size)
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(seed)
    policy = HFCausalLM(task.vocab_size)
    write_hf_checkpoint(policy, model_dir, tokenizer=tokenizer)
    return model_dir


def pattern_reward(completion_ids: list[list[int]], target: list[list[int]],
                   **_: Any) -> list[float]:
    """The pattern task's score of each completion against its target (TRL's reward contract)."""
    import torch

    from tq_plugin.rl.tasks.pattern import EOS, PatternTask

    outs = [ids[: ids.index(EOS)] if EOS in ids else list(ids) for ids in completion_ids]
    pad = torch.nn.utils.rnn.pad_sequence
    scores = PatternTask.score(pad([torch.tensor(o or [0]) for o in outs], batch_first=True),
                               torch.tensor([len(o) for o in outs]),
                               pad([torch.tensor(t) for t in target], batch_first=True),
                               torch.tensor([len(t) for t in target]))
    return scores.tolist()


def trl_run(model_dir: Path, workdir: Path, *, steps: int = STEPS) -> dict[str, Any]:
    """TRL 1.16's ``GRPOTrainer`` on the task for ``steps`` RL steps (module docstring), in this
    process: ``{"train_s", "reward_first", "reward_last"}``."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    task = _task()
    names = token_names(task)
    episodes = task.sample(steps * PROMPTS, torch.Generator().manual_seed(SEED))
    data = datasets.Dataset.from_list([{"prompt": " ".join(names[t] for t in e.prompt),
                                        "target": e.target} for e in episodes])
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              local_files_only=True)
    banned = sorted(set(range(task.vocab_size)) - set(task.output_token_ids))
    args = GRPOConfig(
        output_dir=str(workdir), use_cpu=True, bf16=False, seed=SEED, beta=0.0,
        per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        gradient_accumulation_steps=1, num_iterations=EPOCHS, max_steps=steps * EPOCHS,
        max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        loss_type="dapo", report_to=[], logging_steps=EPOCHS, save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True,
        generation_kwargs={"suppress_tokens": banned})
    trainer = GRPOTrainer(model=model, reward_funcs=[pattern_reward], args=args,
                          train_dataset=data, processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"train_s": train_s, "reward_first": rewards[0] if rewards else float("nan"),
            "reward_last": sum(rewards[-5:]) / max(len(rewards[-5:]), 1) if rewards else
            float("nan"), "log_rows": len(rewards)}


def ours_overrides(model_dir: Path, engine: str, *, steps: int = STEPS) -> list[str]:
    """``tq-train`` overrides of our run on the same model and work as TRL's."""
    return ["--config-name", "grpo", "model=hf_causal_lm", f"model.pretrained_path={model_dir}",
            f"engine={engine}", "task.turns=1", f"recipe.num_steps={steps}",
            f"recipe.prompts_per_step={PROMPTS}", f"recipe.group_size={GROUP}",
            f"recipe.max_new_tokens={NEW_TOKENS}", f"recipe.ppo_epochs={EPOCHS}",
            f"recipe.lr={LR}", f"recipe.seed={SEED}"]


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_ours(model_dir: Path, engine: str, *, steps: int = STEPS) -> dict[str, Any]:
    """One ``tq-train`` run in a fresh process: process and in-run seconds, rewards, per-step
    phase seconds from its ``metrics.csv``."""
    from benchmarks._common import tq_train

    cpu0 = _children_cpu_s()
    run = tq_train(ours_overrides(model_dir, engine, steps=steps))
    cpu_s = _children_cpu_s() - cpu0
    phases = {k: sum(float(r[k]) for r in run.rows) / len(run.rows)
              for k in ("rollout_s", "prepare_s", "train_s")}
    return {"process_s": run.wall_s, "cpu_s": cpu_s, "run_s": float(run.result["wall_s"]),
            "reward_first": run.result["reward_first_avg"],
            "reward_last": run.result["reward_last_avg"], "phases": phases}


def run_trl(model_dir: Path, *, steps: int = STEPS, timeout_s: float = 1800) -> dict[str, Any]:
    """One TRL run (:func:`trl_run`) in a fresh process: its figures and the process seconds;
    ``{"missing": why}`` when TRL is not installed."""
    from benchmarks._common import LAUNCHER_VARS

    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env["TQDM_DISABLE"] = "1"
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_toy_steps", "--trl",
                           str(model_dir), "--steps", str(steps)], env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    process_s, cpu_s = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if proc.returncode:
        raise RuntimeError(f"the TRL run exited {proc.returncode}: {proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    return {"process_s": process_s, "cpu_s": cpu_s, "run_s": out["train_s"],
            "reward_first": out["reward_first"], "reward_last": out["reward_last"]}


def trl_available() -> str | None:
    """``None`` when TRL imports here, else why not."""
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def compare(model_dir: Path, *, runs: int = 3, steps: int = STEPS) -> dict[str, list[dict]]:
    """``runs`` rounds of TRL, ours native, ours hf, taking turns."""
    missing = trl_available()
    results: dict[str, list[dict]] = {"trl": [], "native": [], "hf": []}
    for i in range(runs):
        for name, rows in results.items():
            if name == "trl":
                if missing:
                    continue
                out = run_trl(model_dir, steps=steps)
            else:
                out = run_ours(model_dir, name, steps=steps)
            rows.append(out)
            print(f"  round {i}: {name} process {out['process_s']:.1f} s (CPU "
                  f"{out['cpu_s']:.1f} s), run {out['run_s']:.1f} s,"
                  f" reward {out['reward_first']:.3f} -> {out['reward_last']:.3f}", flush=True)
    return results


# ---------------------------------------------------------------------------- one step, profiled
# Where a sample of one of our runs goes: the first rule with a frame in the sample's stack
# names its bucket (so generation inside the rollout is generation, the rest of the rollout is
# staging, ...). Frames are py-spy's "function (file:line)".
BUCKETS = [
    ("generation", ("Engine.generate (",)),
    ("reassembly", ("finalize_group (",)),
    ("staging", ("RolloutWorker.run (",)),
    ("logprob pass", ("RLModule.forward_pass (",)),
    ("advantages, step record", ("Colocated.prepare_step (",)),
    ("training: forward + loss", ("RLModule.training_step (",)),
    ("training: backward", ("Strategy.backward (",)),
    ("training: optimizer", ("Precision.optimizer_step (",)),
    ("data plane: microbatch reads", ("on_before_batch_transfer (", "iter_microbatches (")),
    ("Lightning hooks and logging", ("Trainer.fit (",)),
    ("start-up, set-up, artifacts", ("",)),
]


def bucket_samples(raw: str) -> Counter:
    """Samples per bucket of a py-spy ``--format raw`` profile."""
    counts: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        for name, keys in BUCKETS:
            if any(k in f for k in keys for f in frames):
                counts[name] += int(n)
                break
    return counts


def profile(model_dir: Path, engine: str, out: Path, *, steps: int = STEPS,
            rate: int = 100) -> dict[str, Any]:
    """One of our runs under py-spy (``rate`` samples/s, wall clock): seconds per step in each
    bucket (the run's samples / steps / rate). ``{"missing": why}`` without py-spy."""
    import shutil

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).is_file():
        return {"missing": "py-spy is not installed"}
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"profile_{engine}.txt"
    cmd = [spy, "record", "--format", "raw", "-r", str(rate), "-o", str(raw), "--",
           sys.executable, "-m", "tq_plugin.cli", *ours_overrides(model_dir, engine, steps=steps),
           f"hydra.run.dir={out / ('run_' + engine)}", "trainer.enable_progress_bar=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"py-spy run exited {proc.returncode}: {proc.stderr[-3000:]}")
    counts = bucket_samples(raw.read_text())
    outside = BUCKETS[-1][0]
    return {"per_step_ms": {k: 1000 * v / rate / steps for k, v in counts.items() if k != outside},
            "outside_s": counts[outside] / rate, "total_s": sum(counts.values()) / rate}


def main(out: str | Path = "benchmarks/out/toy_steps", *, runs: int = 3) -> dict[str, Any]:
    out = Path(out)
    model_dir = make_model(out)
    results = compare(model_dir, runs=runs)
    prof = profile(model_dir, "native", out)
    return {"markdown": markdown(results, prof, trl_available()), "results": results,
            "profile": prof}


def _ratio(ours: list[float], trl: list[float]) -> str:
    from benchmarks._common import Stat

    best = min(ours) / min(trl)
    per_round = Stat.of([a / b for a, b in zip(ours, trl)])
    return f"{best:.2f} (rounds {per_round.fmt('.2f')})"


def markdown(results: dict[str, list[dict]], prof: dict[str, Any], missing: str | None) -> str:
    from benchmarks._common import Stat

    lines = [
        "## Per-step cost at toy shapes: the GRPO pattern task against TRL",
        "",
        "`python -m benchmarks.run_all bench_toy_steps`: 120 RL steps of 16 prompts x 4, at "
        "most 8 new tokens, 4 optimizer steps per RL step (480 in all), one turn "
        "(`task.turns=1`: TRL's `GRPOTrainer` runs one), one torch thread; the `hf_causal_lm` "
        "default shape (llama, 64 wide, 2 layers) over the task's 18 ids, the same initial "
        "weights and a word-level tokenizer for TRL. Ours: `tq-train " +
        " ".join(ours_overrides(Path("MODEL"), "ENGINE")) + "`; TRL 1.16 `GRPOTrainer` with "
        "`num_iterations=4`, `max_steps=480`, the same lr, clip, loss type and sampling. "
        "Each run in a fresh process, the three taking turns; seconds as best / median "
        "(min–max); the run's own seconds are ours' `result.json` `wall_s` and TRL's "
        "`trainer.train()`; process CPU s is the process's user + system seconds (imports "
        "included), the figure that holds still when other work loads the box. Ratios: best "
        "(min / min), then per round (run i against run i).",
        "",
        ("| run | process s | process CPU s | in-run s | reward, first 5 -> last 5 steps "
        "| ours / TRL: process s | CPU s | in-run s |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    trl = results["trl"]
    for name, label in (("trl", "TRL GRPOTrainer"), ("native", "ours, `engine=native`"),
                        ("hf", "ours, `engine=hf`")):
        rows = results[name]
        if not rows:
            lines.append(f"| {label} | not measured ({missing}) | | | | | | |")
            continue
        proc = Stat.of([r["process_s"] for r in rows])
        cpu = Stat.of([r["cpu_s"] for r in rows])
        run = Stat.of([r["run_s"] for r in rows])
        reward = (f"{Stat.of([r['reward_first'] for r in rows]).median:.2f} -> "
                  f"{Stat.of([r['reward_last'] for r in rows]).median:.2f}")
        if name == "trl" or not trl:
            ratios = ["–"] * 3
        else:
            ratios = [_ratio([r[k] for r in rows], [r[k] for r in trl])
                      for k in ("process_s", "cpu_s", "run_s")]
        lines.append(f"| {label} | {proc.min:.1f} / {proc.fmt('.1f')} | {cpu.min:.1f} / "
                     f"{cpu.fmt('.1f')} | {run.min:.1f} / {run.fmt('.1f')} | {reward} | "
                     + " | ".join(ratios) + " |")
    lines.append("")
    if "missing" in prof:
        lines.append(f"Per-step profile: not measured ({prof['missing']}).")
        return "\n".join(lines)
    per_step, start = prof["per_step_ms"], prof["outside_s"]
    lines += [
        (f"Where one step of ours goes (`engine=native`, one run under py-spy at 100 samples/s, "
        f"wall clock; {prof['total_s']:.0f} s in all, of which {start:.1f} s start-up, set-up "
        "and artifacts): ms per RL step, each sample in the first bucket whose function is on "
        "its stack (`BUCKETS` in the module)."),
        "",
        "| bucket | ms / step |",
        "|---|---|",
    ]
    for name, _ in BUCKETS:
        if name in per_step:
            lines.append(f"| {name} | {per_step[name]:.1f} |")
    lines.append(f"| **step total** | **{sum(per_step.values()):.1f}** |")
    return "\n".join(lines)


def _cli(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.bench_toy_steps --trl MODEL_DIR``: one TRL run, JSON on stdout."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--trl", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    ns = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tq-bench-trl-") as tmp:
        out = trl_run(ns.trl, Path(tmp), steps=ns.steps)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    _cli()

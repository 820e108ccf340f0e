"""Real models, the rest of issue 33 §3: Gemma-3-270M at its 262,144-id vocabulary, and
reasoning-gym's ``gsm_symbolic`` with SmolLM2-135M-Instruct.

Both models come from ``make real-model`` (``outputs/real_models/{gemma3-270m,smollm2}``); a
missing one is reported in the section, not converted here.

* Gemma-3-270M (the base model: no chat template, so plain-text few-shot sums ``Q: a + b = ?
  A:`` written to a temporary ``task=prompts`` file, rewarded by :func:`first_number_reward`):
  one GRPO step through ``tq-train`` with ``engine=hf`` at two microbatch budgets
  (``tq.packing.train_mb_tokens`` = ``logprob_mb_tokens`` = 256, then 1,024) and one with
  ``engine=vllm``. Per run: the step's seconds, generation (``rollout_s``), the logprob gap
  between the engine's sampling logprobs and the trainer's after the sync (``logprob_gap``),
  the process's peak RSS; and the real-shapes bench's measure, peak memory per microbatch token:
  the peak-RSS difference of the two ``engine=hf`` runs over their budgets' difference.
* ``gsm_symbolic`` with SmolLM2 (``--config-name grpo_real``, the preset's ``basic_arithmetic``
  options dropped with ``task.config=null``: ``task.config={}`` merges into them and
  ``~task.config`` is refused by the schema): held-out greedy accuracy at the start and after
  a short run, seconds per step, and a few held-out completions (``eval_completions.jsonl`` of
  the run dir).

Run alone: ``python -m benchmarks.run_all bench_real_extra`` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

GEMMA = Path("outputs/real_models/gemma3-270m")
SMOLLM2 = Path("outputs/real_models/smollm2")

# ---------------------------------------------------------------------------- Gemma-3-270M
SHOTS = ((3, 4), (15, 21), (8, 13), (40, 9))
QUESTIONS = ((12, 7), (23, 45), (6, 38), (51, 17), (9, 9), (34, 28), (70, 15), (18, 66))
MB_TOKENS = (256, 1024)  # tq.packing.train_mb_tokens = logprob_mb_tokens of the two hf runs
GEMMA_STEP = ["recipe.num_steps=1", "recipe.prompts_per_step=4", "recipe.group_size=4",
              "recipe.max_new_tokens=16", "recipe.ppo_epochs=1", "recipe.lr=1e-5",
              "recipe.num_threads=2"]
_INT = re.compile(r"-?\d+")


def sum_prompt(a: int, b: int) -> str:
    """A plain-text few-shot prompt for a base model (about 80 Gemma tokens)."""
    shots = "".join(f"Q: {x} + {y} = ?\nA: {x + y}\n" for x, y in SHOTS)
    return f"{shots}Q: {a} + {b} = ?\nA:"


def first_number_reward(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """1 when the completion's first integer is the answer, else 0 (a base model goes on with
    more ``Q: ...`` lines after its answer, so the last number would be the wrong one)."""
    out = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        found = _INT.search(text)
        out.append(float(found is not None and found.group() == str(gold)))
    return out


def write_sums(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": sum_prompt(a, b), "answer": str(a + b)}) + "\n"
                            for a, b in QUESTIONS))
    return path


def train_kept(overrides: list[str], run_dir: Path) -> Any:
    """``benchmarks._common.tq_train`` with its run dir kept at ``run_dir`` (it otherwise removes
    it), so the held-out completions can be read afterwards."""
    from unittest import mock

    from benchmarks import _common

    run_dir.mkdir(parents=True, exist_ok=True)
    with mock.patch.object(_common.tempfile, "TemporaryDirectory",
                           lambda **_: contextlib.nullcontext(str(run_dir))):
        return _common.tq_train(overrides)


def _error(exc: BaseException) -> str:
    """The line of a failed run that says why (the last ``...Error:`` line of its stderr)."""
    if hasattr(exc, "timeout"):  # subprocess.TimeoutExpired: tq_train's limit
        return f"killed by benchmarks._common.tq_train's timeout after {exc.timeout:.0f} s"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (errors or lines or [type(exc).__name__])[-1][:300]


def gemma_run(data: Path, *, engine: str, mb_tokens: int) -> dict[str, Any]:
    overrides = ["--config-name", "grpo", "task=prompts", f"task.path={data}",
                 "task.reward._target_=benchmarks.bench_real_extra.first_number_reward",
                 "model=hf_causal_lm", f"model.pretrained_path={GEMMA}", f"engine={engine}",
                 *GEMMA_STEP, f"tq.packing.train_mb_tokens={mb_tokens}",
                 f"tq.packing.logprob_mb_tokens={mb_tokens}"]
    command = "tq-train " + " ".join(overrides[2:])
    print(f"  {command}", flush=True)
    try:
        from benchmarks._common import tq_train

        run = tq_train(overrides)
    except Exception as exc:  # noqa: BLE001 (the section says why, the other runs go on)
        return {"engine": engine, "mb": mb_tokens, "error": _error(exc), "command": command}
    row = run.rows[0]
    fig = {"engine": engine, "mb": mb_tokens, "command": command, "wall_s": run.wall_s,
           "rollout_s": float(row["rollout_s"]), "prepare_s": float(row["prepare_s"]),
           "train_s": float(row["train_s"]), "gap": float(row["logprob_gap"]),
           "abs_diff": _float(row.get("gen_logprob_abs_diff")),
           "reward": float(row["reward"]), "tokens": int(row["train_tokens"]),
           "microbatches": int(row["microbatches"]),
           "peak_mb": float(run.result["peak_rss_mb"])}
    print(f"    {fig}", flush=True)
    return fig


def _float(value: Any) -> float | None:
    return float(value) if value not in (None, "") else None


# ---------------------------------------------------------------------------- gsm_symbolic
GSM_STEPS, GSM_EVAL_EVERY, GSM_EVAL_SIZE, GSM_NEW_TOKENS = 6, 3, 32, 64
GSM = ["--config-name", "grpo_real", f"model.pretrained_path={SMOLLM2}",
       "task.dataset=gsm_symbolic", "task.config=null",
       f"recipe.max_new_tokens={GSM_NEW_TOKENS}",
       f"recipe.num_steps={GSM_STEPS}", f"recipe.eval_every={GSM_EVAL_EVERY}",
       f"task.eval_size={GSM_EVAL_SIZE}", "tq.packing.train_mb_tokens=1024",
       "tq.packing.logprob_mb_tokens=2048"]


def gsm_run(run_dir: Path) -> dict[str, Any]:
    command = "tq-train " + " ".join(GSM[2:])
    print(f"  {command}", flush=True)
    try:
        run = train_kept(list(GSM), run_dir)
    except Exception as exc:  # noqa: BLE001
        return {"error": _error(exc), "command": command}
    rows = run.rows
    evals = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows
             if r.get("eval/accuracy") not in (None, "")]
    first = run.result.get("eval_first", {}).get("accuracy")
    last = run.result.get("eval", {}).get("accuracy")
    path = run_dir / "eval_completions.jsonl"
    completions = ([json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
                   if path.is_file() else [])
    step_s = [float(r["rollout_s"]) + float(r["prepare_s"]) + float(r["train_s"]) for r in rows]
    fig = {"command": command, "wall_s": run.wall_s, "steps": len(rows),
           "step_s": sum(step_s) / len(step_s), "rollout_s": _mean(rows, "rollout_s"),
           "train_s": _mean(rows, "train_s"), "first": first if first is not None else
           (evals[0][1] if evals else None), "last": last if last is not None else
           (evals[-1][1] if evals else None), "evals": evals,
           "rewards": [float(r["reward"]) for r in rows], "completions": completions,
           "peak_mb": float(run.result["peak_rss_mb"])}
    print(f"    {({k: v for k, v in fig.items() if k != 'completions'})}", flush=True)
    return fig


def _mean(rows: list[dict[str, str]], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


def samples(completions: list[dict[str, Any]], n: int = 2) -> list[dict[str, Any]]:
    """The first ``n`` held-out questions, each at the first and the last evaluated step."""
    steps = sorted({c["step"] for c in completions})
    if not steps:
        return []
    by = {(c["step"], c["prompt"]): c for c in completions}
    questions = [c["prompt"] for c in completions if c["step"] == steps[0]][:n]
    return [{"question": q, "answer": by[(steps[0], q)]["answer"],
             "first": by.get((steps[0], q)), "last": by.get((steps[-1], q)),
             "steps": (steps[0], steps[-1])} for q in questions]


# ---------------------------------------------------------------------------- the section
def main() -> dict[str, Any]:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(".pytest_cache") / "inductor"))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    gemma: list[dict[str, Any]] = []
    gsm: dict[str, Any] = {"error": f"{SMOLLM2} missing: make real-model"}
    with tempfile.TemporaryDirectory(prefix="tq-bench-extra-") as tmp:
        data = write_sums(Path(tmp) / "sums.jsonl")
        if (GEMMA / "config.json").is_file():
            gemma = [gemma_run(data, engine="hf", mb_tokens=mb) for mb in MB_TOKENS]
            gemma.append(gemma_run(data, engine="vllm", mb_tokens=MB_TOKENS[-1]))
        if (SMOLLM2 / "config.json").is_file():
            gsm = gsm_run(Path(tmp) / "gsm")
    wall = time.perf_counter() - t0
    return {"markdown": markdown(gemma, gsm, load=load, wall=wall), "gemma": gemma, "gsm": gsm}


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def markdown(gemma: list[dict[str, Any]], gsm: dict[str, Any], *, load: float,
             wall: float) -> str:
    lines = [
        "## Real models: Gemma-3-270M at 262k ids, and gsm_symbolic (bench_real_extra)",
        "",
        (f"`python -m benchmarks.run_all bench_real_extra` ({wall / 60:.0f} min; load average "
         f"{load:.1f} on 2 cores when it started, other runs beside it: the seconds are upper "
         "bounds). Models from `make real-model`."),
        "",
        "### Gemma-3-270M (268M parameters, 262,144-id vocabulary), one GRPO step",
        "",
    ]
    if not gemma:
        lines.append(f"Not measured: {GEMMA} missing (`make real-model REAL_MODEL=gemma3-270m`).")
    else:
        lines += [
            (f"The base model (no chat template): {len(QUESTIONS)} plain-text few-shot prompts "
             f"`{sum_prompt(*QUESTIONS[0])!r}` (81 tokens), reward 1 when the completion's first "
             "integer is the sum (`benchmarks.bench_real_extra.first_number_reward`); 4 prompts x "
             "4 completions of 16 new tokens, one optimizer step, float32, 2 torch threads: "
             f"`{gemma[0]['command']}` (then `tq.packing.*_mb_tokens={MB_TOKENS[1]}`, then "
             "`engine=vllm`). *step s*: generation + logprob pass + training (`rollout_s + "
             "prepare_s + train_s` of metrics.csv); *wall*: the whole `tq-train` process (imports, "
             "model load, engine start); *logprob gap*: metrics.csv `logprob_gap`, the largest "
             "|engine sampling logprob - trainer logprob| over the step's completion tokens, the "
             "engine having just been synced with the trainer's weights; *peak RSS*: result.json "
             "`peak_rss_mb`."),
            "",
            ("| engine | mb tokens | step s | generation s | logprob pass s | training s "
             "(tokens) | logprob gap | reward | peak RSS MB | wall s |"),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for g in gemma:
            if "error" in g:
                lines.append(f"| {g['engine']} | {g['mb']:,} | failed: `{_short(g['error'], 240)}` "
                             "| | | | | | | |")
                continue
            step = g["rollout_s"] + g["prepare_s"] + g["train_s"]
            lines.append(
                f"| {g['engine']} | {g['mb']:,} | {step:.1f} | {g['rollout_s']:.1f} | "
                f"{g['prepare_s']:.1f} | {g['train_s']:.1f} ({g['tokens']:,}, "
                f"{g['microbatches']} mb) | {g['gap']:.2g} | {g['reward']:.2f} | "
                f"{g['peak_mb']:,.0f} | {g['wall_s']:.0f} |")
        hf = [g for g in gemma if g["engine"] == "hf" and "error" not in g]
        if len(hf) == 2:
            slope = (hf[1]["peak_mb"] - hf[0]["peak_mb"]) / (hf[1]["mb"] - hf[0]["mb"])
            lines += ["", (f"Peak memory per microbatch token (`engine=hf`, the two budgets): "
                           f"({hf[1]['peak_mb']:,.0f} - {hf[0]['peak_mb']:,.0f} MB) / "
                           f"({hf[1]['mb']:,} - {hf[0]['mb']:,} tokens) = **{slope:.2f} MB per "
                           "microbatch token** (process peak RSS: it includes the weights, the "
                           "engine's copy, gradients and AdamW's state, which the difference "
                           "cancels; logits in chunks of `tq.packing.logprob_chunk_tokens`=1024 "
                           "rows).")]
    lines += ["", "### gsm_symbolic with SmolLM2-135M-Instruct", ""]
    if "error" in gsm:
        lines.append(f"Failed: `{gsm.get('command', '')}`: `{_short(gsm['error'], 300)}`.")
        return "\n".join(lines)
    evals = ", ".join(f"step {s}: {_pct(a)}" for s, a in gsm["evals"])
    lines += [
        (f"`{gsm['command']}` (the `grpo_real` preset otherwise: 4 prompts x 8 completions, lr "
         f"2e-5, temperature 0.7, answer = the completion's last number; microbatches of 1,024 "
         "tokens to bound the memory). Held-out greedy "
         f"accuracy ({GSM_EVAL_SIZE} questions never trained on): **{_pct(gsm['first'])} at the "
         f"start -> {_pct(gsm['last'])} after {gsm['steps']} steps** (metrics.csv "
         f"`eval/accuracy`: {evals or '–'}); training reward per step "
         f"{', '.join(f'{r:.2f}' for r in gsm['rewards'])}; "
         f"{gsm['step_s']:.0f} s per step (generation {gsm['rollout_s']:.0f} s, training "
         f"{gsm['train_s']:.0f} s), {gsm['wall_s'] / 60:.1f} min for the run with its "
         f"evaluations; peak RSS {gsm['peak_mb']:,.0f} MB."),
    ]
    shown = samples(gsm["completions"])
    if not shown:
        lines += ["", "No `eval_completions.jsonl` in the run dir: no held-out completions shown."]
    for s in shown:
        lines += ["", f"- *{_short(s['question'], 200)}* (gold {s['answer']})"]
        for label, step in (("first", s["steps"][0]), ("last", s["steps"][1])):
            c = s[label]
            if c is not None:
                lines.append(f"  - step {step}: `{_short(c['completion'], 200)}` -> extracted "
                             f"{c['extracted']!r}, score {c['score']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main()["markdown"])

"""Per-step metrics of a recipe run, and the artifacts written into Hydra's output dir.

* ``metrics.csv``: one row per RL step (reward, tokens/s, padded-token fraction, data-plane bytes…),
  appended as each step finishes (``MetricsLog.live``), so a killed run keeps every finished
  step's row, and rewritten whole, reduced over ranks, when the run ends;
* ``resolved_config.yaml``: the composed config with interpolations resolved;
* ``reward_curve.png``: reward (train, eval), loss, KL, entropy and tokens/s per step
  (``tq_plugin.rl.training.plots``; with the ``plot`` extra, matplotlib);
* ``result.json``: the run's summary, which the sweep report collects from every job.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from tq_plugin.data_plane import KVBatchMeta
from tq_plugin.lightning.module import MICROBATCH_INFO
from tq_plugin.rl.training.plots import plot_run, run_title
from tq_plugin.rl.training.step_record import RL_STEP, STEP_FIGURES

RESULT_FILE = "result.json"


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (Linux), so each job of a one-process sweep measures its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_memory_mb(device: torch.device | None = None) -> float:
    """This process's peak memory so far: ``torch.cuda.max_memory_allocated`` on a CUDA device,
    the peak resident set size (``VmHWM``) on the CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


# Per-microbatch sums the training step reports; a step's (or a global batch's) figures are
# ratios of these sums, so they do not depend on how the rows were cut into microbatches.
SUMMED_STATS = ("loss", "value_loss", "clipped_tokens", "action_tokens", "kl_sum",
                "entropy_sum", "real_tokens", "padded_tokens", "seconds", "clip_low_tokens",
                "clip_high_tokens", "kl_ref_sum")


# The importance-sampling sums of a microbatch (``recipe.is_correction``), logged per optimizer
# step as ``rl/is_*`` and ``rl/gen_logprob_abs_diff``; ``is_ratio_max`` combines by max.
IS_SUMMED_STATS = ("is_ratio_sum", "is_masked_tokens", "gen_lp_abs_diff_sum")
IS_MAX_STATS = ("is_ratio_max",)
# With sampling controls on (recipe.top_k / top_p / min_p): action tokens outside the trainer's
# kept set (dropped from the loss) and outside only the reference's (no KL term); summed, and
# logged as rl/outside_kept_fraction / rl/ref_outside_kept_fraction only when reported.
SAMPLING_STATS = ("outside_kept_tokens", "ref_outside_kept_tokens")


def add_stats(acc: dict[str, float], stats: Mapping[str, float]) -> None:
    for key in SUMMED_STATS:
        acc[key] = acc.get(key, 0.0) + float(stats.get(key, 0.0))


def add_is_stats(acc: dict[str, float], stats: Mapping[str, float]) -> None:
    for key in IS_SUMMED_STATS:
        acc[key] = acc.get(key, 0.0) + float(stats.get(key, 0.0))
    for key in IS_MAX_STATS:
        if key in stats:
            acc[key] = max(acc.get(key, float("-inf")), float(stats[key]))
    for key in SAMPLING_STATS:
        if key in stats:
            acc[key] = acc.get(key, 0.0) + float(stats[key])


def is_metrics(acc: Mapping[str, float]) -> dict[str, float]:
    """Per action token of summed microbatch stats: the mean and largest raw ratio
    ``pi_old / pi_gen`` (before any cap or mask), the fraction of action tokens the correction
    masked out, and the mean ``|log pi_gen - log pi_old|``."""
    actions = max(acc.get("action_tokens", 0.0), 1.0)
    figures = {
        "is_ratio_mean": acc.get("is_ratio_sum", 0.0) / actions,
        "is_ratio_max": acc.get("is_ratio_max", 1.0),
        "is_masked_fraction": acc.get("is_masked_tokens", 0.0) / actions,
        "gen_logprob_abs_diff": acc.get("gen_lp_abs_diff_sum", 0.0) / actions,
    }
    if "outside_kept_tokens" in acc:  # sampling controls on: of the sampled action tokens
        sampled = max(acc.get("action_tokens", 0.0) + acc["outside_kept_tokens"], 1.0)
        figures["outside_kept_fraction"] = acc["outside_kept_tokens"] / sampled
        figures["ref_outside_kept_fraction"] = acc.get("ref_outside_kept_tokens", 0.0) / sampled
    return figures


# Where the IS figures of on-policy (colocated) rows stay while the engine serves the trained
# weights. Kernels and dtypes move single tokens a little (fp32 vLLM vs HF: |log ratio| <= 2.4e-5
# per token; bf16 up to 0.57 on a token, far less on the mean). A sync that did not happen leaves
# the engine on old weights: the mean |log pi_gen - log pi_old| grows with every step trained,
# and the mean ratio drifts out (TRL #5312 trained on the initial checkpoint at 0.018).
ON_POLICY_RATIO_BAND = (0.8, 1.25)
ON_POLICY_MAX_ABS_DIFF = 0.1
_WARN_EVERY = 50  # after the first, one warning per this many optimizer steps out of band


def warn_if_unsynced(figures: Mapping[str, float], off_band_steps: int) -> int:
    """Warn when on-policy rows' ``is_ratio_mean`` leaves :data:`ON_POLICY_RATIO_BAND` or their
    ``gen_logprob_abs_diff`` passes :data:`ON_POLICY_MAX_ABS_DIFF` (the first time, then every
    ``_WARN_EVERY``-th step out of band); returns the new count of such steps."""
    low, high = ON_POLICY_RATIO_BAND
    ratio, diff = figures["is_ratio_mean"], figures["gen_logprob_abs_diff"]
    if low <= ratio <= high and diff <= ON_POLICY_MAX_ABS_DIFF:
        return off_band_steps
    if off_band_steps % _WARN_EVERY == 0:
        logging.getLogger(__name__).warning(
            "on-policy rows: rl/is_ratio_mean=%.4g (sane: [%g, %g]), rl/gen_logprob_abs_diff="
            "%.4g (sane: <= %g): the engine is not sampling from the trained weights (did a "
            "weight sync not happen?)", ratio, low, high, diff, ON_POLICY_MAX_ABS_DIFF)
    return off_band_steps + 1


def rl_metrics(acc: Mapping[str, float], global_batches: int) -> dict[str, float]:
    """Means per global batch (one optimizer step) from summed microbatch stats.

    A microbatch's ``loss`` is already divided by its global batch's normalizer, so the sum over
    a global batch is that batch's loss under every packing mode. ``clipfrac``, ``approx_kl``
    and ``entropy`` are per action token: clipped tokens (those whose ratio the clamp to
    ``[1 - clip_eps, 1 + clip_eps]`` changed) over action tokens is a fraction, in [0, 1] by
    construction. ``clip_low`` / ``clip_high``: the fractions of action tokens whose gradient
    the lower clip (``A < 0``) or the upper one (``A > 0``, clip-higher's side) took (TRL's
    ``clip_ratio/low_mean``, ``high_mean``); ``kl_ref``: the mean reference KL estimate
    (``recipe.beta > 0``).
    """
    n = max(int(global_batches), 1)
    actions = max(acc.get("action_tokens", 0.0), 1.0)
    seconds = acc.get("seconds", 0.0)
    return {
        "loss": acc.get("loss", 0.0) / n,
        "value_loss": acc.get("value_loss", 0.0) / n,
        "clipfrac": acc.get("clipped_tokens", 0.0) / actions,
        "approx_kl": acc.get("kl_sum", 0.0) / actions,
        "entropy": acc.get("entropy_sum", 0.0) / actions,
        "clip_low": acc.get("clip_low_tokens", 0.0) / actions,
        "clip_high": acc.get("clip_high_tokens", 0.0) / actions,
        "kl_ref": acc.get("kl_ref_sum", 0.0) / actions,
        "tokens_per_s": acc.get("real_tokens", 0.0) / seconds if seconds else 0.0,
    }


def _nan_mean_std(values: list[float]) -> tuple[float, float]:
    """nanmean and Bessel nanstd (NaN where undefined), as TRL logs a reward column."""
    valid = [v for v in values if not math.isnan(v)]
    if not valid:
        return math.nan, math.nan
    mean = sum(valid) / len(valid)
    if len(valid) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in valid) / (len(valid) - 1))


def reward_figures(log: list[Mapping[str, Any]]) -> dict[str, float]:
    """A step's per-reward figures from a task's reward log (``PromptTask.drain_reward_log``):
    ``rewards/<name>/mean`` and ``/std`` of each function's raw values (``None`` left out;
    a figure with no value to stand on is left out too),
    ``rewards/unscorable`` (completions no reward applied to) and the mean of each
    ``log_metric`` name, as TRL logs them."""
    columns: dict[str, list[float]] = {}
    custom: dict[str, list[float]] = {}
    unscorable = 0
    for call in log:
        for name, values in call["rewards"].items():
            columns.setdefault(name, []).extend(values)
        for name, values in call.get("metrics", {}).items():
            custom.setdefault(name, []).extend(values)
        unscorable += int(call.get("unscorable", 0))
    out: dict[str, float] = {}
    for name, values in columns.items():
        mean, std = _nan_mean_std(values)
        # Undefined figures (no value applied; one value's std) are left out, as TRL drops NaN.
        out |= {k: v for k, v in ((f"rewards/{name}/mean", mean), (f"rewards/{name}/std", std))
                if not math.isnan(v)}
    if log:
        out["rewards/unscorable"] = float(unscorable)
    out.update({name: sum(v) / len(v) for name, v in custom.items() if v})
    return out


def completion_rows(log: list[Mapping[str, Any]], step: int, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` sample rows ``{step, prompt, completion, <reward>..., <extra>..., reward}``
    from a step's reward log (the first call's first completions), TRL's completions table."""
    rows: list[dict[str, Any]] = []
    for call in log:
        for i, completion in enumerate(call["completions"][:limit - len(rows)]):
            prompt = call["prompts"][i]
            rows.append({"step": step, "prompt": prompt, "completion": completion,
                         **{n: _json_number(v[i]) for n, v in call["rewards"].items()},
                         **{n: v[i] for n, v in call.get("extra", {}).items() if i < len(v)},
                         "reward": _json_number(call["total"][i])})
        if len(rows) >= limit:
            break
    return rows


def _json_number(value: float) -> float | None:
    return None if math.isnan(value) else round(float(value), 6)


COMPLETIONS_FILE = "completions.jsonl"


def log_completions(rows: list[dict[str, Any]], *, output_dir: Path, loggers: list[Any],
                    step: int) -> None:
    """Append ``rows`` (:func:`completion_rows`) to ``completions.jsonl`` in ``output_dir`` and
    hand them, as a table, to the loggers that take text: wandb's ``log_text``, TensorBoard's
    ``add_text`` (a markdown table), MLflow's ``log_text`` (one JSON file per step)."""
    if not rows:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, default=str) + "\n" for r in rows)
    with open(output_dir / COMPLETIONS_FILE, "a") as f:
        f.write(lines)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[r.get(c) if isinstance(r.get(c), (int, float)) or r.get(c) is None
              else json.dumps(r[c]) if not isinstance(r[c], str) else r[c] for c in columns]
             for r in rows]
    for logger in loggers:
        if hasattr(logger, "log_text"):  # WandbLogger
            logger.log_text(key="completions", columns=columns, data=cells, step=step)
            continue
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):  # TensorBoardLogger's SummaryWriter
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ")
                                        for c in row) + " |" for row in cells]
            experiment.add_text("completions", "\n".join(table), global_step=step)
        elif hasattr(experiment, "log_text") and getattr(logger, "run_id", None):  # MLFlowLogger
            experiment.log_text(logger.run_id, lines, f"completions/step_{step:06d}.jsonl")


@dataclass
class StepRecord:
    step: int
    reward: float
    reward_first_turn: float
    reward_last_turn: float
    rollout_s: float
    prepare_s: float
    failed_calls: int
    lp_gap: float = 0.0
    microbatches: int = 0
    global_batches: int = 0
    dp_bytes: int = 0
    # Derived from ``sums`` after every microbatch (``tq_plugin.rl.training.ranks`` merges them per rank).
    real_tokens: float = 0.0
    padded_tokens: float = 0.0
    train_s: float = 0.0
    loss: float = 0.0
    clipfrac: float = 0.0
    approx_kl: float = 0.0
    value_loss: float = 0.0
    entropy: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    kl_ref: float = 0.0
    tokens_per_s: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    # The step record's own figures (step_record.STEP_FIGURES: rewards/<name>/mean and /std,
    # rewards/unscorable, sampling/*), columns of metrics.csv as they are named.
    figures: dict[str, float] = field(default_factory=dict)
    # This rank's peak memory after the step's microbatches (``tq_plugin.rl.models.fsdp.
    # peak_memory_mb``: CUDA allocated on a GPU, RSS on the CPU); every rank's once merged.
    peak_mem_mb: float = 0.0
    rank_peak_mem_mb: list[float] = field(default_factory=list)
    # The policy's learning rate at the step's first microbatch (recipe.lr_scheduler), and the
    # mean over its optimizer steps of the gradient norm before recipe.max_grad_norm's clip.
    lr: float = float("nan")
    grad_norm_sum: float = 0.0
    grad_norms: int = 0
    # The importance-sampling sums (add_is_stats): the step's is_ratio_mean and friends.
    is_sums: dict[str, float] = field(default_factory=dict)

    def add(self, stats: Mapping[str, float], *, last_in_global_batch: bool) -> None:
        add_stats(self.sums, stats)
        if "lr" in stats and not self.microbatches:
            self.lr = float(stats["lr"])
        if "grad_norm" in stats:
            self.grad_norm_sum += float(stats["grad_norm"])
            self.grad_norms += 1
        add_is_stats(self.is_sums, stats)
        self.peak_mem_mb = max(self.peak_mem_mb, float(stats.get("peak_mem_mb", 0.0)))
        self.microbatches += 1
        self.global_batches += int(last_in_global_batch)
        for key, value in rl_metrics(self.sums, self.global_batches).items():
            setattr(self, key, value)
        self.real_tokens = self.sums["real_tokens"]
        self.padded_tokens = self.sums["padded_tokens"]
        self.train_s = self.sums["seconds"]

    def row(self) -> dict[str, Any]:
        padded = self.padded_tokens or 1.0
        return {
            "step": self.step,
            "reward": round(self.reward, 5),
            "reward_first_turn": round(self.reward_first_turn, 5),
            "reward_last_turn": round(self.reward_last_turn, 5),
            "train_tokens": int(self.real_tokens),
            "processed_tokens": int(self.padded_tokens),
            "padded_fraction": round(1.0 - self.real_tokens / padded, 5),
            "tokens_per_s": round(self.real_tokens / self.train_s, 1) if self.train_s else 0.0,
            "microbatches": self.microbatches,
            "optimizer_steps": self.global_batches,
            "loss": round(self.loss, 5),
            "clipfrac": round(self.clipfrac, 5),
            "approx_kl": round(self.approx_kl, 6),
            "value_loss": round(self.value_loss, 5),
            "entropy": round(self.entropy, 5),
            "clip_low": round(self.clip_low, 5),
            "clip_high": round(self.clip_high, 5),
            "kl_ref": round(self.kl_ref, 6),
            "lr": float(f"{self.lr:.6g}"),
            "grad_norm": (round(self.grad_norm_sum / self.grad_norms, 5) if self.grad_norms
                          else float("nan")),
            **{k: float(f"{v:.6g}") for k, v in
               is_metrics({**self.is_sums, "action_tokens": self.sums.get("action_tokens", 0.0)}
                          ).items()},
            **{k: round(float(v), 5) for k, v in sorted(self.figures.items())},
            "rollout_s": round(self.rollout_s, 4),
            "prepare_s": round(self.prepare_s, 4),
            "train_s": round(self.train_s, 4),
            "failed_calls": self.failed_calls,
            "logprob_gap": float(f"{self.lp_gap:.3g}"),
            "dp_bytes": self.dp_bytes,
            **{f"peak_mem_mb_rank{r}": round(mb, 1)
               for r, mb in enumerate(self.rank_peak_mem_mb or [self.peak_mem_mb])},
        }


class MetricsLog:
    """Collects one row per RL step.

    Lightning's dataloader fetches one batch ahead, so step ``s + 1`` is prepared (its rollouts
    generated, ``on_step_ready`` called) before step ``s``'s last microbatch has trained: each
    microbatch is booked on the step its meta names, never on "the latest step".
    """

    def __init__(self, output_dir: Path, *, packing: str) -> None:
        self.output_dir = output_dir
        self.packing = packing
        self.steps: list[StepRecord] = []
        self._by_step: dict[int, StepRecord] = {}
        self.start = time.perf_counter()
        self._dp_last = 0
        self._max_mb_tokens = 0
        # ``live``: append each finished step's row to metrics.csv as it finishes (the recipe
        # sets it on the process that writes the artifacts); ``restored`` the rows a resumed
        # run's checkpoint brought back, written first.
        self.live = False
        self.restored: list[Any] = []
        self._live_names: list[str] | None = None
        self._live_rows: list[dict[str, Any]] = []
        _reset_peak_rss()

    def on_step_ready(self, step: int, *, rewards: torch.Tensor, turn_scores: torch.Tensor,
                      rollout_s: float, prepare_s: float, failed_calls: int, lp_gap: float,
                      dp: Any) -> None:
        total = 0 if dp is None else int(dp.bytes_read + dp.bytes_written)
        if self.steps:
            self.steps[-1].dp_bytes = total - self._dp_last
            self._dp_last = total
        row = StepRecord(step, float(rewards.mean()), float(turn_scores[:, 0].mean()),
                    float(turn_scores[:, -1].mean()), rollout_s, prepare_s, failed_calls, lp_gap)
        self.steps.append(row)
        self._by_step[step] = row
        self._dp_total = total

    def step_finished(self, step: int, dp: Any = None) -> None:
        """Step ``step``'s last microbatch trained: with ``live``, append its row to
        metrics.csv now (``dp``: the client's byte counters, for the step's data-plane bytes so
        far). One line appended and flushed per step; the file is rewritten (atomically) only
        when a row brings a column the header lacks."""
        row = self._by_step.get(step)
        if not self.live or row is None:
            return
        if dp is not None:
            row.dp_bytes = int(dp.bytes_read + dp.bytes_written) - self._dp_last
        values = row.row()
        rows = [*([] if self._live_names is not None else [r.row() for r in self.restored]),
                values]
        names = list(dict.fromkeys([*(self._live_names or []), *(k for r in rows for k in r)]))
        path = self.output_dir / "metrics.csv"
        if self._live_names is not None and names == self._live_names:
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=names, restval="").writerow(values)
                f.flush()
            self._live_rows.append(values)
            return
        self._live_rows += rows
        self._live_names = names
        self.output_dir.mkdir(parents=True, exist_ok=True)
        buf = io.StringIO(newline="")
        writer = csv.DictWriter(buf, fieldnames=names, restval="")
        writer.writeheader()
        writer.writerows(self._live_rows)
        tmp = path.with_name(f".metrics.csv.{os.getpid()}.tmp")
        tmp.write_text(buf.getvalue(), newline="")
        os.replace(tmp, path)

    def on_microbatch(self, meta: KVBatchMeta, stats: Mapping[str, float]) -> None:
        info = meta.extra_info[MICROBATCH_INFO]
        s = self._by_step[int(info["step"])]
        s.figures = dict(meta.extra_info.get(RL_STEP, {}).get(STEP_FIGURES) or s.figures)
        s.add(stats, last_in_global_batch=bool(info["last_in_global_batch"]))
        self._max_mb_tokens = max(self._max_mb_tokens, int(stats.get("padded_tokens", 0)))

    def summary(self, dp_total_bytes: int) -> dict[str, Any]:
        rows = [s.row() for s in self.steps]
        real = sum(s.real_tokens for s in self.steps)
        padded = sum(s.padded_tokens for s in self.steps) or 1.0
        train_s = sum(s.train_s for s in self.steps)
        k = max(1, min(5, len(rows) // 4))
        first = [r["reward"] for r in rows[:k]]
        last = [r["reward"] for r in rows[-k:]]
        return {
            "status": "ok",
            "packing": self.packing,
            "steps": len(rows),
            "reward_first": rows[0]["reward"] if rows else None,
            "reward_last": rows[-1]["reward"] if rows else None,
            "reward_first_avg": sum(first) / len(first) if first else None,
            "reward_last_avg": sum(last) / len(last) if last else None,
            "smoothing_window": k,
            "tokens_per_s": real / train_s if train_s else 0.0,
            "padded_fraction": 1.0 - real / padded,
            "train_tokens": int(real),
            "processed_tokens": int(padded),
            "max_microbatch_tokens": self._max_mb_tokens,
            "max_logprob_gap": max((s.lp_gap for s in self.steps), default=0.0),
            "dp_bytes": int(dp_total_bytes),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "wall_s": round(time.perf_counter() - self.start, 2),
        }

    def finish(self, cfg: DictConfig, dp_total_bytes: int, *, save: bool = True) -> dict[str, Any]:
        if self.steps:
            self.steps[-1].dp_bytes = dp_total_bytes - self._dp_last
        summary = self.summary(dp_total_bytes)
        if save:
            self.write(cfg, summary)
        return summary

    def write(self, cfg: DictConfig, summary: dict[str, Any]) -> None:
        out = self.output_dir
        out.mkdir(parents=True, exist_ok=True)
        rows = [s.row() for s in self.steps]
        if rows:
            with open(out / "metrics.csv", "w", newline="") as f:
                # Every row's keys: a step's own figures (a reward first seen later) included.
                names = list(dict.fromkeys(k for r in rows for k in r))
                writer = csv.DictWriter(f, fieldnames=names, restval="")
                writer.writeheader()
                writer.writerows(rows)
        (out / "resolved_config.yaml").write_text(
            OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
                              resolve=True))
        (out / RESULT_FILE).write_text(json.dumps(summary, indent=2))
        if rows:
            plot_run(rows, out / "reward_curve.png", title=run_title(cfg))


def format_summary(summary: dict[str, Any]) -> str:
    held_out = ""
    first, final = summary.get("eval_first") or {}, summary.get("eval") or {}
    if "accuracy" in final:
        start = f"{first['accuracy']:.3f} -> " if "accuracy" in first else ""
        held_out = f"held-out accuracy (greedy): {start}{final['accuracy']:.3f}\n"
    return held_out + (
        f"steps: {summary['steps']}   reward: {summary['reward_first']:.3f} -> "
        f"{summary['reward_last']:.3f} (mean of first/last {summary['smoothing_window']} steps: "
        f"{summary['reward_first_avg']:.3f} -> {summary['reward_last_avg']:.3f})\n"
        f"train tokens/s: {summary['tokens_per_s']:.0f}   padded-token fraction: "
        f"{summary['padded_fraction']:.3f}   data-plane bytes: {summary['dp_bytes'] / 1e6:.2f} MB   "
        f"peak RSS: {summary['peak_rss_mb']:.0f} MB   wall: {summary['wall_s']:.1f} s"
    )

"""Real model shapes (issue 25): a Qwen2-shaped model at Qwen2.5's 151,936-id vocabulary.

The model: 256 wide, 2 layers, 4 heads of 64 (2 KV heads), tied embeddings, random init (40M
parameters, 160 MB of float32 weights), written with ``save_pretrained`` beside the tiny text
task's tokenizer (``tq_plugin.rl.tasks.tiny_text``): the tokenizer's ids are few, the model's
vocabulary is Qwen's, so every logprob is a softmax over 151,936 logits.

Measured, in one process, contenders taking turns, repeated:

* peak memory of one training step (forward + backward of the GRPO loss, no optimizer) as a
  function of the tokens per microbatch (1k, 2k, 4k): ours (``RLModule.training_step``'s route,
  ``score_tokens``: chunked logprobs from the hidden states) against TRL 1.16's ``GRPOTrainer``
  (``_compute_loss`` on the same sequences: its fused chunked LM head), peak RSS above the
  step's start; the slope in MB per microbatch token between 1k and 4k;
* training tokens/s of that step, ours against TRL's;
* one weight sync of ``engine=hf`` and of ``engine=vllm`` (in-process vLLM's CPU build)
  against a plain copy of the same 160 MB;
* one GRPO step end to end (``tq-train``, 512 new tokens), ``engine=hf`` then ``engine=vllm``:
  where its time goes (generation and staging, the logprob pass, training, the data plane:
  ``dp/policy/dp_time_s`` from the run's Lightning CSV log).

TRL is a bench-only extra (``pip install 'tq_plugin[bench]'``); without it the TRL columns
say so. Run alone: ``python -m benchmarks.run_all bench_real_shapes``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 151_936
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2


def make_model(out: str | Path, *, seed: int = 0, max_positions: int = 4096) -> Path:
    """Write the Qwen2-shaped model (``out/model``: config, safetensors, the tiny text task's
    tokenizer) and the task's prompts (``out/train.jsonl``); returns the model directory.
    Reuses a directory already written."""
    out = Path(out)
    model_dir = out / "model"
    if (model_dir / "config.json").is_file() and (out / "train.jsonl").is_file():
        return model_dir
    import torch
    import transformers

    from tq_plugin.rl.tasks.tiny_text import _texts, reverse_rows, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    rows = reverse_rows(256, seed=seed)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_tokenizer(_texts(rows))
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
        intermediate_size=4 * HIDDEN, max_position_embeddings=max_positions,
        tie_word_embeddings=True, attention_dropout=0.0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    return model_dir


def varied_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A reward that varies between completions of a random model (any real reward gives it 0,
    and its ids past the tokenizer's decode to nothing): the sum of the completion's ids mod 101,
    scaled to [0, 1], so advantages and the update are not all 0."""
    return [(sum(ids) % 101) / 100 for ids in completion_ids]


# ---------------------------------------------------------------------------- memory per token
PROMPT, COMPLETION = 16, 112  # one sequence: 128 tokens, a 16-token prompt and its completion
SIZES = (1024, 2048, 4096)  # tokens per microbatch: 8, 16, 32 sequences
LOGPROB_CHUNK = 1024  # tq.packing.logprob_chunk_tokens' default


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise OSError("no VmRSS in /proc/self/status")


def _peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    raise OSError("no VmHWM in /proc/self/status")


def _measured(step: Any) -> tuple[float, float]:
    """``(peak RSS above the start in MB, seconds)`` of one call of ``step``."""
    import gc
    import time

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the kernel's peak-RSS mark
    base = _rss_mb()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    return _peak_mb() - base, seconds


def _batch(tokens: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = tokens // (PROMPT + COMPLETION)
    # Ids below the tokenizer's size, as the engine would sample them for this task.
    return {"prompt_ids": torch.randint(3, 40, (rows, PROMPT), generator=g),
            "completion_ids": torch.randint(3, 40, (rows, COMPLETION), generator=g),
            "advantages": torch.randn(rows, generator=g)}


def ours_step(policy: Any, batch: dict[str, Any]) -> Any:
    """One training microbatch the way ``RLModule.training_step`` scores it
    (``score_tokens``: chunked logprobs from the hidden states, completion positions only,
    entropy a detached metric), the GRPO token-mean loss, backward."""
    import torch

    from tq_plugin.rl.models.protocol import TokenScoring, score_tokens

    def step() -> None:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, PROMPT:] = True
        lp, _ent = score_tokens(policy, ids, TokenScoring(mask=mask, chunk_tokens=LOGPROB_CHUNK,
                                                         with_entropy=True))
        ratio = torch.exp(lp - lp.detach())
        loss = -(ratio * batch["advantages"].unsqueeze(1) * mask).sum() / mask.sum()
        loss.backward()
        policy.zero_grad(set_to_none=True)

    return step


def trl_trainer(model_dir: Path, workdir: Path) -> Any:
    """TRL 1.16's ``GRPOTrainer`` on the same model (CPU, float32, beta 0: no reference model),
    whose ``compute_loss`` is timed on the same sequences."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              local_files_only=True)
    args = GRPOConfig(output_dir=str(workdir), use_cpu=True, bf16=False, beta=0.0,
                      per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=COMPLETION, report_to=[], logging_steps=1,
                      save_strategy="no", dataloader_num_workers=0)
    data = datasets.Dataset.from_list([{"prompt": "reverse: a b"}] * 8)
    return GRPOTrainer(model=model, reward_funcs=[varied_reward], args=args,
                       train_dataset=data, processing_class=tok)


def trl_step(trainer: Any, batch: dict[str, Any]) -> Any:
    import torch

    def step() -> None:
        inputs = {"prompt_ids": batch["prompt_ids"],
                  "prompt_mask": torch.ones_like(batch["prompt_ids"]),
                  "completion_ids": batch["completion_ids"],
                  "completion_mask": torch.ones_like(batch["completion_ids"]),
                  "advantages": batch["advantages"],
                  "num_items_in_batch": torch.tensor(float(batch["completion_ids"].numel()))}
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, outside it here
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        trainer.model.zero_grad(set_to_none=True)

    return step


def _slope(points: dict[int, float]) -> float:
    """Least-squares MB per token through the (tokens, MB) points."""
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def memory_table(model_dir: Path, workdir: Path, *, repeats: int = 2) -> dict[str, Any]:
    """Peak MB and tokens/s per microbatch size, ours and TRL's, taking turns, best of
    ``repeats`` (peak: the lowest, tokens/s: the highest)."""
    import transformers

    from tq_plugin.rl.models.hf import HFCausalLM

    policy = HFCausalLM(len(transformers.AutoTokenizer.from_pretrained(
        str(model_dir), local_files_only=True)), pretrained_path=str(model_dir))
    policy.train()
    try:
        trainer = trl_trainer(model_dir, workdir)
    except ImportError as exc:  # the bench extra is not installed
        trainer, missing = None, f"{type(exc).__name__}: {exc}"
    else:
        missing = None
    mb: dict[str, dict[int, float]] = {"ours": {}, "trl": {}}
    tps: dict[str, dict[int, float]] = {"ours": {}, "trl": {}}
    for tokens in SIZES:
        batch = _batch(tokens, seed=tokens)
        steps = {"ours": ours_step(policy, batch)}
        if trainer is not None:
            steps["trl"] = trl_step(trainer, batch)
        for _ in range(repeats):
            for name, step in steps.items():
                peak, seconds = _measured(step)
                mb[name][tokens] = min(mb[name].get(tokens, float("inf")), peak)
                tps[name][tokens] = max(tps[name].get(tokens, 0.0), tokens / seconds)
                print(f"  {name} {tokens} tokens: {peak:,.0f} MB, {tokens / seconds:,.0f} tok/s",
                      flush=True)
    return {"mb": mb, "tps": tps, "trl_missing": missing}


# ---------------------------------------------------------------------------- weight sync
SYNC_RUNS = 5
SYNC_GAP_TOLERANCE = 1e-4  # float32 engines agree with the policy to ~1e-6 per token
E2E_ENGINES = ("hf", "vllm")


def _engine(name: str, model_dir: Path) -> Any:
    """``engine=name`` serving the checkpoint in ``model_dir`` (vLLM: the engine group's
    defaults, a 1,024-token context)."""
    from tq_plugin.config.schema import EngineConfig
    from tq_plugin.rollout.engines import build_engine

    return build_engine(EngineConfig(name=name), checkpoint=model_dir, max_model_len=1024)


def sync_gap(engine: Any, policy: Any, *, new_tokens: int = 8) -> float:
    """Largest |engine logprob - policy logprob| over ``new_tokens`` tokens the engine samples
    (temperature 1) after a prompt: ~1e-6 when the engine serves the policy's weights."""
    import torch

    from tq_plugin.rl.models.weights import hf_backbone
    from tq_plugin.rollout.engine import SamplingParams

    prompt = list(range(3, 3 + PROMPT))
    out = engine.generate([prompt], SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                   stop_token_ids=()), seeds=[0])[0]
    ids = torch.tensor([prompt + list(out.token_ids)])
    with torch.no_grad():
        logits = hf_backbone(policy)(ids).logits[0, len(prompt) - 1:-1].float()
    ref = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None])[:, 0]
    return float((torch.tensor(out.logprobs) - ref).abs().max())


def weight_sync(model_dir: Path, *, engine: str = "hf", runs: int = SYNC_RUNS) -> dict[str, Any]:
    """``engine``'s ``update_weights`` of the policy's 160 MB against a plain copy of the same
    tensors into tensors of the same shapes, taking turns. The policy's weights are first moved
    off the checkpoint's (every tensor + 1% noise), so each sync carries new values; afterwards
    ``sync_gap`` checks the engine serves them."""
    import torch

    from benchmarks._common import Stat, interleaved
    from tq_plugin.rl.models.hf import HFCausalLM
    from tq_plugin.rl.models.weights import engine_weights

    policy = HFCausalLM(48, pretrained_path=str(model_dir))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * p.abs().mean() * torch.randn(p.shape, generator=g))
    served = _engine(engine, model_dir)
    named = list(engine_weights(policy, engine))
    targets = [torch.empty_like(t) for _, t in named]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    version = iter(range(1, 10_000))

    def sync() -> None:
        served.update_weights(engine_weights(policy, engine), version=next(version))

    def copy() -> None:
        with torch.no_grad():
            for dst, (_, src) in zip(targets, named, strict=True):
                dst.copy_(src)

    try:
        times = interleaved({"sync": sync, "copy": copy}, runs=runs)
        gap = sync_gap(served, policy)
    finally:
        served.close()
    return {"engine": engine, "mb": nbytes / 1e6, "gap": gap, "sync": Stat.of(times["sync"]),
            "copy": Stat.of(times["copy"]),
            "ratio": Stat.of([a / b for a, b in zip(times["sync"], times["copy"])])}


# ---------------------------------------------------------------------------- one step end to end
def _dp_time_s(logs: Path) -> float | None:
    """The trainer's data-plane seconds over the run (``dp/<role>/dp_time_s`` that Lightning's
    CSV logger wrote: every call through the run's metered client, staging included)."""
    import csv

    total = None
    for path in sorted(logs.glob("lightning_logs/**/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if key.startswith("dp/") and key.endswith("/dp_time_s") and value:
                        total = (total or 0.0) + float(value)
    return total


def end_to_end(data: Path, *, engine: str = "hf", new_tokens: int = 512) -> dict[str, Any]:
    """One GRPO step through ``tq-train`` (``engine``, ``new_tokens`` per completion, 2
    prompts x 2; run from the repository root, which holds the reward): its metrics.csv row
    (where the time goes), result.json and the data plane's seconds."""
    import contextlib
    import tempfile
    from unittest import mock

    from benchmarks import _common

    overrides = ["--config-name", "grpo", "task=prompts", f"task.path={data / 'train.jsonl'}",
                 "task.reward._target_=benchmarks.bench_real_shapes.varied_reward",
                 "model=hf_causal_lm", f"model.pretrained_path={data / 'model'}",
                 f"engine={engine}", f"recipe.max_new_tokens={new_tokens}",
                 "recipe.prompts_per_step=2", "recipe.group_size=2", "recipe.ppo_epochs=1",
                 "recipe.num_steps=1"]
    with tempfile.TemporaryDirectory(prefix="tq-bench-run-") as kept:
        # tq_train's run dir is a temporary directory it removes; keep this one (the recipe
        # pins the CSV logger under it) until its Lightning log is read.
        with mock.patch.object(_common.tempfile, "TemporaryDirectory",
                               lambda **_: contextlib.nullcontext(kept)):
            run = _common.tq_train(overrides)
        dp_s = _dp_time_s(Path(kept))
    return {"engine": engine, "row": run.rows[0], "result": run.result, "dp_s": dp_s,
            "wall_s": run.wall_s, "command": "tq-train " + " ".join(overrides)}


# ---------------------------------------------------------------------------- the section
def main(out: str | Path = "benchmarks/out/real_shapes") -> dict[str, Any]:
    import os
    import tempfile

    import torch

    torch.set_num_threads(2)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(".pytest_cache") / "inductor"))
    load = os.getloadavg()[0]
    out = Path(out)
    model_dir = make_model(out)
    with tempfile.TemporaryDirectory() as tmp:
        mem = memory_table(model_dir, Path(tmp))
    syncs = [weight_sync(model_dir, engine=name) for name in E2E_ENGINES]
    e2e = [end_to_end(out, engine=name) for name in E2E_ENGINES]
    return {"markdown": markdown(mem, syncs, e2e, load=load), "memory": mem, "sync": syncs,
            "e2e": e2e}


def markdown(mem: dict[str, Any], syncs: list[dict[str, Any]], e2e: list[dict[str, Any]], *,
             load: float) -> str:
    ours, trl = mem["mb"]["ours"], mem["mb"]["trl"]
    lines = [
        "## Real model shapes: a Qwen2-shaped model at a 151,936-id vocabulary",
        "",
        (f"`python -m benchmarks.run_all bench_real_shapes`: {HIDDEN} wide, {LAYERS} layers, "
        "random init, 40M parameters (160 MB float32), the tiny text task's tokenizer; sequences "
        f"of {PROMPT} prompt + {COMPLETION} completion tokens; 2 torch threads. One training "
        "microbatch (forward + backward of the GRPO loss, no optimizer step): peak RSS above the "
        "step's start, best of 2, ours (`score_tokens`: chunked logprobs from the hidden states, "
        f"completion positions only, chunk {LOGPROB_CHUNK}) and TRL 1.16 `GRPOTrainer."
        "compute_loss` (its chunked LM head; on the CPU it projects every position) on the same "
        "sequences, taking turns."),
        "",
        "| tokens / microbatch | ours peak MB | TRL peak MB | ours tokens/s | TRL tokens/s |",
        "|---|---|---|---|---|",
    ]
    for tokens in SIZES:
        t_mb = f"{trl[tokens]:,.0f}" if tokens in trl else "–"
        t_tps = f"{mem['tps']['trl'][tokens]:,.1f}" if tokens in trl else "–"
        lines.append(f"| {tokens:,} | {ours[tokens]:,.0f} | {t_mb} | "
                     f"{mem['tps']['ours'][tokens]:,.1f} | {t_tps} |")
    slope = _slope(ours)
    lines += ["", f"Slope (least squares, 1k–4k): ours **{slope:.3f} MB per microbatch token**"]
    if trl:
        lines[-1] += (f", TRL {_slope(trl):.3f} MB per token (ours / TRL: "
                      f"{slope / _slope(trl):.2f}).")
    else:
        lines[-1] += f"; TRL not measured ({mem['trl_missing']}: `pip install 'tq_plugin[bench]'`)."
    lines += ["", (f"One weight sync ({syncs[0]['mb']:.0f} MB of float32) against a plain copy of "
              f"the same tensors into tensors of the same shapes, {SYNC_RUNS} runs, taking turns "
              "(median (min–max)). The synced weights differ from the checkpoint's the engine "
              "started from (1% noise on every tensor); *logprob gap after*: the largest "
              "difference between the engine's logprobs of 8 tokens it sampled and the policy's "
              "own (float32: ~1e-6 when the engine serves the synced weights)."), "",
              "| engine | sync s | plain copy s | sync / copy | logprob gap after |",
              "|---|---|---|---|---|"]
    for sync in syncs:
        lines.append(f"| {sync['engine']} | {sync['sync'].fmt('.3f')} | "
                     f"{sync['copy'].fmt('.3f')} | {sync['ratio'].fmt('.1f', 'x')} | "
                     f"{sync['gap']:.1e} |")
    stale = [sync["engine"] for sync in syncs if sync["gap"] > SYNC_GAP_TOLERANCE]
    if stale:
        lines += ["", (f"After the sync, {' and '.join(f'`engine={e}`' for e in stale)} gave "
                  f"logprobs more than {SYNC_GAP_TOLERANCE:.0e} off the policy's: it does not "
                  "serve every synced tensor.")]
    lines += [
        "",
        (f"One GRPO step end to end, 512 new tokens, 2 prompts x 2, each engine's default "
        f"options (`vllm`: in-process, float32, eager, 64 MiB KV cache, 1 thread; `hf`: the "
        f"process's threads), one after the other (load average {load:.1f} on 2 cores when the "
        f"bench started): `{e2e[0]['command']}` (and `engine=vllm`). *generation and staging*: "
        "`rollout_s`; *logprob pass*: `prepare_s` (the policy's no-grad logprobs, rewards and "
        "advantages written back); *training*: `train_s`; *data plane*: the trainer's metered "
        "client over the step (`dp/policy/dp_time_s`: every store call, the staging puts and "
        "reads included, so it overlaps the other columns); wall: the whole `tq-train` "
        "process, imports and start-up included."),
        "",
        ("| engine | generation and staging s | logprob pass s | training s (tokens/s) | "
        "data plane s (MB) | peak RSS MB | wall s |"),
        "|---|---|---|---|---|---|---|",
    ]
    for run in e2e:
        row, res = run["row"], run["result"]
        dp = "–" if run["dp_s"] is None else f"{run['dp_s']:.2f}"
        lines.append(
            f"| {run['engine']} | {float(row['rollout_s']):.1f} | {float(row['prepare_s']):.1f} | "
            f"{float(row['train_s']):.1f} ({float(row['tokens_per_s']):.1f}) | "
            f"{dp} ({int(float(row['dp_bytes'])) / 1e6:.2f}) | {res['peak_rss_mb']:,.0f} | "
            f"{run['wall_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main()["markdown"])

"""The headline tables of ``README.md`` and ``docs/benchmarks.md``, as templates.

Each ``{bench.figure}`` is a key figure of ``benchmarks/results/<bench>.json`` (``"figures"``);
``python -m benchmarks.render`` fills them in and writes the tables between the documents'
``<!-- headline:start -->`` / ``<!-- headline:end -->`` markers. Write no figure here by hand:
a number in a row's text that is not a ``{bench.figure}`` field is a setting (rows, tokens,
steps) or a target, never a measurement.
"""

from __future__ import annotations


def row(*cells: str) -> tuple[str, ...]:
    """One table row: its cells, ``{bench.figure}`` fields unfilled."""
    return cells


# (what, measured)
README: list[tuple[str, ...]] = [
    row("SmolLM2-135M-Instruct (a real pretrained model, `make real-model`), GRPO on reasoning-gym "
     "two-digit sums, 12 RL steps of 8 x 8: held-out greedy accuracy (96 questions), 3 seeds "
     "([curve](docs/real_model_curve.png))",
     "start {bench_real_model.start}, end {bench_real_model.end}, gain {bench_real_model.gain} "
     "(goal +0.20: met), {bench_real_model.wall_min}-{bench_real_model.wall_max} s a run on a box "
     "loaded by other runs; TRL 1.16 `GRPOTrainer` on the same work (seed 0, one evaluator): "
     "{bench_real_model.trl} against ours {bench_real_model.seed0_end}, wall times taken under "
     "different loads, so the 0.8x goal is not shown either way"),
    row("a step's store cycle (register + put + get + clear, 1024 rows, 13 MB) against a plain copy "
     "of the bytes, caches hot / cold, median (min–max) over rounds",
     "{bench_data_plane.cycle_hot} / {bench_data_plane.cycle_cold}; hot in CPU time "
     "{bench_data_plane.cycle_hot_cpu}; load average {bench_data_plane.load} on 2 cores "
     "(goal 0.35)"),
    row("training-step memory at a 151,936-id vocabulary (Qwen2-shaped, 40M parameters)",
     "{bench_real_shapes.mb_per_token} (TRL 1.16: {bench_real_shapes.trl_mb_per_token})"),
    row("one-row write-back, 1k to 16k-row partition",
     "{bench_data_plane.writeback_small_us} µs to {bench_data_plane.writeback_large_us} µs "
     "(flat)"),
    row("64 rollouts x 4,096-token completions: store put + get against a plain copy of the bytes "
     "(local backend, best / median); the driver's private memory from 1k to 16k rollouts held "
     "(Ray backend)",
     "{bench_real_lengths.local_copy_ratio}; {bench_real_lengths.ray_rssanon_growth}"),
    row("120-step GRPO at toy shapes, same HF model and work as TRL 1.16's `GRPOTrainer`: process "
     "CPU time, ours / TRL, best of 3",
     "{bench_toy_steps.cpu_native_best} (`engine=native`), {bench_toy_steps.cpu_hf_best} "
     "(`engine=hf`); goal 0.8"),
    row("staging digest against NeMo Gym 0.7.0, 4096-token calls",
     "{bench_staging.digest_4096} faster, byte-identical"),
    row("stage + fetch + verify, 256-token calls, 1 thread",
     "{bench_staging.pipeline_calls_s} calls/s; per CPU second "
     "{bench_staging.pipeline_cpu_calls_s}; load average {bench_staging.load} on 2 cores "
     "(goal 5,000)"),
    row("padded tokens with sequence packing, lengths U(100, 2000)",
     "{bench_lightning.packed_waste} (padding to the step's target wastes "
     "{bench_lightning.step_target_waste})"),
    row("Lightning callback + mixin overhead per training step", "{bench_lightning.overhead}"),
    row("GRPO, pattern task, mean reward of the last 20 of 120 steps, seeds {bench_parity.seeds} "
     "([plot](docs/parity_reward.png))",
     "{bench_parity.colocated} colocated; asynchronous with 2 workers: {bench_parity.stale1} at "
     "staleness 1 ({bench_parity.stale1_ratio}x), {bench_parity.stale4} at staleness 4 "
     "({bench_parity.stale4_ratio}x: goal 0.95 missed)"),
    row("an OpenAI-API agent, 64 sessions x 4 turns against one endpoint",
     "staged calls, all before their answer: {bench_agent_endpoint.staged}; lost / duplicated: "
     "{bench_agent_endpoint.lost_dup}"),
    row("FSDP2 against DDP, per-rank parameter + gradient + Adam bytes, 2 ranks",
     "{bench_fsdp.held_ratio}"),
    row("a killed asynchronous run resumed",
     "{async_resume.groups}, {async_resume.staleness}"),
]

# (what, measured, target)
DOCS: list[tuple[str, ...]] = [
    row(README[0][0].replace("docs/real_model_curve.png", "real_model_curve.png"), README[0][1],
     "gain ≥ +0.20"),
    row("a step's store cycle (register + put + get + clear, 1024 rows, 13 MB) vs a plain copy, "
     "caches hot, median (min–max) over 5 rounds of 9 interleaved runs",
     "{bench_data_plane.cycle_hot} (in CPU time: {bench_data_plane.cycle_hot_cpu}; load "
     "average {bench_data_plane.load})",
     "≥ 0.35 (the section says where it stands and why)"),
    row("the same, caches cold / 4096 rows (51 MB) hot",
     "{bench_data_plane.cycle_cold} / {bench_data_plane.cycle_4096_hot}", ""),
    row("peak RSS growth of a put/get/clear loop, 4096 rows",
     "{bench_data_plane.rss_growth} the payload (floor: 2.0×, the caller's batch + one stored "
     "copy)", "≤ 2×: at the floor"),
    row("one-row write-back cost, 1k → 16k-row partition",
     "{bench_data_plane.writeback_small_us} → {bench_data_plane.writeback_large_us} µs "
     "({bench_data_plane.writeback_ratio}×)", "flat (≤ 1.5×)"),
    row("draining in 32-row `claim_meta` calls, 4k → 16k rows",
     "{bench_data_plane.drain_small_ms} → {bench_data_plane.drain_large_ms} ms "
     "({bench_data_plane.drain_ratio}× for 4× the rows)", "linear (≤ 6×)"),
    row("staging digest of Python lists vs NeMo Gym 0.7.0, 4096 / 256 tokens",
     "{bench_staging.digest_4096} / {bench_staging.digest_256} (byte-identical)", "≥ 8× at 4096"),
    row("stage + fetch + verify, 256-token calls, 1 thread, names-only staging partition",
     "{bench_staging.pipeline_calls_s} calls/s (per CPU second: "
     "{bench_staging.pipeline_cpu_calls_s}; staging layer alone: "
     "{bench_staging.staging_alone_calls_s}; load average {bench_staging.load})",
     "≥ 5,000: **missed** (the section says why)"),
    row("RayDataPlane put+get vs raw TransferQueue, same run", "{bench_backends.ray_vs_tq}",
     "≥ 10×: **missed**"),
    row("TransferQueue adapter vs raw TransferQueue", "{bench_backends.adapter_vs_raw} of its "
     "bandwidth", "within 20%"),
    row("disaggregated (1 worker) vs colocated steps/s, PPO, 2 cores",
     "{bench_topology.disagg_1} with weights after every optimizer step, "
     "{bench_topology.disagg_1_per_rl_step} once per RL step", "≥ 1.4×: **missed**"),
    row("callback + mixin overhead per training step",
     "{bench_lightning.overhead} of step time (accounted)", "≤ 5%"),
    row("wasted tokens with sequence packing, lengths U(100, 2000)",
     "{bench_lightning.packed_waste} packed row; {bench_lightning.packed_pad64_waste} with pad "
     "multiple 64", "≤ 2% (padding to the step target wastes {bench_lightning.step_target_waste})"),
    row("generated tokens/s on one HF policy, `hf` / in-process `vllm` vs `native`",
     "{bench_engines.hf_speedup} / {bench_engines.vllm_speedup} ({bench_engines.hf_tok_s} / "
     "{bench_engines.vllm_tok_s} vs {bench_engines.native_tok_s})", ""),
    row("one weight sync of {bench_engines.sync_mb} into the engine vs a plain copy of the bytes",
     "`hf` {bench_engines.hf_sync} ({bench_engines.hf_sync_ratio}), `vllm` "
     "{bench_engines.vllm_sync} ({bench_engines.vllm_sync_ratio})", ""),
    row("FSDP2 vs DDP per-rank parameter + gradient + Adam bytes, 2 ranks, 128 MB model",
     "{bench_fsdp.held_ratio} ({bench_fsdp.fsdp_held} vs {bench_fsdp.ddp_held} MB)", "≈ 0.5×"),
    row("FSDP2 runs, 2 CPU ranks: GRPO colocated (120 steps); PPO disaggregated on Ray, 1 worker "
     "(100 steps)",
     "reward {bench_fsdp.grpo_reward}, peak {bench_fsdp.grpo_peak} MB per rank; "
     "{bench_fsdp.ppo_reward}, {bench_fsdp.ppo_peak} MB", "rising reward, memory per rank"),
    row("stateful model-based store test, `long` profile: examples / rules per backend",
     "local {reliability.local_examples} / {reliability.local_rules}; ray "
     "{reliability.ray_examples} / {reliability.ray_rules}; transferqueue "
     "{reliability.tq_examples} / {reliability.tq_rules}; every step equal to the model",
     "no divergence"),
    row("GRPO on the pattern task, mean reward of the last 20 of 120 steps, seeds "
     "{bench_parity.seeds}",
     "colocated {bench_parity.colocated}; disaggregated (2 workers), staleness 1: "
     "{bench_parity.stale1} ({bench_parity.stale1_ratio}x); staleness 4, decoupled: "
     "{bench_parity.stale4} ({bench_parity.stale4_ratio}x)",
     "≥ 0.95x colocated: staleness 4 **missed**"),
    row("120-step GRPO at toy shapes, process CPU time ours / TRL 1.16 `GRPOTrainer`, best of 3 "
     "(per round)",
     "`native` {bench_toy_steps.cpu_native}; `hf` {bench_toy_steps.cpu_hf}", "≤ 0.8: **missed**"),
    row("killed asynchronous run (SIGKILL / SIGTERM inside step 3) resumed to 6 steps",
     "{async_resume.groups}, {async_resume.staleness}", "none skipped, none twice"),
    row("soak: 8 threads stage, finalize, clear {soak.calls} calls",
     "RSS {soak.rss} (start → peak → end); held {soak.held} (peak → end)",
     "RSS within 10%; ≤ 10% of peak held"),
    row("LoRA r=8 against full fine-tuning, SmolLM2-135M: trainable parameters; one `hf` sync; "
        "held-out accuracy gain on the real task at equal steps",
        "{bench_lora.trainable} ({bench_lora.trainable_share}); {bench_lora.hf_sync_ratio}; "
        "{bench_lora.lora_gain}, {bench_lora.lora_of_full} of full fine-tuning's "
        "({bench_lora.full_gain}); TRL + `peft_config` {bench_lora.trl_lora_gain}",
        "≤ 5% of the trained bytes; sync ≤ 0.1x; ≥ 80% of full's gain"),
]

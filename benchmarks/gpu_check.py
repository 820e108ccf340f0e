"""``make gpu-check``: the short, prepared check for a machine with CUDA GPUs.

Runs a few GRPO steps with ``trainer=gpu engine=vllm`` (the vLLM engine serving the policy on
the GPU, weights synced in place before each step's rollouts) and, when two or more GPUs are
visible, with ``trainer=fsdp`` (FSDP2 over every GPU), then prints one line per run: reward
(first / last step), weight syncs and their median seconds, per-rank peak memory and wall time.
Install the GPU builds first: ``make install TORCH_SPEC='torch==2.13.0 --index-url
https://download.pytorch.org/whl/cu128' VLLM_SPEC=vllm``. Exits non-zero when a run fails.
"""

from __future__ import annotations

import sys

from benchmarks._common import tq_train

STEPS = 5


def _run(name: str, overrides: list[str]) -> bool:
    try:
        run = tq_train(["--config-name", "grpo", "model=hf_causal_lm",
                        f"recipe.num_steps={STEPS}", *overrides])
    except RuntimeError as e:
        print(f"{name}: FAILED {' '.join(overrides)}\n{e}")
        return False
    result, last = run.result, run.rows[-1]
    peaks = {k: v for k, v in last.items() if k.startswith("peak_mem_mb_rank")}
    print(f"{name}: {' '.join(overrides)} | reward {result['reward_first']:.3f} -> "
          f"{result['reward_last']:.3f} | weight syncs {result.get('weight_syncs', 0)}, median "
          f"{result.get('weight_sync_s_median', 0)} s | peak MB {peaks} | wall {run.wall_s:.1f} s")
    return True


def main() -> int:
    import torch

    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {gpus} CUDA device(s): "
          f"{[torch.cuda.get_device_name(i) for i in range(gpus)]}")
    if not gpus:
        print("no CUDA device: nothing to check (this is the GPU check)")
        return 1
    ok = _run("vllm-on-gpu", ["trainer=gpu", "engine=vllm", "engine.dtype=bfloat16"])
    if gpus >= 2:
        ok = _run("fsdp", ["trainer=fsdp", f"trainer.devices={gpus}"]) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

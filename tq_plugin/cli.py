"""``tq-train``: the recipes' Hydra entry point (installed console script).

    tq-train                                   # PPO, embedded backend, sequence packing
    tq-train recipe=grpo tq/packing=dynamic_batching
    tq-train tq/staging=media                  # the policy reads its prompt from staged pixels
    tq-train trainer=ddp_cpu                   # 2 CPU ranks (DDP, gloo), same global batch
    tq-train ckpt_path=outputs/.../checkpoints/sigterm.ckpt   # resume to recipe.num_steps
    tq-train -m tq/packing=none,sequence_packing,dynamic_batching tq.packing.train_mb_tokens=256,1024

Results go to Hydra's output dir (``metrics.csv``, ``resolved_config.yaml``, ``reward_curve.png``,
``result.json``); a multirun ends with ``comparison.{csv,md,png}`` in the sweep dir.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import DictConfig

CONFIG_PATH = "pkg://tq_plugin.conf"
log = logging.getLogger("tq_plugin")


def output_dir() -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the recipe named by ``cfg.recipe._target_``, train it and return its summary."""
    from tq_plugin.rl.training.metrics import format_summary

    # Lightning prints through its own console handler; without this Hydra's root handler
    # repeats every Lightning line.
    logging.getLogger("lightning.pytorch").propagate = False
    recipe = get_class(cfg.recipe._target_)(cfg, output_dir())
    recipe.setup()
    recipe.train()
    summary = recipe.cleanup()
    if summary is None:  # a DDP rank other than 0: rank 0 reports the run
        return {}
    backend = cfg.tq.backend._target_.rsplit(".", 1)[-1]
    print(f"\n[tq_plugin] {cfg.recipe.algorithm} on {backend}, packing={summary['packing']}, "
          f"results in {output_dir()}\n{format_summary(summary)}", flush=True)
    return summary


def _task(cfg: DictConfig) -> dict[str, Any]:
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if not multirun:
        return run(cfg)
    # In a sweep one failed job must not stop the others, nor vanish: record it and carry on.
    try:
        return run(cfg)
    except Exception as exc:
        log.exception("sweep job failed")
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
        from tq_plugin.rl.training.metrics import RESULT_FILE

        out = output_dir()
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT_FILE).write_text(json.dumps(result, indent=2))
        return result


def main(config_name: str = "train") -> None:
    hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(_task)()
    from tq_plugin.rl.training.sweep_report import LAST_REPORT

    if LAST_REPORT.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""GRPO recipe entry point: policy only, group-relative advantages, over the tq_plugin data plane.

    python recipes/grpo.py
    python recipes/grpo.py tq/packing=sequence_packing recipe.group_size=8
    python recipes/grpo.py trainer=ddp_cpu trainer.strategy=ddp_spawn

The recipe itself lives in the package (``tq_plugin.rl.recipe.RLRecipe``), so the same run is
``tq-train recipe=grpo`` after ``pip install``.
"""

from tq_plugin.cli import main

if __name__ == "__main__":
    main(config_name="grpo")

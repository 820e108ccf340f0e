"""PPO recipe entry point: policy + value, GAE, clipped objective, over the tq_plugin data plane.

    python recipes/ppo.py                                  # defaults: conf/ppo.yaml
    python recipes/ppo.py tq/packing=dynamic_batching recipe.ppo_epochs=4
    python recipes/ppo.py trainer=ddp_cpu                  # 2 CPU ranks, same global batch

The recipe itself lives in the package (``tq_plugin.rl.recipe.RLRecipe``), so the same run is
``tq-train recipe=ppo`` after ``pip install``.
"""

from tq_plugin.cli import main

if __name__ == "__main__":
    main(config_name="ppo")

"""tq_plugin: a data plane for RL post-training with Lightning and Hydra."""

"""Device plumbing of the recipes (trainer=gpu), checked on the CPU: the tensors rollout sampling
and the no-grad logprob/value passes feed the model are on the model's device. A policy on the
'meta' device stands in for a GPU; its forward pre-hook records the inputs and stops the pass.
Unrun on CUDA here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tq_plugin.config import ConfigError, PackingConfig, RecipeConfig
from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.lightning.demo import SyntheticRollouts, partition_spec
from tq_plugin.rl.models.tiny import TinyTransformer
from tq_plugin.rl.tasks.generate import sample_continuations
from tq_plugin.rl.training import ranks
from tq_plugin.rl.training.module import RLModule

VOCAB = 16


class Stop(Exception):
    pass


def on_device(device: str) -> tuple[TinyTransformer, list[dict[str, torch.device]]]:
    policy = TinyTransformer(VOCAB, d_model=8, n_heads=2, n_layers=1, max_seq_len=64).to(device)
    seen: list[dict[str, torch.device]] = []

    def record(module: Any, args: tuple, kwargs: dict) -> None:
        tensors = {"input_ids": args[0], **{k: v for k, v in kwargs.items()
                                           if isinstance(v, torch.Tensor)}}
        seen.append({k: v.device for k, v in tensors.items()})
        if device == "meta":
            raise Stop

    policy.register_forward_pre_hook(record, with_kwargs=True)
    return policy, seen


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_sampling_feeds_the_policy_on_its_device(device: str) -> None:
    policy, seen = on_device(device)
    patches = torch.zeros(3, 4)  # host patches, as the rollout worker builds them
    try:
        tokens, logprobs = sample_continuations(
            policy, [[1, 2, 3], [4, 5]], max_new_tokens=2, temperature=1.0,
            generator=torch.Generator().manual_seed(0), image_patches=patches)
    except Stop:
        tokens = None
    assert seen and all(d.type == device for call in seen for d in call.values())
    assert set(seen[0]) == {"input_ids", "image_patches"}
    if device == "cpu":  # plain lists back on the host
        assert [len(t) for t in tokens] == [len(lp) for lp in logprobs]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_logprob_pass_feeds_the_policy_on_its_device_and_writes_host_rows(device: str) -> None:
    policy, seen = on_device(device)
    module = RLModule(policy=policy, value=None, recipe=RecipeConfig(algorithm="grpo"),
                      packing=PackingConfig())
    client = LocalDataPlane()
    client.register_partition(**partition_spec())
    module.dp_client = client
    meta = SyntheticRollouts(rows=3, vocab_size=VOCAB, max_len=10)(0, client)
    if device == "meta":
        with pytest.raises(Stop):
            module.forward_pass(meta, role="policy", step=0)
    else:
        module.forward_pass(meta, role="policy", step=0)
    assert seen and all(d.type == device for call in seen for d in call.values())


def stand_in_trainer(accelerator: str, world: int) -> Any:
    return SimpleNamespace(strategy=type("SingleDeviceStrategy" if world == 1 else "DDPStrategy",
                                         (), {"launcher": None})(),
                           accelerator=type(accelerator, (), {})(), world_size=world)


def test_one_or_several_gpus_are_accepted_and_other_accelerators_refused_by_name() -> None:
    backend = SimpleNamespace(_target_="tq_plugin.data_plane.LocalDataPlane")
    for world in (1, 2):  # one process per GPU, each on its shard of the global batch
        ranks.check_parallel_run(stand_in_trainer("CUDAAccelerator", world), backend=backend,
                                 global_batch=4, save_artifacts=True)
    with pytest.raises(ConfigError, match="trainer.accelerator: .*got MPSAccelerator"):
        ranks.check_parallel_run(stand_in_trainer("MPSAccelerator", 1), backend=backend,
                                 global_batch=4, save_artifacts=True)

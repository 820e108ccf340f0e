"""Real engine calls staged through ``TQTokenSink`` and verified by ``RolloutReassembler``: the
training rows carry each call's sampled tokens, the engine's own logprobs
(``generation_logprobs``, the column the trainer's IS correction reads) and the weight version
the engine held; a call the engine fails poisons its rollouts."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.data_plane import (
    GENERATION_LOGPROBS,
    INPUT_IDS,
    SAMPLE_MASK,
    TOKEN_MASK,
    LocalDataPlane,
)
from tq_plugin.rl.tasks.pattern import EOS, PAD
from tq_plugin.rollout import RolloutWorker
from tq_plugin.staging import RolloutReassembler
from tq_plugin.staging.factory import build_token_sink

from .conftest import TASK


class Recording:
    """Wraps an engine and keeps what each call returned."""

    def __init__(self, engine, fail_on_call: int | None = None) -> None:
        self.engine, self.calls, self.fail_on_call = engine, [], fail_on_call
        self.name = engine.name

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts, params, *, seeds, image_patches=None):
        if len(self.calls) == self.fail_on_call:
            raise RuntimeError("engine died")
        out = self.engine.generate(prompts, params, seeds=seeds, image_patches=image_patches)
        self.calls.append((prompts, out))
        return out


def run_step(engine, *, prompts: int = 3, group: int = 2):
    client = LocalDataPlane()
    sink = build_token_sink(client, staging_partition="rollout_staging")
    worker = RolloutWorker(task=TASK, sink=sink, max_new_tokens=6, temperature=0.8,
                           stop_token_id=EOS, allowed_token_ids=TASK.output_token_ids)
    batch = worker.run(engine, step=0, prompts=prompts, group_size=group,
                       generator=torch.Generator().manual_seed(0))
    client.register_partition("train", fields=[])
    reassembler = RolloutReassembler(client, staging_partition="rollout_staging",
                                     pad_token_id=PAD, clear_staged=True)
    meta = reassembler.finalize_group(batch.receipts, partition_id="train")
    td = client.get_data(meta, [INPUT_IDS, TOKEN_MASK, SAMPLE_MASK, GENERATION_LOGPROBS])
    return batch, meta, td


def test_every_call_is_staged_with_the_engines_tokens_logprobs_and_version(engine_case):
    engine, _ = engine_case
    rec = Recording(engine)
    batch, meta, td = run_step(rec)
    assert batch.staged_calls == 6 * TASK.turns and batch.failed_calls == 0
    assert all(c.weight_version == engine.weight_version
               for r in batch.receipts for c in r.manifest)
    for row in range(meta.size):
        mask = td[TOKEN_MASK][row] > 0
        generated = [t for _, out in rec.calls for t in out[row].token_ids]
        logprobs = [lp for _, out in rec.calls for lp in out[row].logprobs]
        ids = td[INPUT_IDS][row]
        # The action tokens are the engine's sampled tokens, turn after turn, next to its logprobs.
        assert ids[mask].tolist() == generated
        assert td[GENERATION_LOGPROBS][row][mask].tolist() == pytest.approx(logprobs, abs=1e-6)
    assert bool((td[SAMPLE_MASK] > 0).all())


def test_a_call_the_engine_fails_poisons_its_rollouts(engine_case):
    engine, _ = engine_case
    batch, _, td = run_step(Recording(engine, fail_on_call=1))
    assert batch.failed_calls == 6
    assert all(r.capture_poisoned for r in batch.receipts)
    assert bool((td[SAMPLE_MASK] == 0).all())

"""Drop-in conformance with NeMo-Gym 0.7.0's own staging code (skipped where Gym is absent).

A Gym worker installs ``TQTokenSink`` through Gym's ``install_capture`` and a Gym trainer
verifies ``TQTokenSource`` snapshots with Gym's ``verify_and_linearize``: no adapter code.
"""

from __future__ import annotations

import random

import pytest
import torch

from tq_plugin import staging as ours
from tq_plugin.staging import (
    ChainPrefixCache,
    TQTokenSink,
    TQTokenSource,
    resolve_admission_prefix,
    verify_and_linearize,
)

gym = pytest.importorskip(
    "nemo_gym.token_id_capture.staging",
    reason="nemo-gym 0.7.0 is not installed "
    "(pip install --no-deps --ignore-requires-python nemo-gym==0.7.0)",
)

TEXT_PARTITION = "rollout_staging"
MEDIA_PARTITION = "media_staging"


@pytest.fixture
def worker(client):
    """A Gym worker whose capture stages through our sink."""
    host = gym.CaptureHost()
    sink = TQTokenSink(client, staging_partition=TEXT_PARTITION)
    return gym.install_capture(host, sink=sink, weight_version_fn=lambda: 3)


def _receipt(rollout_id: str, coords: list, reward: float = 1.0):
    rows = [gym.CallRecord(**ours.call_record_for(c).model_dump()) for c in coords]
    return gym.RolloutReceipt(
        rollout_id=rollout_id,
        reward=reward,
        manifest=rows,
        terminal_model_call_id=rows[-1].model_call_id,
        terminal_selection="declared",
    )


def _run_rollout(capture, source, rollout_id: str, turns: int = 3, extras=None):
    """Drive Gym's worker-side capture through a chain; children resolve prefixes from staging."""
    cache = ChainPrefixCache(source)
    coords, chain, sequence = [], [], []
    for turn in range(turns):
        call = f"call-{turn}"
        if not coords:
            admission = gym.CaptureAdmission(rollout_id=rollout_id, model_call_id=call, mode="text")
            prefix = None
        else:
            parent = coords[-1]
            admission = gym.CaptureAdmission(
                rollout_id=rollout_id,
                model_call_id=call,
                parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len,
                mode="token_in",
                staging_chain=list(chain),
                parent_chain_hash=parent.chain_hash,
            )
            prefix = resolve_admission_prefix(admission, cache)
            assert prefix == sequence and all(type(t) is int for t in prefix)
        active = capture.begin_call(admission, prefix_token_ids=prefix)
        prompt = sequence + [100 + turn, 200 + turn]
        generated = [300 + turn, 400 + turn]
        result = capture.complete_call(
            active,
            prompt_token_ids=prompt,
            generated_token_ids=generated,
            generated_logprobs=[-0.1 * (turn + 1), -0.0],
            extras=extras,
        )
        assert result.disposition == "staged", result
        coords.append(result)
        chain.append(result.staging_key)
        sequence = prompt + generated
    return coords, sequence


def test_gym_capture_stages_through_our_sink_and_gym_verifies_our_snapshots(client, worker) -> None:
    source = TQTokenSource(client, staging_partition=TEXT_PARTITION)
    coords, sequence = _run_rollout(worker, source, "rollout-1", extras={"k": 1.0, "flag": True})
    snapshots = source.fetch([c.staging_key for c in coords])
    assert all(type(s) is gym.StagedCallBaseSnapshot for s in snapshots)
    receipt = _receipt("rollout-1", coords)
    row = gym.verify_and_linearize(receipt, snapshots)
    assert row.token_ids == sequence
    assert str(row.logprobs[-1]) == "-0.0"
    assert verify_and_linearize(receipt, snapshots).token_ids == sequence


def test_sink_returns_gyms_stage_result_for_gyms_records(client) -> None:
    sink = TQTokenSink(client, staging_partition=TEXT_PARTITION)
    record = gym.StagedCallRecord(
        **ours.make_staged_call_record(
            ours.CaptureAdmission(rollout_id="r", model_call_id="c", mode="text"),
            prompt_ids=[1, 2],
            generated_ids=[3],
            generated_logprobs=[-0.7],
            weight_version=1,
            extras={"x": None},
        ).model_dump()
    )
    result = sink.stage(record)
    assert type(result) is gym.StageResult and result.ok and result.staging_key == "r/c"
    failed = sink.stage(record, attachments={"imgs": torch.zeros(1)})
    assert type(failed) is gym.StageResult and not failed.ok and "media-enabled" in failed.error


def test_a_rejected_stage_poisons_gyms_capture_without_failing_the_call(client) -> None:
    host = gym.CaptureHost()
    capture = gym.install_capture(
        host,
        sink=TQTokenSink(client, staging_partition=TEXT_PARTITION),
        weight_version_fn=lambda: 0,
    )
    active = capture.begin_call(
        gym.CaptureAdmission(rollout_id="r", model_call_id="c", mode="text")
    )
    coords = capture.complete_call(
        active,
        prompt_token_ids=[1],
        generated_token_ids=[2],
        generated_logprobs=[-0.5],
        attachments={"imgs": torch.zeros(1, 4, 12), "imgs_sizes": torch.tensor([[4, 4]])},
    )
    assert coords.disposition == "capture_failed" and coords.staging_key is None


def test_gym_capture_media_attachments_land_with_the_tokens(client) -> None:
    host = gym.CaptureHost()
    sink = TQTokenSink(
        client,
        staging_partition=MEDIA_PARTITION,
        capture_media=True,
        media_pixel_dtype=torch.float32,
    )
    capture = gym.install_capture(host, sink=sink, weight_version_fn=lambda: 0)
    active = capture.begin_call(
        gym.CaptureAdmission(rollout_id="r", model_call_id="c", mode="text")
    )
    pixels = {
        "imgs": torch.randn(1, 4, 12),
        "imgs_sizes": torch.tensor([[4, 4]], dtype=torch.int32),
    }
    coords = capture.complete_call(
        active,
        prompt_token_ids=[1],
        generated_token_ids=[2],
        generated_logprobs=[-0.5],
        attachments=pixels,
    )
    assert coords.disposition == "staged"
    source = TQTokenSource(client, staging_partition=MEDIA_PARTITION, capture_media=True)
    items = source.fetch_for_finalization([coords.staging_key])
    (got,) = source.fetch_media(items)
    assert torch.equal(got.imgs, pixels["imgs"])
    gym.verify_and_linearize(_receipt("r", [coords]), [items[0].snapshot])


def test_implementations_satisfy_gyms_runtime_protocols(client) -> None:
    assert isinstance(TQTokenSink(client, staging_partition=TEXT_PARTITION), gym.StagingSink)
    assert isinstance(TQTokenSource(client, staging_partition=TEXT_PARTITION), gym.StagingSource)


def test_gym_admissions_resolve_through_our_cache(client, worker) -> None:
    source = TQTokenSource(client, staging_partition=TEXT_PARTITION)
    coords, sequence = _run_rollout(worker, source, "r", turns=2)
    inline = gym.CaptureAdmission(
        rollout_id="r",
        model_call_id="x",
        parent_call_id="call-1",
        prev_len=len(sequence),
        mode="token_in",
        required_prefix_token_ids=sequence,
        parent_chain_hash=coords[-1].chain_hash,
    )
    cache = ChainPrefixCache(source)
    assert resolve_admission_prefix(inline, cache) == sequence
    assert cache.fetch([c.staging_key for c in coords]) == sequence


def test_golden_vectors_agree_with_gyms_shipped_json() -> None:
    gym.assert_golden_vectors()
    ours.assert_golden_vectors()
    assert gym.load_golden_vectors() == ours.load_golden_vectors()
    vectors = gym.load_golden_vectors()
    assert ours.compute_extras_digest(vectors["extras"]) == vectors["extras_digest"]
    assert ours.compute_staging_digest(**vectors["staged_call"]) == vectors["staged_call_digest"]


def _random_extras(rng: random.Random, depth: int = 0):
    kinds = (
        ["none", "bool", "int", "float", "str", "list", "dict"]
        if depth < 3
        else ["int", "float", "str"]
    )
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == "float":
        return rng.choice([rng.uniform(-1e6, 1e6), -0.0, 0.0, 1.0])
    if kind == "str":
        return "".join(rng.choice("aé€𝄞z/ ") for _ in range(rng.randint(0, 6)))
    if kind == "list":
        return [_random_extras(rng, depth + 1) for _ in range(rng.randint(0, 20))]
    return {
        f"k{rng.randint(0, 9)}é": _random_extras(rng, depth + 1) for _ in range(rng.randint(0, 4))
    }


def test_our_digests_equal_gyms_on_random_cases() -> None:
    rng = random.Random(7)
    for case in range(300):
        n = rng.randint(1, 40) if case % 50 else rng.randint(500, 1500)
        carry = rng.randint(0, n - 1)
        ids = [rng.choice([rng.randint(0, 2**64 - 1), rng.randint(0, 200_000)]) for _ in range(n)]
        mask = [0.0] * carry + [1.0] * (n - carry)
        logprobs = [0.0] * carry + [
            rng.choice([-rng.expovariate(1.0), -0.0, -1e-40]) for _ in range(n - carry)
        ]
        extras = {"e": _random_extras(rng)} if case % 3 else None
        child = case % 2 == 1
        fields = {
            "schema_version": 2,
            "digest_version": 2,
            "extras_digest_version": 1,
            "rollout_id": f"roll-{case}-é",
            "model_call_id": f"call/{case}",
            "parent_call_id": "p" if child else None,
            "mode": "token_in" if child else "text",
            "prev_len": rng.randint(1, 99) if child else 0,
            "delta_len": n,
            "weight_version": rng.randint(0, 2**40),
            "token_ids_delta": ids,
            "token_mask_delta": mask,
            "generation_log_probs_delta": logprobs,
            "extras_digest": gym.compute_extras_digest(extras),
            "chain_hash": gym.compute_chain_hash(None, ids),
            "cumulative_hash": gym.hash_token_ids(ids),
        }
        fields["cum_len"] = fields["prev_len"] + n
        assert ours.compute_extras_digest(extras) == fields["extras_digest"]
        assert ours.compute_chain_hash(None, ids) == fields["chain_hash"]
        assert ours.compute_chain_hash(fields["chain_hash"], ids[:1]) == gym.compute_chain_hash(
            fields["chain_hash"], ids[:1]
        )
        assert ours.hash_token_ids(ids) == fields["cumulative_hash"]
        assert ours.compute_staging_digest(**fields) == gym.compute_staging_digest(**fields)

"""Engine-side construction of a staged call record from an admission and a completion.

This is the worker half of the protocol in a few lines: the delta is the prompt past the
admitted prefix (masked 0.0, logprob 0.0) followed by the generation (masked 1.0), and the
call commits to its chain hash (parent chain + delta) and to the cumulative hash of the
whole sequence so far. A Gym worker gets the same record from Gym's own capture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tq_plugin.staging.digest import (
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from tq_plugin.staging.records import (
    TOKEN_VERSIONS,
    CallRecord,
    CaptureAdmission,
    RolloutReceipt,
    StagedCallRecord,
)
from tq_plugin.staging.records import staging_key as default_staging_key


def build_staging_delta(
    prompt_ids: Sequence[int],
    prev_len: int,
    generated_ids: Sequence[int],
    generated_logprobs: Sequence[float],
) -> tuple[list[int], list[float], list[float]]:
    """``(ids, mask, logprobs)`` of one call's delta: ``prompt[prev_len:] + generated``."""
    if not 0 <= prev_len <= len(prompt_ids):
        raise ValueError(f"prev_len={prev_len} is outside prompt length {len(prompt_ids)}")
    if len(generated_ids) != len(generated_logprobs):
        raise ValueError(
            "generated token and log-probability lengths differ: "
            f"{len(generated_ids)} != {len(generated_logprobs)}"
        )
    carry = list(prompt_ids[prev_len:])
    ids = carry + list(generated_ids)
    if not ids:
        raise ValueError("staging delta must contain at least one token")
    mask = [0.0] * len(carry) + [1.0] * len(generated_ids)
    logprobs = [0.0] * len(carry) + [float(x) for x in generated_logprobs]
    return ids, mask, logprobs


def make_staged_call_record(
    admission: CaptureAdmission,
    *,
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    generated_logprobs: Sequence[float],
    weight_version: int,
    prefix_token_ids: Sequence[int] | None = None,
    extras: Mapping[str, Any] | None = None,
    token_versions: Sequence[int] | None = None,
) -> StagedCallRecord:
    """The record a worker stages for one completed call under ``admission``.

    ``token_versions``: the weight version that produced each generated token (the per-token
    ledger of in-flight weight updates), kept in ``extras["token_versions"]`` so the call's
    digest covers it; ``None`` stages no ledger (the digest is the one it always was).

    ``prefix_token_ids`` is the resolved prefix (``resolve_admission_prefix``); the prompt
    must begin with it, or the call would stage tokens the gate never authorized.
    """
    prefix = list(
        admission.required_prefix_token_ids if prefix_token_ids is None else prefix_token_ids
    )
    if admission.mode == "token_in":
        if len(prefix) != admission.prev_len:
            raise ValueError(
                f"prefix_token_ids length {len(prefix)} does not equal "
                f"prev_len {admission.prev_len}"
            )
        if list(prompt_ids[: admission.prev_len]) != prefix:
            raise ValueError(
                "generation prompt does not begin with the gate-authorized token prefix"
            )
    ids, mask, logprobs = build_staging_delta(
        prompt_ids, admission.prev_len, generated_ids, generated_logprobs
    )
    extras_dict = None if extras is None else dict(extras)
    if token_versions is not None:
        if extras_dict is not None and TOKEN_VERSIONS in extras_dict:
            raise ValueError(f"{TOKEN_VERSIONS}: given both as an argument and in extras")
        extras_dict = {**(extras_dict or {}), TOKEN_VERSIONS: list(token_versions)}
    fields: dict[str, Any] = {
        "rollout_id": admission.rollout_id,
        "model_call_id": admission.model_call_id,
        "parent_call_id": admission.parent_call_id,
        "mode": admission.mode,
        "prev_len": admission.prev_len,
        "delta_len": len(ids),
        "cum_len": admission.prev_len + len(ids),
        "weight_version": weight_version,
        "token_ids_delta": ids,
        "token_mask_delta": mask,
        "generation_log_probs_delta": logprobs,
        "extras_digest": compute_extras_digest(extras_dict),
        "chain_hash": compute_chain_hash(admission.parent_chain_hash, ids),
        "cumulative_hash": hash_token_ids([*prompt_ids, *generated_ids]),
    }
    fields["digest"] = compute_staging_digest(
        schema_version=2, digest_version=2, extras_digest_version=1, **fields
    )
    return StagedCallRecord(**fields, extras=extras_dict)


def call_record_for(
    record: Any, *, staging_key: str | None = None, response_id: str | None = None
) -> CallRecord:
    """The token-free manifest row of a staged record or of staged ``CommitCoords``.

    Read by attribute, so Gym's objects work too. Coordinates carry their staging key and no
    mode: a root is a text call, a child a token_in call.
    """
    key = staging_key or getattr(record, "staging_key", None)
    mode = getattr(record, "mode", None) or (
        "text" if record.parent_call_id is None else "token_in"
    )
    return CallRecord(
        model_call_id=record.model_call_id,
        parent_call_id=record.parent_call_id,
        prev_len=record.prev_len,
        delta_len=record.delta_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        digest=record.digest,
        extras_digest=record.extras_digest,
        staging_key=key or default_staging_key(record.rollout_id, record.model_call_id),
        mode=mode,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
        response_id=response_id or f"response-{record.model_call_id}",
    )


def make_rollout_receipt(
    records: Sequence[Any],
    *,
    terminal_model_call_id: str | None = None,
    reward: float | None = None,
    staging_keys: Sequence[str] | None = None,
) -> RolloutReceipt:
    """A declared-terminal receipt over staged records (the last record is the default terminal).

    ``staging_keys`` are the keys the sink returned (``StageResult.staging_key``); by default
    each record's default key.
    """
    if not records:
        raise ValueError("a receipt needs at least one staged record")
    keys = list(staging_keys) if staging_keys is not None else [None] * len(records)
    return RolloutReceipt(
        rollout_id=records[0].rollout_id,
        reward=reward,
        terminal_model_call_id=terminal_model_call_id or records[-1].model_call_id,
        manifest=[call_record_for(r, staging_key=k) for r, k in zip(records, keys)],
        terminal_selection="declared",
    )


def make_staged_chain(
    rollout_id: str,
    turns: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
    *,
    weight_versions: Sequence[int] | None = None,
    extras: Sequence[Mapping[str, Any] | None] | None = None,
    call_ids: Sequence[str] | None = None,
) -> list[StagedCallRecord]:
    """A linear chain of staged calls, as a worker would stage a multi-turn rollout.

    Each turn is ``(carry, generated, generated_logprobs)``: the new prompt tokens (turn
    0's carry is the root prompt) and the generation. Call ids default to ``c0, c1, ...``.
    For demos, tests and benchmarks.
    """
    records: list[StagedCallRecord] = []
    sequence: list[int] = []
    for i, (carry, generated, logprobs) in enumerate(turns):
        call = call_ids[i] if call_ids else f"c{i}"
        if records:
            parent = records[-1]
            admission = CaptureAdmission(
                rollout_id=rollout_id,
                model_call_id=call,
                parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len,
                mode="token_in",
                required_prefix_token_ids=list(sequence),
                parent_chain_hash=parent.chain_hash,
            )
        else:
            admission = CaptureAdmission(rollout_id=rollout_id, model_call_id=call, mode="text")
        prompt = [*sequence, *carry]
        records.append(
            make_staged_call_record(
                admission,
                prompt_ids=prompt,
                generated_ids=generated,
                generated_logprobs=logprobs,
                weight_version=weight_versions[i] if weight_versions else 0,
                extras=extras[i] if extras else None,
            )
        )
        sequence = [*prompt, *generated]
    return records

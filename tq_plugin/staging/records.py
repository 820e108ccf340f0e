"""Wire records of the staging protocol (schema 2, digest 2, extras digest 1).

Pydantic v2 models with the reference's fields, validators and error wording, so a record
built here and one built by NeMo-Gym 0.7.0 carry the same digest and reject the same
inputs. Records are not frozen, and ``model_copy(update=...)`` bypasses validation (tests
use that to build tampered snapshots); the verifier re-checks everything it relies on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    model_validator,
)

from tq_plugin.staging.digest import (
    EMPTY_EXTRAS_DIGEST,
    compute_extras_digest,
    staging_digest_and_columns,
)

Identifier = Annotated[str, Field(strict=True, min_length=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
DigestHex = Annotated[str, Field(strict=True, pattern=r"^[0-9a-f]{64}$")]
CaptureMode = Literal["token_in", "text"]
CaptureDisposition = Literal["staged", "capture_failed"]
TerminalSelectionMethod = Literal["declared", "response_id", "content", "heuristic"]


# The per-token version ledger: an extras key holding, for each generated token of the call
# (each mask-1.0 position of its delta, in order), the weight version that produced it. Inside
# extras it is covered by ``extras_digest`` and so by the call's digest; the sink stores it as
# a jagged int64 column of its own (``TOKEN_VERSIONS_FIELD``), never in the metadata JSON, and
# the source puts it back before the extras digest is checked. A call without it keeps the
# digest it always had (NeMo Gym's byte for byte).
TOKEN_VERSIONS = "token_versions"


def check_token_versions(value: Any, generated: int) -> np.ndarray:
    """``value`` (a call's ``extras["token_versions"]``) as an int64 array, once it is a list
    of exact non-negative ints, one per generated token (``generated`` of them, at least one).
    A ``ValueError`` / ``TypeError`` naming ``token_versions`` and the rule otherwise."""
    if type(value) is not list:
        raise TypeError(f"{TOKEN_VERSIONS} must be a list of ints, got {type(value).__name__}")
    kinds = set(map(type, value))
    if kinds - {int}:
        bad = sorted(k.__name__ for k in kinds - {int})
        raise TypeError(f"{TOKEN_VERSIONS} must hold ints only, got {', '.join(bad)}")
    if generated < 1:
        raise ValueError(f"{TOKEN_VERSIONS}: the call generated no token, so it has no ledger")
    if len(value) != generated:
        raise ValueError(f"{TOKEN_VERSIONS} has {len(value)} entries for {generated} generated "
                         "tokens (one version per generated token)")
    try:
        versions = np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"{TOKEN_VERSIONS} holds a version outside the int64 range") from None
    if versions.min() < 0:
        raise ValueError(f"{TOKEN_VERSIONS} must be non-negative, got {int(versions.min())}")
    return versions


def _key_part(name: str, value: Any) -> str:
    """One id as a key component: UTF-8 text with ``%`` and ``/`` percent-escaped."""
    if type(value) is not str:
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid UTF-8 text (lone surrogate at position {exc.start})"
        ) from None
    if "%" in value or "/" in value:
        return value.replace("%", "%25").replace("/", "%2F")
    return value


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """The default staging key ``"<rollout_id>/<model_call_id>"`` (keys are opaque to readers).

    Injective: ``%`` and ``/`` inside an id are percent-escaped, so rollout ``"a/b"`` + call
    ``"c"`` and rollout ``"a"`` + call ``"b/c"`` get different keys; ids without either
    character keep the reference's plain ``"<rollout_id>/<model_call_id>"`` form. Ids must
    be non-empty UTF-8 text (a lone surrogate cannot be stored or returned).
    """
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    return f"{_key_part('rollout_id', rollout_id)}/{_key_part('model_call_id', model_call_id)}"


class _WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: Literal[2] = 2


class _DigestWireModel(_WireModel):
    digest_version: Literal[2] = 2
    extras_digest_version: Literal[1] = 1


class CaptureAdmission(_WireModel):
    """Gate-to-worker contract for one model call: its identity and the prefix it must start with.

    The prefix travels inline (``required_prefix_token_ids``) or as a root-first
    ``staging_chain`` of staged keys whose deltas concatenate to it.
    """

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt = 0
    mode: CaptureMode
    required_prefix_token_ids: list[StrictInt] = Field(default_factory=list)
    staging_chain: list[str] = Field(default_factory=list)
    parent_chain_hash: DigestHex | None = None

    @model_validator(mode="after")
    def _check_admission(self) -> CaptureAdmission:
        if self.required_prefix_token_ids and min(self.required_prefix_token_ids) < 0:
            raise ValueError("required_prefix_token_ids must be non-negative")
        if self.mode == "token_in":
            if self.parent_call_id is None or self.prev_len == 0:
                raise ValueError("token_in admission requires a parent_call_id and prev_len > 0")
            if self.parent_chain_hash is None:
                raise ValueError(
                    "token_in admission requires the parent's chain hash (parent_chain_hash)"
                )
            if not self.staging_chain and len(self.required_prefix_token_ids) != self.prev_len:
                raise ValueError("required_prefix_token_ids length must equal prev_len")
        else:
            offending = [
                name
                for name, is_set in (
                    ("parent_call_id", self.parent_call_id is not None),
                    ("prev_len", self.prev_len != 0),
                    ("required_prefix_token_ids", bool(self.required_prefix_token_ids)),
                    ("staging_chain", bool(self.staging_chain)),
                    ("parent_chain_hash", self.parent_chain_hash is not None),
                )
                if is_set
            ]
            if offending:
                raise ValueError(
                    "text admission must be a parentless root with no required prefix "
                    f"(set: {', '.join(offending)})"
                )
        return self


# The keyword arguments of ``compute_staging_digest``.
_DIGEST_INPUTS = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "rollout_id",
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "token_ids_delta",
    "token_mask_delta",
    "generation_log_probs_delta",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)


def _digest_fields(record: Any) -> dict[str, Any]:
    """The keyword arguments of ``compute_staging_digest`` read off any snapshot-shaped object."""
    return {name: getattr(record, name) for name in _DIGEST_INPUTS}


# Validation-context key under which ``validated_snapshot`` hands a snapshot the digest it has
# just recomputed over the very column values the snapshot is built from (internal).
_DIGEST_RECOMPUTED = "tq_plugin.staging.digest_recomputed"


def recompute_digest(record: Any) -> str:
    """Recompute a snapshot's (ours or Gym's) staging digest from its fields.

    The record's columns are strict pydantic lists, so the exact-type scan is skipped; a
    ``model_copy``-tampered value still has to hash to the recorded digest.
    """
    return staging_digest_and_columns(**_digest_fields(record), check_types=False)[0]


class StagedCallBaseSnapshot(_DigestWireModel):
    """One staged call's token columns and receipt identity, without extras.

    Construction recomputes the digest, so a validated snapshot's columns are the bytes
    its digest vouches for. Ancestry (chain and cumulative hashes, mask order) needs the
    other calls and is the verifier's job.
    """

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    mode: CaptureMode
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    token_ids_delta: list[StrictInt]
    token_mask_delta: list[StrictFloat]
    generation_log_probs_delta: list[StrictFloat]
    extras_digest: DigestHex = EMPTY_EXTRAS_DIGEST
    chain_hash: DigestHex
    cumulative_hash: DigestHex

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.model_call_id)

    @model_validator(mode="after")
    def _check_snapshot(self, info: ValidationInfo) -> StagedCallBaseSnapshot:
        if self.parent_call_id is None and self.prev_len != 0:
            raise ValueError("a parentless staged call must have prev_len == 0")
        if self.parent_call_id is not None and self.prev_len == 0:
            raise ValueError("a child staged call must have prev_len > 0")
        if self.parent_call_id is None and self.mode != "text":
            raise ValueError("a parentless staged call must use text mode")
        if self.parent_call_id is not None and self.mode != "token_in":
            raise ValueError("a child staged call must use token_in mode")
        if self.delta_len == 0:
            raise ValueError("a staged call delta must contain at least one token")
        if (info.context.get(_DIGEST_RECOMPUTED) if info.context else None) == self.digest:
            return self  # the columns hashed to the digest, ids checked unsigned on the way
        if self.token_ids_delta and min(self.token_ids_delta) < 0:
            raise ValueError("token_ids_delta must be non-negative")
        if recompute_digest(self) != self.digest:
            raise ValueError("digest does not match staged call contents")
        return self


def validated_snapshot(
    cls: type[Any], fields: dict[str, Any], columns: dict[str, np.ndarray]
) -> Any:
    """A snapshot of ``cls`` from ``fields`` plus ``columns`` (its three token columns as the
    numpy arrays read), validated as ``cls(**fields, **lists)`` where each list is its
    array's ``tolist()``, but with the digest recomputed over the arrays, not the lists.

    Hashing a fetched int64 / float32 column is about twice as fast as hashing its list,
    and the lists are made here from those very arrays, so the digest vouches for them.
    Only our own snapshot class takes the digest that way (any other class, Gym's included,
    validates as usual); when the array digest fails or differs, the snapshot is validated
    as usual too, so a bad row raises exactly the error it always did.
    """
    lists = {name: values.tolist() for name, values in columns.items()}
    if not (isinstance(cls, type) and issubclass(cls, StagedCallBaseSnapshot)):
        return cls(**fields, **lists)
    inputs = {name: fields.get(name) for name in _DIGEST_INPUTS}
    inputs.update(columns)
    try:
        digest = staging_digest_and_columns(**inputs)[0]
    except (TypeError, ValueError):
        digest = None
    context = {_DIGEST_RECOMPUTED: digest} if digest == fields.get("digest") else None
    return cls.model_validate({**fields, **lists}, context=context)


def checked_snapshot(
    cls: type[Any], fields: dict[str, Any], lists: dict[str, list[Any]], digest: str
) -> Any | None:
    """A snapshot of ``cls`` from ``fields`` plus its three token ``lists``, given ``digest``:
    the digest just recomputed (``digest_of_checked_row``) over the very arrays the lists were
    made from (``tolist()``); None unless it equals the row's own digest and ``cls`` is ours.

    That hash held every field to the rules validation checks (exact types, the version
    literals, non-empty ids, non-negative lengths, lineage and mode, lowercase hex digests,
    finite floats, non-negative ids), so our own class is built without validating it again
    (``model_construct``); a subclass validates with the digest handed in (its own rules run).
    """
    if digest != fields.get("digest") or not (
        isinstance(cls, type) and issubclass(cls, StagedCallBaseSnapshot)
    ):
        return None
    if cls is StagedCallBaseSnapshot:
        return cls.model_construct(**fields, **lists)
    return cls.model_validate({**fields, **lists}, context={_DIGEST_RECOMPUTED: digest})


class StagedCallRecord(StagedCallBaseSnapshot):
    """What a sink receives: a base snapshot plus the extras its ``extras_digest`` commits to."""

    extras: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_extras(self) -> StagedCallRecord:
        try:
            digest = compute_extras_digest(self.extras)
        except TypeError as exc:  # a ValidationError, naming the field, like every other rule
            raise ValueError(f"extras: {exc}") from None
        if digest != self.extras_digest:
            raise ValueError("extras_digest does not match extras")
        if self.extras is not None and TOKEN_VERSIONS in self.extras:
            try:
                check_token_versions(self.extras[TOKEN_VERSIONS],
                                     self.token_mask_delta.count(1.0))
            except TypeError as exc:  # a ValidationError naming the field, as above
                raise ValueError(str(exc)) from None
        return self

    def to_base_snapshot(self) -> StagedCallBaseSnapshot:
        return StagedCallBaseSnapshot.model_validate(self.model_dump(exclude={"extras"}))


class StagedCallSnapshot(StagedCallRecord):
    """Legacy: the exact staged record a source once returned (sources now return base rows)."""


class StageResult(_WireModel):
    """A sink's durability answer: ``ok`` with the authoritative staging key, or an error."""

    ok: bool
    staging_key: Identifier | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _check_result(self) -> StageResult:
        if self.ok and self.staging_key is None:
            raise ValueError("a successful stage result requires staging_key")
        if not self.ok and not self.error:
            raise ValueError("a failed stage result requires an error")
        return self


class CommitCoords(_DigestWireModel):
    """The token-light acknowledgement a worker returns for one call (staged or capture_failed)."""

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    disposition: CaptureDisposition = "staged"
    digest: DigestHex | None = None
    extras_digest: DigestHex | None = None
    staging_key: Identifier | None = None
    chain_hash: DigestHex | None = None
    cumulative_hash: DigestHex | None = None

    @model_validator(mode="after")
    def _check_coords(self) -> CommitCoords:
        if self.parent_call_id is None and self.prev_len != 0:
            raise ValueError("parentless coordinates must have prev_len == 0")
        if self.parent_call_id is not None and self.prev_len == 0:
            raise ValueError("child coordinates must have prev_len > 0")
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("cum_len must equal prev_len + delta_len")
        payload = (
            self.digest,
            self.extras_digest,
            self.staging_key,
            self.chain_hash,
            self.cumulative_hash,
        )
        if self.disposition == "staged":
            if any(value is None for value in payload):
                raise ValueError(
                    "staged coordinates require digest, extras_digest, staging_key, "
                    "chain_hash, and cumulative_hash"
                )
            if self.delta_len < 1:
                raise ValueError("staged coordinates require a non-empty delta")
        else:
            if any(value is not None for value in payload):
                raise ValueError("capture_failed coordinates cannot carry staged payload metadata")
            if self.delta_len != 0:
                raise ValueError("capture_failed coordinates cannot carry token deltas")
        return self


class CallRecord(_DigestWireModel):
    """One token-free manifest row: lineage, lengths, digests and the storage join (staging_key)."""

    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    extras_digest: DigestHex
    staging_key: Identifier
    mode: CaptureMode = "token_in"
    chain_hash: DigestHex
    cumulative_hash: DigestHex
    response_id: Identifier
    admitted_at: StrictFloat | None = None
    output_fingerprint: DigestHex | None = None
    continuation_fingerprint: DigestHex | None = None
    fingerprint_version: NonNegativeInt = 0

    @model_validator(mode="after")
    def _check_row(self) -> CallRecord:
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("manifest lengths must describe a non-empty contiguous delta")
        if self.parent_call_id is None and (self.prev_len != 0 or self.mode != "text"):
            raise ValueError(
                "a parentless manifest row must be a text-mode root with prev_len == 0"
            )
        if self.parent_call_id is not None and (self.prev_len == 0 or self.mode != "token_in"):
            raise ValueError("a child manifest row must use token_in mode with prev_len > 0")
        return self


class ManifestFailure(_WireModel):
    """A poison row: this call's capture failed, so its rollout cannot be trained on."""

    model_call_id: Identifier
    reason: Identifier


class RolloutManifest(_WireModel):
    rollout_id: Identifier
    records: list[CallRecord] = Field(default_factory=list)
    failures: list[ManifestFailure] = Field(default_factory=list)


class RolloutReceipt(_DigestWireModel):
    """The immutable, token-free manifest a framework assembles when a rollout ends."""

    rollout_id: Identifier
    reward: float | None = None
    terminal_model_call_id: Identifier | None = None
    manifest: list[CallRecord] = Field(default_factory=list)
    capture_poisoned: StrictBool = False
    failure_reason: str | None = None
    terminal_selection: TerminalSelectionMethod | None = None
    terminal_attribution_reason: str | None = None

    @model_validator(mode="after")
    def _check_receipt(self) -> RolloutReceipt:
        ids = [row.model_call_id for row in self.manifest]
        if len(set(ids)) != len(ids):
            raise ValueError("receipt manifest contains duplicate model_call_id values")
        if self.terminal_model_call_id is not None and self.terminal_model_call_id not in ids:
            raise ValueError("terminal_model_call_id is absent from the receipt manifest")
        if not self.capture_poisoned:
            if self.failure_reason is not None:
                raise ValueError("an unpoisoned receipt cannot carry a failure_reason")
            if self.terminal_model_call_id is None or self.terminal_selection is None:
                raise ValueError(
                    "an unpoisoned receipt must name terminal_model_call_id and terminal_selection"
                )
        if self.terminal_selection is None:
            if self.terminal_model_call_id is not None:
                raise ValueError("terminal_model_call_id requires a terminal_selection method")
            if not self.failure_reason:
                raise ValueError(
                    "a receipt with no attribution stage must be poisoned with a failure_reason"
                )
        return self

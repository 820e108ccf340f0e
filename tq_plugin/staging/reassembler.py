"""Trainer-side finalization: staged calls of a rollout group → verified training rows.

``RolloutReassembler.finalize_group`` reads every staged call of the group in one batched
fetch, verifies each rollout against its receipt (digests, parent chain, chain and
cumulative hashes), linearizes the terminal's ancestry into one row and writes the group
with ``first_write``. A poisoned or unverifiable rollout becomes a placeholder row with
``sample_mask = 0`` and its reason code in the row's tags: the group keeps its shape (so
GRPO baselines stay aligned), nothing is skipped silently, and one bad rollout never fails
the others.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tq_plugin.data_plane import (
    GENERATION_LOGPROBS,
    INPUT_IDS,
    INPUT_LENGTHS,
    PAD_TO_MULTIPLE,
    SAMPLE_MASK,
    TOKEN_MASK,
    TOTAL_REWARD,
    KVBatchMeta,
    call_dp,
    first_write,
    nested_from_lengths,
)
from tq_plugin.staging.media import (
    MEDIA_IMGS_FIELD,
    MEDIA_IMGS_SIZES_FIELD,
    MEDIA_NUM_FRAMES_FIELD,
    StagedMediaTensors,
)
from tq_plugin.staging.rebuild import LinearizedRow, ReceiptVerificationError, verify_and_linearize
from tq_plugin.staging.records import StagedCallBaseSnapshot
from tq_plugin.staging.source import FetchedStagedCall, StagingReadError, TQTokenSource
from tq_plugin.staging.store import TOKEN_VERSIONS_FIELD

logger = logging.getLogger(__name__)

STATUS_TAG = "staging_status"
STATUS_OK = "ok"
# Per-row tag: a hash of what the row was finalized from (sample id, rollout, staged keys and
# digests, reward), so a retried finalize recognizes the rows its earlier attempt wrote.
FINALIZED_FROM_TAG = "finalized_from"
FINALIZED_FIELDS_TAG = "finalized_fields"  # the columns that write put, comma-separated
REASSEMBLED_FIELDS = (
    INPUT_IDS,
    INPUT_LENGTHS,
    TOKEN_MASK,
    GENERATION_LOGPROBS,
    SAMPLE_MASK,
    TOTAL_REWARD,
)
REASSEMBLED_MEDIA_FIELDS = (MEDIA_IMGS_FIELD, MEDIA_IMGS_SIZES_FIELD, MEDIA_NUM_FRAMES_FIELD)


@dataclass
class _Outcome:
    """One rollout's result: a verified row (and its media), or the reason it has none."""

    rollout_id: str
    status: str = STATUS_OK
    row: LinearizedRow | None = None
    media: list[StagedMediaTensors] | None = None
    reward: float = 0.0
    versions: list[int] | None = None  # per row position: its token's version, -1 off generation
    ledgered: bool = False  # a call of its chain staged a per-token version ledger


def _preflight_status(receipt: Any) -> str | None:
    """The reason a receipt cannot be trained on without reading anything, if there is one."""
    if not hasattr(receipt, "manifest") or not hasattr(receipt, "rollout_id"):
        return "invalid_receipt"
    if receipt.failure_reason:
        return "rollout_failed"
    if receipt.capture_poisoned:
        return "capture_poisoned"
    if not receipt.manifest:
        return "empty_manifest"
    return None


class FinalizeRetryError(RuntimeError):
    """A ``finalize_group`` retried after the rows its earlier attempt wrote have left the
    partition (consumed and cleared): they cannot be returned, and finalizing afresh from
    staged calls that attempt cleared would turn complete rollouts into placeholders."""


# How many finalized groups a reassembler remembers (their origins) to recognise a late retry.
_REMEMBERED_GROUPS = 4096


class RolloutReassembler:
    """Finalize groups of rollouts from a staging partition into a training partition."""

    def __init__(
        self,
        dp_client: Any,
        *,
        staging_partition: str,
        capture_media: bool = False,
        pad_token_id: int = 0,
        reward_field: str | None = TOTAL_REWARD,
        clear_staged: bool = False,
    ) -> None:
        self.dp_client = dp_client
        self.source = TQTokenSource(
            dp_client,
            staging_partition=staging_partition,
            capture_media=capture_media,
            snapshot_cls=StagedCallBaseSnapshot,
        )
        self.capture_media = capture_media
        self.pad_token_id = pad_token_id
        self.reward_field = reward_field
        self.clear_staged = clear_staged
        self._finalized: OrderedDict[tuple[str, tuple[str, ...]], None] = OrderedDict()

    def finalize_group(
        self,
        receipts: Sequence[Any],
        *,
        partition_id: str,
        sample_ids: Sequence[str] | None = None,
        task_name: str = "train",
        pad_to_multiple: int = 1,
        extra_info: Mapping[str, Any] | None = None,
    ) -> KVBatchMeta:
        """Verify, linearize and write one row per receipt (placeholders for failures).

        Sample ids default to each receipt's ``rollout_id``. Row tags carry ``rollout_id``
        and ``staging_status`` (``"ok"`` or the reason code of the placeholder). The reward
        goes to ``reward_field`` (0.0 on placeholders; None writes no reward column).

        Retry-safe: rows tag what they were finalized from, so a retry after the write
        landed (the clear or the reply failed) returns the rows as written and only redoes
        the clear. A read whose outcome is unknown (``StagingReadError``: a transport fault,
        a short result) raises instead of becoming a ``fetch_failed`` placeholder; only a row
        the store reports missing, or one that does not verify, becomes a placeholder. A retry
        of a group this reassembler wrote whose rows have since been consumed and cleared
        raises ``FinalizeRetryError`` and writes nothing (the rows cannot be returned, and its
        staged calls are gone).
        """
        receipts = list(receipts)
        if not receipts:
            raise ValueError("finalize_group needs at least one receipt")
        outcomes = [self._outcome(r, i) for i, r in enumerate(receipts)]
        ids = list(sample_ids) if sample_ids is not None else [o.rollout_id for o in outcomes]
        if len(ids) != len(receipts) or len(set(ids)) != len(ids):
            raise ValueError(
                f"finalize_group needs {len(receipts)} unique sample ids, got {ids!r} "
                "(pass sample_ids when rollout ids repeat)"
            )
        live = [i for i, o in enumerate(outcomes) if o.status == STATUS_OK]
        origins = [_origin(sid, r, o) for sid, r, o in zip(ids, receipts, outcomes)]
        group = (partition_id, tuple(origins))
        done = self._already_written(ids, partition_id, origins)
        if done is None and group in self._finalized:
            raise FinalizeRetryError(
                f"finalize_group: this group ({len(ids)} rollouts, first {ids[0]!r}) was "
                f"finalized into partition {partition_id!r} already and its rows have left it "
                "since (consumed and cleared); a retry cannot return them and would make "
                "placeholders of complete rollouts: use the first attempt's rows"
            )
        if done is not None:
            # A retry after the write landed (the clear or the reply failed): the rows stand
            # as written; re-reading staged rows a previous attempt may have cleared would
            # turn complete rollouts into placeholders.
            if self.clear_staged:
                self._clear(receipts, live)
            lengths, fields, tags = done
            info = dict(extra_info or {})
            if pad_to_multiple > 1:
                info[PAD_TO_MULTIPLE] = int(pad_to_multiple)
            return KVBatchMeta(
                partition_id=partition_id,
                task_name=task_name,
                sample_ids=ids,
                fields=fields,
                sequence_lengths=lengths,
                extra_info=info,
                tags=tags,
            )
        fetched = self._fetch(receipts, outcomes, live)
        for i in live:
            if outcomes[i].status == STATUS_OK:
                self._verify(receipts[i], outcomes[i], fetched[i])
        if self.capture_media:
            self._attach_media(outcomes, fetched)
        batch = self._batch(outcomes)
        written = ",".join(batch)
        meta = first_write(
            batch,
            sample_ids=ids,
            client=self.dp_client,
            partition_id=partition_id,
            extra_info=extra_info,
            task_name=task_name,
            pad_to_multiple=pad_to_multiple,
            tags=[
                {
                    "rollout_id": o.rollout_id,
                    STATUS_TAG: o.status,
                    FINALIZED_FROM_TAG: origin,
                    FINALIZED_FIELDS_TAG: written,
                }
                for o, origin in zip(outcomes, origins)
            ],
        )
        self._remember(group)
        if self.clear_staged:
            self._clear(receipts, live)
        return meta

    def _remember(self, group: tuple[str, tuple[str, ...]]) -> None:
        self._finalized[group] = None
        while len(self._finalized) > _REMEMBERED_GROUPS:
            self._finalized.popitem(last=False)

    def _clear(self, receipts: list[Any], live: list[int]) -> None:
        """Drop the group's staged rows (idempotent: a retry clears what is left)."""
        self.source.store.clear([row.staging_key for i in live for row in receipts[i].manifest])

    def _already_written(
        self, ids: list[str], partition_id: str, origins: list[str]
    ) -> tuple[list[int], list[str], list[dict[str, Any]]] | None:
        """``(lengths, fields, tags)`` when an earlier attempt wrote exactly this group, else None.

        The group counts as written only when every id is tagged as finalized from the same
        receipt and every column the tags name reads back (a put that stopped part-way
        leaves tags but not every column: its rows are dropped and the group is finalized
        afresh). A missing id (``KeyError``) means a fresh finalize. A store without
        ``get_tags`` cannot tell, and is finalized afresh. Any other read failure raises:
        whether the group was written is unknown, and the caller retries.
        """
        if not hasattr(self.dp_client, "get_tags"):
            return None
        try:
            tags = call_dp(self.dp_client, "get_tags", sample_ids=ids, partition_id=partition_id)
        except KeyError:
            return None
        if len(tags) != len(ids):
            raise StagingReadError(
                f"finalize_group: get_tags returned {len(tags)} rows for {len(ids)} ids"
            )
        if any(t.get(FINALIZED_FROM_TAG) != origin for t, origin in zip(tags, origins)):
            return None
        fields = str(tags[0].get(FINALIZED_FIELDS_TAG, "")).split(",")
        if INPUT_LENGTHS not in fields or any(
            t.get(FINALIZED_FIELDS_TAG) != tags[0].get(FINALIZED_FIELDS_TAG) for t in tags
        ):
            return None
        try:
            td = self._read_back(ids, partition_id, fields)
        except StagingReadError:
            raise  # a short read says nothing about the rows: the caller retries
        except KeyError:
            # A put that stopped part-way: these rows carry this group's own tags and were
            # never handed to anyone, so they are dropped and the group is finalized afresh.
            call_dp(self.dp_client, "clear_samples", sample_ids=ids, partition_id=partition_id)
            return None
        return [int(x) for x in td[INPUT_LENGTHS].tolist()], fields, [dict(t) for t in tags]

    def _read_back(self, ids: list[str], partition_id: str, fields: list[str]) -> Any:
        """Every column of the group's rows, or ``KeyError`` when some row lacks one."""
        td = call_dp(
            self.dp_client,
            "get_samples",
            sample_ids=ids,
            partition_id=partition_id,
            select_fields=fields,
        )
        if tuple(td.batch_size) != (len(ids),):
            raise StagingReadError(
                f"finalize_group: read-back of {len(ids)} finalized rows returned "
                f"{tuple(td.batch_size)}"
            )
        return td

    def _outcome(self, receipt: Any, index: int) -> _Outcome:
        status = _preflight_status(receipt)
        rollout_id = getattr(receipt, "rollout_id", None) or f"rollout-{index}"
        reward = getattr(receipt, "reward", None)
        outcome = _Outcome(rollout_id=rollout_id, reward=0.0 if reward is None else float(reward))
        if status is not None:
            self._poison(outcome, status, "receipt refused before any read")
        return outcome

    def _poison(self, outcome: _Outcome, status: str, detail: str) -> None:
        logger.warning(
            "rollout %s becomes a placeholder row: %s (%s)", outcome.rollout_id, status, detail
        )
        outcome.status, outcome.row, outcome.media = status, None, None

    def _fetch(
        self, receipts: list[Any], outcomes: list[_Outcome], live: list[int]
    ) -> dict[int, list[FetchedStagedCall]]:
        """One batched read for the whole group; on failure, per rollout to isolate the bad ones."""
        keys = {i: [row.staging_key for row in receipts[i].manifest] for i in live}
        try:
            flat = self.source.fetch_for_finalization([k for i in live for k in keys[i]])
        except Exception:  # noqa: BLE001 - any failure: isolate the bad rollouts one by one
            flat = None
        fetched: dict[int, list[FetchedStagedCall]] = {}
        position = 0
        for i in live:
            if flat is not None:
                fetched[i] = flat[position : position + len(keys[i])]
                position += len(keys[i])
                continue
            try:
                fetched[i] = self.source.fetch_for_finalization(keys[i])
            except StagingReadError:
                raise  # unknown, not missing: the caller retries; never a placeholder for it
            except Exception as exc:  # noqa: BLE001 - this rollout becomes a placeholder
                self._poison(outcomes[i], "fetch_failed", f"{type(exc).__name__}: {exc}")
        return fetched

    def _verify(self, receipt: Any, outcome: _Outcome, calls: list[FetchedStagedCall]) -> None:
        try:
            # The source validated these snapshots (digest recomputed over the fetched bytes)
            # a moment ago and they never left this object: hash each call once, not twice.
            snapshots = [call.snapshot for call in calls]
            outcome.row = verify_and_linearize(receipt, snapshots, recompute_digests=False)
            outcome.versions, outcome.ledgered = _row_versions(outcome.row, calls)
        except ReceiptVerificationError as exc:
            self._poison(outcome, exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - a malformed receipt: a placeholder, no crash
            self._poison(outcome, "invalid_snapshot", f"{type(exc).__name__}: {exc}")

    def _attach_media(
        self, outcomes: list[_Outcome], fetched: dict[int, list[FetchedStagedCall]]
    ) -> None:
        """Read the chain's media (one read per frames kind) and attach it to each verified row."""
        wanted: dict[int, list[FetchedStagedCall]] = {}
        for i, outcome in enumerate(outcomes):
            if outcome.row is None:
                continue
            by_call = {call.snapshot.model_call_id: call for call in fetched[i]}
            chain = [by_call[c] for c in outcome.row.model_call_ids]
            wanted[i] = [call for call in chain if call.media_present]
        bundles: dict[str, StagedMediaTensors] = {}
        for frames in (False, True):
            items = [c for calls in wanted.values() for c in calls if c.media_has_frames is frames]
            try:
                bundles.update(zip([c.staging_key for c in items], self.source.fetch_media(items)))
            except Exception as exc:  # noqa: BLE001 - isolate the bad rollouts one by one
                logger.warning("batched media read failed (%s); retrying per rollout", exc)
                for calls in wanted.values():
                    mine = [c for c in calls if c.media_has_frames is frames]
                    try:
                        bundles.update(
                            zip([c.staging_key for c in mine], self.source.fetch_media(mine))
                        )
                    except StagingReadError:
                        raise  # unknown, not missing: the caller retries
                    except Exception as exc:  # noqa: BLE001 - its rows become placeholders below
                        logger.warning("media read failed for one rollout: %s", exc)
        for i, calls in wanted.items():
            if all(c.staging_key in bundles for c in calls):
                outcomes[i].media = [bundles[c.staging_key] for c in calls]
            else:
                self._poison(
                    outcomes[i], "media_fetch_failed", "a staged media row could not be read"
                )

    def _batch(self, outcomes: list[_Outcome]) -> dict[str, torch.Tensor]:
        """The group's columns: jagged per-token rows, per-row scalars, and media when present."""
        rows = [o.row for o in outcomes]

        def column(attr: str, pad: float, dtype: torch.dtype) -> torch.Tensor:
            parts = [torch.tensor(getattr(r, attr) if r else [pad], dtype=dtype) for r in rows]
            return nested_from_lengths(torch.cat(parts), lengths)

        lengths = torch.tensor([len(r.token_ids) if r else 1 for r in rows], dtype=torch.int64)
        batch = {
            INPUT_IDS: column("token_ids", self.pad_token_id, torch.int64),
            TOKEN_MASK: column("token_mask", 0.0, torch.float32),
            GENERATION_LOGPROBS: column("logprobs", 0.0, torch.float32),
            INPUT_LENGTHS: lengths,
            SAMPLE_MASK: torch.tensor([1.0 if r else 0.0 for r in rows], dtype=torch.float32),
        }
        if any(o.ledgered for o in outcomes):
            # The per-token version ledger, aligned with the row (-1 off the generated tokens):
            # written only when a call staged one, so ledger-free groups keep today's columns.
            batch[TOKEN_VERSIONS_FIELD] = nested_from_lengths(torch.tensor(
                [v for o in outcomes for v in (o.versions if o.row else [-1])],
                dtype=torch.int64), lengths)
        if self.reward_field is not None:
            rewards = [o.reward if o.row else 0.0 for o in outcomes]
            batch[self.reward_field] = torch.tensor(rewards, dtype=torch.float32)
        if any(o.media for o in outcomes):
            batch.update(_media_batch(outcomes))
        return batch


def _row_versions(row: LinearizedRow, calls: list[FetchedStagedCall]) -> tuple[list[int], bool]:
    """The version of each position of a linearized row (-1 at carried prompt tokens; each
    generated token's from its call's ledger, else the call's ``weight_version``), and whether
    any call of its chain had a ledger."""
    by_id = {call.snapshot.model_call_id: call for call in calls}
    out: list[int] = []
    ledgered = False
    for call_id, carry, generated in row.link_spans:
        call = by_id[call_id]
        out += [-1] * carry
        if call.token_versions is not None:
            out += call.token_versions
            ledgered = True
        else:
            out += [call.snapshot.weight_version] * generated
    return out, ledgered


def _origin(sample_id: str, receipt: Any, outcome: _Outcome) -> str:
    """What a row is finalized from: its id, rollout, reward and staged keys with digests."""
    rows = [
        [getattr(r, "staging_key", None), getattr(r, "digest", None)]
        for r in getattr(receipt, "manifest", None) or []
    ]
    payload = [sample_id, outcome.rollout_id, outcome.reward, rows]
    text = json.dumps(payload, ensure_ascii=True, default=repr)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _media_batch(outcomes: list[_Outcome]) -> dict[str, torch.Tensor]:
    """Each row's chain media concatenated: patches ``[P_i, F]``, sizes ``[n_i, 2]``, and frame
    counts ``[v_i]`` in which a still image counts as a one-frame item (so the counts always
    partition the sizes). Rows without media hold zero-length rows."""
    reference = next(m for o in outcomes if o.media for m in o.media)
    features, pixel_dtype = reference.imgs.shape[-1], reference.imgs.dtype
    imgs, sizes, frames = [], [], []
    for o in outcomes:
        media = o.media or []
        imgs.append(
            torch.cat([m.imgs[0] for m in media])
            if media
            else torch.zeros(0, features, dtype=pixel_dtype)
        )
        sizes.append(
            torch.cat([m.imgs_sizes.to(torch.int32) for m in media])
            if media
            else torch.zeros(0, 2, dtype=torch.int32)
        )
        counts = [
            m.num_frames.to(torch.int32)
            if m.num_frames is not None
            else torch.ones(m.imgs_sizes.shape[0], dtype=torch.int32)
            for m in media
        ]
        frames.append(torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int32))
    return {
        MEDIA_IMGS_FIELD: _jagged(imgs),
        MEDIA_IMGS_SIZES_FIELD: _jagged(sizes),
        MEDIA_NUM_FRAMES_FIELD: _jagged(frames),
    }


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
    return nested_from_lengths(torch.cat(rows), lengths)

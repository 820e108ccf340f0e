"""Load on the agent endpoint (issue 28): 64 concurrent agent sessions of 4 turns each against
one ``AgentEndpoint`` over ``engine=hf``, with the real ``openai`` client on loopback.

Each session is an agent that chats 4 turns (it sends back the reply it got, as
``messages.append(choice.message)`` does) and closes its rollout with a reward. Checked per
run: every answered call is staged once (lost = answered calls whose row is missing,
duplicated = staged rows no answer names, or a manifest longer than the session's turns;
both must be 0), every turn after the first extends its chain (``token_in``), every rollout is
verified and linearized by ``RolloutReassembler`` and, where ``nemo_gym`` imports, by NeMo Gym
0.7.0's own ``verify_and_linearize``. Timed per call (the endpoint's ``CallTiming``): the
engine call it was batched into, the staging overhead proper (the chain read back from the
store + the record with its digests + ``sink.stage``), templating, and the whole request.

The model is the project's tiny text model (``make tiny-model``'s tokenizer and qwen2 LM,
with room for 4 turns). Run: ``python -m benchmarks.bench_agent_endpoint`` (or
``make bench``).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import Stat, table

SESSIONS, TURNS, RUNS = 64, 4, 3
MAX_TOKENS = 8
PARTITION = "agent_staging"


def tiny_policy(out: Path) -> tuple[object, Path]:
    """``(tokenizer, checkpoint dir)``: the tiny text task's tokenizer and a qwen2 LM with 512
    positions (``make tiny-model``'s module, wherever it lives)."""
    module = None
    for name in ("tq_plugin.rl.tasks.tiny_text", "tq_plugin.rl.tiny_model"):
        try:
            module = importlib.import_module(name)
            break
        except ImportError:
            continue
    if module is None:
        raise RuntimeError("the tiny text task module is not importable")
    rows = module.reverse_rows(200)
    texts = [m["content"] for r in rows for m in r["prompt"]] + [r["answer"] for r in rows]
    tokenizer = module.train_tokenizer(texts + [" Correct.", " Try again."])
    model = module.build_model(tokenizer, max_positions=512)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return tokenizer, out


def one_run(engine: object, tokenizer: object, seed: int) -> dict:
    import openai  # noqa: F401 - the endpoint's client

    from tq_plugin.data_plane import LocalDataPlane
    from tq_plugin.rollout import AgentEndpoint
    from tq_plugin.staging import RolloutReassembler
    from tq_plugin.staging.factory import build_token_sink

    dp = LocalDataPlane()
    sink = build_token_sink(dp, staging_partition=PARTITION)
    endpoint = AgentEndpoint(engine, sink, tokenizer, max_model_len=512,
                             default_max_tokens=MAX_TOKENS, seed=seed)
    endpoint.start()
    letters = "abcde"

    async def session(i: int) -> tuple[object, list[dict]]:
        rid = endpoint.open_rollout(f"bench{seed}-s{i}")
        messages: list = []
        staged = []
        async with endpoint.client(rid) as client:
            for turn in range(TURNS):
                text = ("reverse: " + " ".join(letters[(i + k) % 5] for k in range(3))
                        if turn == 0 else " Try again.")
                messages.append({"role": "user", "content": text})
                r = await client.chat.completions.create(model="policy", messages=messages,
                                                         max_tokens=MAX_TOKENS, temperature=1.0)
                staged.append(r.model_extra["tq_staging"])
                messages.append(r.choices[0].message)
        receipt = await endpoint.aclose_rollout(rid, reward=float(i % 2))
        return receipt, staged

    async def load() -> list:
        return await asyncio.gather(*(session(i) for i in range(SESSIONS)))

    start = time.perf_counter()
    results = asyncio.run(load())
    wall = time.perf_counter() - start
    endpoint.stop()
    receipts = [r for r, _ in results]
    answered = [s["staging_key"] for _, staged in results for s in staged]
    rows = set(dp.list_sample_ids(partition_id=PARTITION))
    lost = sum(1 for k in answered if k not in rows)
    duplicated = len(rows - set(answered)) + len(answered) - len(set(answered)) + \
        sum(max(0, len(r.manifest) - TURNS) for r in receipts)
    extends = sum(1 for _, staged in results for s in staged[1:]
                  if s["continuation"] == "extend" and s["mode"] == "token_in")
    gym_ok = gym_verify(dp, receipts)
    dp.register_partition("train", fields=[])
    meta = RolloutReassembler(dp, staging_partition=PARTITION).finalize_group(
        receipts, partition_id="train")
    verified = sum(1 for t in meta.tags if t["staging_status"] == "ok")
    timings = list(endpoint.timings)
    return {"wall": wall, "lost": lost, "duplicated": duplicated, "verified": verified,
            "gym": gym_ok, "extends": extends, "calls": len(answered),
            "staged": endpoint.stats().get("calls_staged", 0), "timings": timings}


def gym_verify(dp: object, receipts: list) -> int | None:
    """Rollouts NeMo Gym's ``verify_and_linearize`` accepts (None where Gym does not import)."""
    try:
        gym = importlib.import_module("nemo_gym.token_id_capture.staging")
    except Exception:  # noqa: BLE001 - a machine without nemo-gym
        return None
    from tq_plugin.staging import TQTokenSource

    source = TQTokenSource(dp, staging_partition=PARTITION)  # Gym's snapshot class, Gym loaded
    ok = 0
    for receipt in receipts:
        snapshots = source.fetch([row.staging_key for row in receipt.manifest])
        gym.verify_and_linearize(gym.RolloutReceipt.model_validate(receipt.model_dump()),
                                 snapshots)
        ok += 1
    return ok


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> dict:
    import torch

    from tq_plugin.rollout.engines.hf import HFEngine

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, ckpt = tiny_policy(Path(tmp) / "model")
        engine = HFEngine(ckpt)
        runs = [one_run(engine, tokenizer, seed) for seed in range(RUNS)]
        engine.close()
    expected = SESSIONS * TURNS
    for run in runs:
        assert run["calls"] == expected == run["staged"], run
        assert run["lost"] == 0 and run["duplicated"] == 0, run
        assert run["verified"] == SESSIONS and run["gym"] in (None, SESSIONS), run
        assert run["extends"] == SESSIONS * (TURNS - 1), run

    def stat(fn) -> Stat:
        return Stat.of([fn(r) for r in runs])

    figures = {
        "engine call (the batched generate)": lambda t: t.engine_s,
        "**staging work** (chain read-back + record + sink.stage)": lambda t: t.staging_s,
        "of which record (digests) + sink.stage": lambda t: t.stage_s,
        "of which chain read-back (ChainPrefixCache)": lambda t: t.prefix_s,
        "staging wall time (waiting for a staging thread included)": lambda t: t.staging_wall_s,
        "templating + tokenizing": lambda t: t.template_s,
        "whole request (queueing for the engine included)": lambda t: t.total_s,
    }
    rows = []
    for label, get in figures.items():
        rows.append([label,
                     stat(lambda r, g=get: pct([g(t) for t in r["timings"]], 50)).fmt(",.2f"),
                     stat(lambda r, g=get: pct([g(t) for t in r["timings"]], 99)).fmt(",.2f")])
    share = stat(lambda r: 100 * statistics.median(t.staging_s / t.engine_s for t in r["timings"]))
    batch = stat(lambda r: statistics.mean(t.batch_size for t in r["timings"]))
    calls_s = stat(lambda r: r["calls"] / r["wall"])
    gym = runs[0]["gym"]
    checks = table(
        ["per run", "figure"],
        [["sessions x turns (answered calls)", f"{SESSIONS} x {TURNS} = {expected}"],
         ["staged calls", f"{runs[0]['staged']} each run"],
         ["lost / duplicated staged calls", "**0 / 0** in every run"],
         ["turns staged as token_in extensions of their chain",
          f"{SESSIONS * (TURNS - 1)} of {SESSIONS * (TURNS - 1)}"],
         ["rollouts verified by RolloutReassembler", f"{SESSIONS} of {SESSIONS}"],
         ["rollouts verified by NeMo Gym 0.7.0 verify_and_linearize",
          "nemo_gym not importable" if gym is None else f"{gym} of {SESSIONS}"],
         ["calls / s through the endpoint", calls_s.fmt(",.0f")],
         ["requests per engine call (mean batch)", batch.fmt(",.1f")]])
    markdown = "\n\n".join([
        "## Agent endpoint under load (`bench_agent_endpoint`)",
        (f"{SESSIONS} concurrent agent sessions x {TURNS} chat turns against one `AgentEndpoint` "
         f"(`engine=hf`, the tiny text model, `max_tokens={MAX_TOKENS}`, one torch thread, "
         "LocalDataPlane), through the `openai` client on loopback (clients and endpoint in one "
         "process); each session sends back the reply it got and closes its rollout with a "
         f"reward. {RUNS} runs, each figure the median (min–max) over runs; load average "
         f"{load:.1f} when it started (2 cores)."),
        checks,
        ("Per call, milliseconds (p50 / p99 within a run; median (min–max) over runs). The "
         "engine call is the batched `generate` the call was part of; the staging work is what "
         "staging adds to a plain OpenAI server, all before the answer is sent: the chain read "
         "back from the store, the record with its digests, and `sink.stage` (timed on the "
         "staging thread); its wall time adds the wait for one of the endpoint's 4 staging "
         "threads, which a whole batch's calls reach at once."),
        table(["per call", "p50 ms", "p99 ms"], rows),
        (f"Staging work / engine call, median per call: {share.fmt(',.1f')} %. The engine "
         "calls are batched (requests queue while the engine runs), so a request's whole time "
         "also holds the wait for its batch. The tiny model makes the engine call short; with "
         "a real model the engine call grows and the staging work does not."),
    ])
    print(markdown)
    return {"markdown": markdown, "runs": [{k: v for k, v in r.items() if k != "timings"}
                                           for r in runs]}


if __name__ == "__main__":
    main()

"""Reliability figures for ``benchmarks/RESULTS.md``: what the fault-injection and fuzz tests
print, re-run here so the recorded figures come from the same command CI runs.

* Fault injection (``tests/test_fault_injection.py``): 1,000 randomized fault schedules each over
  token staging (sink, source, reassembler), column I/O and the Lightning callback.
* Fuzzing (Hypothesis): records/admissions/media, metas, ``shard_meta_for_dp``, column I/O and
  Hydra overrides; per test, how the examples ended.
* The store's stateful model-based test (``tests/data_plane/test_store_state_machine.py``) on
  its ``long`` profile over every backend: examples run and rules exercised.

Run: ``python -m benchmarks.run_all reliability``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ["tests/test_fault_injection.py"]
STATE_MACHINE = "tests/data_plane/test_store_state_machine.py"
FUZZ = [
    "tests/staging/test_fuzz.py",
    "tests/data_plane/test_fuzz_meta.py",
    "tests/data_plane/test_column_io_reliability.py",
    "tests/config/test_fuzz_overrides.py",
]


def _pytest(paths: list[str], *extra: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *extra, *paths],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"reliability tests failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def main() -> dict:
    faults = _pytest(FAULTS)
    blocks = re.findall(r"^== .*?(?=^\S|\Z)", faults, flags=re.MULTILINE | re.DOTALL)
    fuzz = _pytest(FUZZ, "-k", "fuzz or Model", "--hypothesis-show-statistics")
    machine = _pytest([STATE_MACHINE], "-k", "dict_model", env={"TQ_STATE_MACHINE_PROFILE": "long"})
    rules = re.findall(r"state machine \[(\w+)\]: (\d+) examples, (\d+) rules: (.*)$", machine,
                       flags=re.MULTILINE)
    stats = []
    for test, body in re.findall(r"^(tests/\S+::\S+):\n(.*?)(?=^tests/|\Z)", fuzz, flags=re.MULTILINE | re.DOTALL):
        lines = [ln.strip() for ln in body.splitlines() if ln.strip().startswith(("- ", "* "))]
        ran = next((ln for ln in lines if "passing" in ln), "")
        outcomes = [ln[2:] for ln in lines if "%" in ln
                    and not any(w in ln for w in ("Retried draw", "gave up", "Aborted"))]
        stats.append(f"| `{test.split('::')[1]}` | {ran[2:]} | {'; '.join(outcomes) or '—'} |")
    md = "\n".join([
        "### Reliability: fault injection and fuzzing",
        "",
        ("Fault injection: a test-only client fails on command (before, part-way through and after "
        "a put; on a get, by raising or by a short result; on a clear). Every invariant held in "
        "every schedule (a violation fails the test); the figures the test prints:"),
        "",
        "```",
        *[b.rstrip() for b in blocks],
        "```",
        "",
        ("Fuzzing (Hypothesis): each example ends in one documented exception naming the field, "
        "with the store unchanged, or succeeds and reads back what was written."),
        "",
        "| test | examples | how they ended |",
        "|---|---|---|",
        *stats,
        "",
        ("The store against a dict model (`test_store_state_machine.py`, `long` profile): after "
         "every rule the store equals the model byte for byte, and every refused call changed "
         "nothing."),
        "",
        "| backend | examples | rules run | rules, by kind |",
        "|---|---|---|---|",
        *[f"| {b} | {x} | {n} | {kinds} |" for b, x, n, kinds in rules],
    ])
    print(md)
    return {"markdown": md}


if __name__ == "__main__":
    main()

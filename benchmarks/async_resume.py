"""The resume figures of ``benchmarks/RESULTS.md``'s reliability part: the slow test
``tests/rl/topology/test_async_resume.py`` run once, the lines it prints gathered.

A GRPO run on ``tq/backend=ray`` (2 rollout workers, ``max_staleness=1``, ``checkpoint_every=2``)
is stopped inside step 3 by SIGTERM and resumed to 6 steps, and, with in-flight weight updates
on, SIGTERMed in step 2, resumed, SIGKILLed in step 4 and resumed; each line says how many
prompt groups were checked (each trained exactly once across the two runs, in the uninterrupted
run's steps) and how long the resumed run took. Then ``tests/rl/topology/test_journal_resume.py``:
the same topology on a journaled store (``tq.backend.journal_dir``, ``checkpoint_every=3``),
SIGKILLed as step 5 starts and resumed to 8 steps, its line the rollouts recovered and
generated twice (goal 0), the calls staged twice, and the step time the kill threw away.

Run: ``python -m benchmarks.run_all async_resume``.
"""

from __future__ import annotations

import re
import time

from benchmarks.reliability import _pytest

TEST = "tests/rl/topology/test_async_resume.py"
JOURNAL_TEST = "tests/rl/topology/test_journal_resume.py"


def main() -> dict:
    t0 = time.monotonic()
    out = _pytest([TEST])
    seconds = time.monotonic() - t0
    # after a "." or not; the in-flight run's line keeps its label
    lines = [f"{label}{line}" for label, line in re.findall(
        r"\[async resume(, in-flight)?\] (.*)$", out, flags=re.MULTILINE)]
    lines = [line.replace(", in-flight", "with in-flight weight updates: ", 1) for line in lines]
    t1 = time.monotonic()
    journal_out = _pytest([JOURNAL_TEST])
    journal_seconds = time.monotonic() - t1
    journal_lines = re.findall(r"\[journal resume\] (.*)$", journal_out, flags=re.MULTILINE)
    md = "\n".join([
        "### Reliability: killed asynchronous runs resume",
        "",
        (f"`{TEST}` (slow tier; {seconds:.0f} s for the file: an uninterrupted run, a SIGTERM "
         "and its resume, and a run with `recipe.inflight_updates=true` SIGTERMed, resumed, "
         "SIGKILLed and resumed again): "
         "`tq-train --config-name grpo tq/backend=ray recipe.topology=disaggregated "
         "recipe.rollout_workers=2 recipe.max_staleness=1 recipe.checkpoint_every=2` (4 prompts "
         "of 4 rollouts a step, 2 optimizer steps each), stopped inside step 3 and resumed with "
         "`ckpt_path` to 6 steps; no process of any run is left behind 30 s after it ends."),
        "",
        *[f"- {line}" for line in lines],
        "",
        (f"On a journaled store (`{JOURNAL_TEST}`, {journal_seconds:.0f} s: the same command with "
         "`tq.backend.journal_dir=<dir> recipe.checkpoint_every=3 recipe.num_steps=8`, killed as "
         "step 5 starts, resumed with `ckpt_path`; docs/durability.md):"),
        "",
        *[f"- {line}" for line in journal_lines],
    ])
    print(md)
    return {"markdown": md}


if __name__ == "__main__":
    main()

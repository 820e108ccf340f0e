"""The staging package never imports NeMo-Gym on its own, and hands back its own classes then."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_staging_without_gym_in_use_returns_our_classes_and_never_imports_gym() -> None:
    script = textwrap.dedent(
        """
        import sys
        from tq_plugin.data_plane import LocalDataPlane
        from tq_plugin import staging

        dp = LocalDataPlane()
        staging.register_staging_partition(dp, "s")
        admission = staging.CaptureAdmission(rollout_id="r", model_call_id="c", mode="text")
        record = staging.make_staged_call_record(
            admission, prompt_ids=[1], generated_ids=[2], generated_logprobs=[-0.5],
            weight_version=0,
        )
        result = staging.TQTokenSink(dp, staging_partition="s").stage(record)
        (snapshot,) = staging.TQTokenSource(dp, staging_partition="s").fetch(["r/c"])
        assert type(result) is staging.StageResult and result.ok, result
        assert type(snapshot) is staging.StagedCallBaseSnapshot
        assert "nemo_gym" not in sys.modules
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr

"""Logger factories the ``logger`` group names where a YAML node alone cannot say it.

``logger=mlflow`` keeps its store inside the run dir: MLflow 3 refuses its file store unless
``MLFLOW_ALLOW_FILE_STORE`` is set (a database store needs the full ``mlflow`` package and its
SQL stack), so the factory sets it for a ``file:`` store and leaves any other URI alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def mlflow_logger(save_dir: str, *, experiment_name: str = "tq_plugin",
                  tracking_uri: str | None = None, run_name: str | None = None,
                  **kwargs: Any) -> Any:
    """Lightning's ``MLFlowLogger`` over ``tracking_uri``, by default a file store at
    ``<save_dir>/mlruns`` (nothing leaves the machine)."""
    try:
        import mlflow  # noqa: F401
        from lightning.pytorch.loggers import MLFlowLogger
    except ImportError as exc:
        raise ImportError("logger=mlflow needs mlflow: pip install 'tq_plugin[mlflow]'") from exc
    uri = tracking_uri or (Path(save_dir) / "mlruns").resolve().as_uri()
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MLFlowLogger(experiment_name=experiment_name, run_name=run_name, tracking_uri=uri,
                        save_dir=save_dir, **kwargs)


__all__ = ["mlflow_logger"]

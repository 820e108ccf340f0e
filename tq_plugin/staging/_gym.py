"""NeMo-Gym's own record classes, when a Gym process is using this package.

Gym's capture checks the class of a sink's result and its verifier the class of a source's
snapshots, so a drop-in must hand back Gym's classes there. Those are looked up only when
``nemo_gym`` has already been imported in this process (a Gym worker or trainer always has
imported it), lazily and guarded: importing Gym has process-wide side effects, so this
package never imports it on its own.
"""

from __future__ import annotations

import sys
from typing import Any

_RECORDS_MODULE = "nemo_gym.token_id_capture.staging.records"


def gym_record_class(name: str) -> type[Any] | None:
    """Gym's record class ``name`` if ``nemo_gym`` is in use in this process, else None."""
    if "nemo_gym" not in sys.modules:
        return None
    module = sys.modules.get(_RECORDS_MODULE)
    if module is None:
        try:
            import importlib

            module = importlib.import_module(_RECORDS_MODULE)
        except Exception:  # noqa: BLE001 - a broken Gym install: fall back to our classes
            return None
    return getattr(module, name, None)


def is_gym_instance(value: Any, name: str) -> bool:
    """Whether ``value`` is an instance of Gym's class ``name`` (or a subclass), by MRO."""
    return any(
        cls.__name__ == name and cls.__module__.startswith("nemo_gym")
        for cls in type(value).__mro__
    )

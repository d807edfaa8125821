"""silo_pfl: personalized federated learning across silos, on Ray.

The public names are imported lazily, so `import silo_pfl.config` stays light.
"""

from typing import Any

__all__ = ["Federation", "FederationConfig", "FederationResult", "load_config"]
__version__ = "0.1.0"

_LOCATIONS = {
    "Federation": "silo_pfl.federation",
    "FederationConfig": "silo_pfl.config",
    "FederationResult": "silo_pfl.results",
    "load_config": "silo_pfl.settings",
}


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        import importlib

        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'silo_pfl' has no attribute {name!r}")

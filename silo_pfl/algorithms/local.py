"""Local training only: the no-federation baseline. Nothing leaves a silo."""

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm
from silo_pfl.config import FederationConfig
from silo_pfl.errors import ConfigError


@register
class Local(Algorithm):
    """Every key is local, so each silo trains alone on its own data."""

    name = "local"
    default_local_rules = ("all",)
    needs_global_keys = False
    needs_local_keys = True

    def check_config(self, cfg: FederationConfig) -> None:
        super().check_config(cfg)
        if cfg.split.local is not None and list(cfg.split.local) != ["all"]:
            raise ConfigError(
                f"split.local: got {list(cfg.split.local)}, but algorithm local keeps every key "
                "on its silo; drop split.local (or set it to [all]), or choose an algorithm that "
                "shares some keys, such as fedper"
            )

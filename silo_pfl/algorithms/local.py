"""Local training only: the no-federation baseline. Nothing leaves a silo."""

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm


@register
class Local(Algorithm):
    """Every key is local, so each silo trains alone on its own data."""

    name = "local"
    default_local_rules = ("all",)
    needs_global_keys = False
    needs_local_keys = True

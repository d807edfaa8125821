"""FedBN (Li et al., 2021): BatchNorm parameters and running statistics stay on each silo."""

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm


@register
class FedBN(Algorithm):
    """FedAvg over everything but BatchNorm, which each silo keeps for its own feature shift."""

    name = "fedbn"
    default_local_rules = ("batchnorm",)
    needs_local_keys = True

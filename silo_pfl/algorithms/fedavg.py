"""FedAvg (McMahan et al., 2017): every key is global; the baseline every hook defaults to."""

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm


@register
class FedAvg(Algorithm):
    """Local SGD on the whole model, then a weighted mean of the updates."""

    name = "fedavg"

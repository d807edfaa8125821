"""FedAvgM (Hsu et al., 2019), FedAdam, FedYogi and FedAdagrad (Reddi et al., 2021): FedAvg with
a server optimizer over each round's mean update, with momentum or adaptive. Any algorithm
combines with one through server.optimizer (e.g. fedper with server.optimizer=adam); these names
fix it for fedavg."""

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm


@register
class FedAvgM(Algorithm):
    """fedavg with server.optimizer=momentum."""

    name = "fedavgm"
    server_optimizer = "momentum"


@register
class FedAdam(Algorithm):
    """fedavg with server.optimizer=adam."""

    name = "fedadam"
    server_optimizer = "adam"


@register
class FedYogi(Algorithm):
    """fedavg with server.optimizer=yogi."""

    name = "fedyogi"
    server_optimizer = "yogi"


@register
class FedAdagrad(Algorithm):
    """fedavg with server.optimizer=adagrad."""

    name = "fedadagrad"
    server_optimizer = "adagrad"

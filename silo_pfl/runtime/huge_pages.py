"""numpy's transparent huge page advice, turned off in the silo and server workers.

numpy asks the kernel (madvise MADV_HUGEPAGE) to back every new array of 4 MB or more with 2 MB
pages. Where the kernel takes that advice at the fault, as on these VMs, the first touch of a
fresh large array now and then stalls for a tenth of a second or more: a masked update, the
server's sums, made anew every round. Without the advice such an array costs its ordinary page
faults, every time (docs/BENCHMARKS.md, "Huge pages"). An operator's own NUMPY_MADVISE_HUGEPAGE
in the environment wins: numpy then does as it says.
"""

from __future__ import annotations

import os

try:
    from numpy._core import multiarray
except ImportError:  # numpy 1.x
    from numpy.core import multiarray

ENV = "NUMPY_MADVISE_HUGEPAGE"


def set_advice(on: bool) -> bool | None:
    """Turn numpy's huge page advice on or off for the arrays this process makes from now on;
    returns the setting it replaced (None where numpy has no such switch)."""
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    return None if setter is None else bool(setter(on))


def no_advice() -> None:
    """Stop numpy advising huge pages in this process, unless the environment says otherwise."""
    if ENV not in os.environ:
        set_advice(False)

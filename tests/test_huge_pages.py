"""The silo and server workers make their large arrays without numpy's huge page advice, unless
the operator's NUMPY_MADVISE_HUGEPAGE says otherwise. Each case runs in a fresh process, whose
numpy starts with its own default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
from silo_pfl.runtime.actors import SiloHost
from silo_pfl.runtime.huge_pages import set_advice
from silo_pfl.runtime.server_host import ServerHost
before = set_advice(True)
{host}()
print(before, set_advice(True))
"""


def advice(host: str, env_value: str | None) -> tuple[str, str]:
    """numpy's huge page advice in a fresh process before and after it makes `host`."""
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env_value is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(host=host)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    before, after = out.stdout.split()
    return before, after


@pytest.mark.parametrize("host", ["SiloHost", "ServerHost"])
def test_a_worker_host_turns_numpys_huge_page_advice_off(host):
    before, after = advice(host, None)
    if before != "True":
        pytest.skip("numpy gives no huge page advice on this machine: nothing to turn off")
    assert after == "False"


@pytest.mark.parametrize("host", ["SiloHost", "ServerHost"])
def test_the_operators_numpy_madvise_hugepage_wins(host):
    assert advice(host, "1") == ("True", "True")

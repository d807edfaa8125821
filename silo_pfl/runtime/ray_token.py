"""Ray's default authentication token for a local instance, made once and whole.

A first local `ray.init` with token authentication on writes ~/.ray/auth_token when no token is
set, in place and unlocked: two local starts at once (two runs, or `silo-pfl compare`'s workers)
can each write their own and leave one cluster refusing its own processes. Making the file here
first, by `create_once`, gives every racing start the same token.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from silo_pfl.create_once import create_once


def default_token_path() -> Path:
    """Where Ray looks for its token when neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set."""
    return Path.home() / ".ray" / "auth_token"


def ensure_local_token() -> None:
    """With token authentication on (RAY_AUTH_MODE unset or `token`) and no token set, make
    ~/.ray/auth_token as Ray would: 256 random bits in hex."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = default_token_path()
    if not path.exists():
        create_once(path, secrets.token_hex(32).encode("ascii"))

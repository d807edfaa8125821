"""The single place that decides which state_dict keys are global (shared) and which are local.

A split is computed once per silo from the model and the declarative rules, and every payload that
leaves a silo passes `Split.outgoing`, which refuses any local key.

Rules (a key is local if any rule matches it):
  head          the classifier head
  batchnorm     every BatchNorm module, its affine parameters and running statistics
  adapters      every Adapter module (model.adapter_dim > 0)
  all           every key: no federation
  last:K        the last K blocks (see models.blocks)
  first:K       the first K blocks
  pattern:GLOB  keys matching a shell-style pattern, e.g. pattern:body.conv1.*
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

from silo_pfl.errors import ConfigError
from silo_pfl.models import Adapter, BodyHeadModel, block_of, blocks

RULE_HELP = "head, batchnorm, adapters, all, last:K, first:K or pattern:GLOB"


class PrivacyError(RuntimeError):
    """A payload about to leave a silo holds a local key: a bug, never a user error."""


@dataclass(frozen=True)
class Rule:
    """One parsed split rule."""

    kind: str
    arg: str = ""
    index: int = 0

    @property
    def key(self) -> str:
        return f"split.local[{self.index}]"

    @property
    def text(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


def parse_rules(rules: Sequence[str]) -> list[Rule]:
    """Parse rule strings, raising a ConfigError that names the bad entry."""
    parsed = []
    for i, text in enumerate(rules):
        kind, _, arg = str(text).partition(":")
        key = f"split.local[{i}]"
        if kind in ("head", "batchnorm", "adapters", "all") and not arg:
            parsed.append(Rule(kind, "", i))
        elif kind in ("last", "first"):
            if not arg.isdigit() or int(arg) < 1:
                raise ConfigError(f"{key}: got {text!r}, expected {kind}:K with K >= 1")
            parsed.append(Rule(kind, arg, i))
        elif kind == "pattern" and arg:
            parsed.append(Rule(kind, arg, i))
        else:
            raise ConfigError(f"{key}: got {text!r}, expected one of {RULE_HELP}")
    return parsed


def _matches(rule: Rule, keys: list[str], model: BodyHeadModel) -> set[str]:
    owner = block_of(model)
    order = blocks(model)

    def block(key: str) -> str:
        parts = key.split(".")
        return owner.get(".".join(parts[:2]), "head")

    if rule.kind == "all":
        return set(keys)
    if rule.kind == "head":
        return {k for k in keys if k.startswith("head.")}
    if rule.kind in ("batchnorm", "adapters"):
        kind = nn.modules.batchnorm._BatchNorm if rule.kind == "batchnorm" else Adapter
        prefixes = [name + "." for name, m in model.named_modules() if isinstance(m, kind)]
        return {k for k in keys if any(k.startswith(prefix) for prefix in prefixes)}
    if rule.kind in ("last", "first"):
        k = int(rule.arg)
        if k > len(order):
            raise ConfigError(
                f"{rule.key}: {rule.kind}:{k} asks for more blocks than the model has "
                f"({len(order)}: {', '.join(order)})"
            )
        chosen = set(order[-k:] if rule.kind == "last" else order[:k])
        return {key for key in keys if block(key) in chosen}
    return {k for k in keys if fnmatch.fnmatchcase(k, rule.arg)}


@dataclass(frozen=True)
class Split:
    """Global and local state_dict keys of one model, with their sizes."""

    global_keys: tuple[str, ...]
    local_keys: tuple[str, ...]
    global_parameters: int
    local_parameters: int
    global_bytes: int
    rules: tuple[str, ...] = ()  # the split.local rules that made it

    def global_part(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The global entries of a state mapping."""
        return {k: state[k] for k in self.global_keys}

    def outgoing(
        self,
        payload: dict[str, np.ndarray],
        extras: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    ) -> dict[str, np.ndarray]:
        """Check a payload, and every named extra sent with it, before it leaves the silo: each
        holds exactly the global keys, no local key."""
        for name, values in [("", payload), *sorted((extras or {}).items())]:
            where = f" in {name}" if name else ""
            leaked = sorted(set(values) & set(self.local_keys))
            if leaked:
                raise PrivacyError(f"refusing to send local keys{where}: {', '.join(leaked)}")
            if set(values) != set(self.global_keys):
                unknown = sorted(set(values) ^ set(self.global_keys))
                raise PrivacyError(
                    f"payload keys{where} differ from the global keys: {', '.join(unknown)}"
                )
        return payload


def compute_split(model: BodyHeadModel, rules: Sequence[str]) -> Split:
    """Decide, for every state_dict key (buffers included), whether it is global or local."""
    state = model.state_dict()
    keys = list(state)
    local: set[str] = set()
    for rule in parse_rules(rules):
        matched = _matches(rule, keys, model)
        if not matched:
            hint = " (set model.adapter_dim > 0)" if rule.kind == "adapters" else ""
            raise ConfigError(
                f"{rule.key}: rule {rule.text!r} matches no state_dict key of this model{hint}"
            )
        local |= matched
    param_names = {name for name, _ in model.named_parameters()}

    def count(selected: list[str]) -> int:
        return sum(state[k].numel() for k in selected if k in param_names)

    global_keys = [k for k in keys if k not in local]
    local_keys = [k for k in keys if k in local]
    return Split(
        global_keys=tuple(global_keys),
        local_keys=tuple(local_keys),
        global_parameters=count(global_keys),
        local_parameters=count(local_keys),
        global_bytes=sum(state[k].numel() * state[k].element_size() for k in global_keys),
        rules=tuple(str(rule) for rule in rules),
    )


def check_split(split: Split, algorithm: str, needs_global: bool, needs_local: bool) -> None:
    """Raise a one-line ConfigError if the split leaves no global keys, or no local keys, where
    the algorithm's procedure needs them."""
    rules = f"split.local=[{', '.join(split.rules)}]"
    if needs_global and not split.global_keys:
        raise ConfigError(
            f"split.local: {rules} leaves no global keys, so algorithm {algorithm} has nothing "
            "to federate; keep some keys global (e.g. split.local=[head]), or use "
            "algorithm.name=local to train each silo alone"
        )
    if needs_local and not split.local_keys:
        raise ConfigError(
            f"split.local: {rules} leaves no local keys, but algorithm {algorithm} trains or keeps "
            "personal (local) keys; name some (e.g. split.local=[head]), or use an algorithm "
            "without them, e.g. algorithm.name=fedavg"
        )

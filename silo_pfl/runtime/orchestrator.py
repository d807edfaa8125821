"""The round loop, written once. It never branches on an algorithm's name.

One round: the global state is one object in Ray's object store; every silo fits on it and
returns a delta of the global keys, which goes straight to the server actor (never through the
driver); the server aggregates; every silo evaluates its personalized model on the new state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.data import silo_names
from silo_pfl.errors import FederationError
from silo_pfl.messages import EvalMetrics, FitMetrics, SiloInfo, SiloOutcome, SplitInfo
from silo_pfl.results import FederationResult, RoundSummary, SiloResult
from silo_pfl.runtime.actors import get, start_server, start_silo, stop
from silo_pfl.runtime.placement import (
    LABEL_WAIT_SECONDS,
    check_labels,
    server_selector,
    silo_selector,
)
from silo_pfl.runtime.session import ray_session
from silo_pfl.selection import Selector

GLOBAL_STATE_FILE = "global_state.npz"


def _model_shape(infos: Sequence[SiloInfo]) -> tuple[tuple[int, ...], int]:
    """The input shape every silo shares, and the number of classes over all silos."""
    first = infos[0]
    for info in infos[1:]:
        if info.input_shape != first.input_shape:
            raise FederationError(
                f"silo {info.silo}: inputs of shape {info.input_shape}, but silo {first.silo} "
                f"has {first.input_shape}; every silo must share one feature layout"
            )
    return first.input_shape, max(info.num_classes for info in infos)


def _finite_mean(values: Sequence[float]) -> float:
    """Mean of the finite values; NaN when there are none (no training, no validation rows)."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def _summary(
    round_: int, seconds: float, fits: list[FitMetrics], evals: list[EvalMetrics]
) -> RoundSummary:
    per_silo = {
        f.silo: {
            "train_loss": f.train_loss,
            "train_seconds": f.train_seconds,
            "bytes_sent": float(f.bytes_sent),
            "val_accuracy": e.val_accuracy,
            "test_accuracy": e.test_accuracy,
        }
        for f, e in zip(fits, evals, strict=True)
    }
    return RoundSummary(
        round=round_,
        seconds=seconds,
        mean_train_loss=_finite_mean([f.train_loss for f in fits]),
        mean_val_accuracy=_finite_mean([e.val_accuracy for e in evals]),
        mean_test_accuracy=float(np.mean([e.test_accuracy for e in evals])),
        silos=per_silo,
    )


class Orchestrator:
    """Runs one federation on Ray and returns its typed result."""

    def __init__(self, cfg: FederationConfig, callbacks: Sequence[Callback] = ()) -> None:
        self.cfg = cfg
        self.callbacks = list(callbacks)

    @property
    def timeout(self) -> float:
        """How long any remote step may take (round.timeout_s)."""
        return self.cfg.round.timeout_s

    def _each(self, silos: dict[str, Any], method: str, what: str, *args: Any) -> list[Any]:
        """Call `method` on every silo actor and wait, bounded; a late silo is named."""
        refs = [getattr(actor, method).remote(*args) for actor in silos.values()]
        return get(refs, what, self.timeout, [f"silo {name}" for name in silos])

    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def run(self) -> FederationResult:
        """Set up every silo and the server, run the rounds, collect each silo's outcome."""
        with ray_session(self.cfg.ray):
            start = time.perf_counter()
            config = to_dict(self.cfg)
            names = silo_names(self.cfg.data)
            actors: dict[str, Any] = {}
            selectors = {f"silo {n}": silo_selector(self.cfg, n) for n in names}
            check_labels({**selectors, "the server": server_selector(self.cfg)}, LABEL_WAIT_SECONDS)
            try:
                for name in names:
                    actors[name] = start_silo(self.cfg, config, name)
                infos = self._each(actors, "setup", "silo set-up")
                input_shape, num_classes = _model_shape(infos)
                public_keys = {i.silo: i.public_key for i in infos if i.public_key}
                split: SplitInfo = self._each(
                    actors, "build", "silo model", input_shape, num_classes, public_keys
                )[0]
                server = start_server(self.cfg, config, input_shape, num_classes)
                actors["__server__"] = server
                self._emit("on_start", self.cfg, infos, split)
                exporting = self._attach_exporters(infos, actors)
                history = self._rounds(server, {n: actors[n] for n in names})
                silos = {n: actors[n] for n in names}
                outcomes: list[SiloOutcome] = self._each(silos, "outcome", "silo outcome")
                state = get(server.state_bytes.remote(), "the server's global state", self.timeout)
                state_path = self._save_global(state)
                server_node = get(server.node_id.remote(), "the server's node", self.timeout)
                self._export(exporting, actors)
            finally:
                stop(list(actors.values()))
            result = FederationResult(
                name=self.cfg.name,
                algorithm=self.cfg.algorithm["name"],
                rounds=self.cfg.rounds,
                seed=self.cfg.seed,
                wall_seconds=time.perf_counter() - start,
                global_parameters=split.global_parameters,
                local_parameters=split.local_parameters,
                silos={
                    info.silo: SiloResult(
                        test_accuracy=out.test_accuracy,
                        val_accuracy=out.val_accuracy,
                        selected_round=out.selected_round,
                        final_test_accuracy=out.final_test_accuracy,
                        num_train=info.num_train,
                        num_val=info.num_val,
                        num_test=info.num_test,
                        bytes_sent_per_round=split.bytes_sent_per_round,
                        node_id=info.node_id,
                    )
                    for info, out in zip(infos, outcomes, strict=True)
                },
                history=history,
                global_state_path=state_path,
                server_node_id=server_node,
                extras={k: v for callback in self.callbacks for k, v in callback.extras().items()},
            )
        self._emit("on_end", result)
        return result

    def _save_global(self, npz: bytes) -> str:
        """Write the server's global keys, received as bytes, on the driver's own disk."""
        path = Path(self.cfg.output_dir) / self.cfg.name / "server" / GLOBAL_STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(npz)
        return str(path.resolve())

    def _attach_exporters(self, infos: Sequence[SiloInfo], actors: dict[str, Any]) -> list[str]:
        """Hand each callback's per-silo exporters to their silos, which check them now."""
        per_silo: dict[str, dict[str, Any]] = {}
        for index, callback in enumerate(self.callbacks):
            for silo, exporter in callback.exporters(infos).items():
                if silo not in {info.silo for info in infos}:
                    raise FederationError(
                        f"{type(callback).__name__}: an exporter for {silo!r}, not a silo here"
                    )
                per_silo.setdefault(silo, {})[str(index)] = exporter
        refs = [actors[s].attach.remote(e) for s, e in per_silo.items()]
        get(refs, "silo exporter check", self.timeout, [f"silo {s}" for s in per_silo])
        return list(per_silo)

    def _export(self, silos: list[str], actors: dict[str, Any]) -> None:
        """Each silo runs its exporters in its own process; receipts go back to their callbacks."""
        done = self._each({s: actors[s] for s in silos}, "export", "silo export")
        receipts = dict(zip(silos, done, strict=True))
        for index, callback in enumerate(self.callbacks):
            mine = {s: r[str(index)] for s, r in receipts.items() if str(index) in r}
            if mine:
                callback.on_exported(mine)

    def _rounds(self, server: Any, silos: dict[str, Any]) -> list[RoundSummary]:
        history = []
        selector = Selector(self.cfg.eval.selection)
        who = [f"silo {name}" for name in silos]
        global_ref = server.global_state.remote()
        keeping: tuple[str, list[Any], list[str]] = ("", [], [])
        for round_ in range(1, self.cfg.rounds + 1):
            began = time.perf_counter()
            fit_refs = [
                a.fit.options(num_returns=2).remote(global_ref, round_) for a in silos.values()
            ]
            global_ref = server.aggregate.remote(*[update for update, _ in fit_refs])
            eval_refs = [a.evaluate.remote(global_ref, round_) for a in silos.values()]
            metrics = [m for _, m in fit_refs]
            fits = get(metrics, f"round {round_}: silo fit", self.timeout, who)
            evals = get(eval_refs, f"round {round_}: silo evaluation", self.timeout, who)
            get(keeping[1], keeping[0], self.timeout, keeping[2])  # last round's, saved by now
            chosen = selector.choose(evals)
            keeping = (
                f"round {round_}: silo keep",
                [silos[silo].keep.remote(round_) for silo in chosen],
                [f"silo {silo}" for silo in chosen],
            )
            summary = _summary(round_, time.perf_counter() - began, fits, evals)
            history.append(summary)
            self._emit("on_round_end", summary)
        get(keeping[1], keeping[0], self.timeout, keeping[2])
        return history

"""A run from set-up to export, written once. It never branches on an algorithm's name.

A fresh run gets its own directory (run_dir.RunDir); a resumed one continues the latest (or the
named) run of its federation from the server's newest good checkpoint, each silo restoring its own
commit of that round on its own node. Rounds themselves run in runtime.rounds; after each one the
server checkpoints the global state with the driver's bookkeeping (history, selector, each silo's
last commit, the callbacks' state such as the MLflow run id).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import ray

from silo_pfl import durable
from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.data import silo_names
from silo_pfl.errors import ConfigError, FederationError, Interrupted
from silo_pfl.messages import SiloOutcome, SplitInfo, fields_of, model_shape
from silo_pfl.results import FederationResult, RoundSummary, SiloResult
from silo_pfl.run_dir import RESULT_FILE, RunDir, check_resumable, check_resume
from silo_pfl.runtime.actors import get, get_silos, start_server, start_silos, stop
from silo_pfl.runtime.exporting import attach_exporters, check_own_stores, export
from silo_pfl.runtime.metrics import driver_metrics, export_interval
from silo_pfl.runtime.packing import pack
from silo_pfl.runtime.placement import (
    LABEL_WAIT_SECONDS,
    check_labels,
    check_local_cpus,
    check_own_nodes,
    server_selector,
    silo_selector,
)
from silo_pfl.runtime.rounds import Party, Rejoin, RoundRunner
from silo_pfl.runtime.session import ray_session
from silo_pfl.secure.identity import relayed
from silo_pfl.selection import Selector
from silo_pfl.server_start import server_start
from silo_pfl.stop_signals import cause

GLOBAL_STATE_FILE = "global_state.npz"


class Orchestrator:
    """Runs one federation on Ray and returns its typed result."""

    def __init__(
        self,
        cfg: FederationConfig,
        callbacks: Sequence[Callback] = (),
        resume: bool | str = False,
    ) -> None:
        check_resume(resume)
        self.cfg = cfg
        self.callbacks = list(callbacks)
        self.resume = resume  # True: the latest run of this federation; a str: that run id
        self.run_dir = self._run_dir()
        self.resumable = bool(resume)  # whether the run's directory has a round to resume from
        self.checkpointed: int | None = None  # the newest round checkpointed or restored
        self.checkpointing = False  # the server is writing a checkpoint now
        self.started = time.perf_counter()
        self.earlier_seconds = 0.0  # the wall time of the rounds restored, on resume

    def _run_dir(self) -> RunDir:
        """A fresh run's directory, or the run to resume after checking its config (the run
        records that it resumed once it has been restored)."""
        if not self.resume:
            return RunDir.create(self.cfg)
        run = RunDir.find(self.cfg, self.resume if isinstance(self.resume, str) else None)
        saved = run.saved_config()
        check_resumable(saved, self.cfg, run.path)
        if run.finished() and self.cfg.rounds == saved["rounds"]:
            raise ConfigError(
                f"--resume: run {run.run_id} already finished its {saved['rounds']} rounds; "
                "raise rounds= to train longer"
            )
        return run

    @property
    def timeout(self) -> float:
        """How long a remote step outside the rounds may take (round.call_timeout_s)."""
        return self.cfg.round.call_timeout_s

    def _each(
        self, silos: dict[str, Any], names: list[str], method: str, what: str, *args: Any
    ) -> list[Any]:
        """Call `method` on each of the silos `names` and wait, bounded (a worker's calls for k
        silos, run one after another, k times round.call_timeout_s); a late silo is named."""
        refs = {name: getattr(silos[name], method).remote(*args) for name in names}
        return get_silos(refs, silos, what, self.timeout)

    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def run(self) -> FederationResult:
        """Set up every silo and the server (or restore them), run the rounds, collect each
        silo's outcome. A fresh run that fails before its first checkpoint leaves no directory
        (on this node) for --resume to find; a run stopped after one says which run and round
        --resume continues (Interrupted)."""
        try:
            return self._run()
        except KeyboardInterrupt as exc:
            if not self.resumable:
                self.run_dir.discard()
                raise
            # Stopped while the server wrote a checkpoint: that round may or may not be done.
            round_ = None if self.checkpointing else self.checkpointed
            raise Interrupted(cause(exc), self.run_dir.run_id, round_) from exc
        except BaseException:
            if not self.resumable:
                self.run_dir.discard()
            raise

    def _elapsed(self) -> float:
        """The run's wall time so far: this part's, and on resume the restored rounds'."""
        return self.earlier_seconds + time.perf_counter() - self.started

    def _run(self) -> FederationResult:
        run_id = self.run_dir.run_id
        metrics, tags = driver_metrics(self.cfg, run_id)
        keep = ray.is_initialized()  # Ray outlives the run: its workers may serve the next one
        ended = False
        with (
            ray_session(self.cfg.ray, metrics_interval_s=export_interval(self.cfg)),
            contextlib.closing(metrics),
        ):
            metrics.watch()
            self.started = time.perf_counter()
            config = to_dict(self.cfg)
            names = silo_names(self.cfg.data)
            actors: dict[str, Any] = {}
            selectors = {f"silo {n}": silo_selector(self.cfg, n) for n in names}
            check_labels({**selectors, "the server": server_selector(self.cfg)}, LABEL_WAIT_SECONDS)
            try:
                actors["__server__"] = server = start_server(self.cfg, config, run_id, tags, keep)
                cpus = ray.cluster_resources().get("CPU", 1)
                groups = pack(self.cfg, names, cpus)
                check_local_cpus(self.cfg, groups, cpus)
                actors.update(start_silos(self.cfg, config, groups, run_id, tags, keep))
                resuming = bool(self.resume)
                infos = self._each(actors, names, "setup", "silo set-up", resuming)
                check_own_nodes(self.cfg, {i.silo: i.node_id for i in infos})
                input_shape, num_classes = model_shape(infos)
                rows = sum(info.num_train for info in infos)
                start = server_start(self.cfg, input_shape, num_classes, rows)
                built = server.build.remote(start)
                identity_keys = relayed(self.cfg, {i.silo: i.identity_key for i in infos})
                split: SplitInfo = self._each(
                    actors, names, "build", "silo model", input_shape, num_classes, identity_keys
                )[0]
                get(built, "the server's model", self.timeout)
                silos = {n: actors[n] for n in names}
                parties = {n: Party(n, actors[n]) for n in names}
                selector = Selector(self.cfg.eval.selection)
                history: list[RoundSummary] = []
                # a silo's own store that it cannot use refuses the run before anything records
                # it as started: a resumed run's run.json and result.json, the MLflow runs
                check_own_stores(self.callbacks, infos, actors, self.timeout)
                if resuming:
                    self._restore(server, parties, selector, history)
                    self.run_dir.started_again(self.cfg)
                self._emit("on_start", self.cfg, infos, split)
                # before round 0's checkpoint: a store that cannot be reached fails a fresh run
                # while it has nothing to resume, so its directory goes
                exporting = attach_exporters(self.callbacks, infos, actors, self.timeout)
                if resuming:
                    self._emit("on_resumed", list(history))
                else:
                    self._checkpoint(server, 0, parties, selector, history)
                    self.run_dir.checkpointed()  # --resume takes it, the server's disk anywhere
                    self.resumable = True
                rejoin = Rejoin(input_shape, num_classes, identity_keys, exporting)
                runner = RoundRunner(self.cfg, server, parties, rejoin, selector, metrics)
                for round_ in range(len(history) + 1, self.cfg.rounds + 1):
                    self._emit("on_round_start", round_)
                    summary = runner.run(round_)
                    history.append(summary)
                    self._checkpoint(server, round_, parties, selector, history)
                    self._emit("on_round_end", summary)
                runner.finish()
                outcomes: list[SiloOutcome] = self._each(silos, names, "outcome", "silo outcome")
                chosen = {p.selected for p in parties.values()}  # one round: its global keys
                one = chosen.pop() if len(chosen) == 1 else None
                what = "the server's global state"
                state = get(server.state_bytes.remote(one), what, self.timeout)
                state_path = self._save_global(state)
                server_node = get(server.node_id.remote(), "the server's node", self.timeout)
                export(self.callbacks, list(exporting), actors, self.timeout)
                result = FederationResult.of(
                    self.cfg,
                    self.run_dir,
                    split,
                    wall_seconds=self._elapsed(),
                    silos={
                        info.silo: SiloResult.of(
                            info,
                            out,
                            bytes_sent_per_round=split.bytes_sent_per_round,
                            restarts=parties[info.silo].restarts,
                            rounds_taken_part=sum(info.silo in s.participants for s in history),
                        )
                        for info, out in zip(infos, outcomes, strict=True)
                    },
                    history=history,
                    global_state_path=state_path,
                    server_node_id=server_node,
                    extras={
                        k: v for callback in self.callbacks for k, v in callback.extras().items()
                    },
                )
                self._emit("on_end", result)
                metrics.settle()
                metrics.linger()  # the actors hold their last gauges until that scrape
                ended = True
            finally:
                # a fresh run that fails before round 0's checkpoint has its directory deleted
                # next: nothing its actors were about to write may come after
                stop(list(actors.values()), keep and ended, wait_gone=not self.resumable)
        self._emit("on_closed")
        result.write_json(self.run_dir.path / RESULT_FILE)
        return result

    def _checkpoint(
        self,
        server: Any,
        round_: int,
        parties: dict[str, Party],
        selector: Selector,
        history: list[RoundSummary],
    ) -> None:
        """The server checkpoints `round_` with the driver's bookkeeping: what resume needs. The
        history goes to the server a round at a time: this round's summary."""
        bookkeeping = {
            "summary": fields_of(history[-1]) if history else None,
            "selector": {k: list(v) for k, v in selector.best.items()},
            "committed": {n: p.committed for n, p in parties.items()},
            "aggregated": {n: p.uncommitted() for n, p in parties.items()},
            "selected": {n: p.selected for n, p in parties.items()},
            "why_none": {n: list(p.why_none) for n, p in parties.items() if any(p.why_none)},
            "restarts": {n: p.restarts for n, p in parties.items()},
            "callbacks": {type(c).__name__: c.state() for c in self.callbacks},
            "elapsed_s": self._elapsed(),
        }
        what = f"round {round_}: server checkpoint"
        self.checkpointing = True
        get(server.checkpoint.remote(round_, bookkeeping), what, self.timeout)
        self.checkpointed, self.checkpointing = round_, False

    def _restore(
        self,
        server: Any,
        parties: dict[str, Party],
        selector: Selector,
        history: list[RoundSummary],
    ) -> None:
        """Resume from the server's newest good checkpoint: every silo restores its own commit
        of that round from its own directory, the driver its bookkeeping."""
        saved = self._newest_round_all_hold(server, parties)
        for line in saved["skipped"]:
            round_ = len(saved["history"])
            print(f"warning: {line}; resuming from round {round_}", file=sys.stderr, flush=True)
        history.extend(RoundSummary(**s) for s in saved["history"])
        self.earlier_seconds = float(saved.get("elapsed_s", 0.0))  # 0: a checkpoint without it
        selector.best = {k: (float(v[0]), float(v[1])) for k, v in saved["selector"].items()}
        for name, party in parties.items():
            party.committed = int(saved["committed"][name])
            sent = saved.get("aggregated", {}).get(name)  # absent from older checkpoints
            party.aggregated = (int(sent[0]), int(sent[1])) if sent else None
            party.selected = saved.get("selected", {}).get(name)
            party.selected_by_silo = "selected" not in saved
            evaluated, fitted = saved.get("why_none", {}).get(name, ("", ""))  # absent: older
            party.why_none = (str(evaluated), str(fitted))
            party.restarts = int(saved["restarts"][name])
        for callback in self.callbacks:
            callback.restore(saved["callbacks"].get(type(callback).__name__, {}))
        actors = {n: p.actor for n, p in parties.items()}
        refs = {n: p.actor.restore.remote(p.committed) for n, p in parties.items()}
        get_silos(refs, actors, "resume: silo restore", self.timeout)
        # As a rejoin does: a silo whose update was aggregated after its last commit takes back
        # the state that update left with, where the server mirrors it (SCAFFOLD's c_i).
        adopting = {n: p for n, p in parties.items() if p.uncommitted()}
        refs = {n: p.actor.adopt_sent.remote(p.uncommitted()) for n, p in adopting.items()}
        rounds = get_silos(refs, actors, "resume: silo restore", self.timeout)
        for name, round_ in zip(refs, rounds, strict=True):
            adopting[name].committed = int(round_)
        self.checkpointed = len(history)

    def _newest_round_all_hold(self, server: Any, parties: dict[str, Party]) -> dict[str, Any]:
        """The server's newest good checkpoint whose silos' commits are intact too: where a
        silo's checkpoint of the round it committed is damaged, the server goes back a round
        (each line goes to "skipped")."""
        before: int | None = None
        damaged: list[str] = []
        while True:
            try:
                saved = get(
                    server.resume.remote(before), "resume: the server's checkpoint", self.timeout
                )
            except FederationError:
                if not damaged:
                    raise
                raise FederationError(
                    f"{damaged[-1]}; no earlier round is held intact by the server and every silo"
                ) from None
            committed = {n: int(saved["committed"][n]) for n in parties}
            refs = {n: p.actor.check_checkpoint.remote(committed[n]) for n, p in parties.items()}
            actors = {n: p.actor for n, p in parties.items()}
            lines = get_silos(refs, actors, "resume: silo checkpoints", self.timeout)
            damaged += [*saved["skipped"], *(line for line in lines if line)]
            if not any(lines):
                return {**saved, "skipped": damaged}
            before = len(saved["history"])

    def _save_global(self, npz: bytes) -> str:
        """Write the server's global keys, received as bytes, on the driver's own disk."""
        path = self.run_dir.path / "server" / GLOBAL_STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_atomic(path, npz)  # whole, or the one before: result.json points to it
        return str(path.resolve())

"""A run's history on the server's node: one JSON line per round, appended as the round is
checkpointed and never rewritten, so a round costs the same to checkpoint in round 200 as in
round 2. A server checkpoint records how many rounds the log held; resume reads that many, and
the next append cuts off what follows them first (a crash between the append and the checkpoint
leaves one more line, or a partial one). Reading changes nothing on disk: a resume that looks at
a checkpoint, then settles on an older one or fails, leaves the log as it found it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from silo_pfl import checkpoint, durable

LOG_FILE = "history.jsonl"


class RoundLog:
    """The rounds' summaries (`RoundSummary` as a dict) in `directory`, in round order."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOG_FILE
        self.rounds = 0  # the rounds the log holds, as this process knows it
        self.end = 0  # where they end in the file: what follows is cut off before an append

    def append(self, round_: int, summary: dict[str, Any]) -> None:
        """Log round `round_`, the next one; on disk when this returns, or when the enclosing
        `durable.durable_together` block ends."""
        if round_ != self.rounds + 1:
            raise RuntimeError(f"{self.path}: round {round_} logged after {self.rounds}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file() and self.path.stat().st_size > self.end:
            with open(self.path, "r+b") as handle:
                handle.truncate(self.end)
        line = _line(round_, summary)
        durable.append_line(self.path, line)
        self.rounds, self.end = round_, self.end + len(line)

    def read(self, rounds: int) -> list[dict[str, Any]]:
        """The summaries of rounds 1 to `rounds`; the lines after them are left for the next
        append to cut off."""
        data = self.path.read_bytes() if self.path.is_file() else b""
        summaries: list[dict[str, Any]] = []
        end = 0
        for line in data.splitlines(keepends=True):
            if len(summaries) == rounds or not line.endswith(b"\n"):
                break
            try:
                record = json.loads(line)
            except ValueError:
                break
            if record.get("round") != len(summaries) + 1:
                raise checkpoint.CheckpointError(
                    f"{self.path}: round {record.get('round')} where round {len(summaries) + 1} "
                    "was expected"
                )
            summaries.append(record["summary"])
            end += len(line)
        if len(summaries) < rounds:
            raise checkpoint.CheckpointError(
                f"{self.path}: {len(summaries)} rounds logged, the checkpoint needs {rounds}"
            )
        self.rounds, self.end = rounds, end
        return summaries

    def rewrite(self, summaries: list[dict[str, Any]]) -> None:
        """Start the log afresh with `summaries` (rounds 1 to len(summaries))."""
        lines = [_line(i, summary) for i, summary in enumerate(summaries, 1)]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = b"".join(lines)
        durable.write_atomic(self.path, data)
        self.rounds, self.end = len(summaries), len(data)


def _line(round_: int, summary: dict[str, Any]) -> bytes:
    """One round's line of the log."""
    return (json.dumps({"round": round_, "summary": summary}) + "\n").encode()

"""Checkpoints are atomic and verified; a run's directory and `--resume` refuse what they must."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from old_checkpoints import save_torch_kind
from plain_federation import federation, play_round

from silo_pfl import checkpoint, checkpoint_format, durable
from silo_pfl.cli import main
from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.federation import Federation
from silo_pfl.run_dir import RunDir, check_resumable
from silo_pfl.server_start import new_server
from silo_pfl.settings import load_config
from silo_pfl.silo import Silo
from silo_pfl.silo_store import SELECTED


def _write(tmp_path, rounds, kind="torch"):
    for round_ in rounds:
        if kind == "torch":
            state = {"round": round_, "w": torch.full((3,), float(round_))}
            save_torch_kind(tmp_path, round_, state)
        else:
            checkpoint.save_arrays(tmp_path, round_, {"round": round_, "w": np.full(3, round_)})


def test_only_the_newest_checkpoints_are_kept_and_read_back_exactly(tmp_path):
    _write(tmp_path, range(6))
    assert checkpoint.rounds(tmp_path) == [3, 4, 5]
    assert checkpoint.KEEP == 3
    round_, state = checkpoint.load_latest(tmp_path)
    assert round_ == 5 and torch.equal(state["w"], torch.full((3,), 5.0))
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"


def _counting(monkeypatch, module, name) -> list:
    """Calls of module.name, each still made: a record of what reached the disk, and when."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.skipif(durable._SYNCFS is None, reason="this OS has no syncfs")
def test_saves_made_durable_together_wait_for_the_disk_once(tmp_path, monkeypatch):
    """A worker's call for its silos: every file written, then one sync of the file system as
    the block ends; the checkpoints they replace are deleted only after that."""
    fsyncs = _counting(monkeypatch, durable.os, "fsync")
    syncs = _counting(monkeypatch, durable, "_syncfs")
    silos = [tmp_path / name for name in ("a", "b", "c")]
    with durable.durable_together():
        for folder in silos:
            _write(folder, range(6))
        assert not fsyncs and not syncs
        assert all(checkpoint.rounds(folder) == list(range(6)) for folder in silos)
    assert not fsyncs and len(syncs) == 1
    for folder in silos:
        assert checkpoint.rounds(folder) == [3, 4, 5]
        assert checkpoint.load_latest(folder)[0] == 5
        assert not list(folder.glob(".*.tmp"))
    _write(silos[0], [6])  # alone: its file and directory fsynced before save returns
    assert len(fsyncs) == 2 and len(syncs) == 1  # one file a checkpoint, then its directory


def test_a_checkpoint_recycles_the_one_it_replaces_and_deletes_nothing(tmp_path, monkeypatch):
    """Past the newest KEEP, each save overwrites the oldest checkpoint's files in place: no
    file is deleted (freeing blocks is slow on a discard-mounted disk) and none is left over."""
    _write(tmp_path, range(3))
    unlinks = _counting(monkeypatch, checkpoint.Path, "unlink")
    inode = checkpoint.path_of(tmp_path, 0).stat().st_ino
    for round_ in range(3, 9):
        _write(tmp_path, [round_])
        assert checkpoint.rounds(tmp_path) == [round_ - 2, round_ - 1, round_]
        if round_ == 3:
            assert checkpoint.path_of(tmp_path, 3).stat().st_ino == inode, "round 0's file"
    assert not unlinks
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"round-{r:06d}.ckpt" for r in (6, 7, 8)]
    for round_ in (6, 7, 8):
        assert torch.equal(checkpoint.load(tmp_path, round_)["w"], torch.full((3,), float(round_)))
    _write(tmp_path, [9, 10, 11])  # a bigger checkpoint in a recycled file: truncated to it
    save_torch_kind(tmp_path, 12, {"w": torch.zeros(1000)})
    save_torch_kind(tmp_path, 13, {"w": torch.ones(2)})
    assert checkpoint.load(tmp_path, 13)["w"].tolist() == [1.0, 1.0]


def test_without_syncfs_a_block_fsyncs_each_file_and_directory_as_it_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "_SYNCFS", None)
    fsyncs = _counting(monkeypatch, durable.os, "fsync")
    with durable.durable_together():
        _write(tmp_path / "a", range(2))
        _write(tmp_path / "b", range(1))
        assert not fsyncs
    assert len(fsyncs) == 3 + 2  # three checkpoints, one file each, then two directories


def _sectors_written(path: Path) -> int | None:
    """Sectors written so far by the block device that holds `path` (Linux's /sys), or None."""
    device = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat")
    try:
        return int(stat.read_text().split()[6])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.skipif(durable._SYNC_FILE_RANGE is None, reason="this OS has no sync_file_range")
def test_inside_a_block_a_large_file_starts_to_the_disk_as_it_is_written(tmp_path):
    """So that the block's sync at its end waits for less. Left alone, the file's pages would
    wait in memory for that sync (or for the kernel's 30 s expiry): here the device writes them
    while the block is still open."""
    before = _sectors_written(tmp_path)
    if before is None:
        pytest.skip("no statistics for the block device of this directory")
    size = 64 << 20
    assert size >= durable.WRITEBACK_BYTES
    with durable.durable_together():
        checkpoint.save_model(tmp_path, 1, {"w": torch.ones(size // 4)})
        deadline = time.monotonic() + 20
        while (_sectors_written(tmp_path) - before) * 512 < size and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (_sectors_written(tmp_path) - before) * 512 >= size


@pytest.mark.parametrize("kind", ["torch", "arrays"])
def test_a_corrupted_checkpoint_is_named_and_the_previous_good_round_is_used(
    tmp_path, caplog, kind
):
    _write(tmp_path, range(3), kind)
    newest = checkpoint.path_of(tmp_path, 2)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(tmp_path, 2)
    digest = {"torch": "SHA-256", "arrays": "GHASH"}[kind]
    assert str(info.value) == (
        f"checkpoint {newest}: corrupted (its {digest} differs from its header)"
    )
    with caplog.at_level(logging.WARNING, logger="silo_pfl.checkpoint"):
        round_, state = checkpoint.load_latest(tmp_path)
    assert round_ == 1 and state["round"] == 1
    assert f"checkpoint {newest}: corrupted" in caplog.text


@pytest.mark.parametrize("kind", ["torch", "arrays"])
def test_an_older_rounds_whole_file_under_a_newer_name_is_refused_for_the_one_before(
    tmp_path, caplog, kind
):
    """A file is recycled by overwriting it in place, then renamed. A power cut can keep the
    rename and lose the new bytes: the newest name then holds an older round's file, whole, its
    digest right. The round inside it says so, and the previous good round is used."""
    _write(tmp_path, range(3), kind)
    newest = checkpoint.path_of(tmp_path, 2)
    newest.write_bytes(checkpoint.path_of(tmp_path, 0).read_bytes())
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(tmp_path, 2)
    assert str(info.value) == f"checkpoint {newest}: holds round 0, not round 2"
    with caplog.at_level(logging.WARNING, logger="silo_pfl.checkpoint"):
        round_, state = checkpoint.load_latest(tmp_path)
    assert round_ == 1 and state["round"] == 1


@pytest.mark.parametrize("kind", ["torch", "arrays"])
@pytest.mark.parametrize("keep", [0, 20, 90])
def test_a_checkpoint_cut_inside_its_header_is_partial(tmp_path, caplog, keep, kind):
    _write(tmp_path, range(2), kind)
    newest = checkpoint.path_of(tmp_path, 1)
    newest.write_bytes(newest.read_bytes()[:keep])
    with pytest.raises(checkpoint.CheckpointError, match=r"round-000001.ckpt: partial \(no comp"):
        checkpoint.load(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="silo_pfl.checkpoint"):
        assert checkpoint.load_latest(tmp_path)[0] == 0


def test_a_silo_restores_only_the_selected_model_its_checkpoint_vouches_for(job, tmp_path, capsys):
    """A silo's selected model is a plain file; its commit's checkpoint holds its SHA-256, and
    a restore checks the file against it: swapped for another round's model, it is written
    again from its round's checkpoint, and said."""
    silos, server = federation(job, "fedper", f"output_dir={tmp_path}", silos=("va", "cleveland"))
    for round_ in (1, 2):
        play_round(silos, server, round_, commit=True)
        server.checkpoint(round_, {})
    silo = silos[0]
    assert silo.selected_path == checkpoint.path_of(silo.dir / SELECTED, 2, checkpoint.MODEL)
    assert silo.restore(2)  # its own file: restored
    assert "warning" not in capsys.readouterr().err
    silo.selected_path.write_bytes(checkpoint.path_of(silo.dir / SELECTED, 1, ".pt").read_bytes())
    assert silo.restore(2)
    assert "round-000002.pt: corrupted (its SHA" in capsys.readouterr().err
    published = checkpoint.load(silo.dir / SELECTED, 2, silo._selected_sha256)
    expected = silo.store.saved_model(2)
    assert published.keys() == expected.keys()
    assert all(np.array_equal(published[k].numpy(), expected[k]) for k in expected)


def test_a_silo_makes_its_directory_with_its_first_checkpoint_not_at_set_up(job, tmp_path):
    """A fresh silo's set-up writes nothing on its node, and removes what an earlier run left
    in its directory: when another silo's set-up fails, the driver discards the run's directory
    on its own node, and a silo on another node has made none to leave behind."""
    config = to_dict(job("jobs/heart_disease.yaml", f"output_dir={tmp_path / 'runs'}"))
    silo = Silo(config, "va")
    (silo.dir / "checkpoints").mkdir(parents=True)
    (silo.dir / "checkpoints" / "stale").write_text("an earlier run's")
    info = silo.setup()
    assert not silo.dir.exists()
    silo.build(info.input_shape, info.num_classes)
    assert silo.store.rounds() == [0]
    assert sorted(p.name for p in (silo.dir / "checkpoints").iterdir()) == ["round-000000.ckpt"]


def test_a_model_file_is_torch_s_own_and_checked_against_the_digest_given(tmp_path):
    """A selected model is saved as torch.save's bytes alone (MLflow ships that file, and
    torch.load reads it); its SHA-256, kept by the silo's next checkpoint, vouches for it."""
    state = {"w": torch.arange(4.0)}
    digest = checkpoint.save_model(tmp_path, 3, state)
    path = checkpoint.path_of(tmp_path, 3, checkpoint.MODEL)
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
    assert torch.equal(checkpoint.load(tmp_path, 3, digest)["w"], state["w"])
    other = checkpoint.save_model(tmp_path, 3, {"w": torch.zeros(4)})
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(tmp_path, 3, digest)
    assert str(info.value) == (
        f"checkpoint {path}: corrupted (its SHA-256 differs from the checkpoint that selected it)"
    )
    assert other != digest


def test_a_large_state_goes_to_its_file_without_a_copy_of_the_whole_in_memory(tmp_path):
    """torch.save writes each tensor from its own memory into the file, hashed on the way: the
    process allocates no buffer of the file's size (tracemalloc sees every bytes, bytearray and
    BytesIO buffer; a tensor's own memory is torch's, not Python's). The files are torch.save's
    bytes all the same, the checkpoint's headed by their SHA-256."""
    state = {f"w{i}": torch.randn(1 << 20) for i in range(4)}  # 16 MiB
    expected = io.BytesIO()
    torch.save(state, expected, _use_new_zipfile_serialization=False)
    payload = expected.getvalue()
    del expected
    tracemalloc.start()
    try:
        digest = checkpoint.save_model(tmp_path, 1, state)
        path = save_torch_kind(tmp_path, 2, state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = len(payload)
    assert peak < size / 8
    assert checkpoint.path_of(tmp_path, 1, checkpoint.MODEL).read_bytes() == payload
    assert digest == hashlib.sha256(payload).hexdigest()
    assert path.read_bytes() == b"silo_pfl checkpoint sha256=" + digest.encode() + b"\n" + payload


def test_importing_the_module_and_saving_arrays_imports_no_torch(tmp_path):
    """The server, which imports no torch (a second or two at its start), writes and reads its
    checkpoints through this module: importing it, and saving and loading arrays, must not."""
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path

        import numpy as np

        from silo_pfl import checkpoint, durable

        directory = Path(sys.argv[1])
        with durable.durable_together():
            checkpoint.save_arrays(directory, 1, {"w": np.arange(3.0), "round": 1})
        checkpoint.save_arrays(directory, 2, {"w": np.arange(4.0), "round": 2})
        assert checkpoint.load(directory, 1)["w"].tolist() == [0.0, 1.0, 2.0]
        assert checkpoint.load_latest(directory)[1]["round"] == 2
        imported = sorted(name for name in sys.modules if name.split(".")[0] == "torch")
        print(len(imported), imported[:3])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0 []\n", f"torch was imported: {done.stdout}"


def _same(expected, got):
    """`got` is `expected` read back: the same types, dtypes, shapes and values; arrays
    writable and 64-byte aligned."""
    assert type(got) is type(expected)
    if isinstance(expected, np.ndarray):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
        assert np.array_equal(got, expected)
        assert got.flags.writeable and got.ctypes.data % 64 == 0
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            _same(expected[key], got[key])
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected)
        for item, back in zip(expected, got, strict=True):
            _same(item, back)
    else:
        assert got == expected
        if isinstance(expected, np.generic):
            assert got.dtype == expected.dtype


def test_an_arrays_checkpoint_gives_back_writable_arrays_of_the_same_dtype_shape_values(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "round": 7,
        "global": {
            "w": rng.standard_normal((64, 32)).astype(np.float32),
            "counts": np.arange(10, dtype=np.int64),
            "b": rng.standard_normal(5),
            "big": rng.standard_normal(1 << 20),  # 8 MiB
        },
        "optimizer": {"step": np.array(3.5), "beta": np.float32(0.9), "t": np.int64(12)},
        "flags": [np.bool_(True), True, None, "fedavg", b"\x00\xff", 1.25, (1, "two")],
        "views": {
            "strided": np.arange(24.0).reshape(4, 6)[:, ::2],  # made contiguous on the way
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
            "read_only": np.frombuffer(bytes(range(16)), dtype=np.uint8),  # comes back writable
            "empty": np.zeros((0, 3), dtype=np.float32),
            "records": np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        },
        "driver": {"selector": {"va": [0.5, 3.0]}, "mlflow_run": None},
    }
    path = checkpoint.save_arrays(tmp_path, 7, state)
    assert path == checkpoint.path_of(tmp_path, 7)
    back = checkpoint.load(tmp_path, 7)
    _same(state, back)
    assert back["views"]["fortran"].flags.f_contiguous
    back["global"]["big"][:] = 0.0  # writable in place, and of no effect on the file
    assert np.array_equal(checkpoint.load(tmp_path, 7)["global"]["big"], state["global"]["big"])
    assert checkpoint.load_latest(tmp_path)[0] == 7


def test_save_arrays_refuses_what_it_could_not_read_back_and_writes_nothing(tmp_path):
    class Custom:
        pass

    for wrong in (torch.ones(2), Custom(), np.ma.masked_array([1.0]), 1j, print):
        with pytest.raises(TypeError, match=r"^save_arrays: cannot save a "):
            checkpoint.save_arrays(tmp_path, 1, {"ok": np.ones(2), "wrong": [wrong]})
    assert not list(tmp_path.iterdir())


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_an_arrays_checkpoint_that_names_anything_but_numpy_s_own_is_unreadable(tmp_path):
    """Like torch's weights_only: a pickle that would call os.system is refused, not run, even
    though its digest matches its header."""
    marker = tmp_path / "called"
    stream = pickle.dumps({"w": _Evil(marker)}, protocol=5)
    payload = len(stream).to_bytes(8, "little") + stream
    path = checkpoint.path_of(tmp_path, 1)
    path.write_bytes(b"silo_pfl arrays      ghash=" + _ghash(payload) + b"\n" + payload)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(tmp_path, 1)
    assert str(info.value) == f"checkpoint {path}: unreadable (UnpicklingError)"
    assert not marker.exists()


def test_an_arrays_checkpoint_in_numpy_1_s_names_is_read(tmp_path):
    """numpy 1 pickles an array through numpy.core's names, numpy 2 through numpy._core's: the
    requirements admit both, so either reads back."""
    stream = pickle.dumps({"w": np.arange(4.0)}, protocol=3).replace(b"numpy._core", b"numpy.core")
    assert b"numpy.core.multiarray" in stream
    payload = len(stream).to_bytes(8, "little") + stream
    checkpoint.path_of(tmp_path, 1).write_bytes(
        b"silo_pfl arrays      ghash=" + _ghash(payload) + b"\n" + payload
    )
    assert np.array_equal(checkpoint.load(tmp_path, 1)["w"], np.arange(4.0))


def test_load_tells_the_two_kinds_apart_by_their_header(tmp_path):
    """Callers load either kind alike; a file of either kind is recycled into the next."""
    assert len(checkpoint_format.ARRAYS_MAGIC) == len(checkpoint_format.MAGIC)
    save_torch_kind(tmp_path, 0, {"w": torch.ones(2)})
    checkpoint.save_arrays(tmp_path, 1, {"w": np.ones(2)})
    save_torch_kind(tmp_path, 2, {"w": torch.zeros(1000)})
    inode = checkpoint.path_of(tmp_path, 0).stat().st_ino
    checkpoint.save_arrays(tmp_path, 3, {"w": np.arange(3)})  # in round 0's torch file
    assert checkpoint.path_of(tmp_path, 3).stat().st_ino == inode
    assert checkpoint.rounds(tmp_path) == [1, 2, 3]
    assert checkpoint.path_of(tmp_path, 3).read_bytes().startswith(b"silo_pfl arrays      ghash=")
    assert isinstance(checkpoint.load(tmp_path, 1)["w"], np.ndarray)
    assert isinstance(checkpoint.load(tmp_path, 2)["w"], torch.Tensor)
    round_, state = checkpoint.load_latest(tmp_path)
    assert round_ == 3 and state["w"].tolist() == [0, 1, 2]
    save_torch_kind(tmp_path, 4, {"w": torch.full((2,), 4.0)})  # into round 1's arrays file
    assert checkpoint.load(tmp_path, 4)["w"].tolist() == [4.0, 4.0]


def _ghash(data: bytes) -> bytes:
    """AES-GCM's tag over `data` as associated data, key and nonce all zeros, in 64 hex digits."""
    gcm = Cipher(algorithms.AES(bytes(32)), modes.GCM(bytes(12))).encryptor()
    gcm.authenticate_additional_data(data)
    gcm.finalize()
    return b"%064x" % int.from_bytes(gcm.tag, "big")


@pytest.mark.parametrize(
    "values", [1000, checkpoint_format.Ghash.ONE_SHOT // 4 + 1000], ids=["one-shot", "streamed"]
)
def test_an_arrays_file_is_read_back_and_a_flipped_or_lost_byte_is_named(tmp_path, values):
    """The arrays kind (every checkpoint written now) is under a GHASH, tagged in one call up to
    a megabyte, streamed beyond: read back as written; a flipped byte, two swapped words or a
    file cut short is corrupted, named in one line."""
    weights = np.arange(values, dtype=np.float32)
    checkpoint.save_arrays(tmp_path, 1, {"w": weights})
    path = checkpoint.path_of(tmp_path, 1)
    data = path.read_bytes()
    header = data[: len(checkpoint_format.MAGIC) + 65]
    assert header == b"silo_pfl arrays      ghash=" + _ghash(data[len(header) :]) + b"\n"
    assert np.array_equal(checkpoint.load(tmp_path, 1)["w"], weights)
    swapped = data[:-16] + data[-8:] + data[-16:-8]
    for bad in (data[:-1] + bytes([data[-1] ^ 1]), swapped, data[:-8]):
        path.write_bytes(bad)
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.load(tmp_path, 1)
        message = f"checkpoint {path}: corrupted (its GHASH differs from its header)"
        assert str(info.value) == message


@pytest.mark.parametrize(
    ("magic", "digest", "name"),
    [
        (
            b"silo_pfl arrays     sha256=",
            lambda d: b"%064x" % int(hashlib.sha256(d).hexdigest(), 16),
            "SHA-256",
        ),
        (b"silo_pfl arrays      crc32=", lambda d: b"%064x" % zlib.crc32(d), "CRC-32"),
    ],
    ids=["server-sha256", "model-crc32"],
)
def test_an_arrays_file_written_before_the_ghash_is_still_read_and_checked(
    tmp_path, magic, digest, name
):
    """A run resumed on this code reads the server's checkpoints written under a SHA-256 and the
    silos' models written under a CRC-32 by the code before, and checks each against its own."""
    weights = np.arange(10, dtype=np.float64)
    checkpoint.save_arrays(tmp_path, 1, {"w": weights})
    path = checkpoint.path_of(tmp_path, 1)
    payload = path.read_bytes()[len(checkpoint_format.MAGIC) + 65 :]
    path.write_bytes(magic + digest(payload) + b"\n" + payload)
    assert np.array_equal(checkpoint.load(tmp_path, 1)["w"], weights)
    path.write_bytes(magic + digest(payload) + b"\n" + payload[:-1] + b"\1")
    with pytest.raises(checkpoint.CheckpointError, match=rf"corrupted \(its {name} differs"):
        checkpoint.load(tmp_path, 1)


def test_the_spared_round_outlives_the_newest_files(tmp_path):
    """A silo's selected model stays while the models of later rounds come and go."""
    for round_ in range(1, 8):
        checkpoint.save_arrays(tmp_path, round_, {"r": np.full(3, round_)}, spare=2)
    assert checkpoint.rounds(tmp_path) == [2, 5, 6, 7]
    assert checkpoint.load(tmp_path, 2)["r"].tolist() == [2, 2, 2]
    checkpoint.save_arrays(tmp_path, 8, {"r": np.full(3, 8)}, spare=7)
    assert checkpoint.rounds(tmp_path) == [2, 6, 7, 8], "round 7's checkpoint selected round 2"
    checkpoint.save_arrays(tmp_path, 9, {"r": np.full(3, 9)}, spare=7)
    assert checkpoint.rounds(tmp_path) == [7, 8, 9]


def test_a_checkpoint_cut_short_leaves_the_round_the_previous_one_selected(job, monkeypatch):
    """Round 4's checkpoint selects round 1; round 5's, which selects round 5, is cut short
    (Ctrl-C while it is written): the resume from round 4 still finds round 1's global keys."""
    silos, server = federation(job, "fedavg", silos=("cleveland", "hungarian"))
    names = [silo.name for silo in silos]
    server.checkpoint(0, {"selected": dict.fromkeys(names)})
    states = {}
    for round_ in range(1, 6):
        play_round(silos, server, round_)
        states[round_] = {k: v.copy() for k, v in server.global_state().items()}
        if round_ < 5:
            server.checkpoint(round_, {"selected": dict.fromkeys(names, 1)})
    real = checkpoint.arrays_save

    def interrupted(state, fd):
        if fd is not None:
            raise KeyboardInterrupt
        return real(state, fd)

    monkeypatch.setattr(checkpoint, "arrays_save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.checkpoint(5, {"selected": dict.fromkeys(names, 5)})
    monkeypatch.setattr(checkpoint, "arrays_save", real)
    assert checkpoint.path_of(server.dir, 1).is_file()
    server.release()
    resumed = new_server(to_dict(silos[0].cfg), (13,), 2)
    assert resumed.resume()["selected"] == dict.fromkeys(names, 1) and resumed.round == 4
    kept = dict(np.load(io.BytesIO(resumed.state_bytes(1))))
    assert kept.keys() == states[1].keys()
    assert all(np.array_equal(kept[k], states[1][k]) for k in kept)
    resumed.release()


def test_the_same_bytes_saved_for_the_same_round_are_one_file_hard_linked(tmp_path):
    """save_shared writes a round's bytes once per thread: the same bytes for the same round in
    another directory are a hard link to that file; other bytes, another round, or a file
    changed since it was saved are written anew. Each link is pruned on its own."""
    same = {"w": np.arange(300_000, dtype=np.float32), "n": np.int64(7)}
    other = {"w": same["w"] + 1, "n": np.int64(7)}
    a, b, c, d, e = (tmp_path / name for name in "abcde")
    with durable.durable_together():
        digest = checkpoint.save_shared(a, 1, same)
        assert checkpoint.save_shared(b, 1, {**same, "w": same["w"].copy()}) == digest
        changed = checkpoint.save_shared(c, 1, other)
        assert changed != digest
        assert checkpoint.save_shared(d, 2, other) == changed  # another round: written
    inode = {n: checkpoint.path_of(n, 1).stat() for n in (a, b, c)}
    assert inode[a].st_ino == inode[b].st_ino and inode[a].st_nlink == 2
    assert inode[c].st_ino != inode[a].st_ino and inode[c].st_nlink == 1
    assert checkpoint.path_of(d, 2).stat().st_nlink == 1
    assert np.array_equal(checkpoint.load_shared(b, 1, digest)["w"], same["w"])
    with pytest.raises(checkpoint.CheckpointError, match="not the one expected"):
        checkpoint.load_shared(c, 1, digest)
    with pytest.raises(checkpoint.CheckpointError, match=f"{e}.*not found"):
        checkpoint.load_shared(e, 1, digest)

    checkpoint.save_shared(d, 2, same)  # this thread's last: round 2, `same`, in d
    checkpoint.save_arrays(d, 2, {"not": np.zeros(3)})  # d's file replaced behind its back
    checkpoint.save_shared(e, 2, same)
    assert checkpoint.path_of(e, 2).stat().st_ino != checkpoint.path_of(d, 2).stat().st_ino
    assert np.array_equal(checkpoint.load_shared(e, 2, digest)["w"], same["w"])

    for round_ in range(2, 6):
        for folder in (a, b):
            checkpoint.save_shared(folder, round_, {"r": np.full(3, round_)}, spare=1)
    assert checkpoint.rounds(a) == checkpoint.rounds(b) == [1, 3, 4, 5]
    for round_ in (1, 3, 4, 5):
        assert checkpoint.path_of(b, round_).stat().st_nlink == 2
    checkpoint.save_shared(a, 6, {"r": np.full(3, 6)})
    assert checkpoint.rounds(a) == [1, 4, 5, 6], "kept for round 5's file, until the next"
    checkpoint.save_shared(a, 7, {"r": np.full(3, 7)})
    assert checkpoint.rounds(a) == [5, 6, 7]
    assert checkpoint.path_of(b, 1).stat().st_nlink == 1  # a's link is gone, b's file stays


def test_the_same_bytes_on_another_file_system_are_written_there(tmp_path):
    """A hard link cannot cross file systems: there the bytes are written, and read back."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system here")
    same = {"w": np.arange(1000, dtype=np.float32)}
    digest = checkpoint.save_shared(tmp_path / "a", 1, same)
    with tempfile.TemporaryDirectory(dir=shm) as other:
        assert checkpoint.save_shared(Path(other), 1, same) == digest
        assert checkpoint.path_of(Path(other), 1).stat().st_nlink == 1
        assert np.array_equal(checkpoint.load_shared(Path(other), 1, digest)["w"], same["w"])
    assert checkpoint.path_of(tmp_path / "a", 1).stat().st_nlink == 1


def test_arrays_go_to_their_file_and_back_without_a_copy_of_the_whole(tmp_path):
    """Each array's bytes go from its memory to the file (pickle's out-of-band buffers), hashed
    on the way; reading back allocates the file's size once, and the arrays are views of it.
    The layout: the header, then the stream's length and the stream, then each buffer's length
    and its bytes, starting at a multiple of 64 into the payload."""
    state = {f"w{i}": np.random.default_rng(i).standard_normal(1 << 20) for i in range(2)}
    size = sum(array.nbytes for array in state.values())  # 16 MiB
    tracemalloc.start()
    try:
        path = checkpoint.save_arrays(tmp_path, 1, state)
        _, saving = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        back = checkpoint.load(tmp_path, 1)
        _, loading = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert saving < size / 8
    assert loading < size * 1.25
    _same(state, back)
    data = path.read_bytes()
    header, payload = data[: checkpoint_format.HEADER], data[checkpoint_format.HEADER :]
    assert header == b"silo_pfl arrays      ghash=" + _ghash(payload) + b"\n"
    at = 8 + int.from_bytes(payload[:8], "little")
    assert len(payload[8:at]) < 1000  # the stream: no array's bytes
    for array in state.values():
        length = int.from_bytes(payload[at : at + 8], "little")
        at += 8
        assert set(payload[at : at + -at % 64]) <= {0}
        at += -at % 64
        assert payload[at : at + length] == array.tobytes()
        at += length
    assert at == len(payload)


def test_each_run_has_its_own_directory_and_resume_finds_the_latest(tmp_path):
    cfg = load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}"])
    first, second = RunDir.create(cfg), RunDir.create(cfg)
    assert first.path != second.path and first.path.parent == second.path.parent
    first.checkpointed()
    second.checkpointed()
    assert RunDir.find(cfg, None).run_id == second.run_id
    assert RunDir.find(cfg, first.run_id).path == first.path
    with pytest.raises(ConfigError, match=r"^--resume nope: no run nope of heart_disease in "):
        RunDir.find(cfg, "nope")


def test_a_run_directory_that_cannot_be_made_names_output_dir(tmp_path):
    taken = tmp_path / "a_file"
    taken.write_text("not a directory")
    cfg = load_config("jobs/heart_disease.yaml", [f"output_dir={taken}"])
    with pytest.raises(ConfigError) as info:
        RunDir.create(cfg)
    assert str(info.value).startswith(
        f"output_dir: cannot make the run's directory {taken}/heart_disease/"
    )
    assert str(info.value).endswith("; expected a directory this user can write in")
    assert taken.read_text() == "not a directory"


def test_resume_allows_only_more_rounds(tmp_path):
    cfg = load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}"])
    run = RunDir.create(cfg)
    saved = run.saved_config()
    check_resumable(
        saved,
        load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}", "rounds=99"]),
        run.path,
    )
    changed = load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}", "train.lr=0.5"])
    with pytest.raises(ConfigError) as info:
        check_resumable(saved, changed, run.path)
    assert str(info.value) == (
        f"train.lr: got 0.5, but run {run.run_id} was started with {cfg.train.lr!r}; on --resume "
        f"only rounds may change; to resume it as started, give train.lr={cfg.train.lr}"
    )
    # Every changed key at once, as the overrides that resume the run as it was started.
    two = [f"output_dir={tmp_path}", "train.lr=0.5", "model.hidden=[8]", "seed=7"]
    with pytest.raises(ConfigError) as info:
        check_resumable(saved, load_config("jobs/heart_disease.yaml", two), run.path)
    hidden = json.dumps(list(cfg.model.hidden))
    assert str(info.value).endswith(
        f"; to resume it as started, give model.hidden='{hidden}' seed={cfg.seed} "
        f"train.lr={cfg.train.lr}"
    ), str(info.value)
    # Where and how fast it runs may change: the numbers are the same.
    free = ["ray.num_cpus=1", "ray.silos_per_worker=1", "round.timeout_s=900"]
    check_resumable(
        saved, load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}", *free]), run.path
    )
    fewer = load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}", "rounds=1"])
    with pytest.raises(
        ConfigError, match=r"^rounds: got 1, but run .* on --resume rounds may only be raised$"
    ):
        check_resumable(saved, fewer, run.path)


def test_without_mlflow_a_resume_from_another_directory_may_resolve_another_store(tmp_path):
    """tracking.uri defaults to mlflow.db in the working directory; a run without MLflow (a Ray
    Job's working directory is new each time) resumes whatever it resolves to; live metrics,
    which change nothing in a run, may be turned on for its resume."""
    off = [f"output_dir={tmp_path}", "tracking.enabled=false"]
    run = RunDir.create(load_config("jobs/heart_disease.yaml", off))
    saved = run.saved_config()
    elsewhere = [*off, f"tracking.uri=sqlite:///{tmp_path}/elsewhere/mlflow.db"]
    check_resumable(saved, load_config("jobs/heart_disease.yaml", elsewhere), run.path)
    watched = [*off, "metrics.enabled=true", "metrics.linger_s=30", "metrics.export_interval_s=2"]
    check_resumable(saved, load_config("jobs/heart_disease.yaml", watched), run.path)
    turned_on = load_config("jobs/heart_disease.yaml", [*elsewhere, "tracking.enabled=true"])
    with pytest.raises(ConfigError, match=r"^tracking\.enabled: got True, but run "):
        check_resumable(saved, turned_on, run.path)
    saved["tracking"]["enabled"] = True
    with pytest.raises(ConfigError, match=r"^tracking\.uri: got 'sqlite:///.*elsewhere"):
        check_resumable(saved, turned_on, run.path)


def test_a_run_started_before_a_key_existed_resumes_with_that_key_at_its_default(tmp_path):
    """A run's saved config lacks the keys added to the package since it started: they may
    stand at their defaults (which do what the run did), and any other value is refused."""
    cfg = load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}"])
    run = RunDir.create(cfg)
    saved = run.saved_config()
    del saved["eval"]["every"]
    check_resumable(saved, cfg, run.path)
    every = load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path}", "eval.every=3"])
    with pytest.raises(ConfigError) as info:
        check_resumable(saved, every, run.path)
    assert str(info.value) == (
        f"eval.every: got 3, but run {run.run_id} was started with None; on --resume only "
        "rounds may change"
    )
    del saved["train"]["lr"]  # as if the run had no train.lr: the job sets it off its default
    assert cfg.train.lr != FederationConfig().train.lr
    with pytest.raises(ConfigError, match=r"^train.lr: got .*, but run .* started with None"):
        check_resumable(saved, cfg, run.path)


@pytest.mark.parametrize(
    ("before", "message"),
    [
        (False, "error: --resume: no run of heart_disease to resume in "),
        (True, "error: algorithm.name: got 'ditto', but run "),
    ],
)
def test_cli_resume_errors_are_one_line(tmp_path, capsys, before, message):
    out = f"output_dir={tmp_path}"
    if before:
        RunDir.create(load_config("jobs/heart_disease.yaml", [out])).checkpointed()
    code = main(["run", "jobs/heart_disease.yaml", out, "algorithm.name=ditto", "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


def test_cli_resume_names_the_absolute_directory_it_looked_in(tmp_path, monkeypatch, capsys):
    job = str(Path(__file__).resolve().parents[1] / "jobs" / "heart_disease.yaml")
    monkeypatch.chdir(tmp_path)
    code = main(["run", job, "output_dir=runs", "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"error: --resume: no run of heart_disease to resume in {Path.cwd()}/runs/heart_disease "
        "(output_dir=runs is relative to the working directory)\n"
    )
    code = main(["run", job, f"output_dir={tmp_path}", "--resume", "20261130-052301-3fa9c2"])
    assert capsys.readouterr().err == (
        "error: --resume 20261130-052301-3fa9c2: no run 20261130-052301-3fa9c2 of heart_disease "
        f"in {tmp_path}/heart_disease\n"
    )


@pytest.mark.parametrize("run_id", ["", " ", "..", "../other/20261130-052301-3fa9c2"])
def test_a_resume_id_that_names_no_run_directory_is_refused_before_anything_runs(
    run_id, tmp_path, capsys
):
    """An empty --resume (an unset $RUN_ID) would read as no resume and start a fresh run; a
    path could reach another federation's runs. Refused on the command line, for run and
    submit alike, and through the Python API."""
    job = str(Path(__file__).resolve().parents[1] / "jobs" / "heart_disease.yaml")
    for command in ("run", "submit"):
        code = main([command, job, f"output_dir={tmp_path}", "--resume", run_id])
        err = capsys.readouterr().err
        assert code == 2
        assert err == (
            f"error: silo-pfl {command}: --resume: got {run_id!r}, expected a run id (a run "
            "directory's name, e.g. 20261206-151550-10f40f), or no value for the federation's "
            f"latest run (see silo-pfl {command} --help)\n"
        )
    cfg = load_config(job, [f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^--resume: got "):
        Federation(cfg).run(resume=run_id)
    assert list(tmp_path.iterdir()) == []


def _draws() -> tuple[float, float, float]:
    import random

    import numpy as np

    return random.random(), float(np.random.random()), float(torch.rand(1))


def test_generator_states_survive_a_checkpoint_exactly(tmp_path):
    """Each generator's words are saved as bytes, and restored to the same draws."""
    from silo_pfl.seeding import rng_state, seed_everything, set_rng_state

    seed_everything(7)
    _draws()
    state = rng_state()
    assert all(isinstance(state[k], bytes) for k in ["torch"])
    assert len(state["python"][1]) == 4 * 625 and len(state["numpy"][1]) == 4 * 624
    save_torch_kind(tmp_path, 1, {"rng": state})
    expected = _draws()
    set_rng_state(checkpoint.load(tmp_path, 1)["rng"])
    assert _draws() == expected
    seed_everything(8)
    set_rng_state(checkpoint.load(tmp_path, 1)["rng"])
    assert _draws() == expected


def test_a_sent_state_file_holding_an_older_round_is_refused(tmp_path):
    """What a fit left (SCAFFOLD's c_i, which rejoin and resume take back) is recycled like a
    checkpoint: its file says which round it holds, and another round's is refused."""
    from silo_pfl.silo_store import SENT, SiloStore

    store = SiloStore(tmp_path)
    for round_ in (1, 2):
        store.save_sent(round_, 1, {"c": np.full(3, float(round_))})
    assert store.load_sent(2, 1)["c"].tolist() == [2.0, 2.0, 2.0]
    newest = checkpoint.path_of(tmp_path / SENT, 2)
    newest.write_bytes(checkpoint.path_of(tmp_path / SENT, 1).read_bytes())
    with pytest.raises(checkpoint.CheckpointError, match="holds round 1, not round 2"):
        store.load_sent(2, 1)

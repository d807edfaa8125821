"""Silos' identity keys: loaded, never made, where the config lists them; one key per silo; key
files for their owner only; the operator's keys file; the `keys` command's bad input."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import pytest

from silo_pfl.cli import main
from silo_pfl.config import merge_config, to_dict
from silo_pfl.errors import ConfigError, SiloPflError
from silo_pfl.secure import identity
from silo_pfl.silo import Silo

HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")
HEART = "jobs/heart_disease.yaml"
SECURE = "aggregation.secure=true"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A home of the test's own, so that default key directories stay under tmp_path."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _public(directory: Path) -> str:
    """A new identity in `directory`, its public half in base64."""
    return identity.encode_public(identity.public_bytes(identity.create(directory)))


def _keys_file(tmp_path: Path, keys: dict[str, str]) -> str:
    """The operator's file of `keys`, in lines of `<silo> <base64 key>`."""
    path = tmp_path / "keys.txt"
    path.write_text("".join(f"{silo} {key}\n" for silo, key in keys.items()))
    return str(path)


def _listed(tmp_path: Path) -> dict[str, str]:
    """Every hospital's public key, each made in keys/<hospital>."""
    return {name: _public(tmp_path / "keys" / name) for name in HOSPITALS}


def test_a_silo_missing_its_listed_key_makes_none_and_names_the_command(job, tmp_path, home):
    keys = _listed(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    options = [SECURE, f"aggregation.identity_keys={_keys_file(tmp_path, keys)}"]
    config = to_dict(job(HEART, *options, f"silos.va.key_dir={empty}"))
    with pytest.raises(SiloPflError) as info:
        Silo(config, "va").setup()
    command = f"silo-pfl keys init --federation heart_disease --silo va --key-dir {empty}"
    assert str(info.value) == (
        f"silo va: no identity key in its key directory {empty}, and the config lists the "
        f"silos' keys; create it with {command}, then list the key it prints"
    )
    assert list(empty.iterdir()) == []  # no stray key to block that command
    assert main(shlex.split(command)[1:]) == 0
    # In the default directory, the command needs no --key-dir.
    with pytest.raises(SiloPflError) as info:
        Silo(to_dict(job(HEART, *options)), "va").setup()
    default = home / ".silo_pfl" / "keys" / "heart_disease" / "va"
    assert str(info.value) == (
        f"silo va: no identity key in its key directory {default}, and the config lists the "
        "silos' keys; create it with silo-pfl keys init --federation heart_disease --silo va, "
        "then list the key it prints"
    )
    assert not default.exists()


def test_two_silos_listed_with_one_key_are_refused(job, tmp_path):
    keys = _listed(tmp_path)
    shared = _keys_file(tmp_path, {**keys, "va": keys["cleveland"]})
    with pytest.raises(ConfigError) as info:
        job(HEART, SECURE, f"aggregation.identity_keys={shared}")
    assert str(info.value) == (
        f"aggregation.identity_keys ({shared}): silos cleveland and va have the same public "
        "identity key; each silo needs a key of its own (silo-pfl keys init on its node)"
    )
    inline = [f"silos.{silo}.identity_key={key}" for silo, key in keys.items()]
    with pytest.raises(ConfigError) as info:
        job(HEART, SECURE, *inline, f"silos.hungarian.identity_key={keys['switzerland']}")
    assert str(info.value) == (
        "silos.hungarian.identity_key and silos.switzerland.identity_key: silos hungarian and "
        "switzerland have the same public identity key; each silo needs a key of its own "
        "(silo-pfl keys init on its node)"
    )


def test_two_silos_relaying_one_key_are_refused(job, tmp_path):
    """No keys listed: silos whose key directories are one report one identity."""
    shared = tmp_path / "shared"
    options = [SECURE, f"silos.cleveland.key_dir={shared}", f"silos.hungarian.key_dir={shared}"]
    cfg = job(HEART, *options)
    infos = [Silo(to_dict(cfg), name).setup() for name in ("cleveland", "hungarian")]
    with pytest.raises(ConfigError) as info:
        identity.relayed(cfg, {i.silo: i.identity_key for i in infos})
    assert str(info.value) == (
        f"silos cleveland and hungarian report the same identity key, from key directories "
        f"{shared} and {shared} (silos.<name>.key_dir); each silo needs a key directory of its own"
    )


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620], ids=["0640", "0604", "0620"])
def test_a_key_file_others_may_read_or_write_is_refused(mode, tmp_path, capsys):
    directory = tmp_path / "va"
    identity.create(directory)
    path = directory / identity.PRIVATE_FILE
    path.chmod(mode)
    expected = (
        f"{path}: mode {mode:04o} lets others than its owner read or write the identity key; "
        f"allow its owner only: chmod 600 {path}"
    )
    for load in (identity.load, identity.load_or_create):
        with pytest.raises(SiloPflError) as info:
            load(directory)
        assert str(info.value) == expected
    where = ["--federation", "fed", "--silo", "va", "--key-dir", str(directory)]
    assert main(["keys", "show", *where]) == 1
    assert capsys.readouterr() == ("", f"error: {expected}\n")
    path.chmod(0o600)
    assert main(["keys", "show", *where]) == 0


def test_a_key_directory_others_may_write_is_warned_of(tmp_path, caplog):
    directory = tmp_path / "va"
    directory.mkdir()
    directory.chmod(0o777)
    expected = (
        f"{directory}: key directory of mode 0777, in which others than its owner may replace "
        f"the identity key; allow its owner only: chmod 700 {directory}"
    )
    where = ["--federation", "fed", "--silo", "va", "--key-dir", str(directory)]
    with caplog.at_level(logging.WARNING, "silo_pfl.secure"):
        assert main(["keys", "init", *where]) == 0
        assert [r.getMessage() for r in caplog.records] == [expected]
        caplog.clear()
        directory.chmod(0o770)
        identity.load(directory)
        assert [r.getMessage() for r in caplog.records] == [expected.replace("0777", "0770")]
        caplog.clear()
        directory.chmod(0o750)
        identity.load(directory)
        assert caplog.records == []


def test_a_keys_file_missing_a_silo_is_named(job, tmp_path):
    keys = _listed(tmp_path)
    path = _keys_file(tmp_path, {n: k for n, k in keys.items() if n != "hungarian"})
    with pytest.raises(ConfigError) as info:
        job(HEART, SECURE, f"aggregation.identity_keys={path}")
    assert str(info.value) == (
        f"aggregation.identity_keys: {path} has no key for silo hungarian, nor has "
        "silos.hungarian.identity_key; list every silo's public identity key (silo-pfl keys "
        "show), or none"
    )
    cfg = job(
        HEART, SECURE, f"aggregation.identity_keys={path}",
        f"silos.hungarian.identity_key={keys['hungarian']}",
    )  # fmt: skip
    assert identity.configured_keys(cfg, list(HOSPITALS))["hungarian"] == identity.decode_public(
        keys["hungarian"], "hungarian"
    )


def test_a_keys_file_takes_the_lines_keys_show_prints(job, tmp_path, capsys):
    lines = []
    for name in HOSPITALS:
        where = ["--federation", "heart_disease", "--silo", name]
        assert main(["keys", "init", *where, "--key-dir", str(tmp_path / name)]) == 0
        lines.append(capsys.readouterr().out.splitlines()[1])
    public = {name: line.split("=", 1)[1] for name, line in zip(HOSPITALS, lines, strict=True)}
    path = tmp_path / "shown.txt"  # as keys show printed them, and in the other form
    path.write_text(
        f"{lines[0]}\n{lines[1]}  # hungarian's\nswitzerland {public['switzerland']}\n{lines[3]}\n"
    )
    cfg = job(HEART, SECURE, f"aggregation.identity_keys={path}")
    keys = identity.configured_keys(cfg, list(HOSPITALS))
    assert keys == {name: identity.decode_public(key, name) for name, key in public.items()}
    path.write_text(f"silos.site.a.identity_key={public['va']}\n")  # silo names may hold dots
    assert identity.read_key_file(path) == {"site.a": public["va"]}


def test_an_inline_key_unlike_the_keys_file_is_refused(job, tmp_path):
    keys = _listed(tmp_path)
    path = _keys_file(tmp_path, keys)
    other = _public(tmp_path / "other")
    with pytest.raises(ConfigError) as info:
        job(HEART, SECURE, f"aggregation.identity_keys={path}", f"silos.va.identity_key={other}")
    assert str(info.value) == (
        f"silos.va.identity_key: not the key aggregation.identity_keys ({path}) lists for va; "
        "list one key per silo, in one place or the same in both"
    )
    same = f"silos.va.identity_key={keys['va']}"
    cfg = job(HEART, SECURE, f"aggregation.identity_keys={path}", same)
    assert identity.configured_keys(cfg, list(HOSPITALS))["va"] == identity.decode_public(
        keys["va"], "va"
    )


def test_a_keys_file_may_list_late_silos(job, tmp_path):
    keys = _listed(tmp_path)
    path = _keys_file(tmp_path, keys)
    cfg = job(HEART, SECURE, "data.late_silos=[va]", f"aggregation.identity_keys={path}")
    founders = ["cleveland", "hungarian", "switzerland"]
    expected = {name: identity.decode_public(keys[name], name) for name in founders}
    assert identity.configured_keys(cfg, founders) == expected
    # The server reads them from the config as it is sent, without the data sources.
    assert identity.configured_keys(merge_config(to_dict(cfg)), founders) == expected


def test_keys_refuse_an_empty_key_dir(capsys, home):
    for action in ("init", "show"):
        assert main(["keys", action, "--federation", "fed", "--silo", "va", "--key-dir", ""]) == 2
        assert capsys.readouterr() == ("", "error: --key-dir: got '', expected a directory path\n")
    assert not home.exists()


def test_keys_name_a_key_path_that_is_a_directory(tmp_path, capsys):
    path = tmp_path / "va" / identity.PRIVATE_FILE
    path.mkdir(parents=True)
    for action in ("init", "show"):
        where = ["--federation", "fed", "--silo", "va", "--key-dir", str(tmp_path / "va")]
        assert main(["keys", action, *where]) == 1
        assert capsys.readouterr() == (
            "",
            f"error: {path}: is a directory, expected the identity key's file (32 raw bytes)\n",
        )
    assert [p.name for p in path.parent.iterdir()] == [identity.PRIVATE_FILE]

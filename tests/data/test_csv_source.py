"""The CSV source: one file per silo, normalised, and one-line errors naming silo and file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from silo_pfl.data import csv_source
from silo_pfl.errors import ConfigError, DataError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def good_table(rows: int = 40, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    lines = ["height,label,weight"]
    for i in range(rows):
        lines.append(f"{rng.normal(170, 10):.3f},{i % 3},{rng.normal(70, 5):.3f}")
    return "\n".join(lines) + "\n"


def config(paths: dict[str, Path], **overrides) -> csv_source.Params:
    options = {"num_classes": 3, **overrides}
    return csv_source.Params(source="csv", paths={k: str(v) for k, v in paths.items()}, **options)


def load_error(tmp_path: Path, text: str | None, silo: str = "clinic_b") -> str:
    path = tmp_path / "table.csv"
    if text is not None:
        write(path, text)
    with pytest.raises(DataError) as info:
        csv_source.load(config({silo: path}), silo, seed=0)
    message = str(info.value)
    assert "\n" not in message
    assert f"silo {silo}" in message and str(path) in message
    return message


def test_validate_requires_paths():
    with pytest.raises(ConfigError, match=r"data\.paths: give one CSV path per silo, e\.g\."):
        csv_source.validate(csv_source.Params(source="csv"))


def test_validate_requires_num_classes():
    with pytest.raises(ConfigError, match=r"^data\.num_classes: required for data\.source=csv"):
        csv_source.validate(csv_source.Params(source="csv", paths={"a": "/a.csv"}))


@pytest.mark.parametrize("count", [1, 0, -2])
def test_validate_needs_at_least_two_classes(count):
    with pytest.raises(ConfigError, match=rf"^data\.num_classes: got {count}, expected an integer"):
        csv_source.validate(config({"a": Path("/a.csv")}, num_classes=count))


def test_validate_rejects_an_empty_path():
    with pytest.raises(ConfigError, match=r"data\.paths\.a"):
        csv_source.validate(csv_source.Params(source="csv", paths={"a": " "}))


@pytest.mark.parametrize("nested", ["{file: /a.csv}", "[/a.csv]"])
def test_a_silos_path_given_as_a_mapping_or_a_list_is_one_line_at_config(tmp_path, nested):
    """OmegaConf's typed mapping of strings takes a nested mapping or list as it is: refused at
    the config, not found later on the silo's node as a file named "{'file': ...}"."""
    from silo_pfl.settings import load_config

    job = tmp_path / "job.yaml"
    job.write_text(
        "name: nested\nrounds: 1\nmodel: {name: mlp}\ndata:\n  source: csv\n"
        f"  num_classes: 2\n  paths: {{a: /a.csv, b: {nested}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(job))
    assert str(info.value).startswith("data.paths.b: got ")
    assert "expected a silo name mapped to a CSV path" in str(info.value)


def test_silo_names_keep_the_given_order(tmp_path):
    cfg = config({"zeta": tmp_path / "z.csv", "alpha": tmp_path / "a.csv"})
    csv_source.validate(cfg)
    assert csv_source.silo_names(cfg) == ["zeta", "alpha"]


def test_load_splits_and_normalises(tmp_path):
    path = write(tmp_path / "a.csv", good_table())
    cfg = config({"a": path}, test_fraction=0.25, val_fraction=0.2)
    data = csv_source.load(cfg, "a", seed=0)
    assert (len(data.y_train), len(data.y_val), len(data.y_test)) == (24, 6, 10)
    assert data.num_train_total == 30
    assert data.input_shape == (2,)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert data.num_classes == 3
    assert data.preprocessing.feature_names == ("height", "weight")
    train = np.concatenate([data.x_train, data.x_val]).astype(np.float64)
    assert np.allclose(train.mean(axis=0), 0.0, atol=1e-5)
    assert np.allclose(train.std(axis=0), 1.0, atol=1e-5)
    assert sorted(np.bincount(data.y_test).tolist()) == [3, 3, 4]


def test_preprocessing_maps_raw_rows_like_the_silo(tmp_path):
    path = write(tmp_path / "a.csv", good_table())
    data = csv_source.load(config({"a": path}), "a", seed=0)
    _, raw, _ = csv_source.read_silo_csv("a", path, "label")
    applied = data.preprocessing.apply(raw)
    for row in data.x_test:
        assert np.isclose(applied, row, atol=1e-5).all(axis=1).any()


def test_deterministic_for_a_seed_and_split_depends_on_it(tmp_path):
    cfg = config({"a": write(tmp_path / "a.csv", good_table())})
    first, again = csv_source.load(cfg, "a", 5), csv_source.load(cfg, "a", 5)
    assert np.array_equal(first.x_train, again.x_train)
    assert np.array_equal(first.x_val, again.x_val)
    other = csv_source.load(cfg, "a", 6)
    assert not np.array_equal(first.x_val, other.x_val)


def test_constant_feature_keeps_unit_std(tmp_path):
    lines = ["f,label"] + [f"1.0,{i % 2}" for i in range(10)]
    path = write(tmp_path / "c.csv", "\n".join(lines) + "\n")
    data = csv_source.load(config({"c": path}), "c", seed=0)
    assert data.preprocessing.std == (1.0,)
    assert np.all(data.x_train == 0.0)


def test_a_constant_decimal_feature_is_constant_and_a_new_value_stays_finite(tmp_path):
    lines = ["dose,age,label"] + [f"0.1,{30 + i},{i % 2}" for i in range(40)]
    path = write(tmp_path / "d.csv", "\n".join(lines) + "\n")
    data = csv_source.load(config({"d": path}, num_classes=2), "d", seed=0)
    assert data.preprocessing.std[0] == 1.0
    assert np.all(data.x_train[:, 0] == 0.0)
    served = data.preprocessing.apply(np.array([[0.2, 40.0]]))
    assert abs(served[0, 0] - 0.1) < 1e-6


def test_header_names_with_line_breaks_stay_on_one_line(tmp_path):
    header = '"Blood pressure\n(mmHg)",age'
    for text in (
        f"{header},Outcome\n1,2,0\n",
        f'{header},"Blood pressure\n(mmHg)",label\n1,2,3,0\n',
    ):
        message = load_error(tmp_path, text)
        assert "\n" not in message and "Blood pressure" in message


def test_two_rows_are_enough(tmp_path):
    path = write(tmp_path / "t.csv", "f,label\n1,0\n2,1\n")
    data = csv_source.load(config({"t": path}), "t", seed=0)
    assert (len(data.y_train), len(data.y_val), len(data.y_test)) == (1, 0, 1)


def test_missing_file(tmp_path):
    assert "not found" in load_error(tmp_path, None)


def test_missing_label_column_lists_columns(tmp_path):
    message = load_error(tmp_path, "a,b,target\n1,2,0\n3,4,1\n")
    assert "'label'" in message and "columns found: 'a', 'b', 'target'" in message


def test_non_numeric_value_names_column_and_row(tmp_path):
    message = load_error(tmp_path, "a,label\n1,0\n2,1\nabc,0\n")
    assert message.endswith(": column 'a', data row 3 (line 4): not a finite number")
    assert "abc" not in message  # an error names the cell, never quotes it


@pytest.mark.parametrize("huge", ["every", "one"])
def test_values_too_large_to_standardise_name_the_column(tmp_path, huge):
    """1e306 in every row overflowed the mean (NaN features, then 'training diverged ... lower
    train.lr'); one 1e300 cell overflowed the std, which turned the whole column into zeros."""
    big = {"every": [1e306] * 20, "one": [1e300 if i == 7 else float(i) for i in range(20)]}
    rows = [f"{value!r},{i % 2},{i}" for i, value in enumerate(big[huge])]
    message = load_error(tmp_path, "a,label,b\n" + "\n".join(rows) + "\n")
    assert message.endswith(
        ": column 'a': its values are too large to standardise (their mean and spread overflow "
        "float64); rescale the column, e.g. to other units"
    )
    assert "1e+30" not in message


def test_empty_cell_is_rejected(tmp_path):
    message = load_error(tmp_path, "a,b,label\n1,2,0\n3,,1\n")
    assert "column 'b'" in message and "data row 2" in message


def test_empty_file(tmp_path):
    assert "is empty" in load_error(tmp_path, "")


def test_header_without_rows(tmp_path):
    assert "no data rows" in load_error(tmp_path, "a,label\n")


def test_too_few_rows(tmp_path):
    assert "need at least 2" in load_error(tmp_path, "a,label\n1,0\n")


def test_ragged_row(tmp_path):
    message = load_error(tmp_path, "a,b,label\n1,2,0\n1,2\n")
    assert "data row 2" in message and "has 2 values" in message


@pytest.mark.parametrize("label", ["cat", "-1", "1.5", "3", "7.0"])
def test_labels_must_be_declared_class_indices_and_errors_never_quote_them(tmp_path, label):
    message = load_error(tmp_path, f"a,label\n1,0\n2,{label}\n3,1\n")
    assert message.endswith(
        ": label column 'label', data row 2 (line 3): not a class index; labels must be "
        "integers 0..2 (data.num_classes=3)"
    )
    assert message.endswith("labels must be integers 0..2 (data.num_classes=3)")


def test_a_silo_may_hold_only_some_of_the_classes(tmp_path):
    path = write(tmp_path / "skew.csv", "a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(8)))
    data = csv_source.load(config({"s": path}, num_classes=5), "s", seed=0)
    assert data.num_classes == 5 and set(data.y_train) <= {0, 1}


def test_directory_given_as_path(tmp_path):
    path = tmp_path / "table.csv"
    path.mkdir()
    assert "is a directory" in load_error(tmp_path, None)


def test_only_a_label_column(tmp_path):
    assert "no features" in load_error(tmp_path, "label\n0\n1\n")


def test_unknown_silo(tmp_path):
    cfg = config({"a": tmp_path / "a.csv"})
    with pytest.raises(DataError, match=r"silo b: not in data\.paths"):
        csv_source.load(cfg, "b", 0)


def test_a_file_without_a_header_row_never_shows_its_first_example(tmp_path):
    """The first data row, read as the header, was listed as the columns found: a patient's
    values, label included, on the driver's console and in the job's logs."""
    message = load_error(tmp_path, "63.125,145.5,1\n37.75,130.25,0\n41.5,120.0,1\n")
    assert "needs a header row" in message and "3 of the 3 cells" in message
    assert not any(value in message for value in ("63.125", "145.5"))
    repeated = load_error(tmp_path, "63.125,0,label,0\n37.75,1,1,1\n41.5,0,1,0\n")
    assert "repeats column name(s)" in repeated and "63.125" not in repeated


def test_a_column_without_a_name_is_refused(tmp_path):
    """pandas' to_csv writes its row index as a first column without a name: it was trained on
    as a feature, and on rows sorted by label it gave the label away."""
    message = load_error(tmp_path, ",height,label\n0,170.5,0\n1,160.0,1\n2,150.5,0\n")
    assert "column 1 of its header has no name" in message and "index=False" in message


def test_numpys_reader_and_the_cell_by_cell_one_read_a_file_alike(tmp_path):
    """A well-formed file goes through numpy's C reader (benchmarks/csv_read.py: its speed and
    memory); the cell-by-cell reader, kept to name a bad cell, must read it to the same arrays:
    quoted cells, spaces, CRLF, a blank line, exponents and 17 significant digits."""
    text = (
        'height,"label",weight\r\n"170.12345678901234",1, 7.5e1\r\n\r\n'
        "-0.1,0,1E-3\r\n 160 ,2,+65.25\r\n"
    )
    table = csv_source._Table("clinic_b", write(tmp_path / "t.csv", text), "label", 3)
    with table.path.open(newline="", encoding="utf-8-sig") as handle:
        whole = table._read_whole(handle)
    with table.path.open(newline="", encoding="utf-8-sig") as handle:
        cells = table._parse(csv_source.csv.reader(handle))
    assert whole is not None and whole[0] == cells[0] == ("height", "weight")
    assert np.array_equal(whole[1], cells[1]) and np.array_equal(whole[2], cells[2])
    assert whole[1][0].tolist() == [170.12345678901234, 75.0] and whole[2].tolist() == [1, 0, 2]

"""sim.workloads.idx: the IDX reader on the real Fashion-MNIST files (compared with an independent gzip + struct reader) and on
small files written here, good and bad: every bad file or folder gives a one-line DataError naming the folder and
the file, never another exception."""
from __future__ import annotations

import gzip
import math
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from sim.workloads import idx
from sim.base.errors import ConfigError, DataError
from sim.workloads.idx import DEFAULT_PATHS, IDX_FILES, IMAGE_DATASETS, ImageDataset, load_image_dataset, read_idx

REAL = Path(DEFAULT_PATHS["fashion-mnist"])
TRAIN_X, TRAIN_Y = IDX_FILES[("train", "images")], IDX_FILES[("train", "labels")]
TEST_X, TEST_Y = IDX_FILES[("test", "images")], IDX_FILES[("test", "labels")]


# --------------------------------------------------------------------------- helpers

def idx_bytes(arr, *, magic=b"\x00\x00", type_byte=0x08, dims=None, tail=b"", cut=0) -> bytes:
    """The IDX encoding of ``arr`` (uint8), optionally broken: another magic / type byte / dims byte, extra bytes
    after the data, or ``cut`` bytes removed from the end."""
    arr = np.asarray(arr, dtype=np.uint8)
    nd = arr.ndim if dims is None else dims
    head = magic + bytes([type_byte, nd]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = head + arr.tobytes() + tail
    return data[:len(data) - cut] if cut else data


def write_file(path: Path, payload: bytes, gz: bool | None = None) -> Path:
    """Write ``payload``, gzip-compressed when the name ends in .gz (or when ``gz`` says so)."""
    if gz is None:
        gz = path.name.endswith(".gz")
    path.write_bytes(gzip.compress(payload, mtime=0) if gz else payload)
    return path


def make_folder(folder: Path, n_train=5, n_test=3, *, gz=True, seed=0):
    """A folder with the four MNIST-named IDX files of a small random data set; returns the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        ("train", "images"): rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        ("train", "labels"): rng.integers(0, 10, n_train, dtype=np.uint8),
        ("test", "images"): rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        ("test", "labels"): rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for key, name in IDX_FILES.items():
        write_file(folder / (name if gz else name[:-3]), idx_bytes(arrays[key]))
    return arrays


def expect_error(folder: Path, *names: str, match: str | None = None) -> str:
    """load_image_dataset('mnist', folder) raises DataError (nothing else) with one line naming the folder and
    each of ``names``; returns the message."""
    idx.clear_cache()
    with pytest.raises(DataError) as info:
        load_image_dataset("mnist", str(folder))
    msg = str(info.value)
    assert "\n" not in msg
    assert f"data.path = {str(folder)!r}" in msg
    for name in names:
        assert name in msg, (name, msg)
    assert "valid:" in msg and "MNIST" in msg
    if match is not None:
        assert match in msg, (match, msg)
    return msg


def independent_read(path: Path):
    """(dims, data bytes) of a gzip IDX file, with gzip + struct only."""
    with gzip.open(path, "rb") as f:
        buf = f.read()
    zero, type_byte, nd = struct.unpack_from(">HBB", buf, 0)
    assert (zero, type_byte) == (0, 0x08)
    dims = struct.unpack_from(f">{nd}I", buf, 4)
    data = buf[4 + 4 * nd:]
    assert len(data) == math.prod(dims)
    return dims, data


# --------------------------------------------------------------------------- the real Fashion-MNIST files

@pytest.fixture(scope="module")
def real():
    """The Fashion-MNIST data set from Debian's dataset-fashion-mnist; skipped when absent, failed under CI=true."""
    if not all((REAL / name).is_file() for name in IDX_FILES.values()):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the Fashion-MNIST files are not in {REAL}: .ci/run installs "
                        "dataset-fashion-mnist")
        pytest.skip(f"Fashion-MNIST not installed in {REAL} (apt-get install dataset-fashion-mnist)")
    idx.clear_cache()
    return load_image_dataset("fashion-mnist")


def test_real_shapes_dtypes(real):
    assert isinstance(real, ImageDataset)
    assert real.X_train.shape == (60000, 28, 28) and real.X_train.dtype == np.uint8
    assert real.y_train.shape == (60000,) and real.y_train.dtype == np.int64
    assert real.X_test.shape == (10000, 28, 28) and real.X_test.dtype == np.uint8
    assert real.y_test.shape == (10000,) and real.y_test.dtype == np.int64
    assert (real.n_train, real.n_test, real.n_classes) == (60000, 10000, 10)
    assert real.name == "fashion-mnist" and real.path == str(REAL.resolve())
    assert "Fashion-MNIST" in real.source and "Xiao" in real.source and str(REAL) in real.source


def test_real_balanced_labels(real):
    assert np.bincount(real.y_train, minlength=10).tolist() == [6000] * 10
    assert np.bincount(real.y_test, minlength=10).tolist() == [1000] * 10


def test_real_matches_independent_reader(real):
    for key, arr in [(("train", "images"), real.X_train), (("train", "labels"), real.y_train),
                     (("test", "images"), real.X_test), (("test", "labels"), real.y_test)]:
        dims, data = independent_read(REAL / IDX_FILES[key])
        assert arr.shape == tuple(dims)
        assert arr.astype(np.uint8).tobytes() == data
    # values read once with the independent reader above (gzip + struct), pinned so a change of files shows
    assert real.y_train[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert real.y_test[:10].tolist() == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
    assert int(real.X_train[0, 14, 14]) == 217 and int(real.X_test[0, 14, 14]) == 110
    assert int(real.X_train[0].sum()) == 76247
    assert int(real.X_train.sum(dtype=np.int64)) == 3431114169
    assert int(real.X_test.sum(dtype=np.int64)) == 573469082


def test_real_cached_and_read_only(real):
    first = load_image_dataset("fashion-mnist")
    assert load_image_dataset("fashion-mnist", str(REAL) + "/") is first  # read once, then from the cache
    assert np.array_equal(first.X_test, real.X_test)
    for arr in (real.X_train, real.y_train, real.X_test, real.y_test):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 1


def test_real_read_idx(real):
    labels = read_idx(REAL / TEST_Y, ndim=1)
    assert labels.dtype == np.uint8 and labels.shape == (10000,)
    assert np.array_equal(labels, real.y_test)


# --------------------------------------------------------------------------- small files: round trip

@pytest.mark.parametrize("gz", [True, False])
def test_round_trip_mnist(tmp_path, gz):
    arrays = make_folder(tmp_path, gz=gz)
    idx.clear_cache()
    ds = load_image_dataset("mnist", str(tmp_path))
    assert ds.name == "mnist" and ds.n_classes == 10 and ds.path == str(tmp_path.resolve())
    assert np.array_equal(ds.X_train, arrays[("train", "images")]) and ds.X_train.dtype == np.uint8
    assert np.array_equal(ds.y_train, arrays[("train", "labels")]) and ds.y_train.dtype == np.int64
    assert np.array_equal(ds.X_test, arrays[("test", "images")]) and ds.X_test.dtype == np.uint8
    assert np.array_equal(ds.y_test, arrays[("test", "labels")]) and ds.y_test.dtype == np.int64
    assert "MNIST" in ds.source and ("t10k-labels-idx1-ubyte.gz" if gz else "t10k-labels-idx1-ubyte") in ds.source


def test_gz_preferred_over_raw(tmp_path):
    gz_arrays = make_folder(tmp_path, n_train=4, gz=True, seed=1)
    make_folder(tmp_path, n_train=6, gz=False, seed=2)  # torchvision's raw/ keeps both
    idx.clear_cache()
    ds = load_image_dataset("mnist", tmp_path)
    assert np.array_equal(ds.X_train, gz_arrays[("train", "images")])


def test_cache_reads_again_after_a_change(tmp_path):
    make_folder(tmp_path, n_train=4)
    idx.clear_cache()
    a = load_image_dataset("mnist", str(tmp_path))
    assert load_image_dataset("mnist", str(tmp_path)) is a
    arrays = make_folder(tmp_path, n_train=7, seed=3)
    b = load_image_dataset("mnist", str(tmp_path))
    assert b is not a and b.n_train == 7
    assert np.array_equal(b.X_train, arrays[("train", "images")])


@given(arr=hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=6)),
       gz=st.booleans())
def test_property_write_read(arr, gz):
    with tempfile.TemporaryDirectory() as d:
        path = write_file(Path(d) / ("a.idx.gz" if gz else "a.idx"), idx_bytes(arr))
        out = read_idx(path)
        assert out.dtype == np.uint8 and out.shape == arr.shape
        assert np.array_equal(out, arr)
        assert np.array_equal(read_idx(path, ndim=arr.ndim), arr)


# --------------------------------------------------------------------------- bad input: DataError, one line

def test_unknown_name():
    with pytest.raises(ConfigError, match="fashion-mnist, mnist"):
        load_image_dataset("cifar10")
    assert IMAGE_DATASETS == ("fashion-mnist", "mnist")


def test_mnist_needs_path():
    with pytest.raises(DataError) as info:
        load_image_dataset("mnist", "")
    msg = str(info.value)
    assert "data.path" in msg and TRAIN_X in msg and "torchvision" in msg and "\n" not in msg


def test_missing_folder(tmp_path):
    expect_error(tmp_path / "nope", TRAIN_X, match="does not exist")


def test_folder_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    expect_error(f, match="not a folder")


def test_fashion_hint(tmp_path):
    with pytest.raises(DataError) as info:
        load_image_dataset("fashion-mnist", str(tmp_path / "nope"))
    assert "apt-get install dataset-fashion-mnist" in str(info.value)
    assert "/usr/share/datasets/fashion-mnist" in str(info.value)


@pytest.mark.parametrize("name", list(IDX_FILES.values()))
def test_missing_file(tmp_path, name):
    make_folder(tmp_path)
    (tmp_path / name).unlink()
    expect_error(tmp_path, name, match="not found")


def test_directory_where_a_file_should_be(tmp_path):
    make_folder(tmp_path)
    (tmp_path / TEST_X).unlink()
    (tmp_path / TEST_X).mkdir()
    expect_error(tmp_path, TEST_X, match="directory")


def test_broken_symlink(tmp_path):
    make_folder(tmp_path)
    (tmp_path / TRAIN_Y).unlink()
    (tmp_path / TRAIN_Y).symlink_to(tmp_path / "gone")
    expect_error(tmp_path, TRAIN_Y, match="broken symbolic link")


def _replace(folder: Path, name: str, payload: bytes, gz: bool | None = None):
    write_file(folder / name, payload, gz)


@pytest.mark.parametrize("gz", [True, False])
def test_wrong_magic(tmp_path, gz):
    make_folder(tmp_path, gz=gz)
    name = TRAIN_X if gz else TRAIN_X[:-3]
    _replace(tmp_path, name, idx_bytes(np.zeros((2, 28, 28)), magic=b"\x00\x01"))
    expect_error(tmp_path, name, match="magic")


def test_gzip_named_raw(tmp_path):
    make_folder(tmp_path, gz=False)
    name = TRAIN_X[:-3]
    _replace(tmp_path, name, idx_bytes(np.zeros((2, 28, 28))), gz=True)
    expect_error(tmp_path, name, match="gzip")


@pytest.mark.parametrize("type_byte", [0x09, 0x0B, 0x0D, 0x0E, 0x00, 0xFF])
def test_wrong_type_byte(tmp_path, type_byte):
    make_folder(tmp_path)
    _replace(tmp_path, TEST_Y, idx_bytes(np.zeros(3), type_byte=type_byte))
    expect_error(tmp_path, TEST_Y, match="0x08")


@pytest.mark.parametrize("name,arr", [(TRAIN_X, np.zeros((5, 784))), (TRAIN_X, np.zeros(5)),
                                      (TRAIN_Y, np.zeros((5, 1))), (TEST_X, np.zeros((3, 28, 28, 1)))])
def test_wrong_dims(tmp_path, name, arr):
    make_folder(tmp_path)
    _replace(tmp_path, name, idx_bytes(arr))
    expect_error(tmp_path, name, match="dimensions")


def test_zero_dims(tmp_path):
    make_folder(tmp_path)
    _replace(tmp_path, TRAIN_Y, b"\x00\x00\x08\x00")
    expect_error(tmp_path, TRAIN_Y, match="dimensions")


@pytest.mark.parametrize("shape", [(5, 27, 28), (5, 28, 27), (5, 32, 32)])
def test_wrong_image_size(tmp_path, shape):
    make_folder(tmp_path)
    _replace(tmp_path, TRAIN_X, idx_bytes(np.zeros(shape)))
    expect_error(tmp_path, TRAIN_X, match=f"{shape[1]} x {shape[2]} pixels")


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("cut", [1, 28 * 28, 28 * 28 * 3 + 2])
def test_truncated_data(tmp_path, gz, cut):
    make_folder(tmp_path, gz=gz)
    name = TEST_X if gz else TEST_X[:-3]
    _replace(tmp_path, name, idx_bytes(np.zeros((3, 28, 28)), cut=cut))
    expect_error(tmp_path, name, match="truncated")


@pytest.mark.parametrize("payload", [b"", b"\x00\x00", b"\x00\x00\x08\x03\x00\x00\x00\x05"])
def test_truncated_header(tmp_path, payload):
    make_folder(tmp_path)
    _replace(tmp_path, TRAIN_X, payload)
    expect_error(tmp_path, TRAIN_X)


@pytest.mark.parametrize("gz", [True, False])
def test_trailing_bytes(tmp_path, gz):
    make_folder(tmp_path, gz=gz)
    name = TRAIN_Y if gz else TRAIN_Y[:-3]
    _replace(tmp_path, name, idx_bytes(np.zeros(5), tail=b"\x00"))
    expect_error(tmp_path, name, match="after the data")


@pytest.mark.parametrize("how", ["flip", "cut", "not-gzip", "garbage-after"])
def test_corrupt_gzip(tmp_path, how):
    make_folder(tmp_path)
    good = gzip.compress(idx_bytes(np.arange(5 * 28 * 28).reshape(5, 28, 28) % 251), mtime=0)
    if how == "flip":
        bad = bytearray(good)
        for i in range(20, len(bad) - 8, 7):
            bad[i] ^= 0xFF
        bad = bytes(bad)
    elif how == "cut":
        bad = good[:len(good) // 2]
    elif how == "not-gzip":
        bad = b"this is not a gzip stream at all"
    else:
        bad = good + b"garbage"
    (tmp_path / TRAIN_X).write_bytes(bad)
    expect_error(tmp_path, TRAIN_X, match="gzip")


@pytest.mark.parametrize("split", ["train", "test"])
def test_count_mismatch(tmp_path, split):
    make_folder(tmp_path)
    xname, yname = IDX_FILES[(split, "images")], IDX_FILES[(split, "labels")]
    _replace(tmp_path, yname, idx_bytes(np.zeros(2)))
    expect_error(tmp_path, xname, yname, match="labels")


@pytest.mark.parametrize("label", [10, 255])
def test_label_out_of_range(tmp_path, label):
    make_folder(tmp_path)
    _replace(tmp_path, TEST_Y, idx_bytes(np.array([1, label, 2])))
    msg = expect_error(tmp_path, TEST_Y, match=f"label {label} at index 1")
    assert "0 <= label <= 9" in msg


@pytest.mark.parametrize("split", ["train", "test"])
def test_empty_split(tmp_path, split):
    make_folder(tmp_path)
    _replace(tmp_path, IDX_FILES[(split, "images")], idx_bytes(np.zeros((0, 28, 28))))
    _replace(tmp_path, IDX_FILES[(split, "labels")], idx_bytes(np.zeros(0)))
    expect_error(tmp_path, IDX_FILES[(split, "images")], match="empty")


def test_unreadable_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    make_folder(tmp_path)
    (tmp_path / TRAIN_X).chmod(0)
    try:
        expect_error(tmp_path, TRAIN_X, match="cannot be read")
    finally:
        (tmp_path / TRAIN_X).chmod(0o644)


def test_read_idx_errors_name_the_file(tmp_path):
    for payload, match in [(idx_bytes(np.zeros(3), type_byte=0x0C), "0x0c"),
                           (idx_bytes(np.zeros((2, 2))), "dimensions")]:
        p = write_file(tmp_path / "x.idx", payload)
        with pytest.raises(DataError, match=match) as info:
            read_idx(p, ndim=1)
        assert str(p) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(DataError, match="not found"):
        read_idx(tmp_path / "missing.gz")
    with pytest.raises(DataError, match="directory"):
        read_idx(tmp_path)

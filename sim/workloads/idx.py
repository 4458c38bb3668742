"""Reader for the IDX image/label files of MNIST and Fashion-MNIST.

Layer: bottom (``objectives and data``); imports nothing from the rest of ``sim`` but ``sim.base.errors``, and only
numpy (no torch).

- :func:`read_idx` -- one IDX file (gzip-compressed when its name ends in ``.gz``) as a read-only uint8 array.
- :func:`load_image_dataset` -- the four files of a data set's folder as an :class:`ImageDataset`, checked and
  cached in-process.

IDX format
----------
As described on the MNIST database page (Y. LeCun, C. Cortes and C. J. C. Burges, "The MNIST database of
handwritten digits", http://yann.lecun.com/exdb/mnist/, section "FILE FORMATS FOR THE MNIST DATABASE");
Fashion-MNIST (H. Xiao, K. Rasul and R. Vollgraf, "Fashion-MNIST: a Novel Image Dataset for Benchmarking Machine
Learning Algorithms", arXiv:1708.07747, 2017) ships its files in the same format under the same names. All
integers of the header are big-endian:

====== ================ ====================================================================
offset field            value
====== ================ ====================================================================
0      magic, 2 bytes   ``0x00 0x00``
2      type, 1 byte     ``0x08`` = unsigned byte (the only type these data sets use and this
                        reader accepts; the format also defines 0x09 int8, 0x0B int16,
                        0x0C int32, 0x0D float32, 0x0E float64)
3      dims, 1 byte     number of dimensions: 3 for image files (count, rows, columns),
                        1 for label files (count)
4      sizes            ``dims`` x uint32, one per dimension
4+4*d  data             ``prod(sizes)`` bytes in C (row-major) order, nothing after them
====== ================ ====================================================================

Units: pixels are uint8 grey levels 0..255 (MNIST: 0 = background white, 255 = ink; Fashion-MNIST likewise,
0 = background); images are 28 x 28 pixels; labels are class indices 0..9 (:data:`N_CLASSES`). The standard
splits hold 60,000 training and 10,000 test samples, but any non-empty subset in the same format is accepted.

Errors
------
Every problem with a file or folder raises :class:`sim.base.errors.DataError` with one line that names the folder,
the file, what is wrong, the valid value, and how to get the data; an unknown data set name raises
:class:`sim.base.errors.ConfigError` naming the valid names. No OSError, EOFError, zlib.error or numpy ValueError
escapes.
"""
from __future__ import annotations

import gzip
import os
import stat
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.base.errors import ConfigError, DataError

__all__ = ["IMAGE_DATASETS", "DEFAULT_PATHS", "IMAGE_SHAPE", "N_CLASSES", "IDX_FILES", "ImageDataset",
           "read_idx", "load_image_dataset", "clear_cache"]

#: Names accepted by :func:`load_image_dataset`.
IMAGE_DATASETS = ("fashion-mnist", "mnist")

#: Folder read when ``data.path`` is empty: Debian's package ``dataset-fashion-mnist`` installs the four
#: Fashion-MNIST files there; no Debian package ships MNIST, so ``""`` means data.path is required.
DEFAULT_PATHS = {"fashion-mnist": "/usr/share/datasets/fashion-mnist", "mnist": ""}

#: (rows, columns) of one image, in pixels.
IMAGE_SHAPE = (28, 28)

#: Number of classes; labels are 0..N_CLASSES-1.
N_CLASSES = 10

#: The four files of a data set folder, by (split, kind), gzip-compressed names. The uncompressed names (the same
#: without ``.gz``) are accepted too; where both exist the ``.gz`` file is read.
IDX_FILES = {
    ("train", "images"): "train-images-idx3-ubyte.gz",
    ("train", "labels"): "train-labels-idx1-ubyte.gz",
    ("test", "images"): "t10k-images-idx3-ubyte.gz",
    ("test", "labels"): "t10k-labels-idx1-ubyte.gz",
}

_TITLES = {"fashion-mnist": "Fashion-MNIST", "mnist": "MNIST"}
_CITATIONS = {
    "fashion-mnist": "Fashion-MNIST (Xiao, Rasul & Vollgraf 2017, arXiv:1708.07747)",
    "mnist": "MNIST (LeCun, Cortes & Burges, http://yann.lecun.com/exdb/mnist/)",
}
_HOW_TO_GET = {
    "fashion-mnist": "Debian: apt-get install dataset-fashion-mnist puts the four files in "
    "/usr/share/datasets/fashion-mnist; "
    "torchvision's FashionMNIST/raw folder and Keras' ~/.keras/datasets/fashion-mnist hold them too",
    "mnist": "point data.path at a folder holding the four MNIST IDX files, e.g. torchvision's MNIST/raw folder "
    "or the files of the MNIST database page (Keras' mnist.npz is not IDX)",
}
_IDX_TYPES = {0x08: "unsigned byte", 0x09: "signed byte", 0x0B: "int16", 0x0C: "int32", 0x0D: "float32",
              0x0E: "float64"}
_KIND_NDIM = {"images": 3, "labels": 1}
_KIND_WHAT = {3: "image file (count, rows, columns)", 1: "label file (count)"}


class _IdxProblem(Exception):
    """What is wrong with one IDX file (``what``) and the valid value (``valid``); the callers word the error."""

    def __init__(self, what: str, valid: str):
        super().__init__(what)
        self.what = what
        self.valid = valid


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """An image classification data set read from IDX files (:func:`load_image_dataset`).

    All four arrays are read-only (``flags.writeable`` is False): they may be shared with the in-process cache,
    so copy one (``X.copy()``) before changing it. Compared by identity (``eq=False``: arrays have no truth value).

    Attributes:
        X_train: uint8 array of shape ``(n_train, 28, 28)``: grey levels 0..255, row-major (row, column) pixels.
        y_train: int64 array of shape ``(n_train,)``: class labels in ``0..n_classes-1``.
        X_test: uint8 array of shape ``(n_test, 28, 28)``.
        y_test: int64 array of shape ``(n_test,)``.
        n_classes: number of classes (10).
        name: data set name, one of :data:`IMAGE_DATASETS`.
        path: the folder the files were read from (absolute, symbolic links resolved).
        source: provenance: the data set and its citation, the folder, and the four files read with their sizes.
    """

    X_train: np.ndarray = field(repr=False)
    y_train: np.ndarray = field(repr=False)
    X_test: np.ndarray = field(repr=False)
    y_test: np.ndarray = field(repr=False)
    n_classes: int
    name: str
    path: str
    source: str

    @property
    def n_train(self) -> int:
        """Number of training samples (``X_train.shape[0]``)."""
        return int(self.X_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test samples (``X_test.shape[0]``)."""
        return int(self.X_test.shape[0])


def _hex(b: bytes) -> str:
    return "0x" + b.hex() if b else "nothing"


def _parse_idx(raw: bytes, ndim: int | None, gz_hint: bool) -> np.ndarray:
    """Parse the bytes of one (decompressed) IDX file; raises :class:`_IdxProblem`."""
    if len(raw) < 4:
        raise _IdxProblem(f"holds {len(raw)} bytes, shorter than the 4-byte IDX header",
                          "an IDX file: 2 zero bytes, type byte 0x08, dims byte, dims x uint32 sizes, data")
    if raw[0:2] != b"\x00\x00":
        what = f"magic bytes are {_hex(raw[0:2])}"
        if raw[0:2] == b"\x1f\x8b" and gz_hint:
            what += " (a gzip stream: name the file with .gz)"
        raise _IdxProblem(what, "magic 0x0000 (two zero bytes) at the start of an IDX file")
    t = raw[2]
    if t != 0x08:
        kind = _IDX_TYPES.get(t, "not an IDX type")
        raise _IdxProblem(f"type byte is 0x{t:02x} ({kind})", "0x08 (unsigned byte)")
    d = raw[3]
    if ndim is not None and d != ndim:
        raise _IdxProblem(f"has {d} dimensions", f"{ndim} for an {_KIND_WHAT.get(ndim, 'IDX file')}")
    if d == 0:
        raise _IdxProblem("has 0 dimensions", ">= 1 dimension")
    head = 4 + 4 * d
    if len(raw) < head:
        raise _IdxProblem(f"header is truncated: {len(raw)} bytes, {d} dimensions need {head}",
                          f"a {head}-byte header (4 bytes + {d} x uint32 sizes)")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=d, offset=4))
    n = 1
    for s in shape:
        n *= s
    have = len(raw) - head
    if have != n:
        dims = " x ".join(map(str, shape))
        what = (f"data are truncated: {have} bytes" if have < n else f"holds {have - n} bytes after the data: "
                f"{have} bytes") + f" for sizes {dims}"
        raise _IdxProblem(what, f"exactly {n} data bytes after the {head}-byte header")
    arr = np.frombuffer(raw, dtype=np.uint8, count=n, offset=head).reshape(shape)
    arr.flags.writeable = False
    return arr


def _read(path: str, ndim: int | None) -> np.ndarray:
    """Read and parse one IDX file; raises :class:`_IdxProblem` for every problem (no OSError etc. escapes)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        what = "is a broken symbolic link" if os.path.islink(path) else "not found"
        raise _IdxProblem(what, "an existing IDX file") from None
    except OSError as exc:
        raise _IdxProblem(f"cannot be read: {exc.strerror or exc}", "a readable IDX file") from None
    if stat.S_ISDIR(st.st_mode):
        raise _IdxProblem("is a directory, not a regular file", "a regular IDX file")
    if not stat.S_ISREG(st.st_mode):
        raise _IdxProblem("is not a regular file", "a regular IDX file")
    gz = path.endswith(".gz")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if gz:
            raw = gzip.decompress(raw)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise _IdxProblem(f"is not a valid gzip stream ({msg})",
                          "a gzip-compressed IDX file, since the name ends in .gz") from None
    except OSError as exc:
        raise _IdxProblem(f"cannot be read: {exc.strerror or ' '.join(str(exc).split())}",
                          "a readable IDX file") from None
    except MemoryError:
        raise _IdxProblem("does not fit in memory", "an IDX file smaller than the available memory") from None
    try:
        return _parse_idx(raw, ndim, gz_hint=not gz)
    except ValueError as exc:  # numpy; should not happen after the checks above
        raise _IdxProblem(f"is malformed ({' '.join(str(exc).split())})", "an IDX file") from None


def read_idx(path, ndim: int | None = None) -> np.ndarray:
    """Read one IDX file: gzip-compressed when the name ends in ``.gz``, else raw.

    Args:
        path: the file (str or path-like).
        ndim: the number of dimensions the caller expects: 3 for image files (count, rows, columns), 1 for label
            files (count); None accepts any number >= 1.

    Returns:
        A read-only uint8 array of the header's shape, e.g. ``(60000, 28, 28)`` for Fashion-MNIST's training
        images and ``(60000,)`` for its labels.

    Raises:
        DataError: one line naming the file, what is wrong and the valid value when the file is missing or not a
            regular file, the gzip stream is corrupt, the magic is not two zero bytes, the type byte is not 0x08,
            the number of dimensions is not ``ndim``, or the data are not exactly ``prod(sizes)`` bytes
            (truncated or trailing bytes).
    """
    path = os.fspath(path)
    try:
        return _read(path, ndim)
    except _IdxProblem as p:
        raise DataError(f"IDX file {path!r}: {p.what} (valid: {p.valid})") from None


def _folder_desc(name: str) -> str:
    files = ", ".join(IDX_FILES.values())
    return f"a folder holding the four {_TITLES[name]} IDX files {files} (or the same names without .gz)"


_cache: dict[tuple, ImageDataset] = {}
_cache_lock = threading.Lock()
_CACHE_MAX = 4


def clear_cache() -> None:
    """Empty the in-process cache of :func:`load_image_dataset` (the next call reads the files again)."""
    with _cache_lock:
        _cache.clear()


def load_image_dataset(name: str, path="") -> ImageDataset:
    """Load MNIST or Fashion-MNIST from the four IDX files of a folder.

    Args:
        name: ``"fashion-mnist"`` or ``"mnist"`` (:data:`IMAGE_DATASETS`).
        path: the folder (``data.path``); ``""`` means :data:`DEFAULT_PATHS` ``[name]``
            (``/usr/share/datasets/fashion-mnist`` for Fashion-MNIST, where Debian's ``dataset-fashion-mnist``
            installs it; MNIST has no default). The folder must hold ``train-images-idx3-ubyte.gz``,
            ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz`` and ``t10k-labels-idx1-ubyte.gz``, or the
            same names without ``.gz`` (torchvision's ``raw/`` folder keeps both; the ``.gz`` file is read).

    Returns:
        An :class:`ImageDataset`: X_train uint8 ``(n_train, 28, 28)``, y_train int64 ``(n_train,)``, X_test uint8
        ``(n_test, 28, 28)``, y_test int64 ``(n_test,)``, all read-only. The standard splits are 60,000 / 10,000,
        but any non-empty subsets are accepted. A second call with the same name, folder and unchanged files
        (sizes and modification times) returns the cached object without reading.

    Raises:
        ConfigError: ``name`` is not one of :data:`IMAGE_DATASETS`.
        DataError: one line naming the folder, the file, what is wrong, the valid value and how to get the data:
            no folder given for MNIST, the folder is missing or not a folder, a file is missing or malformed
            (see :func:`read_idx`), images are not 3-D with 28 x 28 pixels, labels are not 1-D, a split's image
            and label counts differ, a split is empty, or a label is outside 0..9.
    """
    if not isinstance(name, str) or name not in IMAGE_DATASETS:
        raise ConfigError(f"data set {name!r} is not an image data set: valid names {', '.join(IMAGE_DATASETS)}")
    given = os.fspath(path) if path is not None else ""
    hint = _HOW_TO_GET[name]
    if given == "":
        folder = DEFAULT_PATHS[name]
        if not folder:
            raise DataError(f"data.path = '': {_TITLES[name]} has no default folder, so data.path must be set "
                            f"(valid: {_folder_desc(name)}; {hint})")
        where = f"data.path = '' (default for {name}: {folder!r})"
    else:
        folder = given
        where = f"data.path = {given!r}"

    def fail(what: str, valid: str):
        raise DataError(f"{where}: {what} (valid: {valid}; {hint})")

    try:
        resolved = str(Path(folder).expanduser().resolve())
        isdir = os.path.isdir(resolved)
        exists = os.path.exists(resolved)
    except (OSError, RuntimeError, ValueError) as exc:
        fail(f"the folder cannot be opened ({' '.join(str(exc).split())})", _folder_desc(name))
    if not exists:
        fail("the folder does not exist", _folder_desc(name))
    if not isdir:
        fail("is not a folder", _folder_desc(name))

    chosen: dict[tuple[str, str], str] = {}
    for key, gzname in IDX_FILES.items():
        rawname = gzname[:-3]
        for fname in (gzname, rawname):
            if os.path.lexists(os.path.join(resolved, fname)):
                chosen[key] = fname
                break
        else:
            fail(f"{gzname} not found (nor {rawname})", _folder_desc(name))

    stamp = []
    for key, fname in chosen.items():
        try:
            st = os.stat(os.path.join(resolved, fname))
            stamp.append((fname, st.st_size, st.st_mtime_ns))
        except OSError:
            stamp.append((fname, -1, -1))  # read below reports it
    ckey = (name, resolved, tuple(stamp))
    with _cache_lock:
        hit = _cache.get(ckey)
    if hit is not None:
        return hit

    arrays: dict[tuple[str, str], np.ndarray] = {}
    for key, fname in chosen.items():
        ndim = _KIND_NDIM[key[1]]
        try:
            arrays[key] = _read(os.path.join(resolved, fname), ndim)
        except _IdxProblem as p:
            fail(f"{fname} {p.what}", p.valid)

    out = {}
    for split in ("train", "test"):
        X, y = arrays[(split, "images")], arrays[(split, "labels")]
        xf, yf = chosen[(split, "images")], chosen[(split, "labels")]
        if X.shape[1:] != IMAGE_SHAPE:
            fail(f"{xf} holds images of {X.shape[1]} x {X.shape[2]} pixels",
                 f"{IMAGE_SHAPE[0]} x {IMAGE_SHAPE[1]} pixels")
        if X.shape[0] == 0:
            fail(f"{xf} holds 0 images: the {split} split is empty", "at least 1 sample per split")
        if y.shape[0] != X.shape[0]:
            fail(f"{xf} holds {X.shape[0]} images but {yf} holds {y.shape[0]} labels",
                 "as many labels as images in each split")
        bad = np.flatnonzero(y >= N_CLASSES)
        if bad.size:
            i = int(bad[0])
            fail(f"{yf} holds label {int(y[i])} at index {i} ({bad.size} of {y.size} labels out of range)",
                 f"labels 0 <= label <= {N_CLASSES - 1}")
        y64 = y.astype(np.int64)
        y64.flags.writeable = False
        out[split] = (X, y64)

    files = ", ".join(f"{fname} ({size} bytes)" for fname, size, _ in stamp)
    source = (f"{_CITATIONS[name]}: IDX files read by sim.workloads.idx from {resolved}: {files}; "
              f"{out['train'][0].shape[0]} train / {out['test'][0].shape[0]} test images of 28 x 28 uint8 pixels")
    ds = ImageDataset(X_train=out["train"][0], y_train=out["train"][1], X_test=out["test"][0],
                      y_test=out["test"][1], n_classes=N_CLASSES, name=name, path=resolved, source=source)
    with _cache_lock:
        _cache[ckey] = ds
        while len(_cache) > _CACHE_MAX:
            _cache.pop(next(iter(_cache)))
    return ds

"""Safe, atomic checkpoints for DP training.

A checkpoint holds everything needed to continue with the *same* guarantee: the trained
parameters, the optimizer state, the accountant's history, the sampler's position and every RNG
state (sampling, noise, dropout). It is a ``torch.save`` file of plain containers, tensors and
numbers only, loaded with ``torch.load(weights_only=True)``: loading never unpickles arbitrary
objects. Writes go to a temporary file in the same folder, are fsync'ed, then renamed over the
old file (``os.replace`` is atomic), so a crash mid-write leaves the previous checkpoint intact.
The file starts with one line, ``pdpsgd-checkpoint sha256:<hex digest>``, the SHA-256 of the
``torch.save`` bytes after it: a bit flipped anywhere (a tensor's data or the accountant's history,
which ``torch.load`` reads without complaint) is refused on load (review, round 39: one flipped bit
in the stored history made a resumed run count 6 of its 10 released steps). Files written before
round 39 have no such line and are read unchecked.

Formal guarantee (with ``pdpsgd.train``): RNG *states* are saved and restored, never re-derived
from a seed, so a resumed run continues each random stream where it stopped and never repeats
noise that was already used in a released update. That needs the privacy ledger: it shows whether
updates were released after the checkpoint (then, and when no ledger is given, every stream is
re-seeded from fresh entropy; the CLI refuses a private checkpoint without its ledger).
"""
from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import io
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Tuple

import torch

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "check_fingerprint",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "save_tensors",
    "FORMAT_VERSION",
]

FORMAT_VERSION = 1
# the checkpoint file's first line: this prefix, the hex SHA-256 of the rest of the file, "\n"
_DIGEST_PREFIX = b"pdpsgd-checkpoint sha256:"
_DIGEST_LINE = len(_DIGEST_PREFIX) + 64 + 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or belongs to another run (model, data, privacy plan)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _atomic(path: os.PathLike, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    _atomic(path, lambda f: f.write(data))


def atomic_write_text(path: os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


_NO_FLOCK = {getattr(errno, n) for n in ("ENOLCK", "EOPNOTSUPP", "ENOTSUP", "ENOSYS", "EINVAL") if hasattr(errno, n)}


@contextlib.contextmanager
def file_lock(path: os.PathLike) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) on ``<path>.lock`` while the block runs: processes (and
    trainers in one process: each opens its own file) that read-check-write ``path`` under it take
    turns. Where ``fcntl`` does not exist (Windows) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # (no flock: the caller's check still runs, unlocked)
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # (as the atomic writes do)
    fd = os.open(f"{os.fspath(path)}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # (a file system without flock, e.g. some network mounts: the check runs unlocked)
            if err.errno not in _NO_FLOCK:
                raise
            from ._warn import warn

            warn(f"could not lock {path}.lock ({err.strerror or err}): the ledger's check and write run unlocked, "
                 "so two processes resumed from one checkpoint at the same moment are not kept apart")
        yield
    finally:
        os.close(fd)  # (releases the lock)


def atomic_write_json(path: os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as strict JSON: a non-finite number (the loss of an empty batch) is
    written as null, not as the NaN / Infinity tokens other tools' parsers refuse (review, round 36)."""
    atomic_write_text(path, json.dumps(json_ready(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def json_ready(o: Any) -> Any:
    """``o`` with non-finite floats as None and tensors / paths as lists / strings (for strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, Mapping):
        return {k: json_ready(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_ready(v) for v in o]
    if isinstance(o, (str, int, bool)) or o is None:
        return o
    if getattr(o, "ndim", None) == 0 and callable(getattr(o, "item", None)):  # numpy / torch scalars
        return json_ready(o.item())
    if callable(getattr(o, "tolist", None)) and not isinstance(o, torch.Tensor):  # numpy arrays
        return json_ready(o.tolist())
    return json_ready(_json_default(o))


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def save_tensors(path: os.PathLike, tensors: Mapping[str, torch.Tensor]) -> None:
    """Atomically save a plain name -> tensor dict (moved to CPU): what a run may release, read back
    by ``torch.load(path, weights_only=True)`` and ``model.load_state_dict(..., strict=False)``."""
    payload = {n: t.detach().cpu() for n, t in tensors.items()}
    _atomic(path, lambda f: torch.save(payload, f))


def save_checkpoint(path: os.PathLike, state: Mapping[str, Any]) -> None:
    """Atomically save ``state`` (dicts/lists/tuples of tensors, numbers, strings, None).

    Tensors are moved to CPU. Use ``load_checkpoint`` to read it back safely.
    """
    state = dict(state)
    _check_loadable(state, "state")  # (first: a namedtuple, say, is refused by name, not by _to_cpu's rebuild)
    header = {"format": "pdpsgd-checkpoint", "format_version": FORMAT_VERSION}
    for k, v in header.items():  # (a state read back by load_checkpoint holds the header itself: the same values)
        if k in state and not (type(state[k]) is type(v) and state[k] == v):
            raise ValueError(f"state[{k!r}] = {state[k]!r}: {k!r} is the checkpoint's own header ({v!r}), which "
                             "load_checkpoint checks; store that value under another key")
    payload = {**_to_cpu(state), **header}

    def write(f):
        # the digest line's place is held while torch.save streams through the hash, then filled in:
        # the checkpoint is never held in memory a second time (review, round 39)
        f.write(_DIGEST_PREFIX + b"0" * 64 + b"\n")
        hashing = _HashingWriter(f)
        try:
            torch.save(payload, hashing)
        except Exception:
            if hashing.error is not None:  # (torch's zip writer reports a failed write as its own
                raise hashing.error from None  # 'unexpected pos': the OS's error, e.g. a full disk, is the cause)
            raise
        f.flush()
        f.seek(0)
        f.write(_DIGEST_PREFIX + hashing.sha.hexdigest().encode("ascii") + b"\n")

    _atomic(path, write)


class _HashingWriter:
    """A write-only file that passes every byte to ``f`` and to a SHA-256."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.error = f, hashlib.sha256(), None

    def write(self, b) -> int:
        self.sha.update(b)
        try:
            return self.f.write(b)
        except BaseException as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


class _Shifted(io.RawIOBase):
    """A read-only view of ``f`` from byte ``at`` on (what ``torch.load`` reads after the digest line)."""

    def __init__(self, f, at: int) -> None:
        super().__init__()
        self.f, self.at = f, at
        f.seek(at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self.f.readinto(b)

    def read(self, n: int = -1) -> bytes:
        return self.f.read(n)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos + self.at if whence == 0 else pos, whence) - self.at

    def tell(self) -> int:
        return self.f.tell() - self.at


# what torch.load(weights_only=True) reads back besides tensors, by exact type (a subclass, np.float64
# of float or an IntEnum of int, is pickled as its own class, which it refuses; review of round 40)
_PLAIN = (int, float, bool, complex, str, bytes, bytearray, type(None), torch.dtype, torch.device, torch.Size)
_MAPS = (dict, collections.OrderedDict)
_SEQS = (list, tuple, set)


def _check_loadable(x: Any, at: str) -> None:
    """Refuse, before anything is written, a value ``load_checkpoint`` could not read back (review of
    round 40: a numpy array saved without complaint, and the checkpoint then failed to load)."""
    if isinstance(x, torch.Tensor) or type(x) in _PLAIN:
        return
    if type(x) in _MAPS:
        for k, v in x.items():
            _check_loadable(k, f"{at} key")
            _check_loadable(v, f"{at}[{k!r}]")
        return
    if type(x) in _SEQS:
        for i, v in enumerate(x):
            _check_loadable(v, f"{at}[{i}]")
        return
    hint = " (convert it with torch.from_numpy, .item() or .tolist())" if type(x).__module__.startswith("numpy") else ""
    raise TypeError(f"a checkpoint holds tensors, numbers, strings, None and dicts / lists / tuples / sets of them, "
                    f"which torch.load(weights_only=True) reads back; {at} is a "
                    f"{type(x).__module__}.{type(x).__qualname__}{hint}")


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def load_checkpoint(path: os.PathLike) -> Dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` with ``torch.load(weights_only=True)``.

    Raises ``CheckpointError`` (never a silent fallback) if the file is missing, truncated,
    corrupt (its SHA-256 line disagrees with its content), not a pdpsgd checkpoint or from an
    unknown format version.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if not path.is_file():
        raise CheckpointError(f"the checkpoint path {path} is not a file")
    fix = "resume from an intact copy, or start a new run in a new --output-dir"
    try:
        with open(path, "rb") as f:
            before = _stamp(f)
            if before[0] == 0:
                raise CheckpointError(f"checkpoint {path} is empty (0 bytes: a write that never finished); {fix}")
            head = f.read(_DIGEST_LINE)
            if not head.startswith(_DIGEST_PREFIX[:10]):  # (a file written before round 39: a bare
                f.seek(0)                                  # torch.save zip, read unchecked)
                return _checked(_torch_load(path, f, fix), path)
            want, sha = head[len(_DIGEST_PREFIX):-1], hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):  # (hashed in blocks, not held whole)
                sha.update(block)
            if not head.startswith(_DIGEST_PREFIX) or not head.endswith(b"\n") \
                    or sha.hexdigest().encode("ascii") != want:
                raise CheckpointError(f"checkpoint {path} is corrupt (its SHA-256 does not match its content: a "
                                      f"damaged or edited file); {fix}")
            if before[0] == _DIGEST_LINE:
                raise CheckpointError(f"checkpoint {path} is truncated (its digest line and nothing after it); {fix}")
            # torch.load reads the same open file (an atomic replace since does not change it) from the line
            # on; a write into it meanwhile (a copy over it) changes its size or time (review of round 40)
            state = _torch_load(path, _Shifted(f, _DIGEST_LINE), fix)
            if _stamp(f) != before:
                raise CheckpointError(f"checkpoint {path} changed while it was being read (another process wrote "
                                      "into it); load it again when nothing writes to it")
            return _checked(state, path)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({e.strerror or e})") from None


def _stamp(f) -> Tuple[int, int, int]:
    st = os.fstat(f.fileno())
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _torch_load(path: Path, src: Any, fix: str) -> Any:
    try:
        # mmap=False: torch maps only a path, and a process-wide ``torch.utils.serialization.config.load.mmap``
        # would otherwise refuse the open file (review of round 40)
        return torch.load(src, map_location="cpu", weights_only=True, mmap=False)
    except Exception as e:  # truncated zip, bad pickle opcode, disallowed global, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({first[:200]}); {fix}") from None


def _checked(state: Any, path: Path) -> Dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") != "pdpsgd-checkpoint":
        raise CheckpointError(f"{path} is not a pdpsgd checkpoint")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {state.get('format_version')}, this pdpsgd reads {FORMAT_VERSION}"
        )
    return state


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], *, path: Any = "checkpoint") -> None:
    """Raise ``CheckpointError`` naming every key whose value differs between a checkpoint's
    fingerprint and the current run's (model, dataset size, privacy plan, ...)."""
    diffs = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k, "<missing>"), current.get(k, "<missing>")
        if isinstance(a, float) or isinstance(b, float):
            try:
                same = abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
            except (TypeError, ValueError):
                same = False
        else:
            same = a == b
        if not same:
            diffs.append(f"{k}: {_short(a)} in the checkpoint vs {_short(b)} now")
    if diffs:
        raise CheckpointError(f"{path} belongs to a different run ({'; '.join(diffs)}); "
                              "use the same model, data and privacy settings, or a new --output-dir")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:18] + "…" + s[-18:]

"""Checkpoints and resume: an interrupted + resumed run ends with the same ε and (same seed, CPU)
the same parameters as an uninterrupted one; corrupt / mismatched checkpoints are clear errors;
loading never unpickles arbitrary objects; a crash after a checkpoint never reuses noise."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdpsgd.checkpoint import (CheckpointError, atomic_write_json, check_fingerprint, load_checkpoint,
                               save_checkpoint)
from pdpsgd.cli import main
from test_cli import make_tiny_data, make_tiny_model, one_thread, run_cli, tiny_args  # noqa: F401


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyck")
    return {"model": make_tiny_model(root / "model"), "data": make_tiny_data(root / "data.jsonl"), "root": root}


def _args(tiny, out, *extra):
    # 12 logical steps, dropout on (BERT default 0.1), all params trained, eval every 5 steps
    return tiny_args(tiny, out, "--epochs", "3", "--seed", "7", "--eval-every", "5", "--checkpoint-every", "4",
                     "--dropout", *extra)


def _final(out: Path):
    rep = json.loads((out / "report.json").read_text())
    params = load_checkpoint(out / "checkpoint.pt")["trainer"]["params"]
    return rep["results"], params


@pytest.mark.parametrize("rng", ["torch", "native"])
def test_interrupt_and_resume_is_identical(rng, tiny, tmp_path, capsys):
    """Also with pdpsgd's own noise kernel, whose stream is keyed from the (checkpointed) generator."""
    if rng == "native":
        from pdpsgd import native_rng

        if not native_rng.available():
            pytest.skip("no C compiler to build the native noise kernel")
    a, b = tmp_path / "straight", tmp_path / "resumed"
    extra = ("--noise-rng", rng)
    assert main(_args(tiny, a, *extra)) == 0
    assert main(_args(tiny, b, *extra, "--interrupt-after", "6")) == 130  # simulated Ctrl-C after step 6
    err = capsys.readouterr().err
    assert "interrupted at step 6/12" in err and "--resume" in err
    st = load_checkpoint(b / "checkpoint.pt")
    assert st["trainer"]["step"] == 6 and json.loads(st["trainer"]["accountant"])["history"][0][2] == 6
    assert json.loads((b / "ledger.json").read_text())["steps_released"] == 6
    assert main(_args(tiny, b, *extra, "--resume")) == 0
    ra, pa = _final(a)
    rb, pb = _final(b)
    assert ra["steps"] == rb["steps"] == 12
    assert ra["epsilon"] == rb["epsilon"]  # identical ε (lower, estimate, upper)
    assert pa.keys() == pb.keys()
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n  # bit-identical parameters
    assert ra["accuracy"] == rb["accuracy"]
    # a finished run's checkpoint holds no random stream (they recompute every step's noise; review,
    # round 34), and what it may release, the trained parameters, is a file of its own
    assert load_checkpoint(b / "checkpoint.pt")["trainer"]["rng"] is None
    # a plain name -> tensor dict (review, round 36: it carried the checkpoint's format keys, which
    # model.load_state_dict refuses): torch.load(weights_only=True) reads it
    released = torch.load(b / "trained_params.pt", weights_only=True)
    assert released.keys() == pb.keys() and all(torch.equal(released[n], pb[n]) for n in pb)


def test_resuming_without_the_seed_reports_the_checkpoints(tiny, tmp_path, capsys):
    """Review, round 34: resuming a --seed 7 run without --seed recorded seed None in the report
    ("fresh entropy") while its streams, recomputable from seed 7, went on."""
    out = tmp_path / "r"
    assert main(_args(tiny, out, "--interrupt-after", "2")) == 130
    args = [x for x in _args(tiny, out, "--resume")]
    i = args.index("--seed")
    del args[i:i + 2]
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "no --seed given" in err and "--seed 7" in err
    assert json.loads((out / "report.json").read_text())["settings"]["seed"] == 7


def test_resuming_with_another_test_set_is_noted(tiny, tmp_path, capsys):
    """Round 35: a resume with another --test-data was silent; the report's accuracy curve then
    mixed two test sets. (No privacy effect: the training data must match, and is checked.)"""
    one = str(make_tiny_data(tmp_path / "one.jsonl", n=20, seed=1))
    other = str(make_tiny_data(tmp_path / "other.jsonl", n=20, seed=2))
    for resumed_with, noted in ((one, False), (other, True)):
        out = tmp_path / f"r{noted}"
        assert main(_args(tiny, out, "--test-data", one, "--interrupt-after", "2")) == 130
        capsys.readouterr()
        assert main(_args(tiny, out, "--test-data", resumed_with, "--resume")) == 0
        err = capsys.readouterr().err
        assert ("the test set differs from the checkpoint's run" in err) == noted, err


def test_real_sigint_saves_checkpoint_and_resumes(tiny, tmp_path):
    out, ref = tmp_path / "sig", tmp_path / "ref"
    args = _args(tiny, out, "--epochs", "6", "--checkpoint-every", "1000")  # 24 steps
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "pdpsgd", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    ledger = out / "ledger.json"
    t0 = time.time()
    while time.time() - t0 < 240 and p.poll() is None:
        try:
            if json.loads(ledger.read_text())["steps_released"] >= 2:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    if p.poll() is not None:
        pytest.skip("the run finished before it could be interrupted")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=240)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "checkpoint saved" in err
    st = load_checkpoint(out / "checkpoint.pt")
    k = st["trainer"]["step"]
    assert 2 <= k < 24
    assert json.loads(ledger.read_text())["steps_released"] == k  # ledger and checkpoint agree
    assert main(_args(tiny, out, "--epochs", "6", "--checkpoint-every", "1000", "--resume")) == 0
    assert main(_args(tiny, ref, "--epochs", "6", "--checkpoint-every", "1000")) == 0
    ra, pa = _final(ref)
    rb, pb = _final(out)
    assert ra["epsilon"] == rb["epsilon"]
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


def test_corrupt_and_mismatched_checkpoints_are_clear_errors(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny, out, "--interrupt-after", "2")) == 130
    capsys.readouterr()
    ck = out / "checkpoint.pt"
    good = ck.read_bytes()

    def resume_err(*extra, args=None):
        rc = main(args or _args(tiny, out, "--resume", *extra))
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err
        lines = [ln for ln in err.splitlines() if ln.startswith("pdpsgd: error:")]
        assert len(lines) == 1, err
        return lines[0]

    ck.write_bytes(good[: len(good) // 2])  # truncated
    assert "corrupt" in resume_err()
    ck.write_bytes(b"garbage" * 10)
    assert "corrupt" in resume_err()
    ck.write_bytes(good)
    # other dataset size
    assert "num_train" in resume_err(args=_args(tiny, out, "--resume") + ["--data", str(make_tiny_data(
        tmp_path / "more.jsonl", n=100))])
    # other model (same architecture, other weights)
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert "model" in resume_err(args=_args(tiny, out, "--resume") + ["--model", str(other)])
    # other privacy plan
    assert "noise_multiplier" in resume_err("--epsilon", "5")
    # other optimizer settings: the checkpoint's optimizer state would silently restore its own
    # (the new --lr was ignored but written to report.json before)
    err = resume_err("--lr", "5e-4", "--weight-decay", "0.1")
    assert "--lr 0.0001 in the checkpoint vs 0.0005 now" in err and "--weight-decay 0.01" in err
    assert "--head-lr 0.03 in the checkpoint vs 0.1 now" in resume_err("--head-lr", "0.1")
    # the run still resumes with the right settings; what it takes from the command line instead of
    # the checkpoint is said (it was silent)
    assert main(_args(tiny, out, "--resume", "--seed", "8", "--method", "bk")) == 0
    err = capsys.readouterr().err
    assert "--seed 8 is ignored on resume" in err, err
    assert "--method 'bk' (the checkpoint's run had 'vmap')" in err, err


def test_checkpoint_loading_is_weights_only(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    p = tmp_path / "evil.pt"
    torch.save({"format": "pdpsgd-checkpoint", "format_version": 1, "x": Evil()}, p)
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_checkpoint(p)
    assert not (tmp_path / "pwned").exists()
    torch.save({"a": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a pdpsgd checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def test_a_flipped_bit_anywhere_in_a_checkpoint_is_refused(tmp_path):
    """torch.load reads a checkpoint whose tensor data or strings were damaged without complaint
    (review, round 39: one flipped bit turned the stored history's 5 steps into 1, and a resumed
    run counted 6 of its 10 released steps): the file's SHA-256 line catches any flip."""
    import random

    p = tmp_path / "ck.pt"
    hist = json.dumps({"history": [[1.0, 0.2, 5]]})
    save_checkpoint(p, {"step": 5, "w": torch.arange(4096, dtype=torch.float32), "accountant": hist})
    good = p.read_bytes()
    assert torch.equal(load_checkpoint(p)["w"], torch.arange(4096, dtype=torch.float32))
    at = {"tensor data": good.index(torch.arange(4096, dtype=torch.float32).numpy().tobytes()[4000:4008]),
          "history": good.index(b"0.2, 5]") + 5}
    rng = random.Random(0)
    at.update({f"byte {i}": rng.randrange(len(good)) for i in range(8)})
    for what, i in at.items():
        for bit in (0, 2):
            bad = bytearray(good)
            bad[i] ^= 1 << bit
            p.write_bytes(bytes(bad))
            with pytest.raises(CheckpointError, match="corrupt"):
                load_checkpoint(p)
    p.write_bytes(good[:-1])  # truncated by one byte
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(p)
    # a file written before round 39 (a bare torch.save zip, no digest line) is still read
    torch.save({"format": "pdpsgd-checkpoint", "format_version": 1, "step": 3}, p)
    assert load_checkpoint(p)["step"] == 3


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    p = tmp_path / "ck.pt"
    save_checkpoint(p, {"step": 1, "w": torch.arange(3)})
    real_save = torch.save

    def failing(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError):
        save_checkpoint(p, {"step": 2})
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(p)["step"] == 1
    assert [x.name for x in tmp_path.iterdir()] == ["ck.pt"]  # no temp file left behind
    atomic_write_json(tmp_path / "l.json", {"a": 1})
    assert json.loads((tmp_path / "l.json").read_text()) == {"a": 1}


def test_fingerprint_mismatch_lists_keys():
    check_fingerprint({"a": 1, "b": 0.5}, {"a": 1, "b": 0.5})
    with pytest.raises(CheckpointError, match="num_train: 10 in the checkpoint vs 12 now"):
        check_fingerprint({"num_train": 10}, {"num_train": 12})


def test_crash_after_checkpoint_keeps_lost_steps_on_ledger_and_reseeds(tiny, tmp_path, capsys):
    """Ledger ahead of the checkpoint (a hard kill between checkpoints): the lost releases stay
    counted and no random stream is replayed."""
    out = tmp_path / "crash"
    assert main(_args(tiny, out, "--interrupt-after", "3")) == 130
    ck = load_checkpoint(out / "checkpoint.pt")
    ledger = json.loads((out / "ledger.json").read_text())
    # pretend steps 4 and 5 were released, then the process was killed before a checkpoint
    ledger["steps_released"] = 5
    ledger["accountant"]["history"][0][2] = 5
    atomic_write_json(out / "ledger.json", ledger)
    capsys.readouterr()
    from pdpsgd.train import DPTrainer  # noqa: F401

    assert main(_args(tiny, out, "--resume")) == 0
    err = capsys.readouterr().err
    assert "2 step(s) were released after the last checkpoint" in err
    rep = json.loads((out / "report.json").read_text())["results"]
    assert rep["steps"] == 12 and rep["steps_on_ledger"] == 14  # 12 run + 2 lost, all accounted
    noise_state = ck["trainer"]["rng"]["noise"]
    assert isinstance(noise_state, torch.Tensor)


def test_json_files_are_strict_json_with_null_for_non_finite_numbers(tmp_path):
    """report.json and the ledger are read by other tools: a nan (the loss of an empty Poisson batch)
    or an inf is written as null, never as the bare NaN / Infinity tokens strict parsers refuse (review,
    round 36)."""
    import math

    def strict(text):
        def refuse(tok):
            raise ValueError(f"non-JSON constant {tok}")
        return json.loads(text, parse_constant=refuse)

    obj = {"a": math.nan, "b": [math.inf, 1.5, -math.inf], "c": {"d": (float("nan"), 2)},
           "t": torch.tensor([float("nan"), 1.0]), "n": 3, "s": "NaN"}
    atomic_write_json(tmp_path / "r.json", obj)
    got = strict((tmp_path / "r.json").read_text())
    assert got == {"a": None, "b": [None, 1.5, None], "c": {"d": [None, 2]}, "t": [None, 1.0], "n": 3, "s": "NaN"}
    import numpy as np

    atomic_write_json(tmp_path / "n.json", {"f32": np.float32("nan"), "i64": np.int64(7), "b": np.bool_(True),
                                            "arr": np.array([1.5, np.inf]), "t0": torch.tensor(2.5)})
    assert strict((tmp_path / "n.json").read_text()) == {"f32": None, "i64": 7, "b": True, "arr": [1.5, None],
                                                         "t0": 2.5}


def test_file_lock_where_flock_is_not_supported(tmp_path, monkeypatch):
    """A file system without flock (some network mounts) runs the block unlocked, with a warning,
    instead of failing every step (round 37)."""
    import fcntl

    from pdpsgd.checkpoint import file_lock

    def no_flock(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    ran = []
    with pytest.warns(UserWarning, match="could not lock"):
        with file_lock(tmp_path / "d" / "ledger.json"):
            ran.append(1)
    assert ran == [1] and (tmp_path / "d" / "ledger.json.lock").exists()

    def io_error(fd, op):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", io_error)
    with pytest.raises(OSError, match="Input/output"):  # (any other failure is raised, not run unlocked)
        with file_lock(tmp_path / "d" / "ledger.json"):
            pass


_PEAK_SCRIPT = r"""
import resource, sys, torch
from pdpsgd.checkpoint import load_checkpoint, save_checkpoint
mb = 160
path, what = sys.argv[1], sys.argv[2]
def peak():  # (KiB on Linux)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if what == "save":
    w = torch.ones(mb << 18)  # mb MiB of float32
    base = peak()
    save_checkpoint(path, {"step": 1, "w": w})
else:
    base = peak()
    w = load_checkpoint(path)["w"]
    assert w.numel() == mb << 18 and bool(w[-1] == 1)
print((peak() - base) / mb)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_saving_and_loading_a_checkpoint_hold_it_in_memory_once(tmp_path):
    """The SHA-256 line is computed while streaming: saving does not first serialise the whole
    checkpoint into memory, loading does not read the whole file before torch.load copies it
    (review, round 39: a 400 MiB tensor peaked at 801 MiB on load, 2 copies; now one)."""
    p = str(tmp_path / "big.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for what, most in (("save", 0.5), ("load", 1.5)):
        out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, p, what], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        growth = float(out.stdout.split()[-1])  # peak RSS growth in units of the checkpoint's size
        assert growth < most, (what, growth)


def test_checkpoint_errors_name_the_cause(tmp_path, monkeypatch):
    """Review of round 40's streaming save: a write error (disk full) surfaced as torch's
    'unexpected pos' from its zip writer; a global mmap setting made every load 'corrupt'; an empty
    file said EOFError; a directory said 'no checkpoint'; a numpy array saved but never loaded."""
    import errno as _errno
    import numpy as np

    p = tmp_path / "ck.pt"
    save_checkpoint(p, {"step": 1, "w": torch.arange(3.0)})
    from pdpsgd import checkpoint as ck

    class Full:  # (the file under the hashing writer: the disk fills after 100 bytes)
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 100:
                raise OSError(_errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def flush(self):
            self.f.flush()

    real_init = ck._HashingWriter.__init__
    monkeypatch.setattr(ck._HashingWriter, "__init__", lambda self, f: real_init(self, Full(f)))
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(p, {"step": 2, "w": torch.zeros(1000)})
    monkeypatch.undo()
    assert load_checkpoint(p)["step"] == 1 and not [q for q in tmp_path.iterdir() if q.name.endswith(".tmp")]

    cfg = getattr(getattr(getattr(torch.utils, "serialization", None), "config", None), "load", None)
    if cfg is not None and hasattr(cfg, "mmap"):
        was = cfg.mmap  # (set and put back by assignment: monkeypatch's undo hid the setting for later tests)
        cfg.mmap = True
        try:
            assert load_checkpoint(p)["step"] == 1
            torch.save({"format": "pdpsgd-checkpoint", "format_version": 1, "step": 3}, tmp_path / "old.pt")
            assert load_checkpoint(tmp_path / "old.pt")["step"] == 3
        finally:
            cfg.mmap = was

    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.*intact copy"):
        load_checkpoint(tmp_path / "empty.pt")
    (tmp_path / "head.pt").write_bytes(p.read_bytes()[:ck._DIGEST_LINE])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        load_checkpoint(tmp_path / "head.pt")
    import hashlib

    empty_line = ck._DIGEST_PREFIX + hashlib.sha256(b"").hexdigest().encode() + b"\n"  # (a digest of nothing)
    (tmp_path / "head.pt").write_bytes(empty_line)
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "head.pt")
    with pytest.raises(TypeError, match="key.*numpy"):  # (a key is checked as a value is)
        save_checkpoint(tmp_path / "npkey.pt", {"counts": {np.int64(1): 0}})
    assert not (tmp_path / "npkey.pt").exists()
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(CheckpointError, match="not a file"):
        load_checkpoint(tmp_path / "dir.pt")
    with pytest.raises(TypeError, match=r"'extra'\]\['a'\].*numpy.*torch.from_numpy"):
        save_checkpoint(tmp_path / "np.pt", {"extra": {"a": np.zeros(3)}})
    assert not (tmp_path / "np.pt").exists()
    with pytest.raises(TypeError, match=r"\['t'\]\[1\].*numpy.float64.*\.item\(\)"):  # (a float subclass)
        save_checkpoint(tmp_path / "np.pt", {"t": [1.0, np.float64(2.0)]})
    import collections as _c

    ok = {"s": {1, 2}, "o": _c.OrderedDict(a=torch.ones(2)), "b": b"x", "z": 1j, "d": torch.float16}
    save_checkpoint(tmp_path / "ok.pt", ok)
    back = load_checkpoint(tmp_path / "ok.pt")
    assert back["s"] == {1, 2} and torch.equal(back["o"]["a"], torch.ones(2)) and back["d"] == torch.float16


def test_a_checkpoint_changed_while_it_is_loaded_is_refused(tmp_path, monkeypatch):
    """The digest is checked on a first read, torch.load reads the file again: a write into the file
    between the two (review of round 40) is caught by its size / modification time."""
    p = tmp_path / "ck.pt"
    save_checkpoint(p, {"step": 1, "w": torch.zeros(64)})
    from pdpsgd import checkpoint as ck

    real_init = ck._Shifted.__init__
    data_at = p.read_bytes().index(torch.zeros(64).numpy().tobytes())

    def tamper(self, f, at):
        time.sleep(0.01)
        with open(p, "r+b") as g:
            g.seek(data_at)
            g.write(torch.ones(1).numpy().tobytes())
        real_init(self, f, at)

    monkeypatch.setattr(ck._Shifted, "__init__", tamper)
    with pytest.raises(CheckpointError, match="changed while"):
        load_checkpoint(p)


def test_a_checkpoint_that_cannot_be_written_is_a_clear_cli_error(tiny, tmp_path, monkeypatch, capsys):
    """A full disk when the CLI saves: the error says the previous checkpoint is kept and how to go
    on (it was the OS's traceback)."""
    import errno as _errno
    from pdpsgd import checkpoint as ck

    def full(path, state):
        raise OSError(_errno.ENOSPC, "No space left on device")

    out = tmp_path / "full"
    real = ck.save_checkpoint
    monkeypatch.setattr(ck, "save_checkpoint", full)
    assert main(_args(tiny, out, "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert "could not write the checkpoint" in err and "No space left" in err and "new --output-dir" in err, err
    monkeypatch.setattr(ck, "save_checkpoint", real)
    out, saves = tmp_path / "later", []

    def fills(path, state):  # (the disk fills after the first checkpoint)
        saves.append(path)
        return real(path, state) if len(saves) == 1 else full(path, state)

    monkeypatch.setattr(ck, "save_checkpoint", fills)
    assert main(_args(tiny, out)) == 2
    err = capsys.readouterr().err
    assert "the previous one is intact" in err and "--resume" in err, err
    monkeypatch.setattr(ck, "save_checkpoint", real)
    assert main(_args(tiny, out, "--resume")) == 0


# (mutation review, round 43) kills K02 (prefix check dropped) and K03 (newline check dropped):
# a flipped bit in the digest line's own text (past its first 10 bytes) loaded without complaint
@pytest.mark.parametrize("where", ["prefix", "newline"])
def test_a_flipped_bit_in_the_digest_line_itself_is_refused(tmp_path, where):
    from pdpsgd import checkpoint as ck

    p = tmp_path / "ck.pt"
    save_checkpoint(p, {"step": 5, "w": torch.arange(8.0)})
    bad = bytearray(p.read_bytes())
    i = 15 if where == "prefix" else ck._DIGEST_LINE - 1  # (inside "sha256:" / the line's "\n")
    bad[i] ^= 1 << 1
    p.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(p)


# (mutation review, round 43) kills K06 (format_version not checked)
def test_a_checkpoint_of_another_format_version_is_refused(tmp_path):
    p = tmp_path / "future.pt"
    torch.save({"format": "pdpsgd-checkpoint", "format_version": 2, "step": 1}, p)
    with pytest.raises(CheckpointError, match="checkpoint format 2, this pdpsgd reads 1"):
        load_checkpoint(p)


# (mutation review, round 43) kills K07 (a file holding a non-dict raised AttributeError,
# not CheckpointError)
def test_a_file_holding_no_dict_is_not_a_checkpoint(tmp_path):
    p = tmp_path / "list.pt"
    torch.save([1, 2, 3], p)
    with pytest.raises(CheckpointError, match="not a pdpsgd checkpoint"):
        load_checkpoint(p)


# (mutation review, round 43) kills K08 (float tolerance 1e-12 -> 1e-3) and K09 (keys only in
# one fingerprint not compared)
def test_fingerprint_compares_floats_tightly_and_names_keys_on_one_side_only():
    with pytest.raises(CheckpointError, match="clip: 1.0 in the checkpoint vs 1.0005 now"):
        check_fingerprint({"clip": 1.0}, {"clip": 1.0005})
    with pytest.raises(CheckpointError, match="noise_multiplier"):
        check_fingerprint({"noise_multiplier": 0.8}, {"noise_multiplier": 0.8 * (1 + 1e-6)})
    check_fingerprint({"clip": 1.0}, {"clip": 1.0 + 1e-15})  # (a float's rounding is no difference)
    with pytest.raises(CheckpointError, match="frozen_random_init: '<missing>' in the checkpoint vs 'abc' now"):
        check_fingerprint({"a": 1}, {"a": 1, "frozen_random_init": "abc"})
    with pytest.raises(CheckpointError, match="b: 2 in the checkpoint vs '<missing>' now"):
        check_fingerprint({"a": 1, "b": 2}, {"a": 1})


# (mutation review, round 43) kills K14 (the 0-byte check dropped: the existing test's
# match="empty.*intact copy" also matches the generic "corrupt" message through the file name empty.pt)
def test_an_empty_checkpoint_is_named_as_empty(tmp_path):
    p = tmp_path / "zero.pt"
    p.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is empty \(0 bytes"):
        load_checkpoint(p)


# (mutation review, round 43)
# kills L06 (a resumed run whose streams were re-seeded from fresh entropy still records the checkpoint's --seed
# in report.json, which then claims a seed reproduces a run no seed reproduces)
def test_a_reseeded_resume_records_no_seed(tiny, tmp_path, capsys):
    from pdpsgd.checkpoint import atomic_write_json

    out = tmp_path / "crash"
    assert run_cli(tiny_args(tiny, out, "--seed", "7", "--interrupt-after", "2"), capsys)[0] == 130
    ledger = json.loads((out / "ledger.json").read_text())
    ledger["steps_released"] = 3  # (step 3 released, then a hard kill before its checkpoint)
    ledger["accountant"]["history"][0][2] = 3
    atomic_write_json(out / "ledger.json", ledger)
    rc, _, err = run_cli(tiny_args(tiny, out, "--seed", "7", "--resume"), capsys)
    assert rc == 0 and "released after the last checkpoint" in err, err
    assert json.loads((out / "report.json").read_text())["settings"]["seed"] is None


# (mutation review, round 43) kills L07 (an interrupted run writes trained_params.pt, the file
# a user releases, though the run has not finished)
def test_an_interrupted_run_writes_no_trained_params(tiny, tmp_path, capsys):
    out = tmp_path / "int"
    assert run_cli(tiny_args(tiny, out, "--interrupt-after", "1"), capsys)[0] == 130
    assert (out / "checkpoint.pt").is_file() and not (out / "trained_params.pt").exists()
    assert run_cli(tiny_args(tiny, out, "--resume"), capsys)[0] == 0
    assert (out / "trained_params.pt").is_file()


def test_a_state_cannot_overwrite_the_checkpoints_header_and_a_namedtuple_is_refused_by_name(tmp_path):
    """Mutation review, round 43 (bugs): a state key ``format_version`` replaced the header, the save succeeded and
    the file could never be loaded; a namedtuple in the state failed inside the copy to the CPU with a TypeError
    about its constructor. Both are refused before anything is written, by name; a state read back (which holds
    the header itself) saves again."""
    import collections

    p = tmp_path / "h.pt"
    with pytest.raises(ValueError, match="'format_version' is the checkpoint's own header"):
        save_checkpoint(p, {"format_version": 2, "step": 1})
    with pytest.raises(TypeError, match=r"state\['t'\] is a .*P"):
        save_checkpoint(p, {"t": collections.namedtuple("P", "a b")(1, 2)})
    with pytest.raises(ValueError, match="'format_version' is the checkpoint's own header"):
        save_checkpoint(p, {"format_version": torch.tensor([1.0, 2.0])})  # (not a bare "ambiguous" error)
    assert not p.exists()
    save_checkpoint(p, {"step": 1})
    state = load_checkpoint(p)
    state["step"] += 1
    save_checkpoint(p, state)
    assert load_checkpoint(p)["step"] == 2

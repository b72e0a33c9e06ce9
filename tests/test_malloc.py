"""pdpsgd.malloc: glibc keeps a step's freed memory for the next step (measured as page faults)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from pdpsgd import malloc

GLIBC = malloc._glibc() is not None and malloc._preloaded_allocator() is None


def _untouched_glibc():
    """glibc at its own defaults: no malloc tunables in the environment, no always-on huge pages
    (with either, the default-side fault count below is not what it measures)."""
    if any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in os.environ):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" not in f.read()
    except OSError:
        return True

# A step-like pattern: 96 blocks of 1 MiB (more than glibc's adapted trim threshold of 64 MiB at its
# largest), written, freed together, again; the minor page faults of rounds 2.. are what a next
# step pays for memory the previous step freed.
PROBE = r"""
import json, resource, sys, torch
from pdpsgd.malloc import tune_cpu_malloc
if sys.argv[1] == "tuned":
    assert tune_cpu_malloc().applied
faults = []
for r in range(4):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.empty(1 << 18).fill_(1.0) for _ in range(96)]
    del xs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps(faults))
"""


def _faults(mode):
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_tuned_reuses_freed_memory():
    default, tuned = _faults("default"), _faults("tuned")
    pages = 96 * (1 << 20) // 4096
    # tuned: after the first round, the blocks come from memory the process kept
    assert sum(tuned[1:]) < pages // 5 and tuned[-1] < pages // 20, tuned
    if not _untouched_glibc():
        return
    # default glibc: the second round faults its blocks in again (the freed top was given back to the
    # OS; later rounds may not, once glibc's own adaptation of its thresholds has caught up)
    assert default[1] > pages // 2, default


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_tune_reports_and_is_idempotent():
    a = malloc.tune_cpu_malloc()
    b = malloc.tune_cpu_malloc()
    assert a.applied and b == a
    assert a.mmap_threshold == malloc.MMAP_THRESHOLD_MAX and a.trim_threshold == 1 << 30 and a.mmap_max == 0
    assert "glibc" in a.reason


@pytest.mark.parametrize("kw", [{"mmap_threshold": 0}, {"mmap_threshold": (32 << 20) + 1},
                                {"trim_threshold": 0}, {"trim_threshold": 1 << 31}, {"mmap_max": -1}])
def test_bad_values_raise_before_changing_anything(kw, monkeypatch):
    monkeypatch.setattr(malloc, "_glibc", lambda: pytest.fail("mallopt reached with a bad value"))
    with pytest.raises(ValueError, match="must be"):
        malloc.tune_cpu_malloc(**kw)


# Blocks past glibc's largest mmap threshold (a 40 MiB logits-like tensor and a few smaller ones),
# written and freed, again: mmapped and faulted in every round unless mmap_max=0 keeps them in the heap.
PROBE_BIG = r"""
import json, resource, sys, torch
from pdpsgd.malloc import tune_cpu_malloc
assert tune_cpu_malloc(mmap_max=None if sys.argv[1] == "mmap" else 0).applied
faults = []
for r in range(7):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    small = [torch.empty(1 << 18).fill_(1.0) for _ in range(8)]
    big = torch.empty(10 << 20).fill_(1.0)  # 40 MiB
    del big, small
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps(faults))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_blocks_past_the_mmap_threshold_stay_in_the_heap():
    """``mmap_max=0`` (the default): a block larger than the 32 MiB mmap threshold is served from the
    heap and reused by the next rounds (before: mmapped, unmapped when freed, faulted in again in
    every round)."""
    def run(mode):
        r = subprocess.run([sys.executable, "-c", PROBE_BIG, mode], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    pages = (40 << 20) // 4096
    kept, mapped = run("heap"), run("mmap")
    # (the heap grows over the first rounds, as the small blocks settle into what the big one freed)
    assert sum(kept[-4:]) < pages // 10, kept
    assert min(mapped[1:]) > pages // 2, mapped  # (what mmap_max=0 removes)


SHIM = "#include <stddef.h>\nextern void *__libc_malloc(size_t);\nvoid *malloc(size_t n) { return __libc_malloc(n); }\n"


@pytest.mark.skipif(not GLIBC or not (shutil.which("cc") or shutil.which("gcc")), reason="glibc and a C compiler")
def test_an_interposed_malloc_is_detected_and_left_alone(tmp_path):
    """A malloc preloaded over glibc's (as jemalloc / tcmalloc are) is found by its address, and
    nothing is set."""
    src, lib = tmp_path / "shim.c", tmp_path / "libshimalloc.so"
    src.write_text(SHIM)
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)],
                   check=True, capture_output=True)
    code = "import json; from pdpsgd.malloc import tune_cpu_malloc; print(json.dumps(tune_cpu_malloc()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LD_PRELOAD": str(lib)})
    assert r.returncode == 0, r.stderr
    applied, mmap, trim, reason, mmap_max = json.loads(r.stdout.strip().splitlines()[-1])
    assert not applied and mmap is None and trim is None and mmap_max is None and "libshimalloc.so" in reason


def test_glibc_refusing_a_value_is_reported_not_raised(monkeypatch):
    class Refusing:
        def mallopt(self, param, value):
            return 0

    monkeypatch.setattr(malloc, "_glibc", lambda: Refusing())
    monkeypatch.setattr(malloc, "_preloaded_allocator", lambda: None)
    s = malloc.tune_cpu_malloc()
    assert not s.applied and "refused" in s.reason


def test_other_allocators_left_alone(monkeypatch):
    monkeypatch.setattr(malloc, "_preloaded_allocator", lambda: "jemalloc")
    s = malloc.tune_cpu_malloc()
    assert not s.applied and "jemalloc" in s.reason and s.mmap_threshold is None
    monkeypatch.setattr(malloc, "_preloaded_allocator", lambda: None)
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    s = malloc.tune_cpu_malloc()
    assert not s.applied and "not glibc" in s.reason

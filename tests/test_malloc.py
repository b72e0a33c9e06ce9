"""pdpsgd.malloc: glibc keeps a step's freed memory for the next step (measured as page faults)."""
import json
import subprocess
import sys

import pytest

from pdpsgd import malloc

GLIBC = malloc._glibc() is not None and malloc._preloaded_allocator() is None

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
    # default glibc: the second round faults its blocks in again (the freed top was given back to the
    # OS; later rounds may not, once glibc's own adaptation of its thresholds has caught up)
    assert default[1] > pages // 2, default
    # tuned: after the first round, the blocks come from memory the process kept
    assert sum(tuned[1:]) < pages // 5 and tuned[-1] < pages // 20, tuned


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_tune_reports_and_is_idempotent():
    a = malloc.tune_cpu_malloc()
    b = malloc.tune_cpu_malloc()
    assert a.applied and b == a
    assert a.mmap_threshold == malloc.MMAP_THRESHOLD_MAX and a.trim_threshold == 1 << 30
    assert "glibc" in a.reason


@pytest.mark.parametrize("kw", [{"mmap_threshold": 0}, {"mmap_threshold": (32 << 20) + 1},
                                {"trim_threshold": 0}, {"trim_threshold": 1 << 31}])
def test_bad_values_raise_before_changing_anything(kw, monkeypatch):
    monkeypatch.setattr(malloc, "_glibc", lambda: pytest.fail("mallopt reached with a bad value"))
    with pytest.raises(ValueError, match="threshold must be in"):
        malloc.tune_cpu_malloc(**kw)


def test_other_allocators_left_alone(monkeypatch):
    monkeypatch.setattr(malloc, "_preloaded_allocator", lambda: "jemalloc")
    s = malloc.tune_cpu_malloc()
    assert not s.applied and "jemalloc" in s.reason and s.mmap_threshold is None
    monkeypatch.setattr(malloc, "_preloaded_allocator", lambda: None)
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    s = malloc.tune_cpu_malloc()
    assert not s.applied and "not glibc" in s.reason

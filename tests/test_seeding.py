"""Generators keyed into their whole state: the noise and sampling streams a run uses must not be
one of 2^32 (review, round 35: ``manual_seed(secrets.randbits(63))`` keeps 32 bits on the CPU, and
trying every 32-bit seed against a released update recovers its noise)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from pdpsgd import _seeding
from pdpsgd._seeding import _mt_init, entropy_key, keyed_generator, rekey, seed_key
from pdpsgd.noise import entropy_generator
from pdpsgd.sampling import PoissonSampler


def _words(g: torch.Generator):
    s = g.get_state()[24:24 + 8 * 624]
    return [int.from_bytes(bytes(s[8 * i:8 * i + 8].tolist()), "little") for i in range(624)]


def _from_a_32_bit_seed(g: torch.Generator) -> bool:
    """Whether g's mt19937 state is manual_seed(s) for some s (its words follow the seeding recurrence)."""
    w = _words(g)
    return w == _mt_init(w[0])


def test_manual_seed_keeps_32_bits_and_the_check_sees_it():
    """The premise, and that the check below can fail."""
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5 + (7 << 32))
    assert torch.equal(torch.randn(6, generator=a), torch.randn(6, generator=b))
    assert _from_a_32_bit_seed(torch.Generator().manual_seed(2**62 + 12345))


def test_every_default_stream_has_its_whole_state_random():
    from pdpsgd.train import _fresh_generator

    gens = [entropy_generator(), keyed_generator(), _fresh_generator(None, "noise"),
            _fresh_generator(None, "sample"), _fresh_generator(7, "noise"), PoissonSampler(10, 0.5, 3).generator,
            PoissonSampler(10, 0.5, 3, generator=7).generator]
    for g in gens:
        assert not _from_a_32_bit_seed(g)
    assert len({tuple(_words(g)) for g in gens}) == len(gens)


def test_the_step_and_the_trainer_draw_from_keyed_streams():
    import torch.nn.functional as F
    from torch import nn

    import pdpsgd
    from pdpsgd.train import DPTrainer, plan_training

    model = nn.Linear(3, 2)
    step = pdpsgd.make_dp_step(model, lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none"),
                               max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    step(pdpsgd.trainable_params(model), {"x": torch.randn(4, 3), "y": torch.zeros(4, dtype=torch.long)})
    assert step.generator.device.type == "cpu" and not _from_a_32_bit_seed(step.generator)
    data = {"x": torch.randn(20, 3), "y": torch.zeros(20, dtype=torch.long)}
    plan = plan_training(num_examples=20, epochs=1, batch_size=4, target_epsilon=5.0, delta=1e-3)
    tr = DPTrainer(model, lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none"), data, plan=plan,
                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                   max_physical_batch=4)
    before = [_words(tr.sample_generator), _words(tr.noise_generator)]
    assert not any(_from_a_32_bit_seed(g) for g in (tr.sample_generator, tr.noise_generator))
    tr._reseed()
    assert not any(_from_a_32_bit_seed(g) for g in (tr.sample_generator, tr.noise_generator))
    assert [_words(tr.sample_generator), _words(tr.noise_generator)] != before


def test_keys_are_reproducible_and_distinct():
    a, b = keyed_generator(seed_key(3, "x")), keyed_generator(seed_key(3, "x"))
    assert torch.equal(torch.rand(16, generator=a), torch.rand(16, generator=b))
    for other in (seed_key(3, "y"), seed_key(3 + (1 << 32), "x"), seed_key(3 + (1 << 80), "x"), entropy_key()):
        c = keyed_generator(other)
        assert not torch.equal(torch.rand(16, generator=keyed_generator(seed_key(3, "x"))),
                               torch.rand(16, generator=c))
    g = torch.Generator()
    torch.rand(5, generator=g)
    assert rekey(g, seed_key(3, "x")) is g  # (in place)
    assert torch.equal(torch.rand(16, generator=g), torch.rand(16, generator=keyed_generator(seed_key(3, "x"))))
    with pytest.raises(TypeError, match="seed must be an int"):
        seed_key(True)
    with pytest.raises(TypeError, match="non-empty bytes"):
        rekey(g, b"")


def test_keyed_draws_look_uniform():
    """The written state is a working mt19937: mean and variance of 200k uniforms, and the normal path."""
    g = keyed_generator(seed_key(11))
    u = torch.rand(200_000, generator=g, dtype=torch.float64)
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / 2e5) ** 0.5 and abs(u.var().item() - 1 / 12) < 2e-3
    z = torch.randn(200_000, generator=g, dtype=torch.float64)
    assert abs(z.mean().item()) < 0.012 and abs(z.std().item() - 1) < 0.01


def test_an_unknown_state_layout_is_an_error_not_a_weak_stream(monkeypatch):
    import pdpsgd._seeding as sd

    monkeypatch.setattr(sd, "_OFFSET", 16)
    with pytest.raises(RuntimeError, match="unknown torch CPU generator state layout"):
        keyed_generator(b"k")


def test_the_keyed_state_is_the_stream_torch_draws_against_numpys_mt19937():
    """Independent reference: numpy's MT19937 started from the 624 words written into the state
    draws the stream torch draws (torch's 32-bit ``random_`` keeps every second 32-bit output of
    its 64-bit draws): the key reaches every draw, not just the state's bytes."""
    np = pytest.importorskip("numpy")
    g = keyed_generator(seed_key(3, "x"))
    bg = np.random.MT19937(0)
    bg.state = {"bit_generator": "MT19937", "state": {"key": np.array(_words(g), dtype=np.uint32), "pos": 624}}
    ref = bg.random_raw(2000)[1::2]
    got = torch.empty(1000, dtype=torch.int64).random_(0, 2**32, generator=g)
    assert got.tolist() == ref.tolist()


# ---- mutation review, round 45: the key expansion, its width on accelerators, the entropy key


def _rng45_words(g):
    s = g.get_state()[24:24 + 8 * 624]
    return [int.from_bytes(bytes(s[8 * i:8 * i + 8].tolist()), "little") for i in range(624)]


def test_rng45_cpu_state_is_the_shake256_expansion_of_the_whole_key():
    """Known answer, computed independently with hashlib: the 624 state words are the first 2496
    bytes of SHAKE-256("pdpsgd-generator\\0" + key), 32 bits each, little-endian; every byte of a
    long key counts (a key cut to its tail or head would shrink the secret)."""
    key = bytes(range(256)) * 2 + b"tail"
    raw = hashlib.shake_256(b"pdpsgd-generator\x00" + key).digest(4 * 624)
    want = [int.from_bytes(raw[4 * i:4 * i + 4], "little") for i in range(624)]
    assert _rng45_words(_seeding.keyed_generator(key)) == want
    for i in (0, 250, len(key) - 1):  # one flipped byte anywhere: another state
        other = bytearray(key)
        other[i] ^= 1
        assert _rng45_words(_seeding.keyed_generator(bytes(other))) != want


class _Rng45FakeAcceleratorGenerator:
    class device:
        type = "cuda"

    def __init__(self):
        self.seeds = []

    def manual_seed(self, s):
        self.seeds.append(s)
        return self


def test_rng45_accelerator_generators_take_64_bits_of_the_expansion():
    """Accelerator generators (Philox, a 64-bit seed) are seeded with the first 8 bytes of the
    expansion, little-endian: 64 bits, not 32."""
    seeds = []
    for i in range(8):
        key = f"k{i}".encode()
        g = _Rng45FakeAcceleratorGenerator()
        assert _seeding.rekey(g, key) is g
        want = int.from_bytes(hashlib.shake_256(b"pdpsgd-generator\x00" + key).digest(8), "little")
        assert g.seeds == [want]
        seeds.append(g.seeds[0])
    assert max(seeds) >= 1 << 32 and all(0 <= s < 1 << 64 for s in seeds)


def test_rng45_entropy_keys_are_256_bits_from_the_os():
    keys = {_seeding.entropy_key() for _ in range(4)}
    assert len(keys) == 4 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)

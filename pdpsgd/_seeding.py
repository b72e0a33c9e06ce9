"""Keyed torch generators with all of their state secret, not 32 bits of it.

torch's CPU generator is an mt19937 whose ``manual_seed`` keeps only the low 32 bits of the seed
(review, round 35: ``manual_seed(secrets.randbits(63))`` gave 2^32 possible noise streams; an
attacker who tries them all finds the one whose noise, subtracted from a released update, leaves a
clean gradient, and from then on the noise of every later step). Here a key of any length (OS
entropy, or a user's seed) is expanded by SHAKE-256 into the generator's whole 19,937-bit state.
Accelerator generators (CUDA/XPU/MPS: Philox, a 64-bit seed) take 64 bits of the expansion.

Formal guarantee: with a key from ``secrets`` (256 bits), the stream is one of 2^19937 (CPU) or
2^64 (accelerators) possibilities, each as likely, none recomputable without the key *from the key
alone*. The generator's own outputs must stay secret: mt19937 is linear over GF(2), so ~20,000 of its
output bits give back its state (review, round 37: torch's CPU ``normal_`` released them as noise).
pdpsgd's CPU noise sources therefore take only Philox keys from it (``pdpsgd.fused``), and the
sampler's draws (the batch) are never released.
"""
from __future__ import annotations

import hashlib
import secrets
from typing import Any, Union

import torch

__all__ = ["keyed_generator", "rekey", "entropy_key", "seed_key"]

_MT_N = 624  # mt19937 state words
_OFFSET = 24  # bytes before the state words in the CPU generator's state (seed u64, left i32, seeded i32, next u64)
_PLACEHOLDER_SEED = 5489  # (mt19937's default seed: the state words start from its init sequence)


def entropy_key() -> bytes:
    """256 bits from the OS's entropy source."""
    return secrets.token_bytes(32)


def seed_key(seed: int, what: str = "") -> bytes:
    """A key from a user's integer seed (any size) and a stream name: reproducible, and as secret
    as the seed is."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"a seed must be an int, got {type(seed).__name__}")
    return f"pdpsgd-seed:{seed}:{what}".encode()


def _mt_init(seed: int) -> list:
    s = [seed & 0xFFFFFFFF]
    for i in range(1, _MT_N):
        s.append((1812433253 * (s[-1] ^ (s[-1] >> 30)) + i) & 0xFFFFFFFF)
    return s


def _state_words_view(state: torch.Tensor) -> torch.Tensor:
    """The 624 state words (uint64 slots holding 32 bits each) of a CPU generator's state seeded
    with the placeholder seed, after checking that layout (an error, never a weak stream, if a torch
    version lays it out otherwise)."""
    words = state[_OFFSET:_OFFSET + 8 * _MT_N]
    if state.dtype != torch.uint8 or words.numel() != 8 * _MT_N:
        raise RuntimeError("pdpsgd: unknown torch CPU generator state layout; cannot key the generator")
    got = [int.from_bytes(bytes(words[8 * i:8 * i + 8].tolist()), "little") for i in (0, 1, 2, _MT_N - 1)]
    want = _mt_init(_PLACEHOLDER_SEED)
    if got != [want[0], want[1], want[2], want[_MT_N - 1]]:
        raise RuntimeError("pdpsgd: unknown torch CPU generator state layout; cannot key the generator")
    return words


def rekey(g: torch.Generator, key: bytes) -> torch.Generator:
    """Reset ``g`` (in place) to the stream of ``key``; returns ``g``."""
    if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
        raise TypeError("rekey: the key must be non-empty bytes")
    stream = hashlib.shake_256(b"pdpsgd-generator\x00" + bytes(key))
    if g.device.type != "cpu":
        g.manual_seed(int.from_bytes(stream.digest(8), "little"))
        return g
    g.manual_seed(_PLACEHOLDER_SEED)  # (fresh: left/next/cached normals as after any seeding)
    state = g.get_state()
    words = _state_words_view(state)
    raw = stream.digest(4 * _MT_N)
    if not any(raw):
        raise RuntimeError("rekey: an all-zero mt19937 state")  # (probability 2^-19968)
    slots = words.view(_MT_N, 8)  # each 32-bit word in the low half of its little-endian u64 slot
    slots[:, :4] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_MT_N, 4)
    slots[:, 4:] = 0
    g.set_state(state)
    return g


def keyed_generator(key: Union[bytes, None] = None, device: Any = "cpu") -> torch.Generator:
    """A new generator on ``device`` keyed by ``key`` (default: fresh OS entropy)."""
    return rekey(torch.Generator(device=device), entropy_key() if key is None else key)

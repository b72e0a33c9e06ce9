"""The DP training recipe behind ``pdpsgd train``, as a small library a custom loop can copy.

One logical step::

    Poisson sampler ──> fixed-shape physical batches ──> dp_step.clipped_sum (per physical batch)
        ──> Σ parts ──> dp_step.finalize (noise once) ──> accountant.step + ledger ──> optimizer.step
        ──> telemetry

``DPTrainer`` does exactly this (see ``DPTrainer.step``); ``plan_training`` picks σ for a target
(ε, δ); ``TextClassifier`` / ``load_text_classifier`` / ``select_trainable`` build the default
model (a pretrained Hugging Face encoder + mean pooling + a linear head).

Formal guarantee (``dp=True``): each logical step samples every training example independently
with probability q (Poisson), clips each example's gradient to norm C, adds N(0, σ²C²) once to the
sum and divides by the *expected* batch size q·N. So T steps are the Poisson-subsampled Gaussian
mechanism composed T times; the accountant records each step (and the ledger file is written)
*before* the step's update is applied, so every released update is on the ledger. RNG states are
checkpointed and restored, never re-derived from a seed, so a resumed run never reuses noise.
Hyper-parameters (C, lr, epochs, layers) are assumed chosen without looking at the private data.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._seeding import entropy_key, keyed_generator, rekey, seed_key
from ._warn import warn
from .functional import trainable_params

__all__ = [
    "DPTrainer",
    "TrainingPlan",
    "plan_training",
    "TextClassifier",
    "load_text_classifier",
    "select_trainable",
    "classification_loss",
    "causal_lm_loss",
    "evaluate",
    "ModelError",
    "physical_batches",
    "gather",
    "resolve_method",
    "default_delta",
    "model_fingerprint",
    "random_init_fingerprint",
    "frozen_random_weights",
    "head_body_groups",
]


class ModelError(ValueError):
    """The model folder cannot be used (missing, not a Hugging Face model, bad --train-params)."""


# =============================================================================================
# privacy plan
# =============================================================================================
class TrainingPlan(NamedTuple):
    noise_multiplier: float  # σ
    sample_rate: float  # q
    steps: int  # T logical steps
    expected_batch_size: float  # q·N
    num_examples: int  # N
    target_epsilon: Optional[float]
    delta: float


def default_delta(num_examples: int) -> float:
    """min(1e-5, 1/(10·N)): well below 1/N, the usual ceiling."""
    return min(1e-5, 1.0 / (10.0 * max(1, num_examples)))


def _real_or_none(v: Any) -> Optional[float]:
    """``step._real``'s reading of a number (Python, NumPy, a one-element tensor, a Fraction) as a
    float; None for anything else, a bool included (``_real`` refuses it)."""
    from .step import _real

    try:
        return _real("value", v)
    except (TypeError, OverflowError):
        return None


def plan_training(num_examples: int, *, batch_size: float, epochs: float, target_epsilon: Optional[float],
                  delta: float, noise_multiplier: Optional[float] = None) -> TrainingPlan:
    """σ, q = batch_size/N and T = ceil(epochs/q) for a target ε at δ (σ from ``calibrate_noise``).

    Pass ``noise_multiplier`` to fix σ instead (then ``target_epsilon`` is only recorded).
    """
    from .accounting._common import check_delta

    if num_examples <= 0:
        raise ValueError("the training set is empty")
    if not 0 < batch_size <= num_examples:
        raise ValueError(f"batch size {batch_size} must be in (0, N={num_examples}]")
    # (review, round 38: epochs ≤ 0 gave one step, a NaN σ and δ = 7 were planned, the δ refused only by
    # the first step's ε, after its noisy update was applied and on the ledger)
    given = epochs
    epochs = _real_or_none(epochs)
    if not (epochs is not None and math.isfinite(epochs) and epochs > 0):
        raise ValueError(f"epochs must be a finite number > 0, got {given!r}")
    delta = check_delta(delta)
    if noise_multiplier is not None:
        given, noise_multiplier = noise_multiplier, _real_or_none(noise_multiplier)
        if not (noise_multiplier is not None and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be a finite number ≥ 0 (σ), got {given!r}")
    if target_epsilon is not None:
        given, target_epsilon = target_epsilon, _real_or_none(target_epsilon)
        if not (target_epsilon is not None and math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {given!r}")
    q = float(batch_size) / num_examples
    steps = max(1, int(math.ceil(epochs / q - 1e-9)))
    if noise_multiplier is None:
        if target_epsilon is None:
            raise ValueError("give a target epsilon or a noise multiplier")
        from .accounting import calibrate_noise

        res = calibrate_noise(target_epsilon=target_epsilon, delta=delta, sample_rate=q, steps=steps)
        noise_multiplier = float(getattr(res, "noise_multiplier", res))
    return TrainingPlan(float(noise_multiplier), q, steps, q * num_examples, num_examples, target_epsilon, delta)


def resolve_method(method: str) -> str:
    """"auto"/"bk" need ``pdpsgd.bookkeeping``; without it, fall back to "vmap" (exact, slower)."""
    if method in ("auto", "bk"):
        import importlib.util

        if importlib.util.find_spec("pdpsgd.bookkeeping") is None:
            warn(f"method={method!r} needs pdpsgd.bookkeeping, which is not installed; using 'vmap'")
            return "vmap"
    return method


# =============================================================================================
# sampling (pdpsgd.sampling)
# =============================================================================================
def physical_batches(indices: Tensor, max_batch_size: int) -> List[Any]:
    """``pdpsgd.sampling.to_physical_batches``: ``max(1, ceil(len/max))`` physical batches of exactly
    ``max_batch_size`` slots; padding slots have ``mask`` False (they contribute exactly 0)."""
    from .sampling import to_physical_batches

    return to_physical_batches(indices, max_batch_size)


def gather(data: Mapping[str, Tensor], indices: Tensor, device: Optional[torch.device] = None) -> Dict[str, Tensor]:
    """Rows ``indices`` of every tensor in ``data`` (moved to ``device``)."""
    return {k: (v[indices].to(device) if device is not None else v[indices]) for k, v in data.items()}


# =============================================================================================
# the trainer
# =============================================================================================
def _history_prefix(small: Any, large: Any) -> bool:
    """Whether accountant state ``small``'s run-length history (σ, q, n) is the start of ``large``'s:
    the two ledgers can be the same run's, ``large`` written later (a missing history says nothing)."""
    try:
        hs, hl = [list(r) for r in small["history"]], [list(r) for r in large["history"]]
        if not hs:
            return True
        if len(hs) > len(hl) or hs[:-1] != hl[:len(hs) - 1]:
            return False
        (s1, q1, n1), (s2, q2, n2) = hs[-1], hl[len(hs) - 1]
        return s1 == s2 and q1 == q2 and n1 <= n2
    except (KeyError, TypeError, ValueError):  # (malformed: the accountant's own load says so)
        return True


def _same_history(a: Any, b: Any) -> bool:
    """Whether two accountant states hold the same run-length history (a missing one says nothing)."""
    try:
        return [[float(s), float(q), int(n)] for s, q, n in a["history"]] == \
            [[float(s), float(q), int(n)] for s, q, n in b["history"]]
    except (KeyError, TypeError, ValueError):
        return True


def _history_problem(state: Any, released: int, sigma: float, q: float) -> Optional[str]:
    """What is wrong with accountant state ``state`` as the record of ``released`` steps of this plan
    (σ, q), or None: its last run must be (σ, q) and count them all (review, round 39: a flipped bit
    in a stored history, 5 steps read as 1, went unseen and the resumed run reported a smaller ε).
    An accountant state without a run-length history (another kind of accountant) is not checked."""
    try:
        hist = [list(r) for r in state["history"]]
        if released <= 0:
            return None
        if not hist:
            return f"it records no step, where {released} were released"
        s, r, n = float(hist[-1][0]), float(hist[-1][1]), int(hist[-1][2])
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if not (math.isclose(s, sigma, rel_tol=1e-12) and math.isclose(r, q, rel_tol=1e-12)):
        return f"its last steps were taken at σ = {s!r}, q = {r!r}, not this plan's σ = {sigma!r}, q = {q!r}"
    if n < released:
        return f"it records {n} step(s) at this plan's σ and q, where {released} were released"
    return None


def _derive_seed(seed: int, what: str) -> int:
    return int.from_bytes(hashlib.sha256(f"pdpsgd:{seed}:{what}".encode()).digest()[:8], "little") >> 1


def _fresh_generator(seed: Optional[int], what: str, device: Any = "cpu") -> torch.Generator:
    """``what``'s stream: keyed by ``seed`` (reproducible) or by fresh OS entropy, into the
    generator's whole state (``pdpsgd._seeding``; manual_seed keeps 32 bits on the CPU)."""
    return keyed_generator(None if seed is None else seed_key(seed, what), device)


class DPTrainer:
    """A DP-SGD training loop for ``model`` on in-memory tensors ``data`` (name -> (N, ...)).

    Args:
        loss_fn: ``loss_fn(model, batch) -> Tensor[B]`` (per-example losses).
        optimizer: over the model's trainable parameters (``requires_grad=True``); it sees the
            noisy, clipped gradient in ``p.grad``.
        plan: a ``TrainingPlan`` (σ, q, T); see ``plan_training``.
        max_grad_norm: C. ``max_physical_batch``: examples per forward/backward (memory).
        method: "vmap" | "bk" | "auto" (``make_dp_step``); ``clipping`` / ``clip_budget``: as in
            ``make_dp_step`` (flat, per_layer or parameter groups sharing C). ``train_mode``: run the
            model in train mode (dropout on) while training; False = eval mode. ``dp=False`` trains non-privately on the
            same sampled batches (mean loss over q·N, no clipping, no noise) as a baseline.
        seed: None (fresh OS entropy for every stream) or an int (reproducible runs: anyone who knows
            it can recompute the noise and the batches, so for experiments, never for a model you release).
        noise_rng: "auto" (default: "native" on the CPU where it builds, else "numpy"; "torch" on
            CUDA), "torch" (on the CPU for experiments only: see ``make_dp_step``), "numpy", "mkl"
            or "native" (``make_dp_step``: numpy's, oneMKL's or pdpsgd's own CPU Gaussian, keyed from
            the noise generator; "mkl" needs ``pip install mkl``, "native" a C compiler the first
            time).
        ledger_path: a JSON file rewritten atomically after each ``accountant.step`` and before
            the update is applied; read before each step's draw and, under a lock on
            ``<ledger_path>.lock``, before each write: a file that counts releases this trainer does
            not (another trainer on this run's ledger) stops the step before its release.
        accountant: default ``PRVAccountant()``. ``telemetry``: default ``Telemetry()``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, data: Mapping[str, Tensor], *, optimizer: torch.optim.Optimizer,
                 plan: TrainingPlan, max_grad_norm: float, max_physical_batch: int, method: str = "vmap",
                 dp: bool = True, seed: Optional[int] = None, ledger_path: Optional[os.PathLike] = None,
                 accountant: Any = None, telemetry: Any = None, device: Any = None, chunk_size: Optional[int] = None,
                 epsilon_every: int = 1, clipping: Any = "flat", clip_budget: Optional[Sequence[float]] = None,
                 train_mode: bool = True, noise_rng: str = "auto"):
        from .step import make_dp_step
        from .telemetry import Telemetry

        if not isinstance(data, Mapping) or not all(isinstance(v, Tensor) for v in data.values()):
            # (review, round 42: a DataLoader failed with "'DataLoader' object has no attribute 'items'")
            raise TypeError(
                f"data must be a dict name -> (N, ...) tensor holding the whole training set, got "
                f"{type(data).__name__}{'' if not isinstance(data, Mapping) else ' with non-tensor values'}: "
                "DPTrainer draws its own Poisson batches from it (each example independently with probability "
                "q, which the accountant assumes), so it takes the dataset's tensors, not a DataLoader or its "
                "batches (e.g. data = {'input_ids': ids, 'attention_mask': am, 'labels': y})")
        if not data:
            raise ValueError("data is empty: give name -> (N, ...) tensors")
        sizes = {k: len(v) for k, v in data.items()}
        n = next(iter(sizes.values()))
        for k, m in sizes.items():  # (review, round 37: N was the first tensor's, the others unchecked)
            if m != n:
                raise ValueError(f"every tensor of data holds one row per example: '{k}' has {m} rows, "
                                 f"'{next(iter(sizes))}' {n}")
        if n != plan.num_examples:
            raise ValueError(f"data has {n} examples, the plan {plan.num_examples}")
        if dp:  # (ε is asked at plan.delta after the first update: a bad δ found then is found too late)
            from .accounting._common import check_delta, check_noise_multiplier

            check_delta(plan.delta)
            # (review, round 39: σ = 0 was refused by the accountant's first step, after that step's
            # gradients were computed)
            check_noise_multiplier(plan.noise_multiplier)
        self.model, self.loss_fn, self.data = model, loss_fn, data
        self.optimizer, self.plan = optimizer, plan
        self.max_grad_norm, self.max_physical_batch = float(max_grad_norm), int(max_physical_batch)
        self.dp, self.seed, self.train_mode = dp, seed, bool(train_mode)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.params = trainable_params(model)
        if not self.params:
            raise ValueError("the model has no trainable parameter (requires_grad=True)")
        self.ledger_path = Path(ledger_path) if ledger_path is not None else None
        self._load_failed = False  # (a load_state_dict that raised part-way: no step until one goes through)
        # the ledger file's writes are signed with this trainer's token: a count one above its own that it
        # wrote itself for a step that then raised before its update is its retry's, not another trainer's
        self._writer = secrets.token_hex(16)
        # this run's id, carried by its states: a trainer that released steps takes only a state of its run
        self.run_id = secrets.token_hex(16)
        self._unapplied: Optional[int] = None  # (that count, while the retry is pending)
        self.reseeded = False  # (set by _reseed: the streams went on from fresh entropy, not from any seed)
        if isinstance(epsilon_every, bool) or not isinstance(epsilon_every, numbers.Integral) or epsilon_every < 1:
            raise ValueError(f"epsilon_every={epsilon_every!r}: give a whole number of steps ≥ 1 (ε is computed every "
                             "that many steps, and after the last)")
        self.epsilon_every = int(epsilon_every)
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        if accountant is None:
            from .accounting import PRVAccountant

            accountant = PRVAccountant()
        self.accountant = accountant
        if seed is not None:
            torch.manual_seed(_derive_seed(seed, "torch"))  # dropout (global RNG)
        self.sample_generator = _fresh_generator(seed, "sample")
        noise_dev = "cpu" if self.device.type == "cpu" else self.device
        self.noise_generator = _fresh_generator(seed, "noise", noise_dev)
        from .sampling import PoissonSampler

        self.sampler = PoissonSampler(n, plan.sample_rate, plan.steps, generator=self.sample_generator)
        self.method = method
        self.dp_step = make_dp_step(model, loss_fn, max_grad_norm=self.max_grad_norm,
                                    noise_multiplier=plan.noise_multiplier if dp else 0.0,
                                    expected_batch_size=plan.expected_batch_size, method=method,
                                    chunk_size=chunk_size, generator=self.noise_generator, clipping=clipping,
                                    clip_budget=clip_budget, noise_rng=noise_rng)
        self.step_count = 0
        self.released = 0  # steps on the ledger (== step_count except after a crash)
        self.last_epsilon: Optional[float] = None
        self.step_times: List[float] = []

    # ---------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.step_count >= self.plan.steps

    def epsilon(self, delta: Optional[float] = None):
        """``EpsilonBounds(lower, estimate, upper)`` spent so far (None without DP / before any step)."""
        if not self.dp or self.accountant.num_steps == 0:
            return None
        return self.accountant.epsilon(delta=self.plan.delta if delta is None else delta)

    def step(self) -> Dict[str, Any]:
        """One logical step; returns its telemetry record.

        A step that raises before its update is applied (the loss, an out-of-memory, the ledger's
        write) leaves no trace: the sampler, every random stream and the accountant are put back as
        they were, so calling ``step()`` again retries the same step, with the same batch and the same
        noise (review, round 36: the batch stayed drawn, the sampler ran a draw ahead of the step
        count, and the run ended one step short with "PoissonSampler is exhausted"). Nothing of the
        failed attempt was released, and its retry releases what it would have released, once (a new
        batch instead would make the released batches those that did not fail: no longer Poisson). A
        step whose ``optimizer.step()`` raises may have applied part of its update: it stays on the
        ledger and counts as taken."""
        t0 = time.perf_counter()
        if self._load_failed:
            raise RuntimeError("a load_state_dict failed part-way, so this trainer holds part of that state: load a "
                               "state again (one that loads) before stepping")
        if self.dp:
            self._check_ledger_file()  # (before anything is drawn: a refusal changes nothing)
        saved = self._stream_states()
        counted: Optional[Tuple[Dict[str, Any], int]] = None
        try:
            self.model.train(self.train_mode)
            indices = self.sampler.sample()
            pbs = physical_batches(indices, self.max_physical_batch)
            if self.dp:
                total = None
                for pb in pbs:
                    batch = gather(self.data, pb.indices, self.device)
                    part = self.dp_step.clipped_sum(self.params, batch, pb.mask.to(self.device))
                    total = part if total is None else total + part
                out = self.dp_step.finalize(total, params=self.params)
                grads = out.grads
                # the ledger first: this step is recorded before its update can be released
                counted = (self.accountant.state_dict(), self.released)
                self.accountant.step(noise_multiplier=self.plan.noise_multiplier, sample_rate=self.plan.sample_rate,
                                     num_steps=1)
                self.released += 1
                self._write_ledger()
                mask = total.mask
            else:
                out, grads, mask = self._nonprivate_grads(pbs), None, None
            for name, p in self.params.items():
                if grads is not None:
                    p.grad = grads[name].to(p.dtype)
        except BaseException:
            # nothing was released: put the draw, the streams and the count back (the retry is this step)
            self._restore_streams(saved)
            if counted is not None:
                self.accountant.load_state_dict(counted[0])
                self.released = counted[1]
                if self._unapplied is None and self.ledger_path is not None:  # (the file may count it: the retry's)
                    self._unapplied = counted[1] + 1
            raise
        try:
            self.optimizer.step()  # (the release: from here on the step counts as taken)
        finally:
            self.step_count += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step_times.append(time.perf_counter() - t0)
        eps = None
        if self.dp and (self.step_count % self.epsilon_every == 0 or self.done):
            self.last_epsilon = self.epsilon().upper  # (a bound: the estimate can be below the true ε)
            eps = self.last_epsilon
        # (ε only where it was computed for this step: every ``epsilon_every``-th and the last; the last value
        # carried to the steps between understated what they had spent (review, round 51); ``last_epsilon`` holds it)
        return self.telemetry.record(self.step_count, out, epsilon=eps, mask=mask, step_time=self.step_times[-1])

    def _nonprivate_grads(self, pbs) -> Any:
        """Standard backward of Σ_i loss_i / (q·N) over the real examples (no clip, no noise)."""
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for pb in pbs:
            batch = gather(self.data, pb.indices, self.device)
            m = pb.mask.to(self.device)
            l = self.loss_fn(self.model, batch)
            l = torch.where(m, l, torch.zeros_like(l))
            (l.sum() / self.plan.expected_batch_size).backward()
            losses.append(l.detach()[m])
        allv = torch.cat(losses)

        class _Out(NamedTuple):
            loss: Tensor
            num_examples: Tensor

        return _Out(allv.mean() if allv.numel() else torch.tensor(float("nan")), torch.tensor(allv.numel()))

    def nonprivate_step_time(self, repeats: int = 3) -> float:
        """Seconds of one non-private logical step (forward+backward of the same fixed-shape
        physical batches, expected batch size): the median of ``repeats`` timed runs after one
        warm-up, measured without changing the model or any RNG that the DP run uses. For the
        "time per step vs non-private" figure (against the median DP step: a best-of-one here
        against a mean there swung that ratio by 0.3 on a noisy host)."""
        k = max(1, math.ceil(self.plan.expected_batch_size / self.max_physical_batch))
        idx = torch.arange(min(self.plan.num_examples, k * self.max_physical_batch))
        pbs = physical_batches(idx, self.max_physical_batch)
        rng = torch.get_rng_state()
        self.model.train(self.train_mode)
        times = []
        try:
            for _ in range(max(1, repeats) + 1):  # first is warm-up
                t0 = time.perf_counter()
                for pb in pbs:
                    batch = gather(self.data, pb.indices, self.device)
                    l = self.loss_fn(self.model, batch)
                    grads = torch.autograd.grad(l.sum(), list(self.params.values()), allow_unused=True)
                    del grads
                times.append(time.perf_counter() - t0)
        finally:
            torch.set_rng_state(rng)
        return statistics.median(times[1:])

    # ---------------------------------------------------------------------------------------
    def _reconcile_ledgers(self, given: Optional[Mapping[str, Any]], live: Optional[Mapping[str, Any]] = None
                           ) -> Tuple[Optional[Mapping[str, Any]], str]:
        """The ledger to resume against and where it is from ("given", "file", "live" or ""): ``given``,
        the trainer's own ``ledger_path`` file and ``live`` (this trainer's own count, if it released
        any), whichever counts most releases. The file is read even when a ledger is given (review,
        round 36: a copy taken at checkpoint time hid the file's later releases; their batches and
        noise were replayed and the file was rewritten with a smaller count), so its count is never
        lowered, nor this trainer's (round 37); one from another run (other σ, q or δ), or two that
        disagree on the history, are refused."""
        found: List[Tuple[str, Mapping[str, Any]]] = []
        if given is not None:
            found.append(("", given))
        if self.ledger_path is not None and self.ledger_path.exists():
            # its own ledger file (review, round 33: not read, it was then rewritten from the checkpoint's
            # smaller count at the next step, dropping releases already on it)
            try:
                content = json.loads(self.ledger_path.read_text())
                if not isinstance(content, Mapping):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as err:
                raise ValueError(f"the privacy ledger {self.ledger_path} is unreadable ({err}); refusing to "
                                 "resume (it may hold releases this state does not count)") from None
            found.append((f" {self.ledger_path}", content))
        if not found:
            return (live, "live") if live is not None else (None, "")
        if self.dp:  # another run's ledger would lend its history (review, round 33)
            mine = self._ledger()
            for where, led in found:
                off = [f"{k}: {led[k]!r} in the ledger vs {mine[k]!r} here" for k in ("noise_multiplier", "sample_rate", "delta")
                       if k in led and not math.isclose(float(led[k]), float(mine[k]), rel_tol=1e-12)]
                if off:
                    raise ValueError(f"the privacy ledger{where} is another run's ({', '.join(off)}): refusing to "
                                     "resume with it. Point ledger_path at this run's ledger")
        if len(found) == 2:
            (_, a), (_, b) = found
            na, nb = int(a.get("steps_released", 0)), int(b.get("steps_released", 0))
            small, large = (a, b) if na <= nb else (b, a)
            if not _history_prefix(small.get("accountant"), large.get("accountant")):
                raise ValueError(f"the ledger given and the ledger file {self.ledger_path} belong to different runs "
                                 "(their accountant histories disagree): refusing to resume. Pass this run's ledger "
                                 "(the file's content), or point ledger_path at this run's ledger file")
            best, src = (b, "file") if nb >= na else (a, "given")  # (the file on a tie)
        else:
            best, src = found[0][1], ("given" if found[0][0] == "" else "file")
        if live is not None and int(live["steps_released"]) > int(best.get("steps_released", 0)):
            # (this trainer released more than any ledger says: its own steps of this run, kept counted)
            return live, "live"
        return best, src

    def _privacy_key(self) -> Dict[str, Any]:
        """What a saved state must share with this trainer to continue its guarantee (review, round 33:
        a dp=False trainer's state was accepted by a private one, and its steps went uncounted)."""
        p = self.plan
        return {"dp": bool(self.dp), "noise_multiplier": float(p.noise_multiplier), "sample_rate": float(p.sample_rate),
                "steps": int(p.steps), "num_examples": int(p.num_examples), "max_grad_norm": float(self.max_grad_norm)}

    def _reseed(self) -> None:
        """Every random stream (sampling, noise, dropout) from fresh OS entropy: none is ever replayed."""
        self.reseeded = True  # (no seed reproduces the run from here: the CLI's report says so)
        rekey(self.sample_generator, entropy_key())
        rekey(self.noise_generator, entropy_key())
        torch.manual_seed(secrets.randbits(63))  # (dropout: its masks are not what the guarantee rests on)

    def _ledger(self) -> Dict[str, Any]:
        return {"steps_released": self.released, "noise_multiplier": self.plan.noise_multiplier,
                "sample_rate": self.plan.sample_rate, "delta": self.plan.delta,
                "accountant": self.accountant.state_dict()}

    def _check_ledger_file(self, mine: Optional[int] = None) -> None:
        """The ledger file must not count releases that this trainer (``mine``: its count, default
        ``released``) does not: before every step's draw and, under the file's lock, before every write
        (review, round 37: read once, at load or before the first write, two trainers resumed from one
        checkpoint each rewrote it with the same count and released the same noise and batches)."""
        if self.ledger_path is None or not self.ledger_path.exists():
            return
        mine = self.released if mine is None else mine
        # a fresh trainer on a ledger that already counts releases would rewrite it from its own
        # smaller count, dropping them (review, round 34); a second trainer on this run's ledger would
        # repeat the steps the first one released (round 37): resume that run once, or use another path
        try:
            content = json.loads(self.ledger_path.read_text())
            before, writer = int(content.get("steps_released", 0)), content.get("writer")
        except (OSError, ValueError, TypeError, AttributeError):
            before, writer = -1, None
        if before == mine + 1 and before == self._unapplied and writer == self._writer:
            return  # (this trainer's own write of a step that raised before its update: the retry rewrites it)
        if before < 0 or before > mine:
            what = "is unreadable" if before < 0 else f"already counts {before} released step(s), this trainer {mine}"
            raise ValueError(f"the privacy ledger {self.ledger_path} {what}: another trainer (or process) released "
                             "steps this one does not count, and rewriting the ledger would drop them; continuing "
                             "would repeat their batches and noise. Resume from the ledger (load_state_dict) in one "
                             "trainer only, or give this one another ledger_path")

    def _write_ledger(self) -> None:
        if self.ledger_path is not None:
            from .checkpoint import atomic_write_json, file_lock

            with file_lock(self.ledger_path):  # (check and write in one turn: two writers cannot both pass)
                self._check_ledger_file(self.released - 1)  # (the count before this step's release)
                atomic_write_json(self.ledger_path, {**self._ledger(), "writer": self._writer})
            self._unapplied = None

    def _rng_states(self) -> Dict[str, Any]:
        """Every random stream a step draws from: sampling, noise, torch's CPU (and CUDA) state."""
        rng = {"sample": self.sample_generator.get_state(), "noise": self.noise_generator.get_state(),
               "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def _set_rng_states(self, rng: Mapping[str, Any]) -> None:
        self.sample_generator.set_state(rng["sample"])
        self.noise_generator.set_state(rng["noise"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def _stream_states(self) -> Dict[str, Any]:
        """The sampler's position and every random stream a step draws from (``_restore_streams``)."""
        return {"position": self.sampler.position, **self._rng_states()}

    def _restore_streams(self, st: Mapping[str, Any]) -> None:
        self.sampler.position = st["position"]
        self._set_rng_states(st)

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue: params, optimizer, accountant, sampler, RNG states.

        The random states (noise, sampling, dropout) are secret like a seed: with them every step's
        noise and batch can be recomputed (review, round 34: the 624-word generator state held
        every step's Philox key). A finished trainer's state leaves them out (``rng`` None): it has
        no step left to take."""
        if self._load_failed:
            raise RuntimeError("a load_state_dict failed part-way, so this trainer holds part of that state: load a "
                               "state again (one that loads) before saving")
        rng: Optional[Dict[str, Any]] = None
        if not self.done:
            rng = self._rng_states()
        return {
            "run_id": self.run_id,
            "step": self.step_count,
            "released": self.released,
            "privacy": self._privacy_key(),
            "params": {n: p.detach().clone() for n, p in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
            "accountant": json.dumps(self.accountant.state_dict()),
            "sampler": self.sampler.state_dict(),
            "rng": rng,
            "telemetry": self.telemetry.state_dict() if hasattr(self.telemetry, "state_dict") else {},
            "step_times": torch.tensor(self.step_times, dtype=torch.float64),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, ledger: Optional[Mapping[str, Any]] = None) -> Optional[str]:
        """Restore ``state_dict()`` output. ``ledger``: the ledger file's content (``ledger_path``).

        If the ledger shows more released steps than the checkpoint (a crash after a checkpoint),
        the ledger's accountant is kept (the lost releases stay counted) and every random stream
        is re-seeded from fresh OS entropy (no noise or sample is ever reused); returns a warning
        message in that case, else None.

        The trainer's own ``ledger_path`` file, if it exists, is read too, ``ledger`` given or not, and
        the larger count of the two wins (review, round 36: a given copy hid the file's later releases),
        so the file's count is never lowered; one of another run, or two whose histories disagree, are
        refused. A state whose sampler position is not its step count (a step that raised after its draw,
        before round 36) is refused. Without any ledger a
        private trainer cannot tell whether updates after this
        checkpoint were released (an older checkpoint, or a second run from the same one): restoring
        the noise stream would repeat their noise, and on changed data two releases would then differ
        by the changed example's clipped gradient alone (review, round 33). So every random stream is
        re-seeded from fresh entropy and a warning is returned (ε counts this checkpoint's steps only).
        Pass the ledger to continue the streams exactly.
        """
        # this trainer's own releases are a ledger too (review, round 37: rolled back to an older state
        # of its run without a ledger, it forgot the steps it had released itself); a load that fails
        # part-way puts them back and leaves the trainer refusing to step until a load goes through
        live = self._ledger() if self.dp and self.released > 0 else None
        if live is not None and state.get("run_id") != self.run_id:  # (a state without one: before round 37, unknown)
            raise ValueError(f"this trainer released {self.released} step(s) of its own run, and the state is of "
                             "another run: its count would leave them out (they spent ε on the same data). Load it "
                             "into a fresh trainer, and count both runs' ε")
        # (put back as a pair if the load fails)
        before = (live["accountant"] if live is not None else self.accountant.state_dict(), self.released)
        try:
            out = self._load_state_dict(state, ledger, live)
            if hasattr(self.telemetry, "load_state_dict") and state.get("telemetry"):
                self.telemetry.load_state_dict(state["telemetry"])  # (last: it rewrites its log file)
        except BaseException:
            # (review, round 37: a failure between the accountant's load and the count's left them apart)
            self._load_failed = True
            self.accountant.load_state_dict(before[0])
            self.released = before[1]
            raise
        self._load_failed = False
        # (review, round 37: left None, a resumed finished run's final evaluation recorded ε as null)
        self.last_epsilon = self.epsilon().upper if self.dp and self.released > 0 else None
        if state.get("run_id") is not None:
            self.run_id = state["run_id"]  # (this trainer continues that run)
        return out

    def _load_state_dict(self, state: Mapping[str, Any], ledger: Optional[Mapping[str, Any]],
                         live: Optional[Mapping[str, Any]] = None) -> Optional[str]:
        ledger, source = self._reconcile_ledgers(ledger, live)
        saved = state.get("privacy")
        if saved is not None and dict(saved) != self._privacy_key():
            diff = ", ".join(f"{k}: {saved.get(k)!r} in the state vs {v!r} here"
                             for k, v in self._privacy_key().items() if saved.get(k) != v)
            raise ValueError(f"the state was saved by a trainer with other privacy settings ({diff}): its steps "
                             "would be counted under this one's plan (a dp=False state's steps as private ones). "
                             "Build the trainer with the state's settings")
        # the privacy history must count every release, before anything is loaded
        acc_state = json.loads(state["accountant"])
        released = int(state.get("released", state["step"]))
        if self.dp:
            sigma, q = float(self.plan.noise_multiplier), float(self.plan.sample_rate)
            why = _history_problem(acc_state, released, sigma, q)
            if why is not None:
                raise ValueError(f"the state's privacy history does not count its releases ({why}): the checkpoint "
                                 "was damaged or edited; refusing to resume. Resume from an intact checkpoint")
            if ledger is not None:
                why = _history_problem(ledger.get("accountant"), int(ledger.get("steps_released", 0)), sigma, q)
                if why is not None:
                    raise ValueError(f"the privacy ledger's history does not count its releases ({why}): it was "
                                     "damaged or edited; refusing to resume")
                if int(ledger.get("steps_released", 0)) == released \
                        and not _same_history(ledger.get("accountant"), acc_state):
                    raise ValueError("the state and the privacy ledger count the same releases with different "
                                     "histories: one of them was damaged or edited, or they are different runs'; "
                                     "refusing to resume")
        smp = state.get("sampler")
        if isinstance(smp, Mapping) and "position" in smp and int(smp["position"]) != int(state["step"]):
            # (a step that raised after its draw, before round 36: the plan's last step has no draw left)
            raise ValueError(f"the state's sampler has drawn {int(smp['position'])} batch(es) but {int(state['step'])} "
                             "step(s) were taken: a step failed after drawing its batch (before round 36), so the "
                             "run cannot end on its plan from this state")
        params = state["params"]
        if set(params) != set(self.params):
            raise ValueError("checkpoint parameters differ from the model's trainable parameters")
        with torch.no_grad():
            for n, p in self.params.items():
                if params[n].shape != p.shape:
                    raise ValueError(f"checkpoint parameter {n} has shape {tuple(params[n].shape)}, model {tuple(p.shape)}")
                p.copy_(params[n])
        self.optimizer.load_state_dict(state["optimizer"])

        self.accountant.load_state_dict(acc_state)
        self.sampler.load_state_dict(state["sampler"])
        self.step_count = int(state["step"])
        self.released = released
        self.step_times = [float(x) for x in state.get("step_times", torch.zeros(0)).tolist()]
        rng = state.get("rng")
        if rng is None and not self.done:
            raise ValueError("the state has no random streams (a finished trainer's) but steps are left to take")
        if rng is not None:
            self._set_rng_states(rng)
        if ledger is not None and int(ledger.get("steps_released", 0)) > self.released:
            lost = int(ledger["steps_released"]) - self.released
            self.accountant.load_state_dict(ledger["accountant"])
            self.released = int(ledger["steps_released"])
            self._reseed()
            if source == "live":
                return (f"this trainer had released {lost} step(s) past this state; they stay counted (ε will "
                        "exceed the plan slightly) and all random streams were re-seeded from fresh entropy")
            return (f"{lost} step(s) were released after the last checkpoint and are lost; they stay on the "
                    f"privacy ledger (ε will exceed the plan slightly) and all random streams were re-seeded "
                    "from fresh entropy")
        stale = ledger is not None and int(ledger.get("steps_released", 0)) < self.released
        if (ledger is None or stale) and self.dp and self.plan.noise_multiplier > 0:
            self._reseed()
            if stale:
                return (f"the privacy ledger shows {int(ledger.get('steps_released', 0))} released step(s), fewer than "
                        f"this checkpoint's {self.released}: it is stale or another run's, so updates released after "
                        "the checkpoint cannot be seen; every random stream was re-seeded from fresh entropy (their "
                        "noise is never repeated) and ε counts this checkpoint's steps only")
            return ("no privacy ledger was given: updates released after this checkpoint, if any, cannot be seen, "
                    "so every random stream was re-seeded from fresh entropy (their noise is never repeated) and ε "
                    "counts this checkpoint's steps only; pass ledger= (the content of the file that "
                    "DPTrainer(ledger_path=...) writes) to continue the streams exactly")
        return None


# =============================================================================================
# models
# =============================================================================================
class TextClassifier(nn.Module):
    """A Hugging Face encoder (``AutoModel``), masked mean pooling, a linear head."""

    def __init__(self, encoder: nn.Module, num_labels: int, hidden_size: Optional[int] = None):
        super().__init__()
        self.encoder = encoder
        hidden = hidden_size or getattr(encoder.config, "hidden_size", None) or getattr(encoder.config, "n_embd")
        self.head = nn.Linear(hidden, num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def classification_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Per-example cross-entropy of a ``TextClassifier`` on ``input_ids/attention_mask/labels``."""
    logits = model(batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits, batch["labels"], reduction="none")


def causal_lm_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Per-example *summed* next-token loss of a causal LM (labels -100 are ignored)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = getattr(out, "logits", out)[:, :-1]
    labels = batch["labels"][:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                          ignore_index=-100)
    return tok.view(labels.shape).sum(1)


def load_text_classifier(path: os.PathLike, num_labels: int) -> Tuple[TextClassifier, Any]:
    """(model, tokenizer) from a local Hugging Face folder (offline); ``ModelError`` if unusable.

    Dropout stays as configured (the model is put in train mode while training). Weights the folder
    lacks (a BERT saved without its pooler), which from_pretrained initialises at random, are recorded
    on the model (``_random_init``: name, parameter, whether the output uses it) for
    ``model_fingerprint`` / ``random_init_fingerprint``.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model folder (no config.json)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ModelError("pdpsgd train needs transformers: pip install 'pdpsgd[train]'") from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise ModelError(f"cannot load a tokenizer from {path}: {_first_line(e)}") from None
        try:
            enc, info = AutoModel.from_pretrained(str(path), attn_implementation="eager", output_loading_info=True)
        except Exception as e:
            raise ModelError(f"cannot load a model from {path}: {_first_line(e)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model = TextClassifier(enc, num_labels)
    model._random_init = _random_init_weights(enc, info)
    return model, tok


def _random_init_weights(enc: nn.Module, info: Any) -> List[Tuple[str, nn.Parameter, bool]]:
    """(name, parameter, used) of the encoder's weights that the folder did not hold (or held in another
    shape): from_pretrained initialised them at random. ``used``: the classifier may read it, i.e. all
    but the encoder's pooler (``TextClassifier`` reads ``last_hidden_state`` only). Not a probe by a
    forward (review, round 36: one short eval-mode forward misses weights read only in train mode, at
    longer lengths or by another routed expert)."""
    keys = set()
    for k in list((info or {}).get("missing_keys") or []) + list((info or {}).get("mismatched_keys") or []):
        keys.add(k if isinstance(k, str) else k[0])
    if not keys:
        return []
    prefix = (getattr(enc, "base_model_prefix", "") or "") + "."
    keys |= {k[len(prefix):] for k in keys if prefix != "." and k.startswith(prefix)}
    names: Dict[int, List[str]] = {}
    objs: Dict[int, nn.Parameter] = {}
    for n, p in enc.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        objs[id(p)] = p
    # (a parameter also reachable under a name that was loaded, a tied weight, holds loaded values)
    rand = [(ns[0], objs[i]) for i, ns in names.items() if all(n in keys for n in ns)]
    return [(n, p, not n.startswith("pooler.")) for n, p in rand]


def head_body_groups(model: nn.Module) -> Optional[Dict[str, List[str]]]:
    """Clipping groups ``{"head": [...], "body": [...]}`` of the trained parameters (None when only
    one of them trains). With ``clip_budget=[1, 1]`` each group is clipped to C/√2, so the total
    sensitivity stays C while the small, randomly initialised head is not drowned by the
    encoder's much larger per-example gradients."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    head = [n for n in names if n.startswith("head.")]
    body = [n for n in names if not n.startswith("head.")]
    return {"head": head, "body": body} if head and body else None


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:300]


def _layer_index(name: str) -> Optional[int]:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("layer", "layers", "h", "block", "blocks") and b.isdigit():
            return int(b)
    return None


def select_trainable(model: TextClassifier, spec: str) -> str:
    """Freeze/unfreeze ``model``'s parameters by ``spec`` and return a short description.

    * ``all``: everything; ``head``: the classifier only; ``bias``: biases + head (BitFit);
    * ``top-N``: the top N transformer blocks + head (+ the final norm, if any);
    * ``lora`` / ``lora-R``: LoRA adapters of rank R (default 8) on the attention projections
      (``peft``) + head; the pretrained weights stay frozen. Adapters are ordinary submodules, so
      they get exact per-example clipping like any other parameter.
    """
    spec = spec.strip().lower()
    if spec.startswith("lora"):
        r = 8
        if spec not in ("lora",):
            try:
                r = int(spec.split("-", 1)[1])
            except (IndexError, ValueError):
                raise ModelError(f"--train-params {spec!r}: use lora or lora-R (e.g. lora-8)") from None
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ModelError("--train-params lora needs peft: pip install peft") from None
        try:
            cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, bias="none")
            model.encoder = get_peft_model(model.encoder, cfg)
        except ValueError as e:
            raise ModelError(f"--train-params lora: {_first_line(e)}") from None
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("head.") or "lora_" in n)
        return f"LoRA r={r} adapters + head"
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.head.parameters():
        p.requires_grad_(True)
    if spec == "all":
        for p in model.parameters():
            p.requires_grad_(True)
        return "all parameters"
    if spec == "head":
        return "classification head only"
    if spec == "bias":
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.requires_grad_(True)
        return "biases + head (BitFit)"
    if spec.startswith("top-") or spec.startswith("top"):
        try:
            k = int(spec.split("-", 1)[1] if "-" in spec else spec[3:])
        except ValueError:
            raise ModelError(f"--train-params {spec!r}: use top-N, e.g. top-2") from None
        layers = sorted({i for n, _ in model.encoder.named_parameters() if (i := _layer_index(n)) is not None})
        if not layers:
            raise ModelError("--train-params top-N: cannot find numbered transformer blocks in this model")
        if not 0 <= k <= len(layers):
            raise ModelError(f"--train-params top-{k}: the model has {len(layers)} blocks")
        chosen = set(layers[len(layers) - k:])
        for n, p in model.encoder.named_parameters():
            i = _layer_index(n)
            if i is not None and i in chosen:
                p.requires_grad_(True)
            elif i is None and k > 0 and _after_blocks(n):
                p.requires_grad_(True)  # final norm (GPT-2 ln_f, ...)
        return f"top {k} of {len(layers)} blocks + head"
    raise ModelError(f"--train-params {spec!r}: use all, head, bias, top-N or lora")


def _after_blocks(name: str) -> bool:
    return any(k in name for k in ("ln_f", "final_layer_norm", "norm.weight", "norm.bias")) and "embed" not in name


@torch.no_grad()
def evaluate(model: nn.Module, data: Mapping[str, Tensor], *, batch_size: int = 64, device: Any = None) -> Dict[str, float]:
    """Accuracy and mean loss of a classifier on ``data`` (input_ids, attention_mask, labels)."""
    was = model.training
    model.eval()
    n = len(data["labels"])
    correct, loss = 0, 0.0
    try:
        for s in range(0, n, batch_size):
            b = {k: v[s:s + batch_size] for k, v in data.items()}
            if device is not None:
                b = {k: v.to(device) for k, v in b.items()}
            logits = model(b["input_ids"], b["attention_mask"])
            loss += float(F.cross_entropy(logits.float(), b["labels"], reduction="sum"))
            correct += int((logits.argmax(-1) == b["labels"]).sum())
    finally:
        model.train(was)
    return {"accuracy": correct / max(1, n), "loss": loss / max(1, n), "examples": n}


def _random_ids(model: nn.Module) -> Dict[int, Tuple[str, bool]]:
    return {id(p): (n, used) for n, p, used in getattr(model, "_random_init", None) or ()}


def model_fingerprint(model: nn.Module, *, legacy: bool = False) -> str:
    """sha256 over every parameter's name, shape, dtype and trainability, and the *values* of all
    parameters that come from the pretrained folder (everything except the randomly initialised
    ``head.*`` and LoRA adapters, and the weights that ``load_text_classifier`` found missing from the
    folder, which from_pretrained initialised at random: review, round 36, a run without a seed on a
    BERT saved without its pooler could never be resumed). Call it right after loading: two
    different pretrained models (or architectures) never share it, whatever is trained. For the
    missing weights that matter on resume, see ``random_init_fingerprint``. ``legacy=True``: the hash
    of checkpoints written before round 36, those weights' values included (the same for a folder
    that holds every weight)."""
    rand = {} if legacy else _random_ids(model)
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
        if not n.startswith("head.") and "lora_" not in n and id(p) not in rand:
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def frozen_random_weights(model: nn.Module) -> List[str]:
    """Names (the folder's, as in the encoder) of the weights that the model folder lacked, so from_pretrained initialised them
    at random, that the classifier's output uses, and that do not train: a checkpoint does not hold them,
    so a resumed run is the same model only if they come out the same (the same ``--seed``)."""
    return sorted(n for n, p, used in getattr(model, "_random_init", None) or () if used and not p.requires_grad)


def random_init_fingerprint(model: nn.Module) -> Optional[str]:
    """sha256 over the values of ``frozen_random_weights(model)`` (None when there are none): a run
    resumed with other values would continue another model."""
    names = set(frozen_random_weights(model))
    if not names:
        return None
    h = hashlib.sha256()
    for n, p, _ in model._random_init:
        if n in names:
            h.update(f"{n}:{tuple(p.shape)}:{p.dtype};".encode())
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

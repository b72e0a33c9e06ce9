"""Module -> pure function, tied-weight aware.

``bind(model, loss_fn)`` returns a small wrapper module (the user's model is its submodule and is
never modified) so that ``torch.func.functional_call`` can evaluate ``loss_fn(model, batch)`` at
any parameter values. Parameters are identified by their deduplicated ``named_parameters`` name;
aliases of a tied parameter (e.g. GPT-2's ``lm_head.weight``) map to that one name, so a tied
weight is *one* parameter whose per-example gradient is summed over every use.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten
from torch.nn.parameter import is_lazy
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.parametrize import ParametrizationList
from torch.nn.utils.spectral_norm import SpectralNorm

from ._compat import held, value_before_hold
from ._types import Batch, LossFn, Params
from ._warn import warn

__all__ = ["trainable_params", "ParamIndex", "LossModule", "check_no_batch_mixing", "model_structure", "preserve_module_state",
           "model_constants", "no_writes_to", "no_rope_mixing", "spectral_norms_held", "advance_spectral_norms"]


def trainable_params(model: nn.Module) -> Params:
    """The parameters that ``dp_step`` trains: name -> tensor, tied parameters listed once.

    Pass a sub-dict to ``dp_step`` to freeze the rest (frozen parameters get no gradient and
    cost no privacy). Parameters with ``requires_grad=False`` are left out.
    """
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class ParamIndex:
    """Names, aliases and shapes of a model's parameters and buffers (read once, never written)."""

    def __init__(self, model: nn.Module):
        self.canonical: Dict[str, str] = {}  # any alias -> first name
        first_name: Dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            first_name.setdefault(id(p), name)
            self.canonical[name] = first_name[id(p)]
        self.params: Dict[str, Tensor] = dict(model.named_parameters())
        self._order = {n: i for i, n in enumerate(self.params)}

    def in_model_order(self, names) -> List[str]:
        """Canonical ``names`` in the model's parameter order, whatever order a ``params`` dict had:
        clipping="per_layer"'s groups follow it, so a clip budget's weights go to the same tensors
        (review, round 39: they followed the dict's order, and two orders shared one clipping key)."""
        return sorted(names, key=lambda n: self._order.get(n, len(self._order)))

    def canonical_clipping(self, clipping):
        """A clipping spec with each group's names made canonical (a tied tensor may be named by any
        of its aliases, as in ``params``); "flat"/"per_layer" pass through. Naming one tied tensor
        twice is an error that names both spellings."""
        if isinstance(clipping, str):
            return clipping
        groups = clipping.values() if isinstance(clipping, Mapping) else clipping
        out, spelled = [], {}
        for g in groups:
            names = [g] if isinstance(g, str) else list(g)
            canon = []
            for n in names:
                c = self.canonical.get(n, n)
                if c in spelled and spelled[c] != n:
                    raise ValueError(f"clipping groups name {spelled[c]!r} and {n!r}, which are the same tied "
                                     "tensor; name it once")
                spelled.setdefault(c, n)
                canon.append(c)
            out.append(canon)
        return out

    def resolve(self, params: Mapping[str, Tensor]) -> Params:
        """Validate a user's params dict and return it keyed by canonical names."""
        if not isinstance(params, Mapping):
            raise TypeError(
                "params must be a dict name -> tensor, e.g. pdpsgd.trainable_params(model); "
                f"got {type(params).__name__}"
            )
        if len(params) == 0:
            if self.params and not any(p.requires_grad for p in self.params.values()):
                raise ValueError("params is empty: the model has no parameter with requires_grad=True, so "
                                 "pdpsgd.trainable_params(model) lists none. Unfreeze what should train "
                                 "(e.g. model.classifier.requires_grad_(True)), or pass those tensors by name")
            raise ValueError("params is empty: pass pdpsgd.trainable_params(model) or a non-empty subset")
        out: Params = {}
        frozen: List[str] = []
        for name, value in params.items():
            if name not in self.canonical:
                raise ValueError(
                    f"parameter {name!r} does not belong to the model (known names look like "
                    f"{next(iter(self.params), '<none>')!r}); build params with "
                    "pdpsgd.trainable_params(model)"
                )
            canon = self.canonical[name]
            if canon in out:
                raise ValueError(
                    f"parameters {name!r} and {canon!r} are the same tied tensor; pass it once"
                )
            ref = self.params[canon]
            if not isinstance(value, Tensor) or value.shape != ref.shape:
                shape = getattr(value, "shape", type(value).__name__)
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(shape) if not isinstance(shape, str) else shape}, "
                    f"the model's has {tuple(ref.shape)}"
                )
            if not (value.is_floating_point() or value.is_complex()):
                raise ValueError(f"parameter {name!r} is not floating point ({value.dtype}); it cannot be trained")
            if isinstance(value, nn.Parameter) and value is not ref:
                # (review, round 51: params built before a layer was replaced trained the old layer's tensors,
                # which the model no longer holds: the loss the step reported was not the model's, and the new
                # layer never moved. A plain tensor (a functional caller's own values) is taken as given.)
                raise ValueError(
                    f"params[{name!r}] is an nn.Parameter that is not the model's parameter of that name (was the "
                    "layer replaced, or new Parameters assigned, after params was built?): the step would train "
                    "a tensor the model no longer uses. Build params again, params = pdpsgd.trainable_params(model), "
                    "and the optimizer over them"
                )
            if not ref.requires_grad:
                frozen.append(name)
            out[canon] = value
        if frozen:
            # (review, round 42: an Opacus user freezes with requires_grad_(False); a dict of all of
            # named_parameters() trained them anyway, silently)
            warn(f"params includes {len(frozen)} parameter(s) the model has frozen (requires_grad=False), e.g. "
                 f"{frozen[0]!r}: the step trains them all the same (their gradients are computed, clipped into "
                 "the norm and noised). To keep them frozen leave them out of params: "
                 "pdpsgd.trainable_params(model) lists only the parameters with requires_grad=True (a DPTrainer "
                 "keeps the params it was built with: build it again after freezing)")
        return out



def model_structure(model: nn.Module) -> Tuple[tuple, list]:
    """What a step's memos (batch-dimension probe, example-order verdicts, the parameter index) were
    found for: every module under its name(s), its type, its ``forward`` (set on the instance, or
    its class's, which a patch ``Cls.forward = ...`` replaces), its forward hooks, and its parameter
    objects; and torch's global module hooks. Returns (key, objects): the key compares by identity;
    ``objects`` are what it names, to be kept alive beside it (so an id is not reused by a new object
    while the key is held).

    ``key[0]`` is the layout without the parameters' identities: each parameter slot's shape, dtype,
    device, ``requires_grad`` and the first slot holding the same Parameter object (which weights
    are tied); for a slot holding anything but a plain ``nn.Parameter`` (a subclass can carry state
    of its own into the forward through ``__torch_function__``; a lazy one has no shape yet), its
    type and identity. Parameters swapped for new ones of the same layout (``load_state_dict(assign=True)``)
    change only ``key[1]``: a new parameter index, not a new model for the memos (keyed by names,
    shapes and dtypes, never by a parameter's identity)."""
    mm = nn.modules.module
    glob = (tuple(getattr(mm, "_global_forward_pre_hooks", ())), tuple(getattr(mm, "_global_forward_hooks", ())))
    layout, ids, objs = [glob], [], []
    first: Dict[int, Tuple[str, str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        fwd = m.__dict__.get("forward") or type(m).forward
        ps = tuple(m._parameters.items())
        slots = []
        for k, p in ps:
            if p is None:
                slots.append((k, None))
                continue
            slot = first.setdefault(id(p), (name, k))
            if type(p) is not nn.Parameter or is_lazy(p):
                # a subclass can carry state of its own into the forward (a __torch_function__ that
                # copies an attribute through detach()): its object is part of the layout; a lazy
                # one has no shape yet
                slots.append((k, slot, type(p), id(p)))
                continue
            slots.append((k, slot, tuple(p.shape), p.dtype, p.device, p.requires_grad))
        layout.append((name, id(m), type(m), id(fwd), tuple(m._forward_pre_hooks), tuple(m._forward_hooks),
                       tuple(slots)))
        ids.append(tuple(id(p) for _, p in ps))
        objs.append((m, fwd, ps))
    return (tuple(layout), tuple(ids)), objs


_SETTING_TYPES = frozenset({int, float, bool, str, type(None)})


def model_settings(model: nn.Module) -> List[Dict[str, Any]]:
    """Every module's plain attributes now (numbers, strings, None; ``training`` aside, which the memos
    key themselves): what a forward may branch on besides its inputs and random streams (a
    curriculum's ``model.epoch`` set by the training loop, a flag). A step compares them with what
    they were as its previous step ended, and drops its memos where they differ (review, round 47:
    a layer given, from ``epoch >= 3`` on, a frozen table of B rows at the batch's call site had the
    table's rows credited to examples, 3.7 C between neighbours where 2 C bounds it, the batch shape's
    probe having been run at epoch 0)."""
    return [{k: v for k, v in m.__dict__.items() if type(v) in _SETTING_TYPES and k != "training"}
            for m in model.modules()]


def model_constants(model: nn.Module, trainable: Iterable[str]) -> Dict[str, Tensor]:
    """The constants of the pure function, read from the model *now*: its parameters that are not
    trained (detached, canonical names) and its buffers. Not a construction-time snapshot: after
    ``model.to(dtype)`` or a rebound buffer (e.g. a recomputed RoPE cache) they are new tensors."""
    keep = set(trainable)
    out, every = {}, set()
    for n, p in model.named_parameters():
        every.add(id(p))
        if n not in keep:
            out[n] = p.detach()
    # (a buffer that is a parameter's very tensor is tied to it: functional_call fills it from the
    # parameter, and a value of its own would be refused as a second value for tied names)
    out.update((n, b) for n, b in model.named_buffers() if id(b) not in every)
    return out


# Set by the step while it watches the batch for in-place edits (``step._BatchEdits``): told after each forward.
BATCH_EDITS: contextvars.ContextVar[Any] = contextvars.ContextVar("pdpsgd_batch_edits", default=None)


class LossModule(nn.Module):
    """``forward(batch) = loss_fn(model, batch)``; parameters prefixed ``model.``.

    Exists only so that ``functional_call`` (public API) can swap the parameters of the whole
    loss computation, however ``loss_fn`` calls the model.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, batch: Batch) -> Tensor:  # type: ignore[override]
        try:
            return self._loss_fn(self.model, batch)
        finally:
            watch = BATCH_EDITS.get()
            if watch is not None:  # (a step's first batch of a signature: in-place edits of the batch, ``step``)
                watch.after_forward()

    @staticmethod
    def prefixed(d: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        return {"model." + k: v for k, v in d.items()}


_MIXING = (nn.modules.batchnorm._BatchNorm,)


def check_no_batch_mixing(model: nn.Module) -> None:
    """Raise if the model has a layer that mixes examples of a batch in training mode, or one whose
    forward edits its own weight from the batch (``Embedding(max_norm=...)``).

    A per-example gradient is only defined when each example's loss depends on that example
    alone. BatchNorm in training mode normalises with batch statistics, so example i's loss
    depends on every other example and no clipping bound holds.
    """
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            # F.embedding(max_norm=...) rescales, in place and without noise, the weight rows of the
            # tokens the batch holds (torch.embedding_renorm_), in training and in eval mode alike
            raise ValueError(
                f"layer {name or '<root>'!r} ({type(module).__name__}(max_norm={module.max_norm})) rescales in "
                "place, in every forward, the weight rows of the tokens that the batch holds: a change to the "
                "model that depends on the private batch and gets no noise, outside the DP guarantee (and not "
                "a per-example gradient). Construct it with max_norm=None; to bound the rows, renormalise "
                "them after the optimizer step (a function of the noisy parameters only)."
            )
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.training \
                and module.track_running_stats:
            # per-example normalisation (no mixing), but its forward updates the running statistics,
            # in place, from the batch (what opacus' validator refuses too)
            raise ValueError(
                f"layer {name or '<root>'!r} ({type(module).__name__}(track_running_stats=True)) updates its running "
                "statistics in place from the batch in training mode: a value computed from the private batch "
                "stored in the model without noise, outside the DP guarantee. Construct it with "
                "track_running_stats=False (it then normalises each example by its own statistics), or freeze "
                "it with module.eval()."
            )
        if not isinstance(module, _MIXING):
            continue
        # torch's own rule: batch statistics in training mode, and in eval mode too when the layer
        # keeps no running statistics (track_running_stats=False)
        no_running = getattr(module, "running_mean", None) is None and getattr(module, "running_var", None) is None
        if module.training:
            raise ValueError(
                f"layer {name or '<root>'!r} ({type(module).__name__}) mixes examples of a batch in "
                "training mode (batch statistics), so per-example gradients and the DP guarantee are "
                "undefined. Replace it with GroupNorm or LayerNorm (opacus.validators.ModuleValidator.fix "
                "does this), or freeze it with module.eval() to use its running statistics."
            )
        if no_running:
            raise ValueError(
                f"layer {name or '<root>'!r} ({type(module).__name__}) has track_running_stats=False, so it "
                "normalises with batch statistics even in eval mode: it mixes examples of a batch and "
                "per-example gradients and the DP guarantee are undefined. Replace it with GroupNorm or "
                "LayerNorm (opacus.validators.ModuleValidator.fix does this)."
            )


def _not_watched(m: nn.Module) -> Set[str]:
    """Local names of a module's tensors that torch's own layers write in place in the forward from
    the model's weights alone, not from the batch (not watched by ``no_writes_to``):

    - an RNN's weights on CUDA, which ``flatten_parameters`` (its forward, with cuDNN) copies into
      one flat buffer and re-points at it (their version counters move, their values do not);
    - spectral normalisation's power-iteration vectors u and v (``torch.nn.utils.spectral_norm``'s
      ``weight_u`` / ``weight_v``; ``parametrizations.spectral_norm``'s ``_u`` / ``_v``), updated in
      training mode from the weight (kept across steps: the iteration goes on from them)."""
    out: Set[str] = set()
    if isinstance(m, nn.RNNBase):
        out.update(n for n, t in m._parameters.items() if t is not None and t.is_cuda)
    elif isinstance(m, _SpectralNorm):
        out.update(("_u", "_v"))
    for hook in m._forward_pre_hooks.values():
        if isinstance(hook, SpectralNorm):
            out.update((f"{hook.name}_u", f"{hook.name}_v"))
    return out


def _spectral_norms(model: nn.Module):
    """(spectral normalisation, where it lives) for each in the model: a new-style
    ``parametrizations.spectral_norm`` module with its ``ParametrizationList``, an old-style
    ``spectral_norm`` forward pre-hook with the module it is on."""
    out = []
    for m in model.modules():
        if isinstance(m, ParametrizationList):
            out.extend((q, m) for q in m if isinstance(q, _SpectralNorm))
        hooks = getattr(m, "_forward_pre_hooks", None)
        if isinstance(hooks, dict):
            out.extend((h, m) for h in hooks.values() if isinstance(h, SpectralNorm))
    return out


def _iterations_key(sn: Any) -> Tuple[str, Any]:
    return ("n_power_iterations", sn)


@contextlib.contextmanager
def spectral_norms_held(model: nn.Module, found: Optional[list] = None) -> Iterator[None]:
    """While a step's forwards run: spectral normalisation's power iteration is held (its u and v
    used, not advanced). In training mode torch advances them in every forward, and a step runs a
    number of forwards that follows the private batch size (one per vmap chunk, per physical batch,
    per first-step check), so how far they had moved, kept in the model without noise and read by
    the next step, depended on it (review, round 34: neighbouring batch sizes moved the next step's
    clipped sum by 1e-5 C); and chunks of one step saw different u. :func:`advance_spectral_norms`
    advances them once per step instead (``DPStep.finalize``), from the public weights.
    ``found``: ``_spectral_norms(model)`` if known (a step keeps it per model structure). Counted
    holds (``_compat.held``): overlapping steps on one model put the true count back."""
    found = _spectral_norms(model) if found is None else found
    with held([(_iterations_key(sn), functools.partial(getattr, sn, "n_power_iterations"),
                functools.partial(setattr, sn, "n_power_iterations"), 0) for sn, _ in found]):
        yield


def _own_iterations(sn: Any) -> int:
    """A spectral norm's own iteration count, also while a step holds it at 0."""
    return value_before_hold(_iterations_key(sn), functools.partial(getattr, sn, "n_power_iterations"))


def advance_spectral_norms(model: nn.Module, params: Optional[Mapping[str, Tensor]] = None,
                           found: Optional[list] = None) -> None:
    """One power-iteration update of each spectral normalisation in training mode (what one forward
    of ordinary training does) from the weights the step ran with: ``params`` (canonical or alias
    names) where they hold the normalised weight, else the model's own: once per DP step, whatever
    the batch size (see :func:`spectral_norms_held`)."""
    found = _spectral_norms(model) if found is None else found
    if not found:
        return
    names: Dict[int, list] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)

    def value(t: Tensor) -> Tensor:  # the step's value of this parameter, if it was given one
        for n in names.get(id(t), ()) if params else ():
            if n in params:
                return params[n].detach()
        return t.detach()

    with torch.no_grad():
        for sn, host in found:
            if isinstance(sn, SpectralNorm):  # (old style: a pre-hook on ``host``; torch's own iteration)
                if host.training:
                    W = sn.reshape_weight_to_matrix(value(getattr(host, sn.name + "_orig")))
                    u, v = getattr(host, sn.name + "_u"), getattr(host, sn.name + "_v")
                    for _ in range(_own_iterations(sn)):
                        v = F.normalize(torch.mv(W.t(), u), dim=0, eps=sn.eps, out=v)
                        u = F.normalize(torch.mv(W, v), dim=0, eps=sn.eps, out=u)
                continue
            if not sn.training:
                continue
            # its input: the original(s) through the parametrizations before it, their own power
            # iterations held (each spectral norm advances once, by its own turn)
            if host.is_tensor:
                x = value(host.original)
            else:
                x = host[0](*(value(getattr(host, f"original{i}")) for i in range(host.ntensors)))
            with spectral_norms_held(model, [(q, host) for q in host if isinstance(q, _SpectralNorm)]):
                for i, q in enumerate(host):
                    if q is sn:
                        break
                    if i > 0 or host.is_tensor:
                        x = q(x)
            if x.ndim > 1:  # (a vector is normalised: no u, v)
                sn._power_method(sn._reshape_weight_to_matrix(x), _own_iterations(sn))


def _put_back_quietly(m: nn.Module) -> Set[str]:
    """Buffers that the forward may rewrite from the batch's shape (not a leak to raise on, but
    not kept either): the ``inv_freq`` tables of the rotary embeddings ``no_rope_mixing`` watches
    (``_watched_rope``), which dynamic / long RoPE recompute or switch from the longest position in
    the batch (that check raises where an example's own would differ). Put back after the step,
    without a word; a static kind's rotary module that writes them is raised on as any other."""
    if _watched_rope(m):
        return {n for n in m._buffers if n.endswith("inv_freq")}
    return set()


# buffers up to this many bytes in all are copied before the step and compared after it, value by
# value (a write through ``.data``, ``.numpy()`` or the storage moves no version counter); beyond it,
# and for parameters, the version counter and where the tensor's data lie are compared
WRITE_CHECK_COPY_BYTES = 64 << 20
_PLAIN_TYPES = (Tensor, nn.Parameter, getattr(nn, "Buffer", Tensor))


def _where(t: Tensor):
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):  # (sparse, nested, wrapper subclasses: no data pointer)
        ptr = None
    try:
        shape, stride = tuple(t.shape), t.stride()
    except (RuntimeError, NotImplementedError):
        shape, stride = None, None
    return (ptr, shape, stride, t.dtype, t.layout)


def _copyable(t: Tensor) -> bool:
    """A plain dense tensor with its own storage, whose bytes can be copied and compared."""
    return (type(t) in _PLAIN_TYPES and t.layout == torch.strided and not t.is_meta and not t.is_quantized
            and not t.is_nested)


def _bits(t: Tensor) -> Tensor:
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)  # (bitwise: NaN == NaN, -0.0 != 0.0)


@contextlib.contextmanager
def no_writes_to(model: nn.Module, trained: Mapping[str, Tensor]) -> Iterator[None]:
    """Raise after the block if it wrote to the model: to a buffer (any change of its value), in
    place to a parameter (``trained``: the values the step runs with; the model's frozen ones), or
    registered a new buffer.

    A forward that updates a buffer from the batch (InstanceNorm's running statistics in training
    mode, a custom running mean, a counter of the batch's examples) or edits a frozen weight
    changes the model by a function of the private batch that gets no noise: outside the DP
    guarantee, whatever the gradients' clipping. Plain dense buffers (small in the models we know;
    up to ``WRITE_CHECK_COPY_BYTES`` in all) are copied before the block and compared bit for bit
    after it, so writes through ``.data``, ``.numpy()`` or the storage count, and a rewrite of the
    same values does not; they are put back before raising, and also when the block raises.
    Parameters (and buffers past the budget, sparse / quantized / subclass ones) are compared by
    version counter and data pointer only: an in-place op, ``set_`` or a new ``.data`` counts, a
    write through ``.data`` / the storage in place does not (and it is not undone). Buffers
    registered during the block on the model's modules are removed, and raised on (a submodule
    made in the forward, e.g. a lazily built frozen copy of a layer, is left, and not watched).
    ``_not_watched``'s tensors are not watched; rotary ``inv_freq`` tables are put back."""
    budget = WRITE_CHECK_COPY_BYTES
    copied, versioned, ids, quiet = [], [], set(), []
    skip: Set[str] = set()
    keys = []  # (module, its name prefix, its buffer names before the block)
    for mn, m in model.named_modules():  # (one walk: ~3x faster than named_buffers + named_parameters)
        if not isinstance(m._buffers, dict) or not isinstance(m._parameters, dict):
            continue  # (a TorchScript module: its registries are C++ dicts, and the engine refuses it)
        pre = mn + "." if mn else ""
        keys.append((m, pre, set(m._buffers)))
        local = _not_watched(m)
        skip.update(pre + n for n in local)
        hush = _put_back_quietly(m)
        for n, b in m._buffers.items():
            if b is None or n in local or id(b) in ids:
                continue
            ids.add(id(b))
            size = b.numel() * b.element_size() if _copyable(b) else -1
            if 0 <= size <= budget:
                budget -= size
                (quiet if n in hush else copied).append((pre + n, b, b.detach().clone(), _where(b)))
            else:
                versioned.append((pre + n, b, b._version, _where(b)))
        for n, q in m._parameters.items():
            if q is None or n in local or id(q) in ids:
                continue
            ids.add(id(q))
            if pre + n not in trained:  # (a frozen parameter; the trained ones as the step runs them, below)
                versioned.append((pre + n, q, q._version, _where(q)))
    for n, q in trained.items():
        if n not in skip and isinstance(q, Tensor) and id(q) not in ids:
            ids.add(id(q))
            versioned.append((n, q, q._version, _where(q)))
    try:
        yield
    except BaseException:
        try:  # (the step's own error is what propagates, whatever the clean-up meets)
            _put_back(copied + quiet)
            _remove_new(keys)
        except Exception:  # pragma: no cover - defensive
            pass
        raise
    _put_back(quiet)
    changed = [n for n, t, v, w in versioned if t._version != v or _where(t) != w]
    restored = _put_back(copied)
    added = _remove_new(keys)
    if changed or restored or added:
        names = restored + changed + added
        raise ValueError(
            f"the forward wrote to {names[:5]}{' ...' if len(names) > 5 else ''} (a buffer or parameter of the "
            "model): a value computed from the private batch (e.g. running statistics) stored in the model "
            "without noise, outside the DP guarantee. Put such layers in eval mode, construct InstanceNorm with "
            "track_running_stats=False, or compute the value outside the forward (from public data or the noisy "
            "parameters)."
            + (f" The buffers {restored[:5]} were put back as they were before the step." if restored else "")
            + (f" The buffers {added[:5]}, registered during the step, were removed." if added else "")
            + (f" {changed[:5]} now hold what this batch wrote: reload them before releasing the model."
               if changed else "")
        )


def _put_back(copied) -> list:
    """Write back every copied buffer whose value (or place) changed; their names. The bitwise
    comparisons are gathered into one read per device (one host sync on a GPU, not one a buffer)."""
    same = [_where(b) == w and b.shape == saved.shape and b.dtype == saved.dtype and _copyable(b)
            for _, b, saved, w in copied]
    flags = {i: (_bits(b) != _bits(saved)).any() for i, (ok, (_, b, saved, _w)) in enumerate(zip(same, copied)) if ok}
    by_device: Dict[torch.device, list] = {}
    for i, f in flags.items():
        by_device.setdefault(f.device, []).append(i)
    for idx in by_device.values():
        for i, hit in zip(idx, torch.stack([flags[i] for i in idx]).tolist()):
            same[i] = not hit
    out = []
    for ok, (n, b, saved, _w) in zip(same, copied):
        if ok:
            continue
        with torch.no_grad():
            if b.shape == saved.shape and b.dtype == saved.dtype and _copyable(b):
                b.data.copy_(saved)
            else:
                b.data = saved
        out.append(n)
    return out


def _remove_new(keys) -> list:
    """Remove the buffers registered on the model's modules since ``keys`` was taken; their names.
    (Submodules and parameters made in the forward are left: a lazily built layer, a frozen copy
    of one, is the usual reason, and its values come from the model, not the batch.)"""
    out = []
    for m, pre, before in keys:
        for n in [n for n in m._buffers if n not in before]:
            del m._buffers[n]
            out.append(pre + n)
    return out


# Hugging Face rope kinds whose tables do not depend on the positions' values (elementwise in them)
_STATIC_ROPE = frozenset({"default", "linear", "yarn", "llama3", "proportional"})


def _watched_rope(m: nn.Module) -> bool:
    """A rotary embedding whose tables may depend on the positions it is called with: a Hugging
    Face ``*RotaryEmbedding`` whose ``rope_type`` (per layer type or not) is "dynamic" (NTK),
    "longrope" or another kind not known to be static, or that has no ``rope_type`` (transformers
    before 4.45: ``LlamaDynamicNTKScalingRotaryEmbedding``, remote-code Phi-3 longrope classes)."""
    if not type(m).__name__.endswith("RotaryEmbedding"):
        return False
    kind = getattr(m, "rope_type", None)
    kinds = list(kind.values()) if isinstance(kind, dict) else [kind]
    return not all(isinstance(k, str) and k in _STATIC_ROPE for k in kinds)


class _RopeState:
    """A rotary module's state: its ``inv_freq`` tables (the tensors, and their values) and its
    public plain attributes (``max_seq_len_cached``, ``attention_scaling``, cached tables, ...)."""

    def __init__(self, m: nn.Module):
        self.objs = {n: b for n, b in m._buffers.items() if b is not None and n.endswith("inv_freq")}
        self.vals = {n: b.detach().clone() for n, b in self.objs.items()}
        self.attrs = {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}

    def _attrs_back(self, m: nn.Module) -> None:
        d = vars(m)
        for k in [k for k in d if not k.startswith("_") and k != "training" and k not in self.attrs]:
            del d[k]
        d.update(self.attrs)

    def rebind(self, m: nn.Module) -> None:
        """The module as it was, on fresh copies of its tables (nothing written in place: a
        forward under a functorch transform may not mutate a tensor it captured)."""
        for n, v in self.vals.items():
            cur = m._buffers.get(n)
            m._buffers[n] = (v.clone() if not isinstance(cur, Tensor)
                             else v.to(device=cur.device, dtype=cur.dtype, copy=True))
        self._attrs_back(m)

    def put_back(self, m: nn.Module, values: bool = False) -> None:
        """The module's own tensors back in place (``values``: and their values, where a forward
        wrote them in place), and its attributes."""
        for n, b in self.objs.items():
            m._buffers[n] = b
            if values and not torch.equal(b, self.vals[n].to(b)):
                with torch.no_grad():
                    b.copy_(self.vals[n])
        self._attrs_back(m)


def _rope_rows(pos):
    """(the batch size B, the dim of ``pos`` that runs over the batch), or None where the positions
    cannot tell examples apart (one row shared by the batch, a broadcast ``(1, T)``: a function of
    the padded length) or are not a plain batch of positions."""
    if not isinstance(pos, Tensor) or pos.dim() not in (2, 3):
        return None
    if torch._C._functorch.is_functorch_wrapped_tensor(pos):
        return None  # (under vmap each example runs alone)
    d = 1 if pos.dim() == 3 and pos.shape[0] == 3 else 0  # (multimodal RoPE: (3, B, T))
    B = pos.shape[d]
    return (B, d) if B > 1 else None


def _row(t, B: int, i: int):
    """Row i of a module's input laid out batch-first (or in dim 1), kept as a batch of one; a
    tensor with no such dim of size B as it is (shared by the batch)."""
    if not isinstance(t, Tensor) or t.dim() == 0:
        return t
    for k in (0, 1):
        if k < t.dim() and t.shape[k] == B:
            return t.narrow(k, i, 1)
    return t


def _row_like(y: Tensor, x: Tensor, B: int, d: int, i: int) -> Tensor:
    """Row i of the batch's output y, read in the dim where the output x of row i alone has 1 and y
    has B (the others equal; dim d first): the output's own layout, not the positions'. A y shaped
    as x (a table shared by the batch) is read whole."""
    if x.dim() == y.dim():
        for k in sorted(range(y.dim()), key=lambda k: k != d):
            if y.shape[k] == B and x.shape[k] == 1 and all(
                    a == b for j, (a, b) in enumerate(zip(x.shape, y.shape)) if j != k):
                return y.narrow(k, i, 1)
    return y


def _same_output(alone, batch, B: int, d: int, i: int) -> bool:
    """The module's output for row i run alone equals row i of its output for the batch, bit for bit
    (what the rest of the model is fed: equal bits, equal gradients)."""
    from torch.utils._pytree import tree_flatten

    a, sa = tree_flatten(alone)
    b, sb = tree_flatten(batch)
    if sa != sb:
        return False
    for x, y in zip(a, b):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            y = _row_like(y, x, B, d, i)
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif isinstance(x, Tensor) or isinstance(y, Tensor) or x != y:
            return False
    return True


_ROPE_WARNED = "warned"
ROPE_LENGTH_WARNING = (
    "the rotary embedding {name!r} ({cls}) took other tables than in an earlier step with positions shared by "
    "the batch (torch.arange(T)): they are chosen by the padded length T. That is public only if every batch is "
    "padded to one fixed length; padding to the batch's longest example makes T that example's length, and one "
    "example's length then changes the other examples' gradients, outside the DP guarantee. Pad to a fixed "
    "length (padding='max_length').")


def _tables(m: nn.Module) -> list:
    """What a rotary module's last call computed its output from: its tables and scalings."""
    out = [(n, b.detach().clone()) for n, b in sorted(m._buffers.items()) if b is not None and n.endswith("inv_freq")]
    return out + [(k, v) for k, v in sorted(vars(m).items()) if "attention_scaling" in k]


def _same_tables(a: list, b: list) -> bool:
    if [n for n, _ in a] != [n for n, _ in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            x, y = torch.as_tensor(x), torch.as_tensor(y)
            if x.shape != y.shape or not torch.equal(x.to(y.device, y.dtype), y):
                return False
        elif x != y:
            return False
    return True


@contextlib.contextmanager
def no_rope_mixing(model: nn.Module, *, seen: Optional[dict] = None) -> Iterator[None]:
    """Raise when a rotary embedding gave an example other tables than it gets alone.

    Hugging Face's dynamic RoPE kinds choose their frequency table from ``max(position_ids) + 1``
    over the whole batch: "longrope" (Phi-3) switches to its long table, "dynamic" (NTK) rescales
    its base, and keeps the grown table across calls (``max_seq_len_cached``). With positions
    derived from the attention mask, the longest example then decides the table of every other
    one: one example's length changes the others' gradients, unseen by clipping. With the block on,
    every call of such a module (``_watched_rope``: those kinds, any kind not known to be static,
    and rotary modules with no ``rope_type``) starts from the state it had when the block began
    (nothing carried from one batch, or one forward, to the next; put back after the block), and a
    call whose rows have different largest positions is run again for the row with the smallest
    and the row with the largest of them, each alone: where one's output differs (bit for bit)
    from its row of the batch's output, or the smallest's tables differ from the batch's (its
    output can match by chance: positions all 0), every distinct largest position is run alone,
    and ``ValueError`` is raised where one's output differs. Positions shared by the batch (a
    broadcast ``(1, T)``, the default of Hugging Face models) are not checked: they are a function
    of the padded length T, which is public only when every batch is padded to one fixed length.
    ``seen`` (a dict the caller keeps from step to step): the tables each module took with
    positions broadcast over a batch of several examples; where a later step's differ with another
    largest position (T varied across a threshold), a ``UserWarning`` says so, once (differing at the
    same largest position, the model changed them itself: recorded anew)."""
    mods = [(n, m) for n, m in model.named_modules() if _watched_rope(m)]
    if not mods:
        yield
        return
    entry = {id(m): _RopeState(m) for _, m in mods}
    names = {id(m): n for n, m in mods}

    def split(args, kwargs):
        x = args[0] if args else kwargs.get("x")
        if len(args) > 1:
            return x, args[1], lambda xi, pi: ((xi, pi, *args[2:]), kwargs)
        pos = kwargs.get("position_ids")
        rest = {k: v for k, v in kwargs.items() if k not in ("x", "position_ids")}
        return x, pos, lambda xi, pi: (((xi,) if args else ()), {**rest, **({} if args else {"x": xi}), "position_ids": pi})

    def pre(m, args, kwargs):
        entry[id(m)].rebind(m)  # (each call from the block's starting state)

    def shared(m, pos) -> None:  # (positions shared by the batch: the tables follow the padded length)
        if seen is None or seen.get(names[id(m)]) == _ROPE_WARNED or not isinstance(pos, Tensor) \
                or torch._C._functorch.is_functorch_wrapped_tensor(pos):
            return
        # (tables that changed while the largest position did not were changed by the model itself: a
        # bf16 round trip of the model rounds inv_freq; recorded anew, not warned of)
        now = (int(pos.max()) + 1 if pos.numel() else 0, _tables(m))
        before = seen.setdefault(names[id(m)], now)
        if not _same_tables(before[1], now[1]):
            if before[0] == now[0]:
                seen[names[id(m)]] = now
                return
            seen[names[id(m)]] = _ROPE_WARNED
            warn(ROPE_LENGTH_WARNING.format(name=names[id(m)] or "<root>", cls=type(m).__name__))

    def post(m, args, kwargs, out):
        x, pos, call = split(args, kwargs)
        rows = _rope_rows(pos)
        if rows is None:
            if isinstance(x, Tensor) and x.dim() and x.shape[0] > 1:  # (a batch, not an example alone)
                shared(m, pos)
            return
        B, d = rows
        longest = pos.detach().movedim(d, 0).reshape(B, -1).amax(1)
        lo, hi = int(longest.argmin()), int(longest.argmax())
        if bool(longest[lo] == longest[hi]):
            return
        batch_tables, after = _tables(m), _RopeState(m)

        def alone(i: int) -> Tuple[bool, bool]:  # (same output, same tables as the batch's)
            entry[id(m)].rebind(m)
            a, k = call(_row(x, B, i), pos.narrow(d, i, 1))  # (x: batch-first, or a shared tensor)
            same = _same_output(type(m).forward(m, *a, **k), out, B, d, i)
            return same, _same_tables(_tables(m), batch_tables)

        apart = []
        try:
            with torch.no_grad():
                (out_lo, tab_lo), (out_hi, _) = alone(lo), alone(hi)
                # the shortest row alone on other tables whose output still matches (all its positions
                # 0: cos 1, sin 0 from any table) says nothing of the rows between: run every length
                if not (out_lo and out_hi and tab_lo):
                    first: Dict[int, int] = {}
                    for i, v in enumerate(longest.tolist()):
                        first.setdefault(int(v), i)
                    apart = [v + 1 for v, i in sorted(first.items()) if not alone(i)[0]]
                    if not apart and not (out_lo and out_hi):
                        apart = [int(longest[lo if not out_lo else hi]) + 1]
        finally:
            after.put_back(m)
        if apart:
            raise ValueError(
                f"the rotary embedding {names[id(m)] or '<root>'!r} ({type(m).__name__}, rope_type "
                f"{getattr(m, 'rope_type', None)!r}) gave the batch tables chosen from its largest position "
                f"(max(position_ids) + 1 = {int(longest[hi]) + 1}), and examples whose own largest position + 1 is "
                f"{apart[:8]}{' ...' if len(apart) > 8 else ''} get other ones alone: one example's length changes the "
                "other examples' gradients, outside the DP guarantee. Pad every batch to one fixed length "
                "(padding='max_length', not to the batch's longest example, which makes the padded length that "
                "example's) and pass position_ids shared by the batch, torch.arange(T) (the Hugging Face default when "
                "position_ids is not given; RoPE attention depends on position differences only, so left padding "
                "does not change it), or batch examples of equal length.")

    handles = []
    try:
        for _, m in mods:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
        for _, m in mods:
            entry[id(m)].put_back(m, values=True)


_ABSENT = object()
_IS_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def _holds_wrapper(v: Any) -> bool:
    """A functorch wrapper (vmap / grad), or a tuple / list / dict holding one."""
    if _IS_WRAPPED is None:
        return False
    if isinstance(v, Tensor):
        return bool(_IS_WRAPPED(v))
    if isinstance(v, collections.deque):
        v = list(v)
    if isinstance(v, (tuple, list, dict)):
        return any(isinstance(t, Tensor) and _IS_WRAPPED(t) for t in tree_flatten(v)[0])
    return False


@contextlib.contextmanager
def preserve_module_state(model: nn.Module, *, vmap: bool = False) -> Iterator[None]:
    """Every module's own parameters and buffers are the same objects after the block as before.

    ``torch.func.functional_call`` restores them itself, except (torch 2.13 and earlier) when a
    module is registered under two names and one of its parameters is tied to another module: the
    substituted tensor is then left in the model and the tie is broken, so every later step would
    train a different, untied model. This puts back whatever it left behind; and each
    ``nn.RNNBase``'s cached ``_flat_weights`` list, which a forward with substituted weights leaves
    holding them (review, round 35: vmap's functorch wrappers, or the capture's detached copies,
    stayed there after the step, kept alive, and were what ``deepcopy``/``replicate`` saw), and its
    weights kept as plain attributes rather than parameters, as they were before the block."""
    rnns = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            raise TypeError(f"{name or 'the model'} is a TorchScript module ({type(m).__name__}), which the DP step "
                            "cannot run functionally; pass the eager nn.Module (before torch.jit.script)")
        if isinstance(m, nn.RNNBase) and hasattr(m, "_init_flat_weights"):
            # weights kept as plain attributes (AWD-LSTM's WeightDrop sets them in its forward): what
            # the forward set them to is the step's substitute (review, round 37: a functorch wrapper
            # stayed after an eval-mode step, and deepcopy failed)
            names = getattr(m, "_flat_weights_names", ())
            plain = {n: m.__dict__[n] for n in names if n in m.__dict__}
            absent = [n for n in names if n not in m.__dict__ and n not in m._parameters]  # (set by the forward)
            rnns.append((m, plain, absent))
    mods = list(model.modules())
    saved = [(d, k, v) for m in mods for d in (m._parameters, m._buffers) for k, v in d.items()]
    # ``vmap`` (the block runs the model under torch.func transforms, the only place functorch wrappers
    # arise): each module's plain attributes (a shallow copy of its __dict__), and the contents of each
    # list / dict / deque attribute, which a forward may fill in place (self.hist.append(y),
    # self.kv["k"] = y: the same object, which the identity comparison below cannot see; final review,
    # round 38). Book-keeping's forwards leave plain tensors and skip both (its hot path).
    plain_before = [(m.__dict__, dict(m.__dict__)) for m in mods] if vmap else []
    held = [(v, list(v) if isinstance(v, (list, collections.deque)) else dict(v))
            for m in mods for v in m.__dict__.values()
            if isinstance(v, (list, dict, collections.deque)) and not isinstance(v, nn.Module)] if vmap else []
    try:
        yield
    finally:
        for v, contents in held:
            if _holds_wrapper(v):
                v.clear()
                if isinstance(v, dict):
                    v.update(contents)
                else:
                    v.extend(contents)
        for d, k, v in saved:
            if d.get(k) is not v:
                d[k] = v
        # a tensor the forward kept as a plain attribute (a cache: self.cache = y.detach(), a KV cache's
        # tuple) under vmap is a functorch wrapper that deepcopy / torch.save / any later use refuse, and
        # holds the chunk's activations: such a module's plain attributes as they were before, all of
        # them (a cached table and the length it was cached for stay a pair; review, round 38).
        for now, before in plain_before:
            try:
                same = now == before  # (C-level; the same objects compare equal without __eq__)
            except Exception:  # (a tensor rebound: its __eq__ is elementwise)
                same = False
            if same:
                continue
            if any(before.get(k, _ABSENT) is not v and _holds_wrapper(v) for k, v in now.items()):
                for k in [k for k in now if k not in before]:
                    del now[k]
                now.update(before)
        if rnns:
            with torch.no_grad():
                for m, plain, absent in rnns:
                    m.__dict__.update(plain)
                    for n in absent:  # (review of round 37's diff: WeightDrop sets it in its first forward only)
                        m.__dict__.pop(n, None)
                    m._init_flat_weights()

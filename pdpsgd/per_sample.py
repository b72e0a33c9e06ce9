"""Exact per-example gradients with ``vmap(grad(loss))``, in chunks (memory ∝ chunk × params).

Works for any model that ``torch.func`` can run: every example is evaluated as a batch of one,
so the result equals a loop of ``torch.autograd.grad`` over single examples. torch's fused RNN
kernels (nn.LSTM/GRU/RNN) are replaced by exact pure-PyTorch versions while inside the vmap.
"""
from __future__ import annotations

import collections
import contextlib
import math
import random
import sys
import threading
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._compat import mha_fastpath_off, transformers_vmap_compat
from ._types import Batch, EngineResult, Params, WeightsFn
from .functional import LossModule, preserve_module_state

__all__ = ["batch_size", "slice_batch", "batch_chunks", "per_sample_grads", "vmap_engine", "default_chunk_size", "cat_chunks",
           "chunk_budget_elems"]


def batch_size(batch: Batch) -> int:
    """The common leading dim of the batch's tensor leaves; a clear error if they disagree."""
    leaves, _ = tree_flatten(batch)
    sizes = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            if leaf.dim() == 0:
                raise ValueError(f"batch leaf {i} is a 0-dim tensor; every tensor leaf needs a leading batch dim. "
                                 "A value shared by the batch (a temperature, a step count) belongs in the model "
                                 "or in loss_fn's closure, not in the batch")
            sizes.setdefault(int(leaf.shape[0]), []).append(i)
    if not sizes:
        np_ = sys.modules.get("numpy")
        if np_ is not None and any(isinstance(x, np_.ndarray) for x in leaves):
            raise ValueError("the batch holds NumPy arrays, which are not converted: pass tensors "
                             "(torch.from_numpy(a) or torch.as_tensor(a)), with the examples on the leading dim")
        if len(leaves) == 1 and hasattr(leaves[0], "__iter__") and not isinstance(leaves[0], (str, bytes)):
            where = "is" if leaves[0] is batch else "holds"
            raise ValueError(f"the batch {where} a {type(leaves[0]).__name__}, not tensors: iterate it and pass "
                             "each batch (a tensor, or a dict/tuple of tensors with leading dim B); for private "
                             "training draw the batches with pdpsgd.PoissonSampler and pdpsgd.to_physical_batches "
                             "(the accountant assumes Poisson sampling, which a DataLoader's fixed batches are not)")
        raise ValueError("the batch has no tensor: pass a tensor or a dict/tuple of tensors with leading dim B")
    if len(sizes) > 1:
        detail = ", ".join(f"leaves {v} have {k}" for k, v in sizes.items())
        raise ValueError(
            f"batch dims disagree ({detail}): every tensor in the batch must have the same leading "
            "(batch) dimension"
        )
    return next(iter(sizes))


def check_batch_entries(batch: Batch, B: int) -> None:
    """A clear error for a batch entry that reads as one value per example but is not a tensor (a
    Python list or tuple of B numbers or strings, a NumPy array of B rows): the step cuts only
    tensors per example, so each example's loss would see all B values, its neighbours' included
    (under vmap; in book-keeping's checks and fallback), and an example could move the others'
    gradients past C (review, round 38: lengths from a collate function, 1.25 C)."""
    if B < 2:
        return

    def walk(x: Any, path: str) -> None:
        if isinstance(x, Tensor):
            return
        if isinstance(x, Mapping):
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]")
            return
        np_ = sys.modules.get("numpy")
        if np_ is not None and isinstance(x, np_.ndarray):
            if x.ndim >= 1 and x.shape[0] == B:
                raise ValueError(_PER_EXAMPLE.format(path=path or "the batch", what=f"a NumPy array of {B} rows", B=B))
            return
        if isinstance(x, torch.Size):
            return  # (a shape: not one value per example)
        if isinstance(x, (list, tuple, set, frozenset, range, collections.deque)):
            items = list(x)
            if len(items) == B and not any(isinstance(t, Tensor) for t in tree_flatten(items)[0]):
                # (B values, or B lists / dicts of values: per-example data the step cannot cut; review of
                # round 38: a list of per-example token lists moved the others' sum by 2.8 C)
                raise ValueError(_PER_EXAMPLE.format(path=path or "the batch", what=f"a {type(x).__name__} of {B} "
                                                     "items without tensors", B=B))
            for i, v in enumerate(items):
                walk(v, f"{path}[{i}]")

    walk(batch, "")


_PER_EXAMPLE = ("batch entry {path} is {what}, one per example? The step cuts only tensors per example, so each "
                "example's loss would see all {B} (its neighbours' values too) and one example could move the "
                "others' gradients. Pass it as a tensor whose first dimension is the batch (torch.tensor(...); "
                "texts: tokenize them into tensors, or drop them from the batch); "
                "if it is one value shared by every example, keep it out of the batch (in the model or the "
                "loss_fn's closure). Every tensor in the batch is taken as one row per example.")


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Examples start..stop-1 of the batch (tensor leaves sliced, others kept)."""
    return tree_map(lambda x: x[start:stop] if isinstance(x, Tensor) else x, batch)


def select_examples(batch: Batch, idx: Tensor) -> Batch:
    """The examples at ``idx`` (1-d int64), in that order (tensor leaves indexed on dim 0, others kept)."""
    return tree_map(lambda x: x.index_select(0, idx.to(x.device)) if isinstance(x, Tensor) else x, batch)


def batch_chunks(batch: Batch, B: int, chunk: int) -> Iterator[Tuple[int, int, Batch]]:
    """``(start, stop, examples start..stop-1)`` for each pass of ``chunk`` examples over a batch of
    ``B``; the batch itself when one pass covers it."""
    for start in range(0, B, chunk):
        stop = min(B, start + chunk)
        yield start, stop, (batch if start == 0 and stop == B else slice_batch(batch, start, stop))


def _in_dims(batch: Batch):
    leaves, spec = tree_flatten(batch)
    return tree_unflatten([0 if isinstance(x, Tensor) else None for x in leaves], spec)


@contextlib.contextmanager
def vmap_context(model: torch.nn.Module, mixed_layer_norm: bool = False) -> Iterator[None]:
    """Everything a user model needs to run under vmap: transformers masks, exact RNN ops, dense
    embedding gradients; ``mixed_layer_norm``: ``_MixedLayerNorm``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(transformers_vmap_compat())
        stack.enter_context(mha_fastpath_off())
        stack.enter_context(_dense_embedding_grads(model))
        if mixed_layer_norm:
            stack.enter_context(_MixedLayerNorm())
        try:
            from .rnn import exact_rnn_ops, model_has_rnn
        except ImportError:  # pragma: no cover - rnn module always ships
            exact_rnn_ops = model_has_rnn = None
        if model_has_rnn is not None and model_has_rnn(model):
            stack.enter_context(exact_rnn_ops())
        yield


@contextlib.contextmanager
def _dense_embedding_grads(model: torch.nn.Module) -> Iterator[None]:
    """``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True`` give their weight a sparse
    gradient, which torch.func.vmap cannot batch ("Could not run 'aten::view' with arguments from the
    'SparseCPU' backend"). Per example the gradient is the same values either way, and the step
    returns dense gradients, so these layers run with ``sparse=False`` for the block (restored after)."""
    flipped = [m for m in model.modules()
               if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and getattr(m, "sparse", False)]
    for m in flipped:
        m.sparse = False
    try:
        yield
    finally:
        for m in flipped:
            m.sparse = True


_LOW = (torch.bfloat16, torch.float16)
# models whose vmap run met torch's mixed-dtype layer_norm error (autocast entered inside loss_fn):
# their later runs enter ``_MixedLayerNorm`` from the start
_NEEDS_MIXED_LN: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _mixed_layer_norm_wanted(model: torch.nn.Module) -> bool:
    """Enter ``_MixedLayerNorm`` (a Python check per torch call, ~10 % of a tiny model's vmap step):
    under the caller's autocast, for a model with bf16 / fp16 parameters or buffers among float32
    ones, or one seen to need it."""
    if model in _NEEDS_MIXED_LN or amp_state():
        return True
    dts = {t.dtype for t in model.parameters()} | {t.dtype for t in model.buffers() if t.is_floating_point()}
    return bool(dts & set(_LOW)) and len(dts) > 1


def _is_mixed_layer_norm_error(err: BaseException) -> bool:
    msg = str(err)
    return "expected scalar type" in msg and "but found" in msg


class _MixedLayerNorm(torch.overrides.TorchFunctionMode):
    """``layer_norm`` of a bf16 / fp16 input with float32 weight or bias, computed as the float32
    layer norm of the (exactly) upcast input, cast to the dtype eager's call returns; so are
    ``batch_norm`` and ``instance_norm`` (an eval-mode BatchNorm's, float32 statistics, or an
    affine InstanceNorm's, after a conv under autocast).

    Eager torch takes this mixed call (a LayerNorm right after a linear layer under CPU autocast,
    e.g. BERT's masked-LM head), but its backward fails under vmap ("expected scalar type BFloat16
    but found Float", torch 2.4 to 2.13; with a bias and no weight, plain autograd fails too). The
    upcast call is the same arithmetic: float32 statistics and affine, rounded once to the output
    dtype, which is taken from eager's own call on an empty input (the input's dtype for the mixed
    kernel; float32 where autocast casts layer_norm to float32, as on CUDA). The weight and bias
    gradients are float32 sums (eager's mixed kernel rounds them at the input's precision). Other
    calls pass through, at the cost of one Python check per torch call of the forward: entered only
    where it may be needed (``_mixed_layer_norm_wanted``; ``per_sample_grads`` retries once with it
    when the vmap run meets the error, autocast entered inside ``loss_fn``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.layer_norm or func is torch.layer_norm:
            fixed = _upcast_norm(func, args, kwargs)
            if fixed is not None:
                return fixed
        elif func is torch.nn.functional.batch_norm or func is torch.nn.functional.instance_norm:
            # (an eval-mode BatchNorm, an affine InstanceNorm, under autocast: the same error, "expected
            # scalar type BFloat16 but found Float", from its backward under vmap; their statistics,
            # weight and bias float32; the two take their tensors at the same positions)
            fixed = _upcast_norm(func, args, kwargs, (1, "running_mean", 2, "running_var", 3, "weight", 4,
                                                            "bias"))
            if fixed is not None:
                return fixed
        return func(*args, **kwargs)


def _upcast_norm(func, args, kwargs, others=(2, "weight", 3, "bias")) -> Optional[Tensor]:
    """The call with its input upcast to its other tensors' dtype (``others``: (position, keyword)
    pairs), cast back to the dtype eager's call returns; None where it is not a mixed call."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor) or x.dtype not in _LOW:
        return None
    hi = x.dtype
    for i, name in zip(others[::2], others[1::2]):
        t = args[i] if len(args) > i else kwargs.get(name)
        if isinstance(t, Tensor) and t.is_floating_point():
            hi = torch.promote_types(hi, t.dtype)
    if hi == x.dtype:
        return None
    if func is torch.nn.functional.batch_norm or func is torch.nn.functional.instance_norm:
        shape = tuple(x.shape[1:])
    else:
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
    plain = lambda t: t.detach() if isinstance(t, Tensor) else t  # noqa: E731
    rest_a = tuple(plain(a) for a in args[1:])
    rest_k = {k: plain(v) for k, v in kwargs.items() if k != "input"}
    try:  # the dtype eager's call returns (an empty input: no work)
        with torch.no_grad():
            # (instance_norm refuses an empty batch: one example of zeros, as small as the call's own)
            empty = torch.zeros((int(func is torch.nn.functional.instance_norm), *shape), dtype=x.dtype,
                                device=x.device)
            out_dtype = (func(empty, *rest_a, **rest_k) if args else func(input=empty, **rest_k)).dtype
    except (RuntimeError, ValueError):
        return None  # (eager refuses it too: its own error, from the call itself)
    up = x.to(hi)
    res = func(up, *args[1:], **kwargs) if args else func(**{**kwargs, "input": up})
    return res.to(out_dtype)


def _raised_in(err: BaseException, path_end: str) -> bool:
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(path_end):
            return True
        tb = tb.tb_next
    return False


# torch's out-of-memory errors (book-keeping lets them through its fallbacks too; an OOM is never
# re-read as another error)
OOM_ERRORS = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                   if t)


def _eager_error(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor],
                 batch: Batch) -> Optional[Exception]:
    """The exception ``loss_fn(model, batch)`` raises on the batch (this chunk of it) run eagerly, as
    in ordinary training (trained parameters requiring grad, grad mode on; forked random streams,
    module state kept), itself, with a note saying so; or None if it runs. vmap's messages describe
    its batched internals: a label out of range read 'index 5 is out of bounds for dimension 2 with
    size 3' for 2-D logits (review of round 40)."""
    model = loss_module.model
    devices = sorted({p.device.index or 0 for p in params.values() if p.device.type == "cuda"})
    leaves = {n: p.detach().requires_grad_(p.is_floating_point() or p.is_complex()) for n, p in params.items()}
    try:
        with torch.enable_grad(), preserve_module_state(model), torch.random.fork_rng(devices=devices):
            functional_call(loss_module, LossModule.prefixed({**constants, **leaves}), (batch,))
    except Exception as e:  # (the user's own code's exception, as it raises it)
        if isinstance(e, OOM_ERRORS):
            return None
        if hasattr(e, "add_note"):
            e.add_note("(pdpsgd: raised by loss_fn(model, batch) run eagerly on the batch, after the per-example "
                       "gradients under torch.func.vmap failed: see the chained error above)")
        return e
    return None


def _explain_vmap_error(err: Exception) -> Exception:
    msg = str(err)
    if _raised_in(err, "torch/nn/utils/rnn.py") or "packed sequences" in msg:
        return RuntimeError(
            "packed sequences (pack_padded_sequence) cannot run per example under torch.func.vmap (each "
            "example has its own length), and vmap is used for every trained parameter that has no "
            "book-keeping rule (see dp_step.plan(...) / the output's routes, 'vmap'). Fixes: method='bk' or "
            "'auto' with every trained parameter covered by a rule (nn.LSTM/GRU/RNN take packed input; a "
            "raw nn.Parameter such as a learned h0 does not), or pad the sequences to a common length and "
            f"mask the padded steps. Original error: {msg}"
        )
    if _raised_in(err, "torch/utils/checkpoint.py") or ("requires_grad_()" in msg and "functorch" in msg):
        return RuntimeError(
            "the forward calls autograd itself (requires_grad_() / torch.autograd.* inside the model), which "
            "torch.func.vmap cannot run per example; the usual cause is gradient checkpointing "
            "(model.gradient_checkpointing_enable(), torch.utils.checkpoint). Fixes: turn it off for the DP "
            "step (model.gradient_checkpointing_disable()), or use method='bk' / 'auto', which run the model "
            "batched and work with checkpointing, with every trained parameter covered by a rule (see "
            "dp_step.plan(...): no 'vmap' routes). A loss that takes gradients inside itself "
            "(torch.autograd.grad(..., create_graph=True): a gradient penalty, score matching) needs "
            "torch.func.grad there instead, under every method (book-keeping sends its parameters to this "
            f"fallback). Original error: {msg}"
        )
    if "mutate a captured Tensor" in msg:
        return RuntimeError(
            "the forward writes a tensor it did not create (a buffer updated in place, such as running "
            "statistics of its own, or a tensor kept on a module), which torch.func.vmap cannot run per "
            "example; and statistics over the batch would mix the examples. Fixes: update such state "
            "outside the DP step (e.g. from the released, noisy update), compute it without in-place "
            "writes in eval mode, or use method='bk' / 'auto' with every trained parameter on a rule. "
            f"Original error: {msg}"
        )
    if "setup_context" in msg and "autograd.Function" in msg:  # (review, round 42: BLOOM's gelu in train mode)
        return RuntimeError(
            "the model uses a custom torch.autograd.Function written without a setup_context staticmethod "
            "(e.g. transformers' BloomGelu, used in train mode), which torch.func.vmap cannot run per example. "
            "Fixes: method='bk' / 'auto' with every trained parameter covered by a rule (see dp_step.plan(...): "
            "no 'vmap' routes; they run the model batched), or model.eval() for the DP step if the function is "
            "only used in training, or rewrite the function with setup_context (torch's 'Extending torch.func "
            f"with autograd.Function'). Original error: {msg}"
        )
    if "dynamic shape" in msg:  # (review, round 42: BartForSequenceClassification's unique_consecutive)
        return RuntimeError(
            "the model (or loss_fn) calls an operator whose output shape depends on the values (unique, "
            "nonzero, masked_select, boolean indexing; e.g. BartForSequenceClassification's check that every "
            "example has the same number of end-of-sequence tokens), which torch.func.vmap cannot run per "
            "example. Fixes: method='bk' / 'auto' with every trained parameter covered by a rule (they run the "
            "model batched), or remove the operator from the forward (index with fixed-size tensors, "
            f"torch.where). Original error: {msg}"
        )
    if "data-dependent control flow" in msg or ".item()" in msg:
        return RuntimeError(
            "the model (or loss_fn) branches on tensor values, which torch.func.vmap cannot run per "
            "example. Fixes: remove the .item()/if-on-tensor from the forward, or use method='bk', which "
            "runs the model batched. (A Hugging Face mixture-of-experts model built with "
            "experts_implementation='eager' loops over the experts its tokens chose: build it with "
            "experts_implementation='grouped_mm' (the default) or 'batched_mm', which vmap runs.) "
            f"Original error: {msg}"
        )
    return err


CPU_CHUNK_BUDGET_ELEMS = 1 << 27  # 512 MiB of float32 per-example gradients
ACCEL_CHUNK_FRACTION = 0.125  # accelerators: this share of the device memory free at the call (the
# rest is left to the chunk's vmapped activations and the weighted sum's copy of the gradients)


def chunk_budget_elems(device: torch.device, free_bytes: Optional[int] = None) -> int:
    """Float32 elements of per-example gradients one vmap chunk may hold by default: 512 MiB on
    CPU; on CUDA an eighth of the memory free on the device (``free_bytes``; read from the device
    when None), never below the CPU budget. At 512 MiB a GPT-2-small (124 M parameters) ran one
    example per chunk: 54× the non-private step on an H200 (8.2× with this budget)."""
    if device.type != "cuda":
        return CPU_CHUNK_BUDGET_ELEMS
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    return max(CPU_CHUNK_BUDGET_ELEMS, int(free_bytes * ACCEL_CHUNK_FRACTION) // 4)


def cat_chunks(parts: List[Tensor]) -> Tensor:
    """Per-chunk (b_k,) results joined to (B,); a single chunk is returned as it is (no copy, no
    launch: one per parameter and result adds up on a GPU)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _device_of(params: Mapping[str, Tensor], mask: Tensor) -> torch.device:
    return next(iter(params.values())).device if params else mask.device


def default_chunk_size(batch_len: int, num_params: int, *, budget_elems: int = CPU_CHUNK_BUDGET_ELEMS) -> int:
    """Largest chunk whose per-example gradients fit ~``budget_elems`` elements (default 512 MiB fp32)."""
    return max(1, min(batch_len, budget_elems // max(num_params, 1)))


def per_sample_grads(
    loss_module: LossModule,
    params: Params,
    constants: Mapping[str, Tensor],
    batch: Batch,
    *,
    stray: Sequence[Tuple[str, Tensor]] = (),
    require_grad: bool = False,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Per-example losses (b,) and gradients name -> (b, *shape) for one chunk (vmap, exact).

    ``stray``: the model's own Parameter objects (name, tensor) of the trained ``params``. ``functional_call`` swaps
    the given ``params`` into the modules, so a use of one of these other than through its module's
    attribute (a reference kept in a list or a closure) would get no gradient term: such a loss is
    refused with an error that names the parameter (the per-example losses are taken as values of
    the outer autograd level, which records a path to a stray Parameter and nothing else).
    ``require_grad``: ``params`` are all the step trains, so a loss that depends on none of them is
    refused (``DETACHED_LOSS``) rather than given gradients of 0.
    """

    def loss_one(p: Params, example: Batch) -> Tuple[Tensor, Tensor]:
        one = tree_map(lambda x: x.unsqueeze(0) if isinstance(x, Tensor) else x, example)
        full = LossModule.prefixed({**constants, **p})
        loss = functional_call(loss_module, full, (one,))
        if not isinstance(loss, Tensor) or loss.dim() != 1 or loss.shape[0] != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return one loss per example, shape [B]; got {shape} (method='vmap' runs "
                f"loss_fn on each example alone, as a batch of 1, so it must return shape [1] there). Use "
                "reduction='none' (and sum per-token losses per example), not 'mean' or 'sum' over the batch."
            )
        loss = loss[0]
        if require_grad and not loss.requires_grad:  # (torch.func.grad would return zeros)
            raise ValueError(DETACHED_LOSS)
        return loss, loss

    fn = vmap(grad(loss_one, has_aux=True), in_dims=(None, _in_dims(batch)), randomness="different")
    # (grad mode on: under a caller's no_grad the outer level would record no path to a stray Parameter)
    model = loss_module.model
    mixed = _mixed_layer_norm_wanted(model)
    while True:
        try:
            with vmap_context(model, mixed), preserve_module_state(model, vmap=True), torch.enable_grad(), \
                    watch_stray(stray):
                grads, losses = fn(params, batch)
                if losses.requires_grad and stray:  # (inside the watch: the paths to frozen strays need it)
                    found = torch.autograd.grad(losses.sum(), [p for _, p in stray], allow_unused=True)
                    used = [n for (n, _), g in zip(stray, found) if g is not None]
                    if used:
                        raise stray_parameter_error(used)
            break
        except RuntimeError as err:
            if not mixed and _is_mixed_layer_norm_error(err):  # (autocast entered inside loss_fn)
                _NEEDS_MIXED_LN.add(model)
                mixed = True
                continue
            explained = _explain_vmap_error(err)
            if explained is err and not isinstance(err, OOM_ERRORS):  # (an OOM stays the OOM it is)
                eager = _eager_error(loss_module, params, constants, batch)
                if eager is not None:
                    raise eager from err
            raise explained from err
    # (values: a batch input that requires grad left a graph on them back to it; review, round 38)
    return losses.detach(), {n: g.detach() for n, g in grads.items()}


DETACHED_LOSS = ("loss_fn's per-example losses do not depend on the trained parameters (they do not require grad: "
                 "a .detach(), a torch.no_grad() block, .item() / NumPy, or a loss built from the outputs' values "
                 "anew), so every gradient would be 0 and training would add noise alone. Return the losses as "
                 "computed from the model's output (F.cross_entropy(..., reduction='none')), and pass the parameters "
                 "the loss uses (pdpsgd.trainable_params(model)).")


def stray_parameter_error(used: Sequence[str]) -> ValueError:
    """The error for a loss that reads model parameters ``used`` other than through their modules."""
    return ValueError(
        f"the loss depends on parameter(s) {list(used)[:3]} other than through the model's modules (e.g. "
        "a reference kept in a Python list or a closure, or a copy made at construction): the DP "
        "step swaps the parameters it is given into the modules (torch.func.functional_call) and "
        "cannot see such a use. Read every parameter through its module's attribute (self.<name>)."
    )


def trainable_parameters(model: torch.nn.Module, names: Optional[Mapping[str, Any]] = None) -> List[Tuple[str, Tensor]]:
    """The model's own Parameter objects the step trains (read before a capture swaps them out):
    those whose (first, canonical) name is in ``names`` when given, whatever their ``requires_grad``
    (round 38: a parameter passed in params but frozen on the model escaped the stray-use check;
    ``watch_stray`` lets autograd see it for the block), else those that require grad."""
    return [(n, p) for n, p in model.named_parameters() if (p.requires_grad if names is None else n in names)]


@contextlib.contextmanager
def watch_stray(stray: Sequence[Tuple[str, Tensor]]) -> Iterator[None]:
    """The ``stray`` Parameters that do not require grad do for the block, so that a forward's use
    of one other than through its module (a reference in a list or a closure) leaves a path autograd
    can find; put back after."""
    off = [p for _, p in stray if not p.requires_grad]
    for p in off:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in off:
            p.requires_grad_(False)


_ACC: Dict[torch.dtype, torch.dtype] = {}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 or wider: what norms, clip factors and sums of a ``dtype`` tensor are computed in
    (memoised: ``torch.promote_types`` is a dispatcher call, hundreds per step)."""
    a = _ACC.get(dtype)
    if a is None:
        a = _ACC[dtype] = torch.promote_types(dtype, torch.float32)
    return a


# Column block of ``sq_norm_per_example``: small enough to stay in cache, large enough that the
# few block sums add no visible error.
SQ_NORM_BLOCK = 1 << 14


def sq_norm_per_example(g: Tensor) -> Tensor:
    """(b, *shape) -> (b,) squared L2 norm, accumulated in float32 at least.

    Summed in column blocks of ``SQ_NORM_BLOCK`` (torch's blocked/cascade ``sum`` inside each, then
    one add per block), which keeps the float32 relative error ~1e-7 at any size without a squared
    copy of g. Not ``linalg.vector_norm`` or a BLAS dot, not even on short blocks: on CPU their
    float32 accumulation runs along each SIMD lane, so its error grows with the row length
    (measured relative error of ‖g‖²: 7e-5 at 2 M coordinates, 1e-3 at 13 M; in blocks of 4096,
    1.5e-5 on a crafted contiguous row and 1.2e-4 on a strided or bf16 one, against 2-5e-7 here),
    which would let a clipped contribution exceed C by that much."""
    acc = acc_dtype(g.dtype)
    b, n = g.shape[0], math.prod(g.shape[1:])
    flat = g.reshape(b, n)
    if n <= SQ_NORM_BLOCK:
        return flat.to(acc).pow(2).sum(1)
    out = None
    for i in range(0, n, SQ_NORM_BLOCK):
        s = flat[:, i:i + SQ_NORM_BLOCK].to(acc).pow(2).sum(1)  # (b, k) -> (b,)
        out = s if out is None else out.add_(s)
    return out


def weighted_dot(w: Tensor, g: Tensor) -> Tensor:
    """Σ_i w_i g_i over (b, *shape) as one matrix-vector product (gᵀw), in g's dtype. Callers make
    sure no row of weight 0 is non-finite (``weighted_sum`` zeroes them)."""
    b, n = g.shape[0], math.prod(g.shape[1:])
    return torch.mv(g.reshape(b, n).t(), w.to(g.dtype)).reshape(g.shape[1:])  # (n, b) x (b,) -> shape


def weighted_sum(w: Tensor, g: Tensor) -> Tensor:
    """Σ_i w_i g_i over (b, *shape) with rows of weight 0 skipped exactly (NaN·0 never summed)."""
    acc = acc_dtype(g.dtype)
    keep = (w != 0).view(-1, *([1] * (g.dim() - 1)))
    g = torch.where(keep, g.to(acc), torch.zeros((), dtype=acc, device=g.device))
    return weighted_dot(w, g)


_AMP_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def amp_state() -> Tuple[Tuple[str, torch.dtype], ...]:
    """The caller's ``torch.autocast`` regions in force here: (device type, dtype) for each."""
    out = []
    for dt in _AMP_DEVICES:
        try:
            if torch.is_autocast_enabled(dt):
                out.append((dt, torch.get_autocast_dtype(dt)))
        except (RuntimeError, TypeError, AttributeError, ValueError):  # (a device type this torch does not know)
            continue
    return tuple(out)


@contextlib.contextmanager
def amp(state: Tuple[Tuple[str, torch.dtype], ...], enabled: bool) -> Iterator[None]:
    """The autocast regions of ``state`` (``amp_state``) entered again (``enabled``) or turned off
    for the block; nothing when there are none.

    The engines run the model's forward and backward under the caller's autocast (mixed precision
    is the caller's choice for the model) and their own arithmetic (per-example norms, clip factors,
    clipped sums) with it off: under autocast a matmul of float32 operands runs in bf16 / fp16, and
    a clipped sum taken so was measured above C (0.50024 for C = 0.5, a tiny GPT-2 under bf16
    autocast)."""
    with contextlib.ExitStack() as stack:
        for dt, dtype in state:
            stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled))
        yield


def _rng_state(device: torch.device, held: Sequence[Any] = ()) -> Tuple[Any, ...]:
    """The global random states a forward on ``device`` may draw from: torch's CPU one (and the
    device's on CUDA), Python's ``random`` and, if imported, numpy's legacy global one (round 37:
    torch's alone were watched); and those of ``held``, the generators the model holds
    (``_model_rngs``), if any."""
    states: List[Any] = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    states.append(random.getstate())
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, gauss, cached = np.random.get_state()
        states.append((kind, keys.tobytes(), pos, gauss, cached))
    if held:
        states.append(_HeldStates.of(held))
    return tuple(states)


# ---- random generators a model holds as attributes ---------------------------------------------
# Review, round 47: a module's own generator (``torch.Generator``, ``random.Random``, numpy's
# ``default_rng()`` / ``RandomState``) was invisible to the engines' watch on the random streams. A
# forward that chose a layer's input by it looked as if it drew nothing: book-keeping probed it once
# per batch shape, and a later step whose draw gave the layer a frozen table of B rows at the same
# call site had the table's rows credited to examples (up to 4.2 C between neighbours); the checks'
# extra forwards moved the user's generator on; the exact fallback's forward drew anew and took the
# other branch. Held generators are now watched, forked and replayed with the global streams.
_RNG_KINDS: Dict[type, Optional[str]] = {}


def _rng_kind(t: type) -> Optional[str]:
    """"torch", "py", "np_legacy", "np_gen" or "np_bit" for a generator type whose state can be read
    and set, else None (``random.SystemRandom`` has none: the OS's entropy, not seen)."""
    k = _RNG_KINDS.get(t, "")
    if k != "":
        return k
    k = None
    if issubclass(t, torch.Generator):
        k = "torch"
    elif issubclass(t, random.Random):
        k = None if issubclass(t, random.SystemRandom) else "py"
    else:
        np = sys.modules.get("numpy")
        if np is not None and t.__module__.startswith("numpy"):
            if issubclass(t, np.random.RandomState):
                k = "np_legacy"
            elif issubclass(t, np.random.Generator):
                k = "np_gen"
            elif issubclass(t, np.random.BitGenerator):
                k = "np_bit"
    _RNG_KINDS[t] = k
    return k


_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})  # (nn.Module's own: tensors and modules)
# (the types most of a module's attributes have: hook tables, flags, sizes; no generator among them)
_NOT_RNGS = frozenset({collections.OrderedDict, set, bool, int, float, str, type(None)})


def _model_rngs(model: torch.nn.Module) -> Tuple[Any, ...]:
    """The random generators the model's modules hold as attributes, directly or in a list, tuple or
    dict attribute (``torch.Generator``, ``random.Random``, numpy's ``Generator``, ``RandomState``,
    ``BitGenerator``), each once. Generators kept elsewhere (a global, the loss function's closure, an
    object held by a module) are not found."""
    seen: Dict[int, Any] = {}
    kinds, skip = _RNG_KINDS, _NOT_RNGS
    for m in model.modules():
        for name, v in m.__dict__.items():
            t = type(v)
            if t in skip:
                continue
            if t is dict or t is list or t is tuple:
                if name in _MODULE_TABLES:
                    continue
                for x in (v.values() if t is dict else v):
                    k = kinds.get(type(x), "")
                    if (k if k != "" else _rng_kind(type(x))) is not None:
                        seen.setdefault(id(x), x)
                continue
            k = kinds.get(t, "")
            if (k if k != "" else _rng_kind(t)) is not None:
                seen.setdefault(id(v), v)
    return tuple(seen.values())


# kind -> (read its state, set it, seed it)
_RNG_OPS = {
    "torch": (lambda g: g.get_state(), lambda g, st: g.set_state(st), lambda g, n: g.manual_seed(n)),
    "py": (lambda g: g.getstate(), lambda g, st: g.setstate(st), lambda g, n: g.seed(n)),
    "np_legacy": (lambda g: g.get_state(), lambda g, st: g.set_state(st), lambda g, n: g.seed(n % 2 ** 32)),
    "np_gen": (lambda g: g.bit_generator.state, lambda g, st: setattr(g.bit_generator, "state", st),
               lambda g, n: setattr(g.bit_generator, "state", type(g.bit_generator)(n % 2 ** 32).state)),
    "np_bit": (lambda g: g.state, lambda g, st: setattr(g, "state", st),
               lambda g, n: setattr(g, "state", type(g)(n % 2 ** 32).state)),
}


def _get_rng(g: Any) -> Any:
    return _RNG_OPS[_rng_kind(type(g))][0](g)


def _set_rng(g: Any, state: Any) -> None:
    _RNG_OPS[_rng_kind(type(g))][1](g, state)


def _seed_rng(g: Any, seed: int) -> None:
    _RNG_OPS[_rng_kind(type(g))][2](g, seed)


def _state_eq(x: Any, y: Any) -> bool:
    """Equality of generator states: tensors, numpy arrays, dicts, tuples and lists of them."""
    if isinstance(x, Tensor):
        return isinstance(y, Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_state_eq(x[k], y[k]) for k in x)
    if isinstance(x, (tuple, list)):
        return isinstance(y, (tuple, list)) and len(x) == len(y) and all(_state_eq(a, b) for a, b in zip(x, y))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    return bool(x == y)


class _HeldStates:
    """The states of the model's held generators (``_model_rngs``) at one time, in their order;
    compares equal to another taken from the same generators in the same states."""

    __slots__ = ("rngs", "states")

    def __init__(self, rngs: Sequence[Any], states: Sequence[Any]):
        self.rngs, self.states = tuple(rngs), tuple(states)

    @classmethod
    def of(cls, rngs: Sequence[Any]) -> "_HeldStates":
        return cls(rngs, [_get_rng(g) for g in rngs])

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, _HeldStates) and len(self.rngs) == len(other.rngs)
                and all(a is b for a, b in zip(self.rngs, other.rngs))
                and all(_state_eq(a, b) for a, b in zip(self.states, other.states)))

    __hash__ = None  # type: ignore[assignment]

    def put(self) -> None:
        """Set every generator back to its state here."""
        for g, st in zip(self.rngs, self.states):
            _set_rng(g, st)


@contextlib.contextmanager
def _held_forked(rngs: Sequence[Any], state: Optional[_HeldStates] = None,
                     seed: Optional[int] = None) -> Iterator[None]:
    """The held generators ``rngs`` forked for the block: set to ``state`` (a ``_HeldStates`` of the
    same generators) or seeded with ``seed``, if given; their states as they were put back after."""
    if not rngs:
        yield
        return
    saved = _HeldStates.of(rngs)
    try:
        if state is not None:
            state.put()
        elif seed is not None:
            for g in rngs:
                _seed_rng(g, seed)
        yield
    finally:
        saved.put()


def _same_state(a: Tuple[Any, ...], b: Tuple[Any, ...]) -> bool:
    return all(torch.equal(x, y) if isinstance(x, Tensor) else x == y for x, y in zip(a, b))


def _matmul_knobs() -> List[Any]:
    """The per-backend float32 matmul precision settings (torch >= 2.9's ``fp32_precision``), or []."""
    out = []
    for k in (getattr(getattr(torch.backends, "cuda", None), "matmul", None),
              getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)):
        if k is not None and hasattr(k, "fp32_precision"):
            out.append(k)
    return out


_PRECISION_LOCK = threading.RLock()


@contextlib.contextmanager
def _ieee_matmuls() -> Iterator[List[Tuple[Any, Any]]]:
    """Float32 matmuls at full precision inside (restored after): the engine's norms and clipped sums.
    Yields the caller's settings it changed, as (knob or None for the legacy setter, value).

    ``torch.set_float32_matmul_precision("high")`` (TF32 on CUDA) or ``"medium"`` (bf16 on a CPU with
    AMX: 0.19 absolute error on a 512-long dot product here) made the ghost Grams and the clipped
    sums ~1e-3-1e-2 relative off: a norm under-stated by that lets the example exceed C by as much
    (and the cancellation guard's κ·ε budget assumed float32 rounding; review, round 32). The
    capture (the model's own forward and backward) keeps the caller's setting. Both engines' own
    norms and sums run inside (review, round 39: vmap's weighted sums ran at the caller's setting,
    whose bf16 float32 math on an AMX / AVX-512-BF16 CPU let a contribution reach ~1.004 C).

    The settings are process-wide, so the block holds ``_PRECISION_LOCK`` (re-entrant): a step in
    another thread waits instead of running its engine under this one's capture settings (or
    putting the caller's back while this one's norms run; round 34)."""
    with _PRECISION_LOCK:
        saved: List[Tuple[Any, Any]] = []
        try:
            knobs = _matmul_knobs()
            if knobs:
                for k in knobs:
                    v = k.fp32_precision
                    if v != "ieee":
                        saved.append((k, v))
                        k.fp32_precision = "ieee"
            elif torch.get_float32_matmul_precision() != "highest":
                saved.append((None, torch.get_float32_matmul_precision()))
                torch.set_float32_matmul_precision("highest")
        except (AttributeError, RuntimeError, ValueError):
            pass
        try:
            yield saved
        finally:
            for k, v in reversed(saved):
                if k is None:
                    torch.set_float32_matmul_precision(v)
                else:
                    k.fp32_precision = v


@contextlib.contextmanager
def _caller_matmuls(saved: List[Tuple[Any, Any]]) -> Iterator[None]:
    """Inside :func:`_ieee_matmuls`: the caller's settings back, for the capture."""
    now = [(k, k.fp32_precision if k is not None else torch.get_float32_matmul_precision()) for k, _ in saved]
    for k, v in saved:
        torch.set_float32_matmul_precision(v) if k is None else setattr(k, "fp32_precision", v)
    try:
        yield
    finally:
        for k, v in reversed(now):
            torch.set_float32_matmul_precision(v) if k is None else setattr(k, "fp32_precision", v)


def vmap_engine(
    loss_module: LossModule,
    params: Params,
    constants: Mapping[str, Tensor],
    batch: Batch,
    mask: Tensor,
    weights_fn: WeightsFn,
    *,
    chunk_size: Optional[int] = None,
) -> EngineResult:
    """Per-example norms, weights and the weighted (clipped) sum, chunk by chunk.

    Memory: chunk × (number of trained parameters). Chunks that are all padding are skipped when no
    module is in train mode and a chunk that ran drew no random numbers; otherwise every chunk runs,
    so the random draws (dropout) that the real examples see do not depend on which other examples
    are masked out. The global random states are watched (torch's CPU / CUDA ones, Python's
    ``random``, numpy's legacy one): a forward in eval mode that draws from a private
    ``torch.Generator`` or ``numpy.random.Generator`` still has such chunks skipped.
    """
    B = batch_size(batch)
    check_batch_entries(batch, B)
    numel = sum(p.numel() for p in params.values())
    if chunk_size is None:
        itemsize = max((p.element_size() for p in params.values()), default=4)
        budget = chunk_budget_elems(_device_of(params, mask)) * 4 // max(itemsize, 4)  # float64: half as many
        chunk_size = default_chunk_size(B, numel, budget_elems=budget)
    chunk = chunk_size
    losses_all: List[Tensor] = []
    sq_all: Dict[str, List[Tensor]] = {n: [] for n in params}
    w_all: Dict[str, List[Tensor]] = {n: [] for n in params}
    total: Dict[str, Tensor] = {}
    stray = trainable_parameters(loss_module.model, params)
    state = amp_state()
    rdev = _device_of(params, mask)
    # a chunk of padding alone is skipped only once a chunk has run without moving the random state,
    # with no module in train mode: a root in eval mode may still draw (F.dropout's training=True, a
    # submodule in train mode), and a skipped draw would move the later chunks' masks when an example
    # is masked out (review, round 36: the sum then moved by more than C)
    skippable = not any(mod.training for mod in loss_module.model.modules())
    held = _model_rngs(loss_module.model) if skippable else ()
    quiet = False
    for start, stop, sub in batch_chunks(batch, B, chunk):
        m = mask[start:stop]
        if skippable and quiet and not bool(m.any()):
            b = stop - start
            dev = mask.device
            # (in the real chunks' dtype: review, round 37, float32 zeros cast every chunk's losses down)
            losses_all.append(torch.zeros(b, dtype=losses_all[-1].dtype, device=dev))
            for n, p in params.items():
                z = torch.zeros(b, dtype=acc_dtype(p.dtype), device=dev)
                sq_all[n].append(z)
                w_all[n].append(z)
            continue
        before = _rng_state(rdev, held) if skippable and not quiet else None
        losses, grads = per_sample_grads(loss_module, params, constants, sub, stray=stray, require_grad=True)
        if before is not None:
            quiet = _same_state(before, _rng_state(rdev, held))
            skippable = quiet
        # (the norms and sums in float32 at least, whatever the caller's autocast, and at full float32
        # matmul precision, whatever the caller's setting)
        with amp(state, False), _ieee_matmuls():
            sq = {n: sq_norm_per_example(g) for n, g in grads.items()}
            w = weights_fn(sq, losses, m)
            for n, g in grads.items():
                s = weighted_sum(w[n], g)
                total[n] = s if n not in total else total[n] + s
                sq_all[n].append(sq[n])
                w_all[n].append(w[n])
        losses_all.append(losses.to(acc_dtype(losses.dtype)))
        del grads
    for n, p in params.items():
        if n not in total:
            total[n] = torch.zeros(p.shape, dtype=acc_dtype(p.dtype), device=p.device)
    return EngineResult(
        losses=torch.cat(losses_all) if losses_all else torch.zeros(0),  # (cat promotes to the widest dtype)
        sq_norms={n: cat_chunks(v) for n, v in sq_all.items()},
        weights={n: cat_chunks(v) for n, v in w_all.items()},
        clipped_sum=total,
        routes={n: "vmap" for n in params},
    )

"""Exact, vmap-friendly replacements for torch's fused recurrent kernels.

``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (and their ``*Cell`` siblings) call fused ATen
kernels through ``torch._VF`` (``_VF.lstm``, ``_VF.gru``, ``_VF.rnn_tanh``,
``_VF.rnn_relu``, ``_VF.*_cell``). Those kernels have no (correct) functorch batching
rule, so ``torch.func.vmap(torch.func.grad(loss))`` over a model that contains them
fails. This module re-implements them in plain PyTorch ops, with the *same call
signatures and return values* as the ``_VF`` entry points called from
``torch/nn/modules/rnn.py``, and provides :func:`exact_rnn_ops`, a context manager
that makes unmodified ``nn`` RNN modules use them.

Public names
------------
* :func:`lstm`, :func:`gru`, :func:`rnn_tanh`, :func:`rnn_relu` -- sequence kernels,
  both the padded and the packed-sequence overload.
* :func:`lstm_cell`, :func:`gru_cell`, :func:`rnn_tanh_cell`, :func:`rnn_relu_cell` --
  single-step kernels used by ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``.
* :func:`exact_rnn_ops` -- scoped patch of ``torch.nn.modules.rnn._VF``.
* :func:`model_has_rnn` -- whether a model contains a module that would be affected.

Conventions: ``T`` time steps, ``B`` batch, ``F`` input features, ``H`` hidden size,
``P`` output size of a step (``proj_size`` for a projected LSTM, else ``H``),
``D`` number of directions, ``L`` number of layers, ``N = sum(batch_sizes)`` rows of a
packed sequence.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._compat import held, value_before_hold

__all__ = [
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "exact_rnn_ops",
    "model_has_rnn",
]

State = Tuple[Tensor, ...]
"""Recurrent state of one layer/direction: ``(h,)`` for GRU/RNN, ``(h, c)`` for LSTM."""


class _CellParams(NamedTuple):
    """Weights of one (layer, direction) of a recurrent network."""

    w_ih: Tensor  # (G*H, F)
    w_hh: Tensor  # (G*H, P)
    b_ih: Optional[Tensor]  # (G*H,)
    b_hh: Optional[Tensor]  # (G*H,)
    w_hr: Optional[Tensor]  # (P, H), LSTM projection only


# A step maps (precomputed input gates (B, G*H), state, params) -> (new state, output (B, P)).
Step = Callable[[Tensor, State, _CellParams], Tuple[State, Tensor]]


# --------------------------------------------------------------------------- cell math


def _lstm_step(gi: Tensor, state: State, p: _CellParams) -> Tuple[State, Tensor]:
    """One LSTM step; gate order (i, f, g, o) as in ``torch.nn.LSTM``."""
    h, c = state  # (B, P), (B, H)
    gates = gi + F.linear(h, p.w_hh, p.b_hh)  # (B, 4H)
    i, f, g, o = gates.chunk(4, dim=-1)  # each (B, H)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (B, H)
    h_new = torch.sigmoid(o) * torch.tanh(c_new)  # (B, H)
    if p.w_hr is not None:
        h_new = F.linear(h_new, p.w_hr)  # (B, P)
    return (h_new, c_new), h_new


def _gru_step(gi: Tensor, state: State, p: _CellParams) -> Tuple[State, Tensor]:
    """One GRU step; gate order (r, z, n), ``n = tanh(W_in x + b_in + r*(W_hn h + b_hn))``."""
    (h,) = state  # (B, H)
    gh = F.linear(h, p.w_hh, p.b_hh)  # (B, 3H)
    i_r, i_z, i_n = gi.chunk(3, dim=-1)  # each (B, H)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)  # each (B, H)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    h_new = (h - n) * z + n  # == (1 - z) * n + z * h, in ATen's evaluation order
    return (h_new,), h_new


def _make_simple_step(nonlinearity: Callable[[Tensor], Tensor]) -> Step:
    """An Elman RNN step ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``."""

    def step(gi: Tensor, state: State, p: _CellParams) -> Tuple[State, Tensor]:
        (h,) = state  # (B, H)
        h_new = nonlinearity(gi + F.linear(h, p.w_hh, p.b_hh))  # (B, H)
        return (h_new,), h_new

    return step


_rnn_tanh_step = _make_simple_step(torch.tanh)
_rnn_relu_step = _make_simple_step(torch.relu)


# --------------------------------------------------------------------------- layers


def _run_padded(x: Tensor, state: State, p: _CellParams, step: Step, reverse: bool) -> Tuple[Tensor, State]:
    """Run one direction of one layer over a time-major padded sequence.

    ``x``: (T, B, F). Returns the outputs (T, B, P) and the final state.
    """
    gi = F.linear(x, p.w_ih, p.b_ih)  # (T, B, G*H), input projection for all steps at once
    num_steps = gi.shape[0]
    order = range(num_steps - 1, -1, -1) if reverse else range(num_steps)
    outputs: List[Tensor] = [None] * num_steps  # type: ignore[list-item]
    for t in order:
        state, outputs[t] = step(gi[t], state, p)  # gi[t]: (B, G*H)
    return torch.stack(outputs, dim=0), state  # (T, B, P)


def _run_packed(
    x: Tensor, batch_sizes: List[int], state: State, p: _CellParams, step: Step, reverse: bool
) -> Tuple[Tensor, State]:
    """Run one direction of one layer over packed data, mirroring ATen's ``PackedLayer``.

    ``x``: (N, F) with ``N = sum(batch_sizes)``; ``state`` components have ``batch_sizes[0]``
    rows. Returns outputs (N, P) and the final state (each sequence's state after its own
    last step for the forward direction, after its first step for the reverse one).
    """
    gi = F.linear(x, p.w_ih, p.b_ih)  # (N, G*H)
    outputs: List[Tensor] = []
    if not reverse:
        finished: List[State] = []  # states of sequences that ended, latest-ending last
        offset, last = 0, batch_sizes[0]
        for b in batch_sizes:
            if b < last:  # sequences b..last-1 are complete: stash their final state
                finished.append(tuple(s[b:last] for s in state))
                state = tuple(s[:b] for s in state)
            last = b
            state, out = step(gi[offset : offset + b], state, p)  # (b, P)
            outputs.append(out)
            offset += b
        finished.append(state)
        finished.reverse()  # longest sequences (lowest rows) first
        final = tuple(torch.cat([f[k] for f in finished], dim=0) for k in range(len(state)))
        return torch.cat(outputs, dim=0), final

    init = state
    last = batch_sizes[-1]
    state = tuple(s[:last] for s in init)
    offset = gi.shape[0]
    for b in reversed(batch_sizes):
        if b > last:  # sequences last..b-1 start (from their end) here: take their initial state
            state = tuple(torch.cat([s, s0[last:b]], dim=0) for s, s0 in zip(state, init))
        last = b
        state, out = step(gi[offset - b : offset], state, p)  # (b, P)
        outputs.append(out)
        offset -= b
    outputs.reverse()
    return torch.cat(outputs, dim=0), state


def _gather_params(
    flat_weights: Sequence[Tensor], has_biases: bool, has_proj: bool, num_entries: int
) -> List[_CellParams]:
    """Split ``flat_weights`` (``nn.RNNBase._flat_weights`` order) into per-(layer, direction) params."""
    stride = 2 + 2 * int(has_biases) + int(has_proj)
    weights = list(flat_weights)
    if len(weights) != stride * num_entries:
        raise ValueError(
            f"expected {stride * num_entries} flat weights (has_biases={has_biases}, "
            f"projection={has_proj}, {num_entries} layer-directions), got {len(weights)}"
        )
    params = []
    for k in range(num_entries):
        w = weights[k * stride : (k + 1) * stride]
        b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
        w_hr = w[-1] if has_proj else None
        params.append(_CellParams(w[0], w[1], b_ih, b_hh, w_hr))
    return params


def _batch_sizes_list(batch_sizes: Tensor) -> List[int]:
    """``batch_sizes`` as Python ints; a clear error when it is batched (e.g. under vmap)."""
    try:
        return [int(b) for b in batch_sizes.tolist()]
    except RuntimeError as exc:
        raise RuntimeError(
            "pdpsgd.rnn: packed sequences whose batch_sizes differ per example are "
            "unsupported under torch.func.vmap (batch_sizes must be a plain CPU tensor of "
            "ints). Pad the sequences to a common length instead and mask the padded "
            "steps in the loss (or use per-example lengths to gather the last valid output)."
        ) from exc


def _multi_layer(
    x: Tensor,
    hx: State,
    flat_weights: Sequence[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    step: Step,
    batch_sizes: Optional[List[int]],
) -> Tuple[Tensor, State]:
    """Stack layers/directions like ATen's ``_rnn_impl``.

    ``x``: (T, B, F) if ``batch_sizes`` is None else packed (N, F). ``hx`` components are
    (L*D, B, *). Returns the last layer's output (..., D*P) and the final state, each
    component (L*D, B, *), ordered ``[l0 fwd, l0 bwd, l1 fwd, ...]``.
    """
    num_dirs = 2 if bidirectional else 1
    has_proj = len(hx) == 2 and hx[0].shape[-1] != hx[1].shape[-1]  # as ATen decides
    params = _gather_params(flat_weights, has_biases, has_proj, num_layers * num_dirs)
    finals: List[List[Tensor]] = [[] for _ in hx]
    layer_input = x
    for layer in range(num_layers):
        dir_outputs = []
        for direction in range(num_dirs):
            idx = layer * num_dirs + direction
            state0 = tuple(h[idx] for h in hx)  # each (B, *)
            reverse = direction == 1
            if batch_sizes is None:
                out, state = _run_padded(layer_input, state0, params[idx], step, reverse)
            else:
                out, state = _run_packed(layer_input, batch_sizes, state0, params[idx], step, reverse)
            dir_outputs.append(out)
            for k, s in enumerate(state):
                finals[k].append(s)
        layer_output = torch.cat(dir_outputs, dim=-1) if num_dirs == 2 else dir_outputs[0]  # (..., D*P)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_output = F.dropout(layer_output, p=dropout, training=True)
        layer_input = layer_output
    return layer_input, tuple(torch.stack(f, dim=0) for f in finals)


# --------------------------------------------------------------------------- _VF-compatible API


def _sig(*names: str) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind) for n in names])


_TAIL = ("params", "has_biases", "num_layers", "dropout", "train", "bidirectional")
_PADDED_SIG = _sig("input", "hx", *_TAIL, "batch_first")
_PACKED_SIG = _sig("data", "batch_sizes", "hx", *_TAIL)


def _dispatch(name: str, step: Step, is_lstm: bool, args: tuple, kwargs: dict):
    """Resolve the padded / packed overload (as torch's argument parser does) and run it."""
    try:
        bound = _PADDED_SIG.bind(*args, **kwargs).arguments
    except TypeError:
        bound = None
    # Padded iff ``params`` is a tensor list (and, for LSTM, ``hx`` is a tensor list too).
    if bound is not None and isinstance(bound["params"], (list, tuple)) and (
        not is_lstm or isinstance(bound["hx"], (list, tuple))
    ):
        packed = False
    else:
        try:
            bound = _PACKED_SIG.bind(*args, **kwargs).arguments
        except TypeError:
            raise TypeError(
                f"{name}() arguments match neither {name}{_PADDED_SIG} nor {name}{_PACKED_SIG}"
            ) from None
        packed = True

    hx = tuple(bound["hx"]) if is_lstm else (bound["hx"],)  # each (L*D, B, *)
    common = (
        bound["params"],
        bool(bound["has_biases"]),
        int(bound["num_layers"]),
        float(bound["dropout"]),
        bool(bound["train"]),
        bool(bound["bidirectional"]),
        step,
    )
    if packed:
        sizes = _batch_sizes_list(bound["batch_sizes"])
        output, final = _multi_layer(bound["data"], hx, *common, batch_sizes=sizes)  # (N, D*P)
    else:
        x = bound["input"]
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D input, got {x.dim()}-D")
        batch_first = bool(bound["batch_first"])
        if batch_first:
            x = x.transpose(0, 1)  # (B, T, F) -> (T, B, F)
        output, final = _multi_layer(x, hx, *common, batch_sizes=None)  # (T, B, D*P)
        if batch_first:
            output = output.transpose(0, 1)  # (B, T, D*P)
    return (output, *final)


def lstm(*args, **kwargs) -> Tuple[Tensor, Tensor, Tensor]:
    """Drop-in for ``torch._VF.lstm``; returns ``(output, h_n, c_n)``.

    Overloads (as called from ``torch.nn.LSTM.forward``)::

        lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
        lstm(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional)

    ``hx = (h0, c0)`` with shapes (L*D, B, P), (L*D, B, H); ``params`` in
    ``nn.LSTM._flat_weights`` order. A projection (``proj_size > 0``) is inferred from
    ``P != H``, exactly as ATen does.
    """
    return _dispatch("lstm", _lstm_step, True, args, kwargs)  # type: ignore[return-value]


def gru(*args, **kwargs) -> Tuple[Tensor, Tensor]:
    """Drop-in for ``torch._VF.gru``; returns ``(output, h_n)``. Overloads as :func:`lstm`, ``hx`` a tensor."""
    return _dispatch("gru", _gru_step, False, args, kwargs)  # type: ignore[return-value]


def rnn_tanh(*args, **kwargs) -> Tuple[Tensor, Tensor]:
    """Drop-in for ``torch._VF.rnn_tanh``; returns ``(output, h_n)``. Overloads as :func:`gru`."""
    return _dispatch("rnn_tanh", _rnn_tanh_step, False, args, kwargs)  # type: ignore[return-value]


def rnn_relu(*args, **kwargs) -> Tuple[Tensor, Tensor]:
    """Drop-in for ``torch._VF.rnn_relu``; returns ``(output, h_n)``. Overloads as :func:`gru`."""
    return _dispatch("rnn_relu", _rnn_relu_step, False, args, kwargs)  # type: ignore[return-value]


def _cell(step: Step, x: Tensor, state: State, w_ih, w_hh, b_ih, b_hh) -> State:
    p = _CellParams(w_ih, w_hh, b_ih, b_hh, None)
    new_state, _ = step(F.linear(x, w_ih, b_ih), state, p)  # x: (B, F)
    return new_state


def lstm_cell(input: Tensor, hx: Sequence[Tensor], w_ih: Tensor, w_hh: Tensor,
              b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Drop-in for ``torch._VF.lstm_cell``: ``input`` (B, F), ``hx = (h, c)`` each (B, H) -> ``(h', c')``."""
    h, c = _cell(_lstm_step, input, tuple(hx), w_ih, w_hh, b_ih, b_hh)
    return h, c


def gru_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor,
             b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None) -> Tensor:
    """Drop-in for ``torch._VF.gru_cell``: ``input`` (B, F), ``hx`` (B, H) -> ``h'`` (B, H)."""
    return _cell(_gru_step, input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


def rnn_tanh_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor,
                  b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None) -> Tensor:
    """Drop-in for ``torch._VF.rnn_tanh_cell``: ``input`` (B, F), ``hx`` (B, H) -> ``h'`` (B, H)."""
    return _cell(_rnn_tanh_step, input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


def rnn_relu_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor,
                  b_ih: Optional[Tensor] = None, b_hh: Optional[Tensor] = None) -> Tensor:
    """Drop-in for ``torch._VF.rnn_relu_cell``: ``input`` (B, F), ``hx`` (B, H) -> ``h'`` (B, H)."""
    return _cell(_rnn_relu_step, input, (hx,), w_ih, w_hh, b_ih, b_hh)[0]


# --------------------------------------------------------------------------- scoped patch

_REPLACEMENTS = {
    "lstm": lstm,
    "gru": gru,
    "rnn_tanh": rnn_tanh,
    "rnn_relu": rnn_relu,
    "lstm_cell": lstm_cell,
    "gru_cell": gru_cell,
    "rnn_tanh_cell": rnn_tanh_cell,
    "rnn_relu_cell": rnn_relu_cell,
}


class _ExactVF:
    """Stand-in for ``torch._VF`` inside ``torch.nn.modules.rnn``.

    The recurrent kernels in ``_REPLACEMENTS`` resolve to this module's implementations;
    every other attribute is delegated to the wrapped real ``_VF``.
    """

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        # Only reached for names not found on the instance.
        if name == "_real":  # not yet initialised (e.g. copy/pickle): avoid recursion
            raise AttributeError(name)
        impl = _REPLACEMENTS.get(name)
        return impl if impl is not None else getattr(self._real, name)

    def __repr__(self) -> str:
        return f"<pdpsgd.rnn exact ops over {self._real!r}>"


def _rnn_module():
    import torch.nn.modules.rnn as rnn_module

    return rnn_module


@contextlib.contextmanager
def exact_rnn_ops(model: Optional[nn.Module] = None) -> Iterator[None]:
    """Make ``nn.LSTM/GRU/RNN`` (and ``*Cell``) use this module's pure-PyTorch kernels.

    While active, the ``_VF`` global of ``torch.nn.modules.rnn`` is replaced by a proxy
    whose recurrent kernels are :func:`lstm`, :func:`gru`, ... and which delegates
    everything else to the real ``torch._VF``; it is restored on exit, also when the
    body raises. Nesting is fine (an inner use keeps the active proxy and restores it).

    If ``model`` is given and contains no recurrent module (:func:`model_has_rnn`),
    nothing is patched.

    The patch is process-wide while active (not thread-local), counted across threads
    (``_compat.held``: the last user to leave restores the real ``_VF``, in whatever order they
    leave; review, round 35: each restoring what it saw on entry left the proxy installed for
    good when two threads left out of order), and TorchScript-compiled RNN modules, which do not
    go through the Python ``_VF`` lookup, are unaffected.
    """
    if model is not None and not model_has_rnn(model):
        yield
        return
    rnn_module = _rnn_module()

    def get():
        return rnn_module._VF

    def put(v):
        rnn_module._VF = v

    current = value_before_hold("rnn_VF", get)
    proxy = current if isinstance(current, _ExactVF) else _ExactVF(current)

    def get_flatten():
        return nn.RNNBase.flatten_parameters

    def put_flatten(v):
        nn.RNNBase.flatten_parameters = v

    flatten = _flatten_guard(value_before_hold("rnn_flatten", get_flatten))
    with held([("rnn_VF", get, put, proxy), ("rnn_flatten", get_flatten, put_flatten, flatten)]):
        yield


def _flatten_guard(orig):
    """``RNNBase.flatten_parameters`` that does nothing while the weights are torch.func wrappers: on
    CUDA it reads each weight's ``data_ptr()``, which a wrapper has none of ("Cannot access data
    pointer of Tensor that doesn't have storage"), and RNNBase.forward calls it whenever
    functional_call has swapped the weights in (review, round 36; torch issue #105982). The kernels
    this module puts in place read the weights one by one: nothing to flatten."""
    orig = getattr(orig, "_pdpsgd_orig", orig)
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)

    def flatten_parameters(self):
        if wrapped is not None and any(isinstance(w, torch.Tensor) and wrapped(w) for w in self._flat_weights):
            return None
        return orig(self)

    flatten_parameters._pdpsgd_orig = orig
    return flatten_parameters


def model_has_rnn(model: nn.Module) -> bool:
    """Whether ``model`` contains a module whose forward calls a fused ``_VF`` recurrent kernel
    (``nn.RNN``/``nn.LSTM``/``nn.GRU`` or ``nn.RNNCell``/``nn.LSTMCell``/``nn.GRUCell``)."""
    return any(isinstance(m, (nn.RNNBase, nn.RNNCellBase)) for m in model.modules())

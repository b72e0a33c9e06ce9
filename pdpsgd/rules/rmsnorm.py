"""RMSNorm: torch ``nn.RMSNorm`` and LLaMA-, Gemma- and T5-style custom modules (x·rsqrt(mean(x²)+eps)·w).

Custom modules are transformers' own classes (``transformers_own_class``: review, round 37, a user's
``MyRMSNorm`` whose forward stopped the weight's gradient on rows with an outlier, same values, was
taken, 94 % off on a later batch of the shape) whose name contains "RMSNorm" (or ends in
"T5LayerNorm") with a ``.weight`` and a ``variance_epsilon`` (or ``eps``) attribute, and *verified on
every call*: the rule recomputes
the output by the formulas it knows, LLaMA's and T5's w ⊙ x̂ and Gemma's (1 + w) ⊙ x̂ (all: ∂out/∂w = x̂), and
compares them with the module's output; on mismatch it returns None and the engine falls back to
exact vmap for that layer.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._warn import warn
from .base import Explicit, Rule, Use, first_input, transformers_own_class


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class TorchRMSNormRule(Rule):
    """nn.RMSNorm: G_w,i = Σ_t g ⊙ x·rsqrt(mean(x²)+eps) (B, *normalized_shape)."""

    name = "rmsnorm"
    needs_output = False
    rowwise = True
    eager = True

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        if module.weight is None:
            return {}
        x = first_input(args, kwargs, "x")
        k = len(module.normalized_shape)
        if x is None or x.dim() < k + 1 or x.shape[0] != batch_size:
            return None
        # (eps None: torch takes the epsilon of the dtype it computes in, float32 for bf16 / fp16; review, round 34)
        eps = module.eps if module.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
        dims = tuple(range(x.dim() - k, x.dim()))
        xa = x.to(_acc(x.dtype))
        xhat = xa * torch.rsqrt(xa.pow(2).mean(dims, keepdim=True) + eps)
        red = tuple(range(1, x.dim() - k))
        gw = grad_output.to(xhat.dtype) * xhat
        return {"weight": Explicit(gw.sum(red) if red else gw)}


# T5-style RMS norms of transformers under other names (round 53: Switch Transformers' took the fallback)
T5_STYLE_NAMES = ("SwitchTransformersLayerNorm", "UdopLayerNorm", "Pix2StructLayerNorm", "Pop2PianoLayerNorm",
                  "Kosmos2_5LayerNorm")


def is_custom_rmsnorm(module: nn.Module) -> bool:
    """A class of transformers' own whose name contains "RMSNorm" (or ends in "T5LayerNorm", or is one of
    ``T5_STYLE_NAMES``: T5's RMS norm), with a 1-d ``weight`` Parameter and an epsilon attribute. (A filter only: every call is
    verified against the output; a user's own class takes the exact fallback, or a rule registered
    for it.)"""
    w = getattr(module, "weight", None)
    cls = type(module)
    name = cls.__name__
    shaped = (
        ("RMSNorm" in name or name.endswith("T5LayerNorm") or name in T5_STYLE_NAMES)
        and isinstance(w, Tensor)
        and w.dim() == 1
        and set(module._parameters) <= {"weight"}
        and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float)
    )
    if not shaped:
        return False
    if transformers_own_class(cls):
        return True
    if cls not in _DECLINED:  # (once per class: e.g. a trust_remote_code model's, whose module is transformers_modules.*)
        _DECLINED.add(cls)
        warn(f"{cls.__module__}.{name} looks like an RMS norm but is not a class of transformers' own, so its "
             "weight takes the exact per-example fallback (slower): a value check cannot tell whether its forward "
             "stops the gradient somewhere (review, round 37). If its forward is w ⊙ x̂ (LLaMA / T5) or (1 + w) ⊙ x̂ "
             "(Gemma), register the rule for it: reg = pdpsgd.rules.default_registry().copy(); reg.register("
             f"{name}, pdpsgd.rules.rmsnorm.CustomRMSNormRule()); make_dp_step(..., bk_options={{'registry': reg}})")
    return False


_DECLINED: set = set()


class CustomRMSNormRule(Rule):
    """LLaMA-style: out = w ⊙ (x_f32 · rsqrt(mean(x_f32²)+eps)).to(x.dtype); Gemma-style:
    out = ((x_f32 · rsqrt(mean(x_f32²)+eps)) ⊙ (1 + w)).to(x.dtype); Helium-style:
    out = (w_f32 ⊙ x_f32 · rsqrt(mean(x_f32²)+eps)).to(x.dtype); T5-style: out = w ⊙ (x · rsqrt(mean(x_f32²)+eps));
    checked against the output. Each way G_w,i = Σ_t g ⊙ x̂ (x̂ as the formula multiplies it: cast to x.dtype
    for LLaMA, not for Gemma)."""

    name = "rmsnorm_custom"
    rowwise = True
    checks_call = True  # matched by name: a call it declines is not the layer it knows

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs, "hidden_states")
        if x is None or x.dim() < 2 or x.shape[0] != batch_size or not isinstance(output, Tensor):
            return None
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", None)))
        w = module.weight.detach()
        # compared in float32 (float64 for float64 outputs): |r - o| is exact near agreement (Sterbenz), and
        # the threshold, 8 ulps of the output's own dtype, is far above float32's rounding of it
        cmp = _acc(output.dtype)
        outc = output.detach().to(cmp)
        tol_unit = 8 * torch.finfo(output.dtype).eps
        tiny = torch.finfo(output.dtype).tiny
        computes = tuple(dict.fromkeys((torch.float32, _acc(x.dtype))))  # in float32 (and x's dtype if wider)

        def normed(compute):
            h = x.to(compute)
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

        def llama():  # w ⊙ x̂.to(x.dtype)
            for compute in computes:
                xhat = normed(compute).to(x.dtype)
                yield xhat, w * xhat, None

        def others():
            for compute in computes:  # Gemma: its product (so autograd's weight gradient) is in `compute`
                xc = normed(compute)
                yield xc, (xc * (1.0 + w.to(compute))).to(x.dtype), compute
            if x.dtype != torch.float32:  # Helium: w.to(float32) ⊙ x̂ (for float32 x, LLaMA's)
                xc = normed(torch.float32)
                yield xc, (w.to(torch.float32) * xc).to(x.dtype), torch.float32
            if x.dtype != torch.float32:  # T5: x itself scaled (for float32 x, the same as LLaMA's)
                xt = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
                if w.dtype in (torch.float16, torch.bfloat16):
                    xt = xt.to(w.dtype)
                yield xt, w * xt, None

        def excess(rc, d=None):  # > 0 where an element is off by more than a few ulps of itself, relative
            return ((rc - outc).abs() if d is None else d) - tol_unit * (rc.abs() + outc.abs()) - tiny

        # the common formula first: one host read (a sync on a GPU) for LLaMA-style layers, whose output it gives
        # bit for bit; otherwise every formula, and the closest one that agrees (review, round 53: in bf16 LLaMA's
        # formula agreed, within 8 ulps, with a Helium norm's output, whose float32 product it then missed)
        cands: List[Tuple[float, int, Tuple[Tensor, Optional[torch.dtype]]]] = []  # (max |r - o|, order, (x̂, prod))
        for stage in (llama, others):
            xhats, errs, offs = [], [], []
            forms = list(stage())
            if any(ref.shape != output.shape for _, ref, _ in forms):
                return None
            # (the output's dtype too: under autocast LLaMA's is float32 where Helium's is x's, and at w = 1 both
            # agree in value; review, round 53)
            forms = [f for f in forms if f[1].dtype == output.dtype]
            for xh, ref, prod in forms:
                xhats.append((xh, prod))
                # element by element, relative: a few ulps of each output (a formula that differs
                # from this one, e.g. with the mean subtracted, differs far more on some element)
                rc = ref.to(cmp)
                d = (rc - outc).abs()  # (once: read by both)
                bad = excess(rc, d)
                errs.append(bad.max() if bad.numel() else outc.new_zeros(()))
                offs.append(torch.nan_to_num(d, nan=0.0).max() if d.numel() else outc.new_zeros(()))
            if not forms:
                continue
            both = torch.stack(errs + offs).tolist()  # one host read per stage
            errs_h, offs_h = both[:len(errs)], both[len(errs):]
            if any(e != e for e in errs_h):  # NaN somewhere (rare): recheck, NaN where both are NaN agrees
                for i, (_, ref, _) in enumerate(forms):  # (such an example's gradient is NaN either way)
                    if errs_h[i] != errs_h[i]:
                        rc = ref.to(cmp)
                        same = (rc == outc) | (rc.isnan() & outc.isnan())  # (equal infinities too)
                        errs_h[i] = float(torch.where(same, -1.0, excess(rc)).max()) if rc.numel() else 0.0
            cands += [(offs_h[i], len(cands) + i, xhats[i]) for i, e in enumerate(errs_h) if e <= 0]
            if cands and min(cands)[0] == 0.0:
                break  # (a formula that gives the output bit for bit: no other can fit better)
        if not cands:
            return None  # not a formula we know: exact fallback
        xhat, prod = min(cands, key=lambda c: c[:2])[2]
        acc = _acc(x.dtype)
        if prod is not None and prod != acc:  # Gemma in float32 inside a wider model: autograd's float32 sum
            gw = grad_output.to(prod) * xhat  # (B, *, d)
            red = tuple(range(1, gw.dim() - 1))
            return {"weight": Explicit((gw.sum(red) if red else gw).to(w.dtype).to(acc))}
        gw = grad_output.to(acc) * xhat.to(acc)  # (B, *, d)
        red = tuple(range(1, gw.dim() - 1))
        return {"weight": Explicit(gw.sum(red) if red else gw)}


TYPES = (nn.RMSNorm,)

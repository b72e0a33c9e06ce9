"""GPU exactness checks (run by gpu.sh): bk/auto == naive float64 oracle on CUDA, compiled fused
noise+scale == eager on CUDA, bf16 and fp16 models with float32 norms/sums. Exits non-zero on any failure."""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
warnings.filterwarnings("ignore")


def main() -> int:
    import models
    import pdpsgd
    from pdpsgd import fused
    from pdpsgd.testing import assert_exact

    dev = torch.device(os.environ.get("PDPSGD_DEVICE", "cuda"))  # cpu: dry run of this script
    t0 = time.time()
    fails = 0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (4, 12), generator=g)
    am = torch.ones(4, 12, dtype=torch.long)
    am[1, 7:] = 0
    am[3, 2:] = 0
    lm = {"input_ids": ids.to(dev), "attention_mask": am.to(dev), "labels": ids.masked_fill(am == 0, -100).to(dev)}
    cls = {"input_ids": ids.to(dev), "attention_mask": am.to(dev), "labels": torch.tensor([0, 1, 2, 1], device=dev)}
    cases = [("gpt2 tied", models.tiny_gpt2().to(dev), models.hf_lm_loss, lm),
             ("bert", models.tiny_bert().to(dev), models.hf_cls_loss, cls),
             ("tied lm", models.TiedLM().to(dev), models.lm_loss_fn, {"input_ids": ids.clamp(max=19).to(dev),
                                                                       "labels": ids.clamp(max=19).to(dev)}),
             # T5: its relative attention bias through the capture adapter (rules/t5_relative_bias.py)
             ("t5", models.tiny_t5().to(dev), models.t5_loss,
              {"input_ids": ids.clamp(max=models.T5_VOCAB - 1).to(dev), "attention_mask": am.to(dev),
               "labels": ids[:, :5].clamp(max=models.T5_VOCAB - 1).to(dev)})]
    for name, model, loss, batch in cases:
        for method in ("bk", "auto"):
            for cm in (None, "ghost", "explicit"):
                opts = {"cost_model": cm} if cm else {}
                try:
                    r = assert_exact(model, loss, batch, method=method, max_grad_norm=0.5, bk_options=opts)
                    if "vmap" in r.routes.values():  # every case here is on its rules
                        raise AssertionError(f"vmap fallback: {[n for n, v in r.routes.items() if v == 'vmap']}")
                    print(f"ok   {name:10s} {method:4s} {cm or 'default':8s} norms {r.max_rel_err_norms:.1e} "
                          f"sums {r.max_rel_err_sum:.1e}")
                except AssertionError as e:
                    fails += 1
                    print(f"FAIL {name} {method} {cm}: {e}")
    # compiled fused noise+scale == eager, on CUDA
    sums = {n: torch.randn(p.shape, device=dev) for n, p in models.tiny_gpt2().named_parameters()}
    dt = {n: torch.float32 for n in sums}
    e = fused.noise_and_scale(sums, 0.8, torch.Generator(device=dev).manual_seed(3), 8.0, dt, compile=False)
    c = fused.noise_and_scale(sums, 0.8, torch.Generator(device=dev).manual_seed(3), 8.0, dt, compile=True)
    err = max(float((e[n] - c[n]).abs().max()) for n in sums)
    print(("ok  " if err < 1e-5 else "FAIL") + f" fused compiled vs eager on CUDA: max abs diff {err:.2e}")
    fails += err >= 1e-5
    # bf16 model: norms / sums in float32, close to the float32 model's
    m = models.tiny_gpt2().to(dev)
    ref = pdpsgd.make_dp_step(m, models.hf_lm_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="vmap")
    want = ref.clipped_sum(pdpsgd.trainable_params(m), lm).per_sample_norms
    for dt in (torch.bfloat16, torch.float16):
        mb = models.tiny_gpt2().to(dev).to(dt)
        for method in ("bk", "auto"):
            st = pdpsgd.make_dp_step(mb, models.hf_lm_loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method)
            part = st.clipped_sum(pdpsgd.trainable_params(mb), lm)
            rel = float(((part.per_sample_norms - want).abs() / want).max())
            ok = all(s.dtype == torch.float32 for s in part.sums.values()) and rel < 0.1
            print(("ok  " if ok else "FAIL") + f" {str(dt)[6:]} {method}: float32 sums, norm rel. diff vs fp32 model {rel:.3f}")
            fails += not ok
    # bf16 autocast around a float32 model: float32 norms and sums, each contribution <= C
    m = models.tiny_gpt2().to(dev)

    def amp_loss(model, batch):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return models.hf_lm_loss(model, batch)

    C = float(want.min()) / 4
    for method in ("bk", "auto"):
        st = pdpsgd.make_dp_step(m, amp_loss, max_grad_norm=1e9, noise_multiplier=0.0, method=method)
        part = st.clipped_sum(pdpsgd.trainable_params(m), lm)
        rel = float(((part.per_sample_norms - want).abs() / want).max())
        st = pdpsgd.make_dp_step(m, amp_loss, max_grad_norm=C, noise_multiplier=0.0, method=method)
        worst = 0.0
        for i in range(lm["input_ids"].shape[0]):
            s = st.clipped_sum(pdpsgd.trainable_params(m), {k: v[i:i + 1] for k, v in lm.items()}).sums
            worst = max(worst, sum(float(v.double().pow(2).sum()) for v in s.values()) ** 0.5 / C)
        ok = all(s.dtype == torch.float32 for s in part.sums.values()) and rel < 0.05 and worst <= 1 + 1e-5
        print(("ok  " if ok else "FAIL") + f" autocast bf16 {method}: norm rel. diff {rel:.3f}, max contribution/C {worst:.6f}")
        fails += not ok
    print(f"gpu checks: {fails} failures, {time.time() - t0:.0f}s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

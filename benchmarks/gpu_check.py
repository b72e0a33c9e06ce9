"""GPU exactness checks (run by gpu.sh): bk/auto == naive float64 oracle on CUDA, compiled fused
noise+scale == eager on CUDA, bf16 and fp16 models with float32 norms/sums. Exits non-zero on any failure."""
from __future__ import annotations

import contextlib
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
    # float32 noise on CUDA from float64 normals (curand's float32 Box–Muller ends its tails at ~6.7σ;
    # review, round 33): the step's draw equals a float64 draw of the same generator, cast
    from pdpsgd.fused import WIDE_PIECE
    n = WIDE_PIECE + 1000
    got = fused.draw_noise({"w": torch.Size([n])}, torch.Generator(device=dev).manual_seed(7), torch.float32, dev,
                           std=1.0, rng="torch")["w"]
    g = torch.Generator(device=dev).manual_seed(7)
    want = torch.cat([torch.empty(m, dtype=torch.float64, device=dev).normal_(generator=g) for m in (WIDE_PIECE, 1000)])
    ok = got.dtype == torch.float32 and torch.equal(got, want.float())
    print(("ok  " if ok else "FAIL") + " float32 noise drawn as float64 normals (tails to ~8.6σ), cast")
    fails += not ok
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
    # TF32 (or bf16) float32 matmuls set by the caller: the capture keeps them, the engine's norms and
    # clipped sums run at full precision (bookkeeping._ieee_matmuls). Each released contribution <= C
    # within 1e-6 (H100, round 33: 1.0000001 C; the control, engine matmuls at TF32: 1.000006 C), the batch's norms equal
    # each example's alone, and the caller's setting is back after the step. Three ways to ask for TF32.
    fails += _tf32_checks(dev, models, pdpsgd)
    print(f"gpu checks: {fails} failures, {time.time() - t0:.0f}s")
    return 1 if fails else 0


def _tf32_checks(dev, models, pdpsgd) -> int:
    from pdpsgd import bookkeeping
    if dev.type != "cuda":
        modes = [("set_float32_matmul_precision('medium')", lambda: torch.set_float32_matmul_precision("medium"))]
    else:
        def legacy():
            torch.backends.cuda.matmul.allow_tf32 = True

        def new_api():
            torch.backends.cuda.matmul.fp32_precision = "tf32"

        modes = [("control: engine at TF32 too (expected to exceed C; not counted)", legacy),
                 ("allow_tf32 = True", legacy),
                 ("set_float32_matmul_precision('high')", lambda: torch.set_float32_matmul_precision("high")),
                 ("cuda.matmul.fp32_precision = 'tf32'", new_api)]

    def state():  # (the generic getter raises once the per-backend knobs differ: a mix of APIs)
        try:
            out = [torch.get_float32_matmul_precision()]
        except RuntimeError:
            out = ["(mixed)"]
        for k in (getattr(torch.backends.cuda, "matmul", None), getattr(torch.backends.mkldnn, "matmul", None)):
            out.append(getattr(k, "fp32_precision", None))
        return out

    g = torch.Generator().manual_seed(1)
    T = 48
    ids = torch.randint(0, 512, (4, T), generator=g).to(dev)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    fails = 0
    for name, set_mode in modes:
        torch.set_float32_matmul_precision("highest")
        m = models.tiny_gpt2(vocab=512, dim=256, layers=2, positions=64).to(dev)
        control = name.startswith("control")
        saved_ieee = bookkeeping._ieee_matmuls
        if control:  # the check's sensitivity: without the full-precision engine matmuls
            bookkeeping._ieee_matmuls = lambda: contextlib.nullcontext([])
        try:
            set_mode()
            before = state()
            worst, agree = 0.0, 0.0
            for method in ("bk", "auto"):
                free = pdpsgd.make_dp_step(m, models.hf_lm_loss, max_grad_norm=1e9, noise_multiplier=0.0, method=method)
                norms = free.clipped_sum(pdpsgd.trainable_params(m), batch).per_sample_norms.double()
                C = float(norms.min()) / 3
                st = pdpsgd.make_dp_step(m, models.hf_lm_loss, max_grad_norm=C, noise_multiplier=0.0, method=method)
                for i in range(ids.shape[0]):
                    one = {k: v[i:i + 1] for k, v in batch.items()}
                    part = st.clipped_sum(pdpsgd.trainable_params(m), one)
                    c = sum(float(v.double().pow(2).sum()) for v in part.sums.values()) ** 0.5
                    worst = max(worst, c / C)
                    agree = max(agree, abs(float(part.per_sample_norms[0]) - float(norms[i])) / float(norms[i]))
            after = state()
            ok = worst <= 1 + 1e-6 and agree <= 1e-4 and before == after
            print(("info" if control else "ok  " if ok else "FAIL") + f" {name}: max contribution/C {worst:.7f}, batch vs alone norms "
                  f"{agree:.1e}, setting kept {before == after} ({after})")
            fails += not ok and not control
        except Exception as e:  # noqa: BLE001 - report, go on
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            fails += 1
        finally:
            bookkeeping._ieee_matmuls = saved_ieee
            torch.set_float32_matmul_precision("highest")
            if dev.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = False
    return fails


if __name__ == "__main__":
    sys.exit(main())

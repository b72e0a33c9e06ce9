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

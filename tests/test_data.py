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

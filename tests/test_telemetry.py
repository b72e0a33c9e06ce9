"""pdpsgd.telemetry: the JSON-lines log is strict JSON and, after a resume, the restored run's."""
import json
import math

from pdpsgd.telemetry import Telemetry


def _strict(line):
    def refuse(tok):
        raise ValueError(f"non-JSON constant {tok}")
    return json.loads(line, parse_constant=refuse)


def test_log_lines_are_strict_json():
    """An empty Poisson batch's loss is nan: written as null (review, round 36: bare NaN tokens)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        t = Telemetry(Path(d) / "t.jsonl")
        t.record(1, loss_extra=math.nan, epsilon=0.5)
        t.record_eval(1, accuracy=math.inf)
        rows = [_strict(x) for x in (Path(d) / "t.jsonl").read_text().splitlines()]
    assert rows[0]["loss_extra"] is None and rows[1]["eval"]["accuracy"] is None
    assert math.isnan(t.history[0]["loss_extra"])  # (in memory, the value itself)


def test_loading_a_state_rewrites_the_log_to_the_restored_run(tmp_path):
    """Resuming from step 2 of a run that logged 4 steps redoes steps 3 and 4: the log is rewritten to
    the restored records, so no step appears twice (review, round 36: appended again)."""
    p = tmp_path / "t.jsonl"
    t = Telemetry(p)
    t.record(1, epsilon=0.1)
    t.record_eval(1, accuracy=0.3)
    t.record(2, epsilon=0.2)
    saved = t.state_dict()
    t.record(3, epsilon=0.3)
    t.record(4, epsilon=0.4)
    fresh = Telemetry(p)
    fresh.load_state_dict(saved)
    fresh.record(3, epsilon=0.3)
    rows = [_strict(x) for x in p.read_text().splitlines()]
    assert [r.get("step", r.get("eval", {}).get("step")) for r in rows] == [1, 1, 2, 3]
    assert "eval" in rows[1] and rows[1]["eval"]["accuracy"] == 0.3
    assert [r["step"] for r in fresh.history] == [1, 2, 3]

"""The README's code runs as written, and CI runs the README's test command."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_python_snippets_run():
    blocks = _blocks("python")
    assert blocks, "README has no python snippet"
    ns = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - our own README
    assert ns["out"].grads.keys() == ns["params"].keys()


def test_ci_runs_the_readme_test_command():
    cmds = [l for b in _blocks("bash") for l in b.splitlines() if "pytest" in l and not l.startswith("#")]
    assert cmds, "README names no test command"
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = cmds[0].split("&&")[-1].strip()
    assert test_cmd in ci, f"CI must run the README's test command {test_cmd!r}"

"""Standalone reproductions: scripts that import torch and torchrec only, one per known issue in the
repository (repros/), and one per finding of a gate report.

Each known-issue script runs here on the installed stack and must agree with known_issues.toml: exit
1 (it reproduces) where its entry applies, exit 0 where the entry says it is fixed. A generated
script (a sharded configuration a check registers) is what `paritykit repro` writes; its oracle is
shown right on configurations torchrec computes right (exit 0), and shown to catch a planted bug
applied in every process it spawns (``paritykit plant``). A hand-written script (a checkpoint, a
pipeline, an op) shows its oracle right with ``--control``: the nearest configuration torchrec
computes right, which must pass on every stack.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from paritykit.checks import known_configurations, known_issues
from paritykit.gate.repro import prelude_block, prelude_text, refresh_preludes, script_text
from paritykit.gate.repro_command import known_issue_title
from paritykit.harness.versions import installed_versions

ROOT = Path(__file__).resolve().parent.parent
REPROS = ROOT / "repros"
ALLOWED_IMPORTS = {"argparse", "dataclasses", "datetime", "json", "math", "os", "sys", "tempfile", "threading", "time",
                   "traceback", "zlib", "torch", "torchrec", "tensordict"}
ENTRIES = {issue.id: issue for issue in known_issues.load() if issue.id}
GENERATED = {i for i, k in known_configurations.registered().items() if k.reproduction is not None}
HANDWRITTEN = sorted(set(ENTRIES) - GENERATED)
SCRIPT_TIMEOUT_S = 600


def run_script(path: Path, *prefix: str, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, str(path), *args], capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)


def imported_modules(text: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").partition(".")[0])
    return found


def test_every_known_issue_has_an_id_and_a_script_in_the_repository_and_nothing_else_is_there():
    assert [issue.case for issue in known_issues.load() if not issue.id] == []
    assert GENERATED <= set(ENTRIES)
    assert {p.stem for p in REPROS.glob("*.py")} == set(ENTRIES)


@pytest.mark.parametrize("issue_id", sorted(GENERATED))
def test_the_committed_script_is_what_paritykit_repro_writes_and_imports_torch_and_torchrec_only(issue_id):
    text = (REPROS / f"{issue_id}.py").read_text()
    assert text == script_text(known_configurations.reproduction(issue_id), known_issue_title(issue_id)), (
        f"repros/{issue_id}.py is stale: regenerate it with `paritykit repro {issue_id} -o repros/{issue_id}.py`")
    assert imported_modules(text) <= ALLOWED_IMPORTS
    assert "paritykit" not in imported_modules(text)


# A script runs in 5-10 s. On every change: generated scripts of each kind of configuration the
# template writes (grid, VBE with an EC, a batch fed in two forms, uneven batches, a dense kernel);
# every other script (each generated one is also checked to be what `paritykit repro` writes, above;
# the hand-written ones for their prelude and imports, below) in the release profile, beside the controls.
EVERY_CHANGE = {"ebc-grid-mean", "vbe-training-ec", "kjt-after-td", "row-wise-family-uneven-batch", "ec-dense-kernel"}


@pytest.mark.parametrize("issue_id", [i if i in GENERATED and i in EVERY_CHANGE else pytest.param(i, marks=pytest.mark.slow)
                                      for i in sorted(ENTRIES)])
def test_the_known_issue_script_reproduces_exactly_where_its_entry_says(issue_id):
    standing = ENTRIES[issue_id].standing(installed_versions())
    if standing == "elsewhere":
        pytest.skip(f"{issue_id} is listed for {ENTRIES[issue_id].listed_for()} only: the gate says whether it still reproduces")
    result = run_script(REPROS / f"{issue_id}.py")
    if standing == "applies":
        assert (result.returncode, result.stdout.split(":")[0]) == (1, "REPRODUCED"), result.stdout + result.stderr[-3000:]
    else:  # fixed on this stack
        assert (result.returncode, result.stdout.split(":")[0]) == (0, "OK"), result.stdout + result.stderr[-3000:]


@pytest.mark.parametrize("issue_id", HANDWRITTEN)
def test_a_hand_written_script_names_its_issue_imports_torch_and_torchrec_only_and_is_what_repro_gives(issue_id, capsys):
    from paritykit.gate import cli

    text = (REPROS / f"{issue_id}.py").read_text()
    opening = ast.get_docstring(ast.parse(text)).split("\n\n")[:2]  # the title, or a line and then the title
    assert any(paragraph.startswith(f"Known torchrec issue {issue_id} (listed for ") for paragraph in opening)
    assert imported_modules(text) <= ALLOWED_IMPORTS
    assert cli.main(["repro", issue_id]) == 0
    assert capsys.readouterr().out == text




@pytest.mark.parametrize("issue_id", HANDWRITTEN)
def test_a_hand_written_script_carries_the_prelude_byte_for_byte(issue_id):
    text = (REPROS / f"{issue_id}.py").read_text()
    start, end = prelude_block(text, issue_id)
    assert text[start:end] == prelude_text(), (
        f"repros/{issue_id}.py's prelude differs from paritykit/gate/repro_prelude.py's: `paritykit repro --refresh-prelude`")
    docstring_end = text.index(chr(34) * 3, 3) + 3
    assert text[docstring_end:start].strip() == "", "the prelude comes right after the docstring"


def test_the_prelude_imports_torch_and_the_allowed_stdlib_only_and_a_refresh_rewrites_a_drifted_copy(tmp_path):
    assert imported_modules(prelude_text()) <= ALLOWED_IMPORTS
    script = chr(34) * 3 + "Known torchrec issue x." + chr(34) * 3 + "\n\n" + prelude_text() + "\n\nprint('body')\n"
    (tmp_path / "fresh.py").write_text(script)
    (tmp_path / "drifted.py").write_text(script.replace("EXIT_OK, EXIT_REPRODUCED", "EXIT_OK,  EXIT_REPRODUCED"))
    (tmp_path / "plain.py").write_text("print('no prelude')\n")
    assert [p.name for p in refresh_preludes(tmp_path)] == ["drifted.py"]
    assert (tmp_path / "drifted.py").read_text() == script
    assert (tmp_path / "plain.py").read_text() == "print('no prelude')\n"


PLUMBING_BODY = """
def run_rank(rank, scratch, how):
    start_process_group(rank, 2, scratch, timeout_s=120)  # longer than the deadline: the parent must end a hang
    if rank == 1 and how == "crash":
        os._exit(3)  # dies without a result
    if rank == 1 and how == "hang":
        import time
        time.sleep(600)  # outlives the deadline
    finish_rank(scratch, {"rank": rank, "problems": []}, failed=False)


def main():
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("a bug of the script itself")
    results = run_ranks(run_rank, (how,), 2, deadline_s=90 if how == "hang" else 300)  # two torch imports fit
    errors = [r for r in results if r.get("error")]
    if errors:
        return cannot_run("; ".join(f"rank {r['rank']}: {r['error']}" for r in errors))
    return ok("both ranks finished")


if __name__ == "__main__":
    run_script(main)
"""


@pytest.mark.slow  # three runs that spawn ranks: the release profile's
@pytest.mark.parametrize("how", ["crash", "hang", "raise", "clean"])
def test_the_prelude_reports_a_crashed_or_hung_rank_or_a_failing_script_as_cannot_run(tmp_path, how):
    path = tmp_path / "plumbing.py"
    path.write_text(chr(34) * 3 + "The prelude's plumbing." + chr(34) * 3 + "\n\n" + prelude_text() + PLUMBING_BODY)
    result = run_script(path, args=(how,))
    expected = (0, "OK") if how == "clean" else (2, "CANNOT RUN")
    assert (result.returncode, result.stdout.split(":")[0]) == expected, result.stdout + result.stderr[-3000:]
    assert {"crash": "rank 1: it wrote no result", "hang": "rank 1: it did not finish within 90 s",
            "raise": "ValueError: a bug of the script itself", "clean": "both ranks finished"}[how] in result.stdout


@pytest.mark.slow  # one more run of every hand-written script: the release profile's
@pytest.mark.parametrize("issue_id", HANDWRITTEN)
def test_a_hand_written_script_passes_its_control_a_configuration_torchrec_computes_right(issue_id):
    result = run_script(REPROS / f"{issue_id}.py", args=("--control",))
    assert (result.returncode, result.stdout.split(":")[0]) == (0, "OK"), result.stdout + result.stderr[-3000:]


def pinned_configuration(index: int):
    from paritykit.checks.sharding.cases import configuration_of
    from paritykit.checks.sharding.pinned import pinned_cases

    return configuration_of(pinned_cases(2)[index])


@pytest.mark.parametrize("index", [0, 5])
def test_a_script_passes_on_a_configuration_torchrec_computes_right(tmp_path, index):
    # Pinned sharding cases: an EC over CW [0,1,0] + TW + RW, a weighted EBC over RW + CW + DP, 3 steps.
    path = tmp_path / "clean.py"
    path.write_text(script_text(pinned_configuration(index), "a configuration torchrec computes right"))
    result = run_script(path)
    assert (result.returncode, result.stdout.split(":")[0]) == (0, "OK"), result.stdout + result.stderr[-3000:]


def test_a_script_fails_under_a_planted_bug_applied_in_every_rank_it_spawns(tmp_path):
    # The weighted EBC over RW + CW + DP: the column-wise table's gradient comes back through the
    # pooled all-to-all, which the plant stops dividing by the world size.
    path = tmp_path / "planted.py"
    path.write_text(script_text(pinned_configuration(5), "planted"))
    result = run_script(path, sys.executable, "-m", "paritykit", "plant", "pooled-all-to-all-backward-not-divided", "--")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "REPRODUCED: the sharded ebc differs from the unsharded one" in result.stdout
    assert "table 't1' after the step" in result.stdout


def report_with_a_finding(directory: Path) -> Path:
    from paritykit.checks.results import CaseResult
    from paritykit.errors import Divergence
    from paritykit.gate.report import Report, render_json

    configuration = pinned_configuration(5).to_json()
    divergence = Divergence("backward or update", "table gradient or update", "sharded vs unsharded", 0, table="t1")
    case = CaseResult("sharding", "case-1", "fail", replay="paritykit gate ...", message="differs",
                      divergence=divergence.to_dict(), configuration=configuration)
    (directory / "report.json").write_text(render_json(Report(cases=[case])))
    return directory


@pytest.mark.parametrize("name", ["F1", "short id"])
def test_paritykit_repro_writes_the_script_of_a_finding_or_case_of_a_report(tmp_path, name):
    from paritykit.gate import cli

    report = report_with_a_finding(tmp_path)
    case_id = json.loads((report / "report.json").read_text())["cases"][0]["short_id"]
    out = tmp_path / "repro.py"
    assert cli.main(["repro", "F1" if name == "F1" else case_id, "--from", str(report), "-o", str(out)]) == 0
    text = out.read_text()
    namespace: dict = {}
    exec(compile(text.split("\nUNITS_OF_ROUNDOFF")[0], str(out), "exec"), namespace)  # up to CONFIG, no run
    assert namespace["CONFIG"] == pinned_configuration(5).to_json()
    assert "table gradient or update" in text.split('"""')[1]


def test_paritykit_repro_of_something_it_does_not_know_exits_2(tmp_path, capsys):
    from paritykit.gate import cli

    assert cli.main(["repro", "no-such-issue"]) == 2
    assert "no-such-issue" in capsys.readouterr().err
    assert cli.main(["repro", "F9", "--from", str(report_with_a_finding(tmp_path))]) == 2


def test_paritykit_plant_refuses_an_unknown_plant_and_passes_the_exit_code_through(capsys):
    from paritykit.gate import cli

    assert cli.main(["plant", "no-such-plant", "--", sys.executable, "-c", "pass"]) == 2
    assert "no-such-plant" in capsys.readouterr().err
    assert cli.main(["plant", "wrong-pooling-mode", "--", sys.executable, "-c", "import sys; sys.exit(3)"]) == 3

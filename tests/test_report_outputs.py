"""Nothing lost to bad output arguments: every path the gate (or `fixtures record`, or `repro -o`)
will write is checked before anything runs, with exit 2 naming the path."""

import subprocess
import sys
import time

import pytest

from paritykit.gate import cli
from paritykit.gate.outputs import require_writable_directory


def unwritable(tmp_path):
    # A directory under a regular file cannot be created by anyone, root included.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "report"


def test_report_into_an_unwritable_directory_fails_within_a_second_before_any_case_runs(tmp_path):
    target = unwritable(tmp_path)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "paritykit", "gate", "--report", str(target)], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    assert result.returncode == 2
    assert f"--report {target}: cannot write there" in result.stderr
    assert "paritykit gate: td-kjt" not in result.stderr  # no check started
    # The whole process, interpreter start included; the check itself takes milliseconds.
    assert elapsed < 1.0 or _check_alone_is_fast(target), f"took {elapsed:.2f} s"


def _check_alone_is_fast(target) -> bool:
    """On a loaded machine the interpreter's start alone can pass a second: then time the check itself."""
    started = time.perf_counter()
    with pytest.raises(Exception):
        require_writable_directory(target, "--report")
    return time.perf_counter() - started < 0.1


def test_an_existing_report_file_that_cannot_be_written_is_named(tmp_path, capsys):
    (tmp_path / "report.md").mkdir()  # where report.md should go, a directory
    assert cli.main(["gate", "--check", "sync", "--report", str(tmp_path)]) == 2
    assert f"--report {tmp_path}: cannot write there" in capsys.readouterr().err


def test_fixtures_record_into_an_unwritable_directory_exits_2(tmp_path, capsys):
    target = unwritable(tmp_path)
    assert cli.main(["fixtures", "record", "--dir", str(target)]) == 2
    assert f"--dir {target}: cannot write there" in capsys.readouterr().err


def test_repro_into_an_unwritable_file_exits_2(tmp_path, capsys):
    target = unwritable(tmp_path) / "repro.py"
    assert cli.main(["repro", "ebc-grid-mean", "-o", str(target)]) == 2
    assert f"-o {target.parent}: cannot write there" in capsys.readouterr().err


def test_a_writable_report_directory_is_created_and_left_without_probe(tmp_path):
    target = tmp_path / "new" / "report"
    assert require_writable_directory(target, "--report", ("report.md",)) == target
    assert target.is_dir() and list(target.iterdir()) == []

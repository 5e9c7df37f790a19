"""Launching a script of your own: the command each rank runs, bad counts, and a script started without mpirun."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ulfmtrain.launching.launch import program

pytestmark = pytest.mark.timeout(240)
SCRIPT = """
import helper, ulfmtrain
comm = ulfmtrain.connect()
print(f"{helper.NAME} rank {comm.rank} of {comm.size}", flush=True)
comm.barrier()
"""


@pytest.fixture
def script(tmp_path):
    d = tmp_path / "app"
    d.mkdir()
    (d / "helper.py").write_text("NAME = 'sibling'\n")      # a sibling import: the script's folder is on sys.path
    (d / "main.py").write_text(textwrap.dedent(SCRIPT))
    return d / "main.py"


def ulfmtrain(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "ulfmtrain", *args], capture_output=True, text=True, timeout=200,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def test_each_rank_runs_python_scripts_with_this_interpreter_and_train_as_the_module():
    assert program(["python", "main.py", "--lr", "1"]) == [sys.executable, "main.py", "--lr", "1"]
    assert program(["python3.11", "main.py"]) == [sys.executable, "main.py"]
    assert program(["train", "--data", "D"]) == [sys.executable, "-P", "-m", "ulfmtrain", "train", "--data", "D"]
    assert program(["./my_program", "x"]) == ["./my_program", "x"]


@pytest.mark.parametrize("args, words", [(["-n", "0"], "-n 0"), (["-n", "2", "--spares", "-1"], "--spares -1"),
                                         (["-n", "2"], "needs a command")])
def test_bad_counts_are_one_line_printed_once(args, words):
    proc = ulfmtrain("launch", *args, *(["--", "python", "x.py"] if words != "needs a command" else []))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ulfmtrain: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_mpirun_a_script_is_a_world_of_one_after_one_warning(script):
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200,
                          env={k: v for k, v in os.environ.items() if k != "ULFMTRAIN_REQUIRE_FT"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "sibling rank 0 of 1"
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("ulfmtrain: warning:")]
    assert len(warnings) == 1 and "python -m ulfmtrain launch -n 4 -- python" in warnings[0], proc.stderr


def test_insisting_on_fault_tolerance_refuses_with_one_line(script):
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200,
                          env={**os.environ, "ULFMTRAIN_REQUIRE_FT": "1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert [ln for ln in proc.stderr.splitlines() if ln] == [ln for ln in proc.stderr.splitlines()
                                                            if ln.startswith("ulfmtrain: error: fault tolerance")]


@pytest.mark.faults
def test_launch_runs_a_script_with_its_sibling_imports_on_every_rank(script, tmp_path):
    proc = ulfmtrain("launch", "-n", "2", "--", "python", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["sibling rank 0 of 2", "sibling rank 1 of 2"], proc.stdout

"""The GPU verification kit (gpu/), as far as it runs without a GPU: the proxy-vs-CUDA table builder
with the CPU backend on both sides, the eager TD/KJT runner on CPU, carrying a wheel in pieces, and
the scripts' refusals. The CUDA runs themselves are documented in docs/gpu.md."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from paritykit.checks.sync.budget import measure
from paritykit.checks.sync.budgets import BUDGETS
from paritykit.errors import ParityError
from paritykit.harness import plants

GPU_KIT = Path(__file__).resolve().parent.parent / "gpu"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on machines without CUDA; this one has CUDA")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", GPU_KIT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


sync_table = _load("sync_table")
eager_td_kjt = _load("eager_td_kjt")
pieces = _load("pieces")


def test_table_with_the_proxy_on_both_sides_has_every_budget_at_its_hand_derived_count(tmp_path):
    markdown = tmp_path / "table.md"
    assert sync_table.main(["--left", "cpu", "--right", "cpu", "--markdown", str(markdown)]) == 0
    lines = markdown.read_text().splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    assert len(rows) == len(BUDGETS)
    for line, budget in zip(rows, BUDGETS):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[:4] == [f"`{budget.name}`", str(budget.budget), str(budget.budget), str(budget.budget)]
        assert cells[-1] == "yes"
    assert lines[-1] == f"{len(BUDGETS)} of {len(BUDGETS)} budgets agree."


def test_a_side_that_counts_differently_is_flagged_using_a_stand_in_for_the_cuda_side():
    budgets = [b for b in BUDGETS if b.name in ("kjt.permute", "kjt.plain_constructor")]
    proxy = sync_table.measure_on("cpu")

    def stand_in_cuda(budget):  # no CUDA here: the proxy's record with one sync more for kjt.permute
        record = proxy(budget)
        if budget.name == "kjt.permute":
            record.events.append(replace(record.events[0], kind="item"))
        return record

    rows = sync_table.count_rows(budgets, proxy, stand_in_cuda)
    assert [(row.budget, row.left_total, row.right_total, row.agrees) for row in rows] == [
        ("kjt.plain_constructor", 0, 0, True), ("kjt.permute", 1, 2, False)]
    table = sync_table.render_markdown(rows, "cpu", "cuda")
    assert "| `kjt.permute` | 1 | 1 | 2 | h2d-copy 1 | h2d-copy 1, item 1 | **no** |" in table
    assert table.endswith("1 of 2 budgets agree.\n")


@NO_CUDA
def test_table_refuses_a_cuda_side_without_a_gpu(capsys):
    assert sync_table.main(["--right", "cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_table_refuses_an_unknown_device():
    with pytest.raises(SystemExit) as info:
        sync_table.main(["--left", "tpu"])
    assert info.value.code == 2


def test_eager_td_kjt_runner_passes_on_cpu_and_counts_its_cases(capsys):
    assert eager_td_kjt.main(["--device", "cpu", "--examples", "6"]) == 0
    assert capsys.readouterr().out.strip() == "eager TD/KJT parity on cpu: 6 cases passed (seed 0)"


def test_eager_td_kjt_runner_catches_a_planted_key_swap_in_the_conversion():
    with plants.applied(["feature-key-swap"]), pytest.raises(ParityError):
        eager_td_kjt.run_cases("cpu", examples=20, seed=0)


@NO_CUDA
def test_eager_td_kjt_runner_refuses_cuda_without_a_gpu():
    assert eager_td_kjt.main(["--device", "cuda", "--examples", "1"]) == 2


def _wheel(tmp_path: Path, size: int) -> Path:
    wheel = tmp_path / "fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(bytes(index % 251 for index in range(size)))
    return wheel


def test_a_wheel_split_into_pieces_joins_back_byte_for_byte(tmp_path):
    wheel = _wheel(tmp_path, 5 * pieces.MIB // 2)
    made = pieces.split(wheel, tmp_path / "pieces", pieces.MIB)
    assert [p.stat().st_size for p in made] == [pieces.MIB, pieces.MIB, pieces.MIB // 2]
    joined = pieces.join(tmp_path / "pieces", tmp_path / "out")
    assert joined.name == wheel.name and joined.read_bytes() == wheel.read_bytes()


def test_join_names_a_missing_piece_and_refuses_a_corrupt_one(tmp_path):
    wheel = _wheel(tmp_path, 3 * pieces.MIB)
    made = pieces.split(wheel, tmp_path / "pieces", pieces.MIB)
    made[1].rename(tmp_path / "elsewhere")
    with pytest.raises(SystemExit, match=rf"has 3 pieces; missing \['{made[1].name}'\]"):
        pieces.join(tmp_path / "pieces", tmp_path / "out")
    (tmp_path / "elsewhere").rename(made[1])
    made[2].write_bytes(b"x" + made[2].read_bytes()[1:])
    with pytest.raises(SystemExit, match="joined from 3 pieces has sha256 .*, the manifest says"):
        pieces.join(tmp_path / "pieces", tmp_path / "out")


def test_install_script_refuses_an_unknown_tier():
    run = subprocess.run(["bash", str(GPU_KIT / "install_offline.sh"), "3"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "tier must be 1 or 2, got 3" in run.stderr


@NO_CUDA
def test_install_script_stops_before_installing_anything_without_a_gpu(tmp_path):
    run = subprocess.run(["bash", str(GPU_KIT / "install_offline.sh"), "1", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert run.returncode != 0
    assert "torch sees no GPU" in run.stderr


def test_every_tier_names_torchrec_and_its_fbgemm_build():
    tiers: dict[str, list[str]] = {}
    for line in (GPU_KIT / "wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            tier, requirement = line.split()
            tiers.setdefault(tier, []).append(requirement.split("==")[0])
    assert {"torchrec", "fbgemm-gpu-cpu"} <= set(tiers["1"]) and "fbgemm-gpu" not in tiers["1"]
    assert {"torchrec", "fbgemm-gpu"} <= set(tiers["2"]) and "fbgemm-gpu-cpu" not in tiers["2"]

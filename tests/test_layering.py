"""The package's layering: the import-linter contract, and a JAX-free planner.

hetpar.passes and hetpar.cost_models live in top-level folders mapped into the
package (pyproject's package-dir), which import-linter cannot follow; the
contract is checked on a staging copy with the folders where Python finds them.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, **kw)


def test_import_contract(tmp_path):
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' installs import-linter")
    stage = tmp_path / "hetpar"
    shutil.copytree(ROOT / "hetpar", stage, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("passes", "cost_models"):
        shutil.copytree(ROOT / folder, stage / folder, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([lint, "--no-cache", "--config", str(ROOT / "pyproject.toml")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and "KEPT" in r.stdout


@pytest.mark.parametrize("module", ["hetpar", "hetpar.core", "hetpar.planner"])
def test_jax_free(module):
    r = _python(f"import sys, {module}; "
                "bad = sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules); "
                "assert not bad, bad")
    assert r.returncode == 0, r.stderr


def test_plan_from_graph_file_never_imports_jax(tmp_path):
    from tests.random_tables import random_cost_table

    graph = tmp_path / "graph.json"
    random_cost_table(0, layers=6, devices=2).save(graph)
    out = tmp_path / "plan.json"
    code = ("import sys\nfrom hetpar.cli import run\n"
            f"try:\n    run(['plan', '--graph', {str(graph)!r}, '--out', {str(out)!r}])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'jax' not in sys.modules, 'hetpar plan --graph imported jax'\n")
    r = _python(code)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(out.read_text())["format"] == "hetpar.plan"

"""Every notebook under ``notebooks/`` runs top to bottom, as a researcher would run it.

Each ``notebooks/*.ipynb`` (globbed, so a new notebook is picked up without editing this file) is
executed with nbclient in a fresh ``python3`` kernel of *this* interpreter (a kernelspec written for
``sys.executable``, so a ``python3`` kernel installed elsewhere on the machine is never used), with
the notebooks folder as its working directory (what Jupyter does when the notebook is opened
there) and a per-cell timeout. A cell that raises fails the test with the cell's traceback.

Skips only when nbclient is not installed (``pip install -e ".[test]"`` brings it, with nbformat
and ipykernel).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed: pip install -e '.[test]'")
import nbformat  # noqa: E402  (a dependency of nbclient)
from jupyter_client import KernelManager  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOK_FILES = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 120  # per cell; each notebook as a whole is meant to run in well under a minute on 2 CPU cores
MAX_STORED_OUTPUT_BYTES = 20_000  # notebooks are committed without outputs (CI executes them); allow a few lines


@pytest.fixture(scope="session")
def kernel_dirs(tmp_path_factory) -> list[str]:
    """A kernelspec folder whose only ``python3`` kernel is this interpreter (``sys.executable``)."""
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(root / "python3")
    spec = json.loads((root / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    return [str(root)]


def execute(nb, kernel_dirs: list[str], cwd: Path = NOTEBOOKS, timeout: int = CELL_TIMEOUT_S):
    """Run every cell of ``nb`` in place (outputs land in ``nb``); raises `CellExecutionError` on a failing cell."""
    specs = KernelSpecManager(kernel_dirs=kernel_dirs, ensure_native_kernel=False)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=specs)
    client = nbclient.NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute()
    finally:  # nbclient shuts down only kernels it created itself
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return nb


def stream_text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in NOTEBOOK_FILES])
def test_notebook_runs(path: Path, kernel_dirs):
    nb = nbformat.read(path, as_version=4)
    assert any(c.cell_type == "code" for c in nb.cells), f"{path.name} has no code cell"
    start = time.perf_counter()
    execute(nb, kernel_dirs)
    elapsed = time.perf_counter() - start
    print(f"{path.name}: {elapsed:.1f} s")


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in NOTEBOOK_FILES])
def test_notebook_is_committed_without_large_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    stored = sum(len(json.dumps(c.get("outputs", []))) for c in nb.cells if c.cell_type == "code")
    assert stored <= MAX_STORED_OUTPUT_BYTES, (
        f"{path.name} stores {stored} bytes of outputs; strip them before committing (CI executes the notebook)"
    )


def test_failing_cell_fails(tmp_path, kernel_dirs):
    """The executor really reports errors: a one-cell notebook that raises makes `execute` raise."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise RuntimeError('deliberate failure')")])
    with pytest.raises(CellExecutionError, match="deliberate failure"):
        execute(nb, kernel_dirs, cwd=tmp_path)


def test_kernel_is_this_interpreter_in_the_given_folder(tmp_path, kernel_dirs):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, sys\nprint(sys.executable)\nprint(os.getcwd())"
    )])
    execute(nb, kernel_dirs, cwd=tmp_path)
    executable, cwd = stream_text(nb).splitlines()
    assert executable == sys.executable
    assert Path(cwd).resolve() == tmp_path.resolve()

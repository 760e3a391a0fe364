"""Every notebook under ``notebooks/`` runs top to bottom, as a researcher would run it.

Each ``notebooks/*.ipynb`` (globbed, so a new notebook is picked up without editing this file) is
executed with nbclient in a fresh ``python3`` kernel of *this* interpreter (a kernelspec written for
``sys.executable``, so a ``python3`` kernel installed elsewhere on the machine is never used), with
the notebooks folder as its working directory (what Jupyter does when the notebook is opened
there) and a per-cell timeout. A cell that raises fails the test with the cell's traceback.

The notebooks are committed *with* their outputs, so that their figures show on the repository
page; the tests re-execute them in memory and never compare outputs, so a regenerated output (new
timings) cannot fail them. To refresh the committed outputs after editing a notebook:

    python tests/test_notebooks.py --write [notebooks/01_quickstart.ipynb ...]

which executes each notebook as the test does and saves it without the volatile per-cell
execution timestamps.

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
MAX_STORED_BYTES = 3_000_000  # a notebook with its outputs (figures as PNG) stays small enough to review


def write_kernel_dirs(root: Path) -> list[str]:
    """A kernelspec folder under ``root`` whose only ``python3`` kernel is this interpreter."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(root / "python3")
    spec = json.loads((root / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    return [str(root)]


@pytest.fixture(scope="session")
def kernel_dirs(tmp_path_factory) -> list[str]:
    """A kernelspec folder whose only ``python3`` kernel is this interpreter (``sys.executable``)."""
    return write_kernel_dirs(tmp_path_factory.mktemp("kernels"))


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
def test_notebook_is_committed_with_its_outputs(path: Path):
    """Every code cell ran, in order, without an error; the figures are stored; nothing volatile or
    machine-specific is (timestamps, the path it was run from)."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    redo = f"run `python tests/test_notebooks.py --write {path.relative_to(NOTEBOOKS.parent)}`"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{path.name}: not run in order; {redo}"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert outputs, f"{path.name} is committed without outputs; {redo}"
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{path.name} stores an error; {redo}"
    if "matplotlib" in "".join(c.source for c in code):
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no figure stored; {redo}"
    assert not any("execution" in c.metadata for c in code), f"{path.name} stores cell timestamps; {redo}"
    text = path.read_text()
    assert str(NOTEBOOKS.parent) not in text, f"{path.name} stores the path it was run from; {redo}"
    assert len(text.encode()) <= MAX_STORED_BYTES, f"{path.name} is {len(text.encode())} bytes"


def clean(nb):
    """``nb`` without what changes on every run besides its results: per-cell execution timestamps,
    where the kernel happened to split a cell's printed text, and the absolute folder it ran in
    (printed paths read relative to the repository)."""
    root = str(NOTEBOOKS.parent)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        merged = []
        for output in cell.outputs:  # consecutive pieces of one stream: one output
            if (merged and output.get("output_type") == "stream" and merged[-1].get("output_type") == "stream"
                    and merged[-1].get("name") == output.get("name")):
                merged[-1]["text"] += output["text"]
            else:
                merged.append(output)
        cell.outputs = merged
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = output["text"].replace(root + "/", "").replace(root, ".")
            for key, value in output.get("data", {}).items():
                if key.startswith("text/") and isinstance(value, str):
                    output["data"][key] = value.replace(root + "/", "").replace(root, ".")
    return nb


def write(paths, kernel_dirs: list[str]) -> None:
    """Execute each notebook as the test does and save it with its outputs (`clean`ed)."""
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        execute(nb, kernel_dirs)
        nbformat.write(clean(nb), path)
        print(f"{path.name}: executed in {time.perf_counter() - start:.1f} s and saved with its outputs")


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


if __name__ == "__main__":  # python tests/test_notebooks.py --write [NOTEBOOK ...]
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="Execute notebooks and save them with their outputs.")
    parser.add_argument("--write", action="store_true", required=True, help="execute and save (the only action)")
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        write([p.resolve() for p in args.notebooks] or NOTEBOOK_FILES, write_kernel_dirs(Path(folder)))

"""The notebook example, executed in a real Jupyter kernel (nbclient and ipykernel)."""

from __future__ import annotations

import re
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent


def test_notebook_trains_cancels_fits_again_and_plots() -> None:
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()

    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells), "a cell did not run"
    outputs = [output for cell in code_cells for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")

    # Top-level await trained, with a notebook progress bar (a widget, not text).
    assert re.search(r"after 3 epochs: validation accuracy [0-9.]+%", text)
    widgets = [
        o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert widgets, "no notebook progress bar"

    # A running fit was cancelled and the same kernel fitted again.
    cancelled = re.search(
        r"cancelled after (\d+) complete epochs and (\d+) steps; the kernel lives on", text
    )
    assert cancelled is not None
    assert int(cancelled.group(2)) > 0
    again = re.search(r"epochs \d+ to (\d+) trained", text)
    assert again is not None
    assert int(again.group(1)) == int(cancelled.group(1)) + 3

    accuracy = re.findall(r"validation accuracy: ([0-9.]+)%", text)
    assert accuracy
    assert float(accuracy[-1]) > 90.0

    # The loss curve was drawn.
    assert [o for o in outputs if "image/png" in o.get("data", {})], "no plot"

"""The docs' Python blocks run (issue 60, item 5): each doc's ```python blocks in order, in
one namespace, in a fresh process, against the module under test and the main build's
models (tests/check_doc_code.py --run-python: its markers, preludes and the stubs it lays
out in a scratch folder). ctest `docs_code` compiles the C++ blocks and parses these."""

import os
import subprocess
import sys

import pytest

from conftest import ARTIFACTS, ROOT

CHECKER = ROOT / "tests" / "check_doc_code.py"
sys.path.insert(0, str(CHECKER.parent))
import check_doc_code  # noqa: E402

DOCS = sorted({b.doc for b in check_doc_code.read_docs(ROOT)[0] if b.language == "python"})


def test_the_docs_have_python_blocks():
    assert {"README.md", "docs/python.md", "python/README.md"} <= set(DOCS)


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc, tmp_path):
    done = subprocess.run(
        [sys.executable, str(CHECKER), "--run-python", doc, str(ROOT), str(ARTIFACTS),
         str(tmp_path)], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, NEML2_DISPATCH_ARTIFACTS=str(ARTIFACTS)))
    assert done.returncode == 0, f"{doc}:\n{done.stdout}\n{done.stderr}"

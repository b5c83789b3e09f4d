"""The layering in ARCHITECTURE.md, checked by import-linter's contracts in pyproject.toml."""

import subprocess
import sys
from pathlib import Path


def test_import_layers_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports)], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout

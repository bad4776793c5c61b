from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite the golden files (tests/golden: ir.yaml and out.<type>.yaml per case) from the current code (review the diff!)",
    )

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))  # the top-level files are plain modules, not a package


def shared_path(*parts):
    """A path under ../shared, or skip the test with a reason when ../shared is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not found (../shared is not beside the repo)")
    return p

"""Settings for every collected item, the package's docstring examples included."""

import os
import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_basetemp(tmp_path_factory):
    """Keep what the suite writes with `tempfile` (docstring examples, cluster logs, torchrun
    and compiler caches, in this process and its subprocesses) under pytest's basetemp, which
    pytest prunes to the last three runs. Left in /tmp, each run leaked about 25 folders and
    repeated runs filled the disk a later CI install needed."""
    folder = str(tmp_path_factory.mktemp("tempfile"))
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    yield
    tempfile.tempdir = None
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before

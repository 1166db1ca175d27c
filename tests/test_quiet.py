"""Optional libraries' import-time noise is filtered (symcost/_quiet.py), nothing else."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

NOISY = "import logging, torchao; logging.getLogger('torchao').warning('kept: a warning of its own')"


def test_torchao_import_noise_is_dropped_and_its_other_warnings_kept():
    """Importing torchao (as transformers does when it loads any model, once torchao is installed)
    logs a 'Failed to load' line per CUDA kernel library a CPU build cannot load: after
    ``import symcost`` those lines are gone, while a warning of torchao's own still shows. The same
    import without symcost is the control (it must print them on this machine, or the test says so)."""
    pytest.importorskip("torchao")
    bare = subprocess.run([sys.executable, "-c", NOISY], capture_output=True, text=True, timeout=300)
    if "Failed to load" not in bare.stderr:
        pytest.skip("torchao loads every kernel library here: no noise to filter")
    quiet = subprocess.run([sys.executable, "-c", "import symcost; " + NOISY], capture_output=True, text=True,
                           timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "Failed to load" not in quiet.stderr and "is now natively supported" not in quiet.stderr, quiet.stderr
    assert "kept: a warning of its own" in quiet.stderr


def test_filters_install_once():
    import symcost._quiet as q

    q.install()
    q.install()
    assert sum(isinstance(f, q._Drop) for f in logging.getLogger("torchao").filters) == 1

"""Virtual environments for tests that install volta_train as a user would (standard library only, so that any
interpreter can import it).

:func:`make_venv` gives a fresh venv that sees the creating environment's packages after its own, through a .pth file
that lists that environment's site-packages. ``python -m venv --system-site-packages`` would give it the *base
interpreter's* packages instead, which lack torch & co. when the creating environment is itself a virtual environment
(a newcomer following README in a fresh venv).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

PTH_NAME = "_outer_environment.pth"


def outer_site_packages() -> list[str]:
    """This environment's site-packages directories (a virtual environment's own, not its base interpreter's)."""
    found = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        found.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(found) if os.path.isdir(d)]


def make_venv(venv: Path) -> Path:
    """A fresh virtual environment that sees this environment's packages after its own; returns its python.

    Directories named in a .pth file join sys.path without their own .pth files running, so an editable install of
    volta_train here does not shadow one installed into the venv.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = Path(venv) / "bin" / "python"
    inner = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    Path(inner, PTH_NAME).write_text("\n".join(outer_site_packages()) + "\n")
    return python

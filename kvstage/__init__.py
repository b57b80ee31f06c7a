"""kvstage: the application, and (as installed) the parent of kvstage.shared,
kvstage.sim and kvstage.hw.

An install maps the checkout's top-level folders shared/, sim/ and hw/ to those
names (pyproject.toml's package-dir; the editable install does it with an import
hook). Run straight from a checkout without installing it (`PYTHONPATH=.`, or a
non-editable install shadowed by the checkout's own kvstage/ folder), the same names
resolve here: the checkout's root joins this package's search path, but only in a
checkout, never in site-packages.
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "shared" / "ring.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 - a package's __path__
del _Path, _checkout

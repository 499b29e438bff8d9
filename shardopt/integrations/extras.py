"""The pip extras the framework integrations need, and the error that names them.

Each integration imports its framework at the top of its module; without the framework that
import would end in a bare ``ModuleNotFoundError: No module named 'transformers'`` that does
not say which extra of shardopt installs it. The integrations wrap those imports and call
:func:`raise_missing_extra`, which names the extra to install.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["EXTRAS", "raise_missing_extra"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers", "accelerate"),
    "lightning": ("lightning",),
}
"""Extra name (setup.cfg ``[options.extras_require]``) -> the top-level packages it installs
that an integration imports."""


def raise_missing_extra(error: ModuleNotFoundError, integration: str, extra: str) -> NoReturn:
    """Re-raise ``error`` (a failed framework import in ``integration``) naming the extra to
    install when the missing module is one of ``extra``'s packages; any other missing module
    (say, a broken framework install) is raised as it was.

    Args:
        error: the ``ModuleNotFoundError`` of the framework import.
        integration: the importing module, e.g. ``"shardopt.integrations.transformers"``.
        extra: the extra that installs the framework, a key of :data:`EXTRAS`.

    Raises:
        ModuleNotFoundError: always; with ``pip install 'shardopt[<extra>]'`` when a package
            of the extra is missing.
    """
    packages = EXTRAS[extra]
    missing = (error.name or "").split(".")[0]
    if missing not in packages:
        raise error
    raise ModuleNotFoundError(
        f"{integration} needs the {missing!r} package, which is not installed: pip install 'shardopt[{extra}]' "
        f"('.[{extra}]' in a source checkout), which installs {' and '.join(packages)} at versions shardopt supports",
        name=missing,
    ) from error

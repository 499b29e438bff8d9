"""Importing an integration without its framework says which extra of shardopt installs it.

The framework is made missing in this process (``sys.modules[name] = None`` makes ``import
name`` fail as when it is not installed), so nothing is uninstalled."""

from __future__ import annotations

import importlib
import sys

import pytest

from shardopt.integrations.extras import EXTRAS, raise_missing_extra

CASES = [
    # integration, the framework made missing, the extra that installs it, modules to re-import
    ("shardopt.integrations.transformers", "transformers", "hf", ()),
    ("shardopt.integrations.accelerate", "accelerate", "hf", ()),
    ("shardopt.integrations.lightning", "lightning", "lightning", ("shardopt.integrations.lightning_precision",)),
    ("shardopt.integrations.lightning_precision", "lightning", "lightning", ()),
]


@pytest.mark.parametrize(("integration", "framework", "extra", "also"), CASES)
def test_import_without_the_framework_names_the_pip_extra(monkeypatch: pytest.MonkeyPatch, integration: str,
                                                          framework: str, extra: str, also: tuple[str, ...]) -> None:
    for name in (integration, *also):
        monkeypatch.delitem(sys.modules, name, raising=False)  # import it afresh; restored afterwards
    monkeypatch.setitem(sys.modules, framework, None)
    for name in [n for n in sys.modules if n.startswith(f"{framework}.")]:  # imported by earlier tests in this
        monkeypatch.setitem(sys.modules, name, None)  # process: `import lightning.pytorch` would find it first
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(integration)
    packages = " and ".join(EXTRAS[extra])
    assert str(info.value) == (f"{integration} needs the {framework!r} package, which is not installed: pip install "
                               f"'shardopt[{extra}]' ('.[{extra}]' in a source checkout), which installs {packages} at "
                               "versions shardopt supports"), info.value
    assert info.value.name == framework


def test_the_extras_named_are_those_setup_cfg_declares() -> None:
    import configparser
    from pathlib import Path

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    declared = config["options.extras_require"]
    for extra, packages in EXTRAS.items():
        for package in packages:
            assert package in declared[extra], (extra, package, declared[extra])


def test_another_missing_module_is_raised_as_it_was() -> None:
    error = ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers")
    with pytest.raises(ModuleNotFoundError) as info:
        raise_missing_extra(error, "shardopt.integrations.transformers", "hf")
    assert info.value is error

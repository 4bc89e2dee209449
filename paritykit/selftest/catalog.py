"""Imports every planted-bug module so that each registers its plants with paritykit.plants.

A plant registered without ``check=`` is expected to be caught by the check its module serves.
"""

import importlib

from paritykit import plants

# catalog module -> the check its plants are aimed at
CATALOG_MODULES = {
    "paritykit.selftest.catalog_convert": "td-kjt",
    "paritykit.selftest.catalog_cw": "cw-stitch",
    "paritykit.selftest.catalog_pipeline": "pipeline",
    "paritykit.selftest.catalog_sync": "sync",
    "paritykit.selftest.catalog_fixtures": "fixtures",
}

for _module in CATALOG_MODULES:
    try:
        importlib.import_module(_module)
    except ModuleNotFoundError as _exc:
        if _exc.name != _module:
            raise

for _name, (_check, _description) in list(plants.PLANT_INFO.items()):
    if not _check:
        plants.PLANT_INFO[_name] = (CATALOG_MODULES[plants.PLANTS[_name].__module__], _description)

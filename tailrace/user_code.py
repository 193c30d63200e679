"""A function of the user's, named in the config as `module:function` (the module importable: on
PYTHONPATH or in the working directory) or `path/to/file.py:function`: the store's entry filter
(`store.filter`) and a task's reward (`task.reward`). Every way it can fail to load is one line naming
the key, the spec and the fix."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from tailrace.common import ConfigError

FORM = "write it as module:function or path/to/file.py:function"


def load_function(spec: str, key: str) -> Callable:
    """The function `spec` names; `key` (e.g. "store.filter") for the messages."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ConfigError(f"{key}={spec!r}: {FORM}")
    if where.endswith(".py"):
        module = _from_file(spec, Path(where), key)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` finds the working directory's
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(
                f"{key}={spec}: cannot import {where!r} ({e}); put it on PYTHONPATH or in the working "
                f"directory, or {FORM}"
            ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec}: {where} has no function {name!r}")
    return fn


def _from_file(spec: str, path: Path, key: str):
    if not path.is_file():
        raise ConfigError(f"{key}={spec}: no file {path}; give an existing .py file's path")
    loader = importlib.util.spec_from_file_location(f"tailrace_user_{path.stem}", path)
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{key}={spec}: {path} fails to load: {type(e).__name__}: {e}") from None
    return module

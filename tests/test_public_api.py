"""The library API: what `from mlx_engine import ...` gives a user."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import mlx_engine
from mlx_engine import errors

ROOT = Path(__file__).resolve().parent.parent

PUBLIC = ("Engine", "EngineConfig", "GenerationRequest", "SamplingParams", "GenerationEvent", "Usage")


def test_public_names_import_from_the_package():
    from mlx_engine import (  # noqa: F401
        DuetError,
        Engine,
        EngineConfig,
        GenerationEvent,
        GenerationRequest,
        RequestError,
        SamplingParams,
        Usage,
    )
    from mlx_engine.engine import Engine as EngineClass
    from mlx_engine.request import GenerationRequest as RequestClass

    assert Engine is EngineClass and GenerationRequest is RequestClass
    assert callable(Engine.load)
    assert set(PUBLIC) <= set(mlx_engine.__all__)
    for name in mlx_engine.__all__:
        assert getattr(mlx_engine, name) is not None, name
    assert set(mlx_engine.__all__) <= set(dir(mlx_engine))


def test_every_error_class_is_exported():
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.DuetError) and obj.__module__ == errors.__name__
    }
    assert "DuetError" in defined and "EngineShutDownError" in defined
    assert defined <= set(mlx_engine.__all__), defined - set(mlx_engine.__all__)
    for name in defined:
        assert getattr(mlx_engine, name) is getattr(errors, name)


def test_unknown_name_is_an_attribute_error():
    try:
        mlx_engine.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("mlx_engine.NoSuchThing did not raise AttributeError")


def test_import_is_light_and_the_engine_loads_on_first_use():
    # MLX must not be imported by `import mlx_engine` itself: the BLAS preload has to come first,
    # and a user importing only the request vocabulary or the errors pays nothing for MLX.
    code = (
        "import sys, mlx_engine\n"
        "from mlx_engine import DuetError, GenerationRequest, SamplingParams\n"
        "print('mlx.core' in sys.modules)\n"
        "engine_class = mlx_engine.Engine\n"
        "print('mlx.core' in sys.modules, engine_class.__module__)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    assert r.stdout.split() == ["False", "True", "mlx_engine.engine.api"]

"""The schema from a Pydantic model: `[schema] pydantic = "module:Class"` imported, and its JSON Schema.

The only module that imports pydantic, an extra (`pip install 'batchjson[pydantic]'`). The class's
`model_json_schema()` is the job's schema; from there on the job is the one that schema written by hand would
give: the same grammar, validation (jsonschema's verdict, not the model's validators), typed columns and hash.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

from batchjson.errors import SpecError

KEY = "schema.pydantic"
_FORM = "'module:Class' (e.g. 'invoices:Invoice' for the class Invoice in invoices.py next to the spec)"


def _model_class(model: object) -> type:
    """`model` if it is a Pydantic model class; else a SpecError saying what it is."""
    try:
        from pydantic import BaseModel
    except ImportError:
        raise SpecError(f"{KEY} needs Pydantic 2: pip install 'batchjson[pydantic]'.") from None
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model
    what = (f"the class {model.__module__}.{model.__qualname__}" if isinstance(model, type)
            else f"an instance of {type(model).__name__}: give the class itself" if isinstance(model, BaseModel)
            else f"{type(model).__name__} {model!r}")
    raise SpecError(f"{KEY}: {what} is not a Pydantic model (a subclass of pydantic.BaseModel). Give the model "
                    f"class, as {_FORM}.")


def reference(model: object) -> str:
    """The import path of a model class, as `schema.pydantic` spells it. It names the model in the spec; the class
    need not be importable by that path (one defined in a notebook is `__main__:Class`)."""
    model = _model_class(model)
    return f"{model.__module__}:{model.__qualname__}"


def load(ref: str, folder: Path) -> type:
    """Import the class `ref` ('package.module:Class'), looking for the module in `folder` (the spec's) first, then
    in the installed packages. A module already imported is not read again, as with any Python import."""
    module_name, _, name = ref.partition(":")
    if not module_name or not name:
        raise SpecError(f"{KEY} must be {_FORM}; got {ref!r}.")
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        parents = {module_name.rsplit(".", i)[0] for i in range(module_name.count(".") + 1)}
        if e.name not in parents:  # a module that the model's module imports
            raise _import_failed(module_name, e) from None
        raise SpecError(f"{KEY}: no module {module_name!r} in {folder} or the installed packages. Put "
                        f"{module_name.replace('.', '/')}.py next to the spec, or install the package that holds "
                        "it.") from None
    except Exception as e:  # the model's own module failed: the user's code, so the user's to fix
        raise _import_failed(module_name, e) from None
    finally:
        sys.path.remove(str(folder))
    target = module
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise SpecError(f"{KEY}: the module {module_name} ({module.__file__}) has no {name!r}.")
    return target


def _import_failed(module_name: str, e: Exception) -> SpecError:
    frames = traceback.extract_tb(e.__traceback__)
    where = "" if isinstance(e, SyntaxError) or not frames else f" at {frames[-1].filename}:{frames[-1].lineno}"
    hint = " Install it: pip install 'batchjson[pydantic]'." if getattr(e, "name", None) == "pydantic" else ""
    return SpecError(f"{KEY}: importing {module_name} failed{where}: {type(e).__name__}: {e}.{hint}")


def json_schema(model: object) -> dict:
    """The JSON Schema of a Pydantic model class (validation mode: what the model accepts as input)."""
    model = _model_class(model)
    try:
        return model.model_json_schema()
    except Exception as e:  # pydantic's refusal (a field type with no JSON Schema) or the model's json_schema_extra
        raise SpecError(f"{KEY}: Pydantic cannot write a JSON Schema for {reference(model)}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. Change the field's type to one "
                        "JSON Schema can describe.") from None

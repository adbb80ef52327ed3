"""Pure functions of ``mlx_lm.tokenizer_utils``, without the import of transformers it starts with.

``mlx_lm.tokenizer_utils`` opens with ``from transformers import AutoTokenizer, ...``: importing
transformers takes 1.6-2.3 s on our machines (it scans its model folders), the largest part of a
cold ``duet generate``'s time to the first token, and the functions Duet takes from that module
(``_infer_tool_parser``: which tool-call parser a chat template and vocabulary ask for) never touch
it. So ``pure_function`` compiles the named function from the installed module's own source, with
the module-level functions it calls, in a namespace of Python's builtins alone; mlx-lm stays the one
source of the rules. Where the function names anything else (a global, an import), or the source
cannot be read, the module is imported as usual and its own function returned: slower, never wrong.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_engine.loading import mlx_lm_lazy

MODULE = "mlx_lm.tokenizer_utils"


def _names(node: ast.AST) -> set[str]:
    """The global names a function reads: every name loaded in it that it does not bind itself."""
    loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(node, ast.FunctionDef):
        a = node.args
        bound |= {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        bound |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    return loaded - bound


def _compiled(module: str, name: str) -> Callable[..., Any] | None:
    """``name`` from ``module``'s source, with the module-level functions it needs; None where it
    needs anything else or the source is not there."""
    mlx_lm_lazy.install()  # finding mlx_lm.x would run mlx_lm/__init__, which imports transformers
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if name not in funcs:
        return None
    want, todo = set[str](), [name]
    while todo:
        f = todo.pop()
        if f in want:
            continue
        want.add(f)
        fn = funcs[f]
        if fn.decorator_list:
            return None
        for n in _names(fn):
            if n in funcs:
                todo.append(n)
            elif not hasattr(builtins, n):
                return None  # a global or an imported name: not ours to copy
    body = ast.Module(body=[funcs[f] for f in sorted(want)], type_ignores=[])
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": module}
    exec(compile(body, spec.origin, "exec"), namespace)  # noqa: S102 - the installed package's own code
    fn_obj = namespace[name]
    return fn_obj if callable(fn_obj) else None


@functools.cache
def pure_function(name: str, module: str = MODULE) -> Callable[..., Any]:
    """``module.name``, compiled alone where it is a pure function (see the module's docstring),
    else imported."""
    try:
        fn = _compiled(module, name)
    except (OSError, SyntaxError, ValueError, ImportError):
        fn = None
    if fn is not None:
        return fn
    got: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return got

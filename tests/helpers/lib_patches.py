"""Shortcuts around work that libraries the tests drive repeat for nothing, applied by
tests/conftest.py in each process that runs tests. Each gives the results the library gives
without it; where a library's internals differ from what a shortcut expects, it is left out.

- typer's `CliRunner.invoke(app, ...)` builds the click command tree of the whole app on every
  call (it reads every command's signature: about 20 ms, and the edit loop invokes the CLI 400
  times). Here each process builds it once per app; the app is not changed after import.
- Triton's interpreter (TRITON_INTERPRET=1) patches `triton.language` for the kernel at each
  launch, and again at every call of a `@triton.jit` function inside it (`tl.sum`, `tl.max`
  and the kernels' own helpers: each call scans the language modules, about 0.2 ms, on every
  loop step of every program). A second patch from the same module globals within one launch
  changes nothing (patched members are no longer builtins, and the rest is set to the same
  thing), so it is skipped: about a sixth of the interpreted kernel tests' CPU.
"""

from __future__ import annotations

import functools
import os


def apply() -> None:
    _build_cli_commands_once()
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_language_once_per_launch()


def _build_cli_commands_once() -> None:
    try:
        import typer.testing
    except ImportError:
        return
    build = getattr(typer.testing, "_get_command", None)  # typer.main.get_command, as imported
    if build is not None and not hasattr(build, "cache_info"):
        typer.testing._get_command = functools.cache(build)


def _patch_language_once_per_launch() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    empty = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or executor is None or empty is None or hasattr(patch, "seen"):
        return
    launch = executor.__call__
    seen: set[int] = set()  # the module globals patched in the current launch

    def patch_once(fn):
        if id(fn.__globals__) in seen:
            return empty()  # nothing to restore: this launch's own patch stays
        seen.add(id(fn.__globals__))
        return patch(fn)

    def launch_patching_once(self, *args, **kwargs):
        seen.clear()
        return launch(self, *args, **kwargs)

    patch_once.seen = seen
    interpreter._patch_lang = patch_once
    executor.__call__ = launch_patching_once

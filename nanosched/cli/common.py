"""What every command shares: errors as `error: ...` lines with exit codes, SIGTERM as Ctrl-C,
the GPU a command defaults to, flag checks, and help text typer prints as written.

Errors that name a bad input (`NanoschedError`) print one line to stderr and exit with code 2,
as typer's own usage errors do; a file that cannot be read or written exits with code 1.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import typer

from nanosched.constants import DEFAULT_GPU
from nanosched.errors import ConfigError, NanoschedError

F = TypeVar("F", bound=Callable[..., Any])

TP_FIT_BATCH = 1024  # the batch `analyze` and `models` size the smallest tp for, as the search


def reports_errors(fn: F) -> F:
    """Turn a NanoschedError into `error: ...` on stderr and exit code 2; an OSError (a file
    that cannot be read or written) into `error: FILE: why`, exit code 1: no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NanoschedError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=2) from None
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            typer.echo(f"error: {where}{exc.strerror or exc}", err=True)
            raise typer.Exit(code=1) from None

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so `search` and `profile` stop
    the same way for both: a clear message, an earlier output file untouched, exit 130."""
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def require_matplotlib(flag: str = "--plot") -> None:
    """Refuse `flag` before any work when matplotlib is missing, naming the extra."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"{flag} needs matplotlib: pip install -e '.[plot]' (or "
                          f"pip install matplotlib)") from None


def literal(text: str) -> str:
    """`text` as help that typer prints verbatim: where rich renders the help, square brackets
    (`[plot]`) would be read as markup and vanish, so they are escaped."""
    try:
        from rich.markup import escape
    except ImportError:  # typer prints plain click help without rich
        return text
    return escape(text)


def unwrapped(doc: str | None) -> str | None:
    """A command's docstring as help: its hard line breaks joined within each paragraph, since
    rich keeps them and they show as breaks in mid-sentence in a box of another width; a
    paragraph of `- ` items keeps one item per line."""
    if not doc:
        return doc
    import inspect

    out = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        lines = [ln.strip() for ln in para.splitlines()]
        items: list[str] = []
        for ln in lines:
            if items and not ln.startswith("- "):
                items[-1] += " " + ln
            else:
                items.append(ln)
        out.append("\n".join(items))
    return "\n\n".join(out)


def unwrap_help(app: typer.Typer) -> None:
    """`unwrapped` on the help of every command and group callback of `app`, and no type
    shown for a flag (typer tags each `<bool>`, though a flag takes no value)."""
    infos = [*app.registered_commands, *([app.registered_callback]
                                         if app.registered_callback else [])]
    for info in infos:
        if info.callback is not None:
            info.callback.__doc__ = unwrapped(info.callback.__doc__)
        if info.help:
            info.help = unwrapped(info.help)
    if app.info.help:
        app.info.help = unwrapped(app.info.help)
    for group in app.registered_groups:
        unwrap_help(group.typer_instance)
    _flags_without_type()


def _flags_without_type() -> None:
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)  # typer >= 0.20's rich types
    if shown is None or getattr(TyperOption, "_nanosched_flags", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and not self.count else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]
    TyperOption._nanosched_flags = True  # type: ignore[attr-defined]


GPU_DEVICE_FILES = ("/dev/nvidia*", "/proc/driver/nvidia/gpus", "/dev/kfd")  # CUDA, ROCm


def _gpu_devices_present() -> bool:
    """Whether this machine has GPU device files at all: without them torch (seconds to
    import) need not be asked, and commands that only name a GPU start at once."""
    import glob

    return any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def visible_gpus() -> list[str]:
    """The names of the CUDA devices torch sees, by index ([] without CUDA)."""
    if not _gpu_devices_present():
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch, no driver
        return []


def _listed(names: list[str]) -> str:
    return ", ".join(f"{i}: {n}" for i, n in enumerate(names)) or "none"


def gpu_prior_name(gpu: str) -> str:
    """`--gpu` of models, analyze and search as a GPU name: a name as given, or a device index
    as the name of the GPU at that index here. (`profile` takes both too: `gpu_index`.)"""
    if not gpu.strip().isdigit():
        return gpu
    from nanosched.hardware import prior_for

    names = visible_gpus()
    index = int(gpu)
    if index >= len(names):
        raise ConfigError(f"--gpu {gpu}: no GPU at that index here (GPUs here: "
                          f"{_listed(names)}); give a GPU name such as h100")
    prior = prior_for(names[index])
    if prior is None:
        raise ConfigError(f"--gpu {gpu} is a {names[index]}, which has no prior; give a GPU "
                          f"name such as h100")
    return prior.name


def gpu_index(gpu: str, fake: bool = False) -> int:
    """`--gpu` of profile as a CUDA device index: an index as given, or a GPU name (h100,
    h200, ...) as the first device of that kind here (any, for a dry run on a fake GPU)."""
    from nanosched.hardware import get_gpu, prior_for

    text = gpu.strip()
    if text.isdigit():
        return int(text)
    if text.startswith("-") and text[1:].isdigit():
        raise ConfigError(f"--gpu must be a CUDA device index (0, 1, ...) or a GPU name, got "
                          f"{gpu}")
    want = get_gpu(text).name  # a known name, else the error lists them
    if fake:
        return 0
    names = visible_gpus()
    for i, name in enumerate(names):
        prior = prior_for(name)
        if prior is not None and prior.name == want:
            return i
    raise ConfigError(f"--gpu {gpu}: no {want} here (GPUs here: {_listed(names)}); give the "
                      f"index of the GPU to measure")


def gpu_here() -> str | None:
    """The prior name (hardware.GPUS) of the CUDA device present, None without one (or when
    torch knows no prior for it)."""
    names = visible_gpus()
    if not names:
        return None
    name = names[0]
    from nanosched.hardware import prior_for

    prior = prior_for(name)
    if prior is None:
        typer.echo(f"note: no prior for {name}; pass --gpu", err=True)
    return prior.name if prior is not None else None


def default_gpu(gpu: str | None, assume: bool = True) -> str | None:
    """`--gpu` as given, else the GPU present, else (with `assume`) DEFAULT_GPU, said on
    stderr; without `assume` None is returned for the command to decide."""
    if gpu is not None:
        return gpu_prior_name(gpu)
    here = gpu_here()
    if here is not None:
        typer.echo(f"--gpu not given: using {here}, the GPU present", err=True)
        return here
    if assume:
        typer.echo(f"--gpu not given and no GPU here: assuming {DEFAULT_GPU}", err=True)
        return DEFAULT_GPU
    return None


def check_flag(flag: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise ConfigError `FLAG must be ALLOWED, got VALUE` unless `ok`."""
    if not ok:
        raise ConfigError(f"{flag} must be {allowed}, got {value}")

"""What `nanosched serve` does before the port opens: flags → a loaded engine.

`ServeConfig` is the engine's `EngineConfig` plus the server's own settings. `prepare` checks
the server flags and loads the engine through `runtime.loader.load_engine`, which chooses and
validates the schedule before the weights load, so a schedule for another model, tp or GPU
stops the server at once with the reason (`ScheduleError`, exit 2). `--schedule auto` replays
the shipped schedule that matches, else runs Sequential, logging which and why. Batches the
chosen strategy does not accept fall back to Sequential (`EngineStats.fallbacks`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from nanosched.errors import ConfigError
from nanosched.models.spec import ModelSpec
from nanosched.runtime.config import EngineConfig
from nanosched.runtime.engine import Engine
from nanosched.runtime.loader import LoadedEngine, gpu_name, load_engine
from nanosched.runtime.server.connections import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S
from nanosched.runtime.server.statslog import DEFAULT_STATS_INTERVAL_S
from nanosched.runtime.server.text import TextCodec

log = logging.getLogger("nanosched.serve")
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # OpenAI bodies are small; a 128k-token prompt fits


@dataclass(frozen=True)
class ServeConfig:
    """What `nanosched serve` was asked for: the engine, then the server around it."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(schedule="auto",
                                                                      graphs="auto"))
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    drain_timeout_s: float = 30.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    api_key: str | None = None  # /v1/ routes need "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # default: default_model_name(--model)
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S  # the throughput/queue line; 0: off
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a request's headers, from connect
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # its body, from the headers
    max_connections: int | None = None  # open at once; None: default_max_connections()


@dataclass
class Served:
    """A model ready to serve: the engine (not yet running), its text codec and limits."""

    name: str
    spec: ModelSpec
    engine: Engine
    codec: TextCodec
    strategy: str
    closer: LoadedEngine | None = None  # releases the replay's partitions at exit
    aliases: tuple[str, ...] = ()  # other names requests may give the model (`model_names`)
    model_path: str = ""  # --model as given (a router reads it from /server_info)
    tp: int = 1


def check_flags(cfg: ServeConfig) -> None:
    """Refuse bad server flags before the port is bound or anything loads."""
    if cfg.engine.model is None:
        raise ConfigError("--model is required")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {cfg.port}")
    if cfg.max_queue < 1:
        raise ConfigError(f"--max-queue must be at least 1, got {cfg.max_queue}")
    if not 0 <= cfg.drain_timeout_s < float("inf"):
        raise ConfigError(f"--drain-timeout must be a finite number of seconds >= 0, got "
                          f"{cfg.drain_timeout_s}")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise ConfigError("--api-key is empty: give a key, or leave the flag out to serve "
                          "without one")
    if cfg.api_key is not None and not (cfg.api_key.isascii() and cfg.api_key.isprintable()):
        raise ConfigError("--api-key holds a non-ASCII or control character, which no client "
                          "can send in an HTTP header: use printable ASCII only")
    for flag, value in (("--header-timeout", cfg.header_timeout_s),
                        ("--body-timeout", cfg.body_timeout_s)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be a finite number of seconds > 0, got {value}")
    if cfg.max_connections is not None and cfg.max_connections < 1:
        raise ConfigError(f"--max-connections must be at least 1, got {cfg.max_connections}")
    if cfg.served_model_name is not None and not cfg.served_model_name.strip():
        raise ConfigError("--served-model-name is empty: give a name, or leave the flag out to "
                          "use the checkpoint folder's name")
    if not 0 <= cfg.stats_interval_s < float("inf"):
        raise ConfigError(f"--stats-interval must be a finite number of seconds >= 0 (0: no "
                          f"periodic line), got {cfg.stats_interval_s}")
    if cfg.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be at least 1, got "
                          f"{cfg.max_request_bytes}")


def model_names(model: str, served_model_name: str | None) -> tuple[str, tuple[str, ...]]:
    """(the name /v1/models lists and answers carry, the other names a request may give):
    `--served-model-name` if given, else `default_model_name`; also the `--model` string as
    given (a vLLM client sends the path it served) and its short name."""
    name = served_model_name or default_model_name(model)
    others = dict.fromkeys(n for n in (model, default_model_name(model)) if n != name)
    return name, tuple(others)


def default_model_name(model: str) -> str:
    """The model id clients send and /v1/models lists: a checkpoint folder's name (for
    `.../config.json`, its folder's; for another JSON file, its stem), or the registered name.
    Never an absolute path, which would leak the server's file layout and change per host."""
    path = Path(model)
    if path.is_dir():
        return path.resolve().name
    if path.is_file():
        return path.resolve().parent.name if path.name == "config.json" else path.stem
    return model


def prepare(cfg: ServeConfig) -> Served:
    """Check the flags, then load the engine (schedule first, then model, KV pages, engine)."""
    check_flags(cfg)
    codec = TextCodec.for_model(cfg.engine.model)  # a bad tokenizer is named before the model
    loaded = load_engine(cfg.engine)
    c = loaded.config
    log.info("%s on %s%s: strategy %s, dense batch %d, %d KV pages of %d tokens, CUDA graphs "
             "%s", loaded.spec.name, f"{c.tp} x " if c.tp > 1 else "",
             gpu_name(loaded.model.device), loaded.choice.name, c.dense_batch, c.num_pages,
             c.page_size, c.graphs)
    name, aliases = model_names(cfg.engine.model, cfg.served_model_name)
    log.info("serving as model %r%s", name,
             "".join(f" (or {a!r})" for a in aliases))
    return Served(name, loaded.spec, loaded.engine, codec, loaded.choice.name, loaded, aliases,
                  cfg.engine.model, c.tp)

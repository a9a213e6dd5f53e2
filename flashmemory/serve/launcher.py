"""run_server: validate the flags, then run uvicorn with the app; the engine loads in the background."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from flashmemory.config import EngineConfig
from flashmemory.errors import FlashMemoryError
from flashmemory.serve.args import add_serve_args, check_env_errors, engine_kwargs, server_config

logger = logging.getLogger(__name__)

EXIT_ERROR = 1


def run_server(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit status. Bad settings raise FlashMemoryError before binding."""
    import uvicorn

    from flashmemory.engine.sizing import check_host_budget
    from flashmemory.model.loader import resolve_model_path
    from flashmemory.serve.app import create_app
    from flashmemory.serve.shutdown import FLUSH_TIMEOUT_S, GracefulServer

    check_env_errors(args)
    log_level = (args.serve_log_level or "info").lower()
    config = server_config(args, log_level)  # refuses a public host without a key
    kwargs = engine_kwargs(args)
    engine_config = EngineConfig.from_kwargs(**kwargs)  # a bad setting fails now, not after the server is up
    if engine_config.kv_cache == "tiered":
        check_host_budget(engine_config)  # so does an L1 pool over the free RAM or an L2 file over the free disk
    resolve_model_path(kwargs["model_path"])  # so does a missing model
    logging.getLogger().setLevel(log_level.upper() if log_level != "trace" else "DEBUG")
    logging.getLogger("flashmemory").setLevel(log_level.upper() if log_level != "trace" else "DEBUG")

    load_error: list[str] = []
    server: GracefulServer | None = None

    def on_load_failure(message: str) -> None:
        load_error.append(message)
        if server is not None:
            server.should_exit = True  # a server whose model cannot load is of no use: stop with the reason

    fatal_error: list[str] = []

    def on_fatal(message: str) -> None:
        fatal_error.append(message)
        if server is not None:
            server.should_exit = True  # the device is lost: exit non-zero so a supervisor restarts the server

    app = create_app(config, kwargs, on_load_failure=on_load_failure, on_fatal=on_fatal)
    logger.info("serving %s on http://%s:%d (API key: %s, streaming: %s)", app.state.server.model_name, config.host,
                config.port, "required" if config.api_key else "none", "on" if config.enable_streaming else "off")
    # NOTE: the drain (serve/shutdown.py) ends every request before uvicorn's own shutdown begins; uvicorn's
    # timeout only bounds what is left after it (a response whose client stopped reading).
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                    timeout_graceful_shutdown=FLUSH_TIMEOUT_S)
    server = GracefulServer(uvicorn_config, app.state.server)
    server.run()
    if load_error:
        raise FlashMemoryError(f"the model could not be loaded: {load_error[0]}")
    if fatal_error:
        raise FlashMemoryError(f"{fatal_error[0]}; the server stopped so that it can be restarted")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashmemory.serve",
        description="FlashMemory's OpenAI-compatible server. Every flag can also be set by a FLASHMEMORY_* "
        "environment variable (FLASHMEMORY_PORT, FLASHMEMORY_API_KEY, FLASHMEMORY_KV_PRECISION, ...); "
        "docs/configuration.md lists them.",
    )
    add_serve_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_server(args)
    except FlashMemoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130

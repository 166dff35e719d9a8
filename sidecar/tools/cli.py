"""Command line: ``health-sidecar`` serves; ``--check-config`` validates and prints the plan.

Configuration errors print one line per bad variable on stderr and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sidecar import __version__
from sidecar.config import ConfigError, Settings, check_names, load_settings, names_set

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="health-sidecar",
        description="Role-aware canary health checks for one LLM inference worker. "
        "Configured by environment variables (see README).",
    )
    parser.add_argument(
        "command",
        nargs="?",
        choices=["serve", "demo", "probes"],
        default="serve",
        help="serve (default): run the sidecar; demo: run it against the engine at "
        "SIDECAR_ENGINE_URL, or a bundled fake engine when no engine of the configured backend "
        "answers there; probes: print the engine container's Kubernetes probes sized from this "
        "configuration",
    )
    parser.add_argument(
        "--max-load-seconds",
        type=float,
        default=7200.0,
        metavar="S",
        help="with probes: the longest the engine may take to load its model (default 7200)",
    )
    parser.add_argument(
        "--grpc",
        action="store_true",
        help="with probes: kubelet grpc probes on the gRPC health service (SIDECAR_GRPC_PORT) "
        "instead of httpGet",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--env-file",
        metavar="PATH",
        help="read variables from this env file too (the environment wins over it)",
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration, print the effective plan, and exit",
    )
    return parser


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.value,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    demo = args.command == "demo"
    try:
        if demo:
            from sidecar.tools.demo import demo_defaults

            settings = load_settings(args.env_file, demo_defaults())
        else:
            settings = load_settings(args.env_file)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"health-sidecar: configuration error: {line}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        from sidecar.tools.plan import render

        print(render(settings, check_names(names_set(args.env_file)).ignored))
        return 0
    if args.command == "probes":
        from sidecar.tools.probes import render as render_probes

        try:
            print(render_probes(settings, args.max_load_seconds, grpc=args.grpc))
        except ValueError as exc:
            print(f"health-sidecar: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    from sidecar.wiring import missing_for, run

    missing = missing_for(
        settings
    )  # what is installed here: checked at start, never in --check-config
    if missing is not None:
        print(f"health-sidecar: cannot start: {missing}", file=sys.stderr)
        return EXIT_CONFIG
    _configure_logging(settings)
    if demo:
        from sidecar.tools.demo import run as run_demo

        return run_demo(settings)
    return run(settings)

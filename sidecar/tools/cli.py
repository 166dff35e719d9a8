"""Command line: ``health-sidecar`` serves; ``--check-config`` validates and prints the plan.

Exit statuses (docs/reference/cli.md): 0 the configuration is valid (and, with --check-config,
this machine has what starting it needs); 2 it is not: one line per bad variable on stderr, no
traceback (also when a part refuses it at start); 3 it is valid but this machine lacks what
starting it needs (an extra, a mounted directory), each named on one line.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sidecar import __version__
from sidecar.config import ConfigError, Settings, check_names, names_set
from sidecar.redact import RedactingFilter
from sidecar.runtime.exits import EXIT_CONFIG, EXIT_NOT_HERE
from sidecar.wiring import Blueprint, load, resolve


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
    secrets = [s.get_secret_value() for s in (settings.engine_api_key, settings.control_token) if s]
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter(secrets))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    demo = args.command == "demo"
    try:
        if demo:
            from sidecar.tools.demo import demo_defaults

            settings = load(args.env_file, demo_defaults())
        else:
            settings = load(args.env_file)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"health-sidecar: configuration error: {line}", file=sys.stderr)
        return EXIT_CONFIG
    blueprint = resolve(settings)
    if args.check_config:
        from sidecar.tools.plan import render

        ignored = check_names(names_set(args.env_file), blueprint_passes(blueprint)).ignored
        print(render(blueprint, ignored))
        return EXIT_NOT_HERE if blueprint.missing else 0
    if args.command == "probes":
        from sidecar.tools.probes import render as render_probes

        try:
            print(render_probes(blueprint, args.max_load_seconds, grpc=args.grpc))
        except ValueError as exc:
            print(f"health-sidecar: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    if blueprint.missing:  # what this machine lacks: --check-config says it too
        for why in blueprint.missing:
            print(f"health-sidecar: cannot start: {why}", file=sys.stderr)
        return EXIT_NOT_HERE
    _configure_logging(settings)
    if demo:
        from sidecar.tools.demo import run as run_demo

        return run_demo(blueprint)
    from sidecar.wiring import run

    return run(blueprint)


def blueprint_passes(blueprint: Blueprint) -> tuple[str, ...]:
    """The variables the chosen transport hands on (its client reads them)."""
    return blueprint.transport.passes

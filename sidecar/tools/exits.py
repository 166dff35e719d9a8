"""The command line's exit statuses, once (docs/reference/cli.md is generated from them)."""

EXIT_CONFIG = 2
EXIT_NOT_HERE = 3
#: What each exit status says.
EXIT_STATUSES = {
    0: "the configuration is valid: `--check-config` printed its plan, and this machine has what "
    "starting it needs; `serve` ended as asked (SIGTERM, drained)",
    EXIT_CONFIG: "the configuration is not valid: one line per bad variable on stderr, no "
    "traceback; also a part that refused it at start (Dynamo's runtime, a payload that is no "
    "request of the gRPC method)",
    EXIT_NOT_HERE: "the configuration is valid but this machine lacks what starting it needs (the "
    "transport's extra, a mounted directory), each named on one line: `--check-config` prints "
    "the plan and the lines, `serve` the lines",
}

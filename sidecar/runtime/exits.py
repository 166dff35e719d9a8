"""The process's exit statuses, once (docs/reference/cli.md is generated from them)."""

EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_NOT_HERE = 3
#: What each exit status says.
EXIT_STATUSES: dict[int | str, str] = {
    0: "the configuration is valid: `--check-config` printed its plan, and this machine has what "
    "starting it needs; `serve` ended as asked (SIGTERM, drained)",
    EXIT_FAILURE: "`serve` stopped for a failure of its own: the monitor died of an unexpected "
    "error (logged as critical, with its traceback), or a server could not bind its port",
    EXIT_CONFIG: "the configuration is not valid: one line per bad variable on stderr, no "
    "traceback; also a part that refused it at start (Dynamo's runtime, a payload that is no "
    "request of the gRPC method)",
    EXIT_NOT_HERE: "the configuration is valid but this machine lacks what starting it needs (the "
    "transport's extra, a mounted directory), each named on one line: `--check-config` prints "
    "the plan and the lines, `serve` the lines",
    "`SIDECAR_POD_RESTART_EXIT_CODE`": "opt-in (unset: never): the worker stopped being live (its "
    "liveness clock ran out, as /live turns 503), so `serve` exits with this code for the "
    "kubelet to restart the whole pod in place (docs/deploy/pod-restart.md)",
}

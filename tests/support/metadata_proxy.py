"""A worker's system server as Dynamo's Kubernetes discovery mode serves it, in front of a worker
that runs with file discovery: ``python -m tests.support.metadata_proxy --upstream URL --kv-dir DIR
--port P --port-file F`` (:class:`MetadataProxy` starts it).

GET /health, /live and /metrics are the worker's own answers. GET /metadata is what a worker
under Kubernetes discovery serves (Dynamo's ``DiscoveryMetadata``: ``endpoints`` keyed
"namespace/component/endpoint", each the discovery record the worker registered), built from the
worker's own record in its file discovery, and kept once read: the worker keeps its metadata in
memory, whatever the cluster does with it. That is what the sidecar's Kubernetes path reads, here
where no cluster runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.support.dynamo_worker import endpoint_instances
from tests.support.processes import Process, read_port_file

FORWARDED = ("/health", "/live", "/metrics")


class Metadata:
    def __init__(self, upstream: str, kv_dir: Path) -> None:
        self.upstream, self.kv_dir = upstream, kv_dir
        self.endpoints: dict[str, Any] = {}
        self.lock = threading.Lock()

    def document(self, http: httpx.Client) -> dict[str, Any]:
        metrics = http.get(f"{self.upstream}/metrics").text
        for path in (self.kv_dir / "v1" / "instances").glob("*"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            key = f"{record['namespace']}.{record['component']}.{record['endpoint']}"
            if record["instance_id"] in endpoint_instances(metrics, key):
                with self.lock:
                    self.endpoints[key.replace(".", "/")] = record
        with self.lock:
            return {"endpoints": dict(self.endpoints), "model_cards": {}, "metrics_endpoints": {}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--kv-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0, help="0 lets the OS pick one")
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    metadata = Metadata(args.upstream, args.kv_dir)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_GET(self) -> None:
            with httpx.Client(timeout=2.0, trust_env=False) as http:
                try:
                    if self.path == "/metadata":
                        status, body = 200, json.dumps(metadata.document(http)).encode()
                    elif self.path in FORWARDED:
                        answer = http.get(f"{args.upstream}{self.path}")
                        status, body = answer.status_code, answer.content
                    else:
                        status, body = 404, b"not found"
                except httpx.HTTPError:
                    self.close_connection = True
                    return  # the worker did not answer: neither does its system server
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.port_file)
    server.serve_forever()


class MetadataProxy(Process):
    """This proxy in front of the worker whose system server is ``upstream`` and whose file
    discovery is ``kv_dir``, on a free loopback port."""

    name = "metadata-proxy"
    start_timeout = 10.0
    ready_interval = 0.02

    def __init__(self, upstream: str, kv_dir: str | Path) -> None:
        super().__init__()
        self.upstream, self.kv_dir = upstream, Path(kv_dir)

    @property
    def port_file(self) -> Path:
        return self.workdir / "port"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "tests.support.metadata_proxy", "--upstream", self.upstream]
        argv += ["--kv-dir", str(self.kv_dir), "--port", str(self.port)]
        return [*argv, "--port-file", str(self.port_file)]

    def ready(self) -> bool:
        return read_port_file(self.port_file) == self.port


if __name__ == "__main__":
    main()

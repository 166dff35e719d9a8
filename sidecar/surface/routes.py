"""The routes the sidecar serves besides the probe routes (whose paths are configured), apart
from the app so that what checks the configuration against them never loads the web stack."""

from __future__ import annotations

METRICS_PATH = "/metrics"
OPENAPI_PATH = "/openapi.json"
SIDECAR_LIVE_PATH = "/sidecar/live"
STATUS_PAGE_PATH, HISTORY_PATH = "/", "/debug/history"  # for people; not in the schema

# The probe paths (DYN_SYSTEM_HEALTH_PATH, DYN_SYSTEM_LIVE_PATH) may not take these.
RESERVED_ROUTES = {
    METRICS_PATH: "the metrics route",
    OPENAPI_PATH: "the OpenAPI schema route",
    SIDECAR_LIVE_PATH: "the sidecar's own liveness route",
    STATUS_PAGE_PATH: "the status page",
    HISTORY_PATH: "the status page's history route",
}

"""Write prometheusrule.yaml: rules.yml's groups, unchanged, in a PrometheusRule.

rules.yml is the single source (promtool reads it); the PrometheusRule embeds its text from the
`groups:` line on, indented under `spec:`, so comments and block scalars stay as written.
Run after editing rules.yml:  python3 deploy/monitoring/render_prometheusrule.py
(tests/test_alerts.py fails when prometheusrule.yaml is not what this writes).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "rules.yml"
TARGET = HERE / "prometheusrule.yaml"

HEADER = """\
# GENERATED from rules.yml by render_prometheusrule.py: edit rules.yml, then run
#   python3 deploy/monitoring/render_prometheusrule.py
# The health-sidecar alerts for the Prometheus operator. Apply it where your Prometheus
# selects rules (kube-prometheus-stack's default ruleSelector wants the label
# release: <its Helm release name>; add it under metadata.labels), for example:
#   kubectl -n monitoring apply -f deploy/monitoring/prometheusrule.yaml
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: health-sidecar
  labels:
    app.kubernetes.io/name: health-sidecar
    app.kubernetes.io/part-of: health-sidecar
spec:
"""


def render(source: str) -> str:
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "".join(f"  {line}\n" if line.strip() else "\n" for line in lines[start:])
    return HEADER + body


def main() -> int:
    text = render(SOURCE.read_text())
    if "--check" in sys.argv[1:]:
        if TARGET.read_text() != text:
            print(f"{TARGET} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the sidecar serves: the HTTP app and its bodies, the status page, the metrics, the
control routes and the recent history."""

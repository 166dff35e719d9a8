"""The pure core: the evidence sources, the endpoint and its units, the verdict and the
schedule (when each kind of probe is due). No I/O."""

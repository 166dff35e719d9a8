"""What the tests share: processes and their harness, the real engines, the network namespace,
and the one rule for a missing prerequisite (:mod:`tests.support.prerequisites`)."""

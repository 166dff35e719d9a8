"""The configuration, by concept: every variable and the kind of value it takes (``fields.py``,
``values.py``), the rules across variables (``rules.py``), the misspelled names (``names.py``),
and loading with its error lines (``load.py``). Read once from the environment, validated loudly;
what the sidecar does with it is resolved once by the composition root (``sidecar/wiring/``).
"""

from sidecar.config.fields import DiscoveryBackend, LogLevel, PlaneKind, Settings
from sidecar.config.load import Catalog, ConfigError, load_settings, validated
from sidecar.config.names import check_names, names_set
from sidecar.config.rules import Rule, broken_rules, env_name, expected, shown

__all__ = [
    "Catalog",
    "ConfigError",
    "DiscoveryBackend",
    "LogLevel",
    "PlaneKind",
    "Rule",
    "Settings",
    "broken_rules",
    "check_names",
    "env_name",
    "expected",
    "load_settings",
    "names_set",
    "shown",
    "validated",
]

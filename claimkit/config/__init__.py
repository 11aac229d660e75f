"""The config layer: the transport JSON and flags, read and checked (docs/configuration.md).

- :mod:`claimkit.config.model`: :class:`Config`, :class:`QueueConfig` and
  :class:`WrongKeyType` (raised by the layers above, defined below them);
- :mod:`claimkit.config.parse`: :func:`load_config`, every field's check, the Redis URL and
  its password from the JSON, the flags or the environment;
- :mod:`claimkit.config.gate_params`: each gate type's ``gate_params``, checked (the gates
  themselves are :mod:`claimkit.consumer.gates`).

Imports only the protocol and store layers below it (``check_url``) and ``claimkit._errors``.
"""

from __future__ import annotations

from claimkit._errors import ConfigError as ConfigError
from claimkit.config.model import Config as Config
from claimkit.config.model import QueueConfig as QueueConfig
from claimkit.config.model import WrongKeyType as WrongKeyType
from claimkit.config.parse import has_password as has_password
from claimkit.config.parse import load_config as load_config

__all__ = [
    "Config",
    "ConfigError",
    "QueueConfig",
    "WrongKeyType",
    "has_password",
    "load_config",
]

"""`python -m rl_engine.config FILE [KEY=VALUE ...]`: validate a config and print what it resolves to."""

import sys

from rl_engine.config.loading import ConfigError, load_config, to_yaml

try:
    print(to_yaml(load_config(sys.argv[1], sys.argv[2:]).resolved()))
except ConfigError as exc:
    print(exc, file=sys.stderr)
    sys.exit(2)

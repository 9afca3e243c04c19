"""The config system every training recipe uses.

A run is configured in four steps::

    path, overrides = parse_cli(sys.argv[1:])  # --config grpo.yaml policy.lr=1e-6 +tag=x
    cfg = load_config(path, overrides)  # YAML + `defaults:` inheritance + overrides
    typed = validate_config(cfg, TrainConfig)  # resolve ${...}, check types, friendly errors
    save_config(cfg, run_dir / "config.yaml")  # the resolved config, for reproducibility

YAML files may name parent files in a top-level ``defaults:`` key (a path or a list of paths,
relative to the file naming them; ``.yaml`` may be left off). Parents are loaded depth-first and
merged in order, later parents winning over earlier ones; the file's own keys win over all of
them. Mappings merge key by key, except one marked ``_override_: true``, which replaces the
mapping it would merge into (``merge_layers``; the marker is gone once the config is resolved). Overrides use Hydra's grammar (parsed by Hydra itself): ``a.b=1`` changes an existing key,
``+a.b=1`` adds a new one, ``++a.b=1`` adds or changes, ``~a.b`` deletes (``~a.b=1`` only if the
value is 1). As in Hydra, a dict value merges into an existing mapping, and a nested interpolation
on the command line must be quoted (``'x=${mul:${a},2}'``). Interpolations (``${a.b}``,
``${oc.env:VAR,default}``, ``${mul:${a},2}``) stay lazy until :func:`validate_config`,
:func:`resolve_config` or :func:`save_config` resolves them.
"""

from rl_distributed.config._cli import parse_cli, save_config, to_yaml
from rl_distributed.config._describe import (
    REQUIRED,
    Key,
    commented_yaml,
    config_keys,
    field_description,
)
from rl_distributed.config._errors import ConfigError, ConfigIssue
from rl_distributed.config._loading import drop_override_markers, load_config, merge_layers
from rl_distributed.config._overrides import apply_overrides
from rl_distributed.config._resolvers import register_resolvers
from rl_distributed.config._validation import (
    ConfigModel,
    resolve_config,
    type_name,
    validate_config,
)

__all__ = [
    "REQUIRED",
    "ConfigError",
    "ConfigIssue",
    "ConfigModel",
    "Key",
    "apply_overrides",
    "commented_yaml",
    "config_keys",
    "drop_override_markers",
    "field_description",
    "load_config",
    "merge_layers",
    "parse_cli",
    "register_resolvers",
    "resolve_config",
    "save_config",
    "to_yaml",
    "type_name",
    "validate_config",
]

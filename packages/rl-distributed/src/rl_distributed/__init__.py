"""rl-distributed: Ray virtual clusters, worker groups, named sharding, batched data, config.

Public names are imported lazily so that ``import rl_distributed`` (and command-line tools built
on it) stay fast; ``from rl_distributed import RayWorkerGroup`` loads Ray only then.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("rl-distributed")
except PackageNotFoundError:  # linked, not installed, into an isolated worker environment
    __version__ = "0+linked"

_EXPORTS = {
    "BatchedDataDict": "rl_distributed.batched_data_dict",
    "DynamicBatchingArgs": "rl_distributed.batched_data_dict",
    "SequencePackingArgs": "rl_distributed.batched_data_dict",
    "NamedSharding": "rl_distributed.named_sharding",
    "ClusterError": "rl_distributed.virtual_cluster",
    "RayVirtualCluster": "rl_distributed.virtual_cluster",
    "init_ray": "rl_distributed.virtual_cluster",
    "RayWorkerBuilder": "rl_distributed.worker_groups",
    "RayWorkerGroup": "rl_distributed.worker_groups",
    "WorkerCallError": "rl_distributed.worker_groups",
    "WorkerDiedError": "rl_distributed.worker_groups",
    "WorkerGroupError": "rl_distributed.worker_groups",
    "WorkerTimeoutError": "rl_distributed.worker_groups",
    "ConfigError": "rl_distributed.config",
    "ConfigModel": "rl_distributed.config",
    "load_config": "rl_distributed.config",
    "validate_config": "rl_distributed.config",
}

__all__ = [
    "BatchedDataDict",
    "ClusterError",
    "ConfigError",
    "ConfigModel",
    "DynamicBatchingArgs",
    "NamedSharding",
    "RayVirtualCluster",
    "RayWorkerBuilder",
    "RayWorkerGroup",
    "SequencePackingArgs",
    "WorkerCallError",
    "WorkerDiedError",
    "WorkerGroupError",
    "WorkerTimeoutError",
    "__version__",
    "init_ray",
    "load_config",
    "validate_config",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rl_distributed' has no attribute {name!r}")


if TYPE_CHECKING:
    from rl_distributed.batched_data_dict import (
        BatchedDataDict,
        DynamicBatchingArgs,
        SequencePackingArgs,
    )
    from rl_distributed.config import ConfigError, ConfigModel, load_config, validate_config
    from rl_distributed.named_sharding import NamedSharding
    from rl_distributed.virtual_cluster import ClusterError, RayVirtualCluster, init_ray
    from rl_distributed.worker_groups import (
        RayWorkerBuilder,
        RayWorkerGroup,
        WorkerCallError,
        WorkerDiedError,
        WorkerGroupError,
        WorkerTimeoutError,
    )

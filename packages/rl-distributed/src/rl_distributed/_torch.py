"""The one message for "this part of rl-distributed needs torch, which is an extra"."""

TORCH_EXTRA_HINT = (
    "needs PyTorch, which `pip install rl-distributed` leaves out (the cluster tooling works "
    "without it). Install it with: pip install 'rl-distributed[torch]' (or install the torch "
    "build for your machine first, e.g. a CUDA or CPU wheel)."
)


def missing_torch(what: str) -> ImportError:
    return ImportError(f"{what} {TORCH_EXTRA_HINT}", name="torch")

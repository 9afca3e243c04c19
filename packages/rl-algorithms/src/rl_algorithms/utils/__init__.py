"""Run infrastructure shared by every algorithm: logging and checkpoints."""

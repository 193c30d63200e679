"""tailrace: fast RL post-training of language models by attacking the long tail of rollouts."""

__version__ = "0.1.0"
